"""Mesh kernels: ``pl.kernel(body, out_type, mesh=...)`` and ``pl.core_map``.

Both versions of JAX trace them to one primitive, ``mpmd_map`` (JAX 0.10's
stateful ``core_map`` is discharged to it by ``run_state``): a body jaxpr per
mesh whose operands are whole refs (inputs, outputs, scratch), run once per
point of the mesh (per core / subcore), every program at the same time,
sharing the memory the hardware shares.

This package is the mesh-kernel family (``kernel_family``): such an eqn
becomes a ``MeshKernel`` (``kernel.py``) whose *runner* is picked by mesh
type when it is planned, and runs with the operand buffers. The TPU runner
(TensorCore meshes, SparseCore subcore meshes) is ``tpu.py``, Mosaic GPU's
``mosaic_gpu.entry``; others plug in with::

    meshes.register_mesh_runner(lambda mesh: isinstance(mesh, MyMesh), my_runner)

    def my_runner(kernel: meshes.MeshKernel, buffers: list[np.ndarray]) -> None:
      # buffers: the inputs then the outputs (an aliased output *is* its
      # input's buffer); run every program, writing the outputs in place.
      # kernel.program(i) is a KernelPlan of body i (one grid point, whole
      # refs); meshes.run_programs runs programs as concurrent instances.

or, for a mesh with its own executor, a ``meshes.MeshRunner`` subclass
(``check``, ``compile``, ``device_features``, ``written_inputs``, ``run``).

A mesh type with no runner raises ``UnsupportedError`` naming the mesh and the
kernel line, as every unsupported construct does.
"""
from __future__ import annotations

from pallas_np.meshes.kernel import (MESH_KERNELS, MeshKernel, MeshRunner, get_mesh_kernel,
                                     mesh_kernel_error, register_mesh_runner, runner_for)
from pallas_np.meshes.programs import Program, run_programs
from pallas_np.meshes import tpu  # noqa: F401  (registers the TPU runner)

__all__ = ["MESH_KERNELS", "MeshKernel", "MeshRunner", "Program", "get_mesh_kernel",
           "mesh_kernel_error", "register_mesh_runner", "run_programs", "runner_for"]
