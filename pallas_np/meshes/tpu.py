"""The TPU mesh runner: TensorCore meshes (megacore) and SparseCore
subcore meshes.

Every point of the mesh is a program (a TensorCore, a SparseCore scalar
subcore, a SparseCore vector subcore) running the body on its own thread
(``programs.run_programs``). What the programs share is what the hardware
shares:

=================  ==========================================================
memory             shared by
=================  ==========================================================
operands (HBM)     every program (they are the kernel's inputs and outputs)
HBM / ANY scratch  every program
CMEM scratch       every TensorCore of the chip
VMEM_SHARED        the vector subcores of one SparseCore (its Spmem)
VMEM, SMEM,        one program (a core's or subcore's private memory)
semaphores
=================  ==========================================================

``pl.run_scoped(..., collective_axes=...)`` buffers are shared along the
named axes (``programs.ProgramContext.collective_alloc``).
"""
from __future__ import annotations

import itertools

from pallas_np import _compat as jc
from pallas_np.errors import UnsupportedError
from pallas_np.memory import allocate
from pallas_np.meshes.kernel import register_mesh_runner
from pallas_np.meshes.programs import Program, run_programs

_TPU_MESHES = tuple(t for t in (jc.TensorCoreMesh, jc.VectorSubcoreMesh, jc.ScalarSubcoreMesh)
                    if t is not None)


def is_tpu_mesh(mesh) -> bool:
  return isinstance(mesh, _TPU_MESHES)


def _space_name(aval) -> str:
  space = jc.memory_space_of(aval)
  if space is None:
    return "any"
  return str(getattr(space, "name", None) or getattr(space, "value", space)).lower()


def shared_axes(mesh, aval) -> tuple:
  """The mesh axes along which programs see one buffer for a scratch aval."""
  names = tuple(mesh.shape)
  space = _space_name(aval)
  if "hbm" in space or space == "any" or space.endswith(".any"):
    return names
  if "cmem" in space and isinstance(mesh, jc.TensorCoreMesh):
    return names
  if "vmem_shared" in space:
    if jc.VectorSubcoreMesh is not None and isinstance(mesh, jc.VectorSubcoreMesh):
      return (mesh.subcore_axis_name,)
    if isinstance(mesh, jc.TensorCoreMesh):
      return names
  return ()


def barrier_axes(mesh):
  """``plsc.subcore_barrier`` spans the vector subcores of one SparseCore."""
  if jc.VectorSubcoreMesh is not None and isinstance(mesh, jc.VectorSubcoreMesh):
    return (mesh.subcore_axis_name,)
  return None


def unit_of(mesh) -> str:
  if jc.VectorSubcoreMesh is not None and isinstance(mesh, jc.VectorSubcoreMesh):
    return "subcore"
  return "core"


def run_tpu_mesh(kernel, buffers):
  if len(kernel.meshes) != 1:
    raise UnsupportedError(
        f"pallas_np: mesh kernel {kernel.source} pairs several meshes (MPMD: "
        f"{', '.join(type(m).__name__ for m in kernel.meshes)}); one mesh per kernel is "
        "supported")
  mesh = kernel.meshes[0]
  plan = kernel.program(0)
  names, sizes = tuple(mesh.shape), tuple(int(s) for s in mesh.shape.values())
  scratch_avals = kernel.scratch_avals(0)
  inner = [a.inner_aval if isinstance(a, jc.AbstractRef) else a for a in scratch_avals]
  sharing = [shared_axes(mesh, a) for a in scratch_avals]
  semaphores = [i for i, a in enumerate(inner) if jc.is_semaphore_dtype(a.dtype)]
  allocations: dict = {}
  programs = []
  for coords in itertools.product(*map(range, sizes)):
    scratch = []
    for i, (aval, axes) in enumerate(zip(inner, sharing)):
      key = (i, tuple(c for n, c in zip(names, coords) if n not in axes))
      buf = allocations.get(key)
      if buf is None:
        buf = allocations[key] = allocate(aval.shape, aval.dtype, kernel.params)
      scratch.append(buf)
    programs.append(Program(plan, names, sizes, coords, [*buffers, *scratch],
                            len(buffers), semaphores, barrier_axes(mesh)))
  run_programs(kernel, programs, unit_of(mesh))


register_mesh_runner(is_tpu_mesh, run_tpu_mesh)
