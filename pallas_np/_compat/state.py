"""Pallas refs: ref types, indexers, ref transforms, effects, state
discharge."""
from __future__ import annotations

from jax._src import core as jax_core
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing as state_indexing
from jax._src.state import primitives as state_primitives  # noqa: F401  (re-exported)
from jax._src.state import types as state_types

from pallas_np._compat.core import ClosedJaxpr, is_semaphore_dtype

AbstractRef = state_types.AbstractRef
TransformedRef = state_types.TransformedRef
NDIndexer = state_indexing.NDIndexer
Slice = state_indexing.Slice
RefBitcaster = getattr(state_types, "RefBitcaster", None)
RefReshaper = getattr(state_types, "RefReshaper", None)
BitcastTransform = getattr(state_types, "BitcastTransform", None)
ReshapeTransform = getattr(state_types, "ReshapeTransform", None)
TransposeTransform = getattr(state_types, "TransposeTransform", None)
SelectTransform = getattr(state_types, "SelectTransform", None)  # pl.select_ref
WriteEffect = state_types.WriteEffect
AccumEffect = state_types.AccumEffect
ReadEffect = state_types.ReadEffect
run_state_p = state_discharge.run_state_p


def written_invar_positions(jaxpr) -> set[int]:
  """Positions of a jaxpr's invars (refs) that it writes or accumulates into."""
  pos = {v: i for i, v in enumerate(jaxpr.invars)}
  out = set()
  for eff in jaxpr.effects:
    if isinstance(eff, (WriteEffect, AccumEffect)):
      target = getattr(eff, "input", getattr(eff, "input_index", None))
      if isinstance(target, int):
        out.add(target)
      elif target in pos:
        out.add(pos[target])
  # Semaphores change under signals and waits, remote ones included (which
  # carry no effect on the kernel's own ref).
  out.update(i for i, v in enumerate(jaxpr.invars)
             if is_semaphore_dtype(getattr(v.aval, "dtype", None)))
  return out


def discharge_run_state(jaxpr):
  """A run_state body with its refs discharged (closed, no consts): what
  run_state's own impl evaluates; a core_map inside becomes an mpmd_map."""
  if ClosedJaxpr is not jax_core.Jaxpr:
    jaxpr = ClosedJaxpr(jaxpr, ())
  return state_discharge.discharge_state(jaxpr)


def memory_space_of(aval):
  """The memory space of a ref aval (or of a ShapedArray that carries one)."""
  return getattr(aval, "memory_space", None)
