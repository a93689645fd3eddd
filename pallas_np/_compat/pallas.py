"""Pallas itself: the pallas_call primitive, grid and block mappings, mesh
kernels (``pl.kernel(mesh=...)``, ``pl.core_map``), the interpret-mode
config."""
from __future__ import annotations

import jax
import numpy as np
from jax._src import checkify as _checkify
from jax._src import config as jax_config
from jax._src import core as jax_core
from jax._src.pallas import core as pallas_core
from jax._src.pallas import pallas_call as pallas_call_mod
from jax._src.pallas import primitives as pallas_primitives
from jax._src.pallas.mosaic import primitives as mosaic_primitives

from pallas_np._compat.core import optional_primitive, source_summary
from pallas_np._compat.state import AbstractRef, memory_space_of
from pallas_np._compat.versions import mesh_kernel_bodies

pallas_call_p = pallas_call_mod.pallas_call_p
GridMapping = pallas_core.GridMapping
BlockMapping = pallas_core.BlockMapping
Blocked = pallas_core.Blocked
Element = pallas_core.Element
Squeezed = pallas_core.Squeezed
BoundedSlice = pallas_core.BoundedSlice
Indirect = pallas_core.Indirect
DynamicGridDim = pallas_core.DynamicGridDim
# pl.DeviceIdType (JAX 0.12); pltpu.DeviceIdType before (and deprecated after).
DeviceIdType = getattr(pallas_primitives, "DeviceIdType", None) or mosaic_primitives.DeviceIdType

interpret_mode_config = jax_config.pallas_tpu_interpret_mode_context_manager


def get_block_shape(block_shape):
  return pallas_core._get_block_shape(block_shape)


def uninitialized_value_np(dtype):
  """Scalar fill interpret=True uses for memory nobody wrote (mirrors
  jax._src.pallas.primitives.uninitialized_value)."""
  dtype = np.dtype(dtype)
  if jax.numpy.issubdtype(dtype, jax.numpy.floating) or jax.numpy.issubdtype(
      dtype, jax.numpy.complexfloating):
    return np.array(np.nan, dtype)
  if jax.numpy.issubdtype(dtype, jax.numpy.integer):
    if dtype == np.dtype(pallas_core.SEMAPHORE_INTERPRET_DTYPE):
      return np.array(0, dtype)
    return np.array(jax.numpy.iinfo(dtype).min, dtype)  # int4 too (ml_dtypes)
  if dtype == np.dtype(bool):
    return np.array(False, dtype)
  return np.zeros((), dtype)


# -- mesh kernels: pl.kernel(mesh=...) / pl.core_map ----------------------------
mpmd_map_p = optional_primitive("pallas.mpmd", "mpmd_map_p")
core_map_p = optional_primitive("pallas.core", "core_map_p")


def mesh_kernel_primitives() -> tuple:
  """The primitives of mesh kernels that lower without pallas_call_p (JAX
  0.10: ``mpmd_map``, whose CPU lowering calls JAX's pallas_call lowering
  directly, and ``core_map``), those this JAX has."""
  return tuple(p for p in (mpmd_map_p, core_map_p) if isinstance(p, jax_core.Primitive))


def mesh_kernel_sources(params) -> list[str]:
  """'fn at file:line' of the body jaxpr(s) of a mesh-kernel eqn's params;
  where the body is JAX's own wrapper (a discharged core_map), the user
  line of its first eqn."""
  bodies = mesh_kernel_bodies(params)
  out = []
  for j in bodies:
    j = getattr(j, "jaxpr", j)
    dbg = getattr(j, "debug_info", None)
    src = getattr(dbg, "func_src_info", None)
    if src and "jax/_src/" not in src.replace("\\", "/"):
      out.append(src)
      continue
    for eqn in getattr(j, "eqns", ()):
      line = source_summary(eqn.source_info)
      if line and line != "<unknown source>":
        out.append(line)
        break
  return out


def mesh_grid_mapping(jaxpr, num_inputs: int, num_outputs: int, default_memory_space,
                      grid=(), debug=False):
  """The GridMapping of a mesh kernel's body: the mesh as the grid (what
  ``pl.program_id`` reads inside a core_map), every operand a whole-array
  ref in its memory space (what JAX's fallback lowering of ``mpmd_map``
  builds)."""
  avals = [v.aval for v in jaxpr.invars]

  def spec(aval):
    space = memory_space_of(aval)
    return pallas_core.BlockSpec(memory_space=space if space is not None
                                 else default_memory_space)
  inner = [a.inner_aval if isinstance(a, AbstractRef) else a for a in avals]
  in_avals, out_avals = inner[:num_inputs], inner[num_inputs:num_inputs + num_outputs]
  grid_spec = pallas_core.GridSpec(
      grid=tuple(grid), in_specs=tuple(spec(a) for a in avals[:num_inputs]),
      out_specs=tuple(spec(a) for a in avals[num_inputs:num_inputs + num_outputs]))
  in_tree = jax.tree_util.tree_structure(tuple(in_avals))
  out_tree = jax.tree_util.tree_structure(tuple(out_avals))
  _, gm = pallas_core.get_grid_mapping(
      grid_spec, in_avals, in_tree, [f"arg{i}" for i in range(num_inputs)],
      out_avals, out_tree, [f"out{i}" for i in range(num_outputs)], debug=debug)
  return gm


# ``pl.debug_check`` / ``checkify.check`` inside a kernel (``debug=True``: a
# runtime assert where the device's lowering emits one).
check_p = _checkify.check_p
CheckFailedError = _checkify.JaxRuntimeError


def debug_checks_enabled() -> bool:
  """``jax_pallas_enable_debug_checks``: the kernels' debug checks run."""
  return bool(pallas_core.debug_checks_enabled())


def failed_check_message(err_tree, args) -> tuple[object, str]:
  """(the failure predicate, the formatted message) of a ``check_p``'s
  operands (one check: what Pallas's lowerings accept)."""
  error = jax.tree_util.tree_unflatten(err_tree, list(args))
  [pred] = error._pred.values()
  [exception_tree] = error._metadata.values()
  [payload] = error._payload.values()
  exception = jax.tree_util.tree_unflatten(exception_tree, payload)
  return pred, str(exception)
