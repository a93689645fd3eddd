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
  if hasattr(space, "mesh") and hasattr(space, "memory_space"):  # `pltpu.VMEM @ mesh`
    space = space.memory_space
  if space is None:
    return "any"
  return str(getattr(space, "name", None) or getattr(space, "value", space)).lower()


def shared_axes(mesh, aval):
  """The mesh axes along which programs see one buffer for a scratch aval
  (programs of other meshes of the kernel with the same coordinates off
  those axes share it too); None: each program's own memory."""
  names = tuple(mesh.shape)
  space = _space_name(aval)
  if "hbm" in space or space == "any" or space.endswith(".any"):
    return names
  if "cmem" in space and isinstance(mesh, jc.TensorCoreMesh):
    return names
  if "vmem_shared" in space:
    if jc.VectorSubcoreMesh is not None and isinstance(mesh, jc.VectorSubcoreMesh):
      return (mesh.subcore_axis_name,)
    if jc.ScalarSubcoreMesh is not None and isinstance(mesh, jc.ScalarSubcoreMesh):
      return ()  # the SparseCore's Spmem: with its vector subcores
    if isinstance(mesh, jc.TensorCoreMesh):
      return names
  return None


def barrier_axes(mesh):
  """``plsc.subcore_barrier`` spans the vector subcores of one SparseCore."""
  if jc.VectorSubcoreMesh is not None and isinstance(mesh, jc.VectorSubcoreMesh):
    return (mesh.subcore_axis_name,)
  return None


def unit_of(mesh) -> str:
  if jc.VectorSubcoreMesh is not None and isinstance(mesh, jc.VectorSubcoreMesh):
    return "subcore"
  if jc.ScalarSubcoreMesh is not None and isinstance(mesh, jc.ScalarSubcoreMesh):
    return "scalar subcore"
  return "core"


def run_tpu_mesh(kernel, buffers):
  """Every body over every point of its mesh, all at once. Several meshes
  (a SparseCore's scalar subcore with its vector subcores) share what their
  memory spaces share: scratch is keyed by the coordinates off its sharing
  axes, and the meshes of one kernel name the core axis alike."""
  allocations: dict = {}
  programs = []
  for body, mesh in enumerate(kernel.meshes):
    plan = kernel.program(body)
    names, sizes = tuple(mesh.shape), tuple(int(s) for s in mesh.shape.values())
    scratch_avals = kernel.scratch_avals(body)
    inner = [a.inner_aval if isinstance(a, jc.AbstractRef) else a for a in scratch_avals]
    sharing = [shared_axes(mesh, a) for a in scratch_avals]
    semaphores = [i for i, a in enumerate(inner) if jc.is_semaphore_dtype(a.dtype)]
    offset = len(programs)
    for coords in itertools.product(*map(range, sizes)):
      scratch = []
      for i, (aval, axes) in enumerate(zip(inner, sharing)):
        if axes is None:  # one program's own memory
          key = (i, "private", body, coords)
        else:
          key = (i, "shared", tuple((n, c) for n, c in zip(names, coords) if n not in axes))
        buf = allocations.get(key)
        if buf is None:
          buf = allocations[key] = allocate(aval.shape, aval.dtype, kernel.params)
        scratch.append(buf)
      programs.append(Program(plan, names, sizes, coords, [*buffers, *scratch],
                              len(buffers), semaphores, barrier_axes(mesh), unit_of(mesh),
                              offset))
  run_programs(kernel, programs)


register_mesh_runner(is_tpu_mesh, run_tpu_mesh)
