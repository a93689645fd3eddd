"""The grid executor: runs a compiled kernel over its grid.

``kernel_plan.KernelPlan`` is one pallas_call, built once and run many
times: it pads operands, allocates outputs and scratch (``pallas_np.memory``),
and picks how to walk the grid: batched over lanes of grid points
(``vectorize``, whose analysis is ``lanes`` and whose passes run in
``slab_runner``), chunks of grid points on threads (``threads``), or its own
sequential grid loop (``KernelPlan.run_grid``; megacore splits in
``KernelPlan``). ``blocks.BlockGeometry`` cuts each operand's blocks out of
its array.
"""
from pallas_np.grid.blocks import BlockGeometry
from pallas_np.grid.kernel_plan import KernelPlan

__all__ = ["BlockGeometry", "KernelPlan"]
