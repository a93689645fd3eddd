"""Mosaic GPU (``jax.experimental.pallas.mosaic_gpu``, "plgpu") kernels in
numpy mode: one module per primitive family, the block/warpgroup executor
(``threads``, ``kernel``) and the mesh-kernel entry (``entry``).

See docs/gpu.md, "Mosaic GPU". Without plgpu (absl-py missing) nothing here
registers and Mosaic GPU kernels never reach pallas_np."""
from pallas_np import _compat as jc

if jc.mgpu_core is not None:
  from pallas_np.mosaic_gpu import (atomics, barriers, cluster, collectives, copies,  # noqa: F401
                                    inline, layout, smem_stores, tcgen05, wgmma)
