"""``pl.run_state`` (``run_state_p``): run a stateful body on fresh refs
holding the operands' values; the results are the refs' final values.

Two forms reach a kernel or an eager program:
- an operand that is itself a ref (a kernel ref passed through, as Mosaic
  GPU's ``emit_pipeline`` does) is handed to the body as is: writes land in it;
- ``pl.core_map`` used on values (a stateful core_map, or JAX 0.12's
  stateful ``mpmd_map``, inside ``run_state``): the body is discharged as
  JAX's own impl does, so it becomes the ``mpmd_map`` on values that
  pallas_np.meshes runs."""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import races, registry
from pallas_np.memory import allocate


_MESH_KERNELS = jc.mesh_kernel_primitives()  # core_map (JAX 0.10), mpmd_map


def _has_core_map(jaxpr) -> bool:
  """A mesh kernel on the body's refs: only its discharged form (an
  ``mpmd_map`` on values) runs, in pallas_np.meshes."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  return any(e.primitive in _MESH_KERNELS for e in jaxpr.eqns)


@registry.register(jc.run_state_p, needs_ctx=True, foldable=False, context_free=True,
                   batch=registry.unbatched("rare in kernels; runs lane by lane"))
def _run_state(e):
  jaxpr = e.params["jaxpr"]
  is_initialized = tuple(e.params.get("is_initialized") or (True,) * len(jaxpr.invars))
  if _has_core_map(jaxpr):
    return _discharged(e, jaxpr, is_initialized)
  plan = e.compiler.compile(jaxpr).fn
  params = e.compiler.params
  is_ref = [isinstance(a, jc.AbstractRef) for a in e.in_avals]
  avals = [v.aval.inner_aval for v in jaxpr.invars]
  # A Mosaic GPU run_state over wgmma accumulators waits for every wgmma
  # (wgmma_wait(0)) before it returns their values; the race detector of a
  # warpgroup (pallas_np.mosaic_gpu.race_clocks) orders that.
  waits_wgmma = params.detect_races and any(jc.is_wgmma_acc_aval(v.aval) for v in jaxpr.invars)

  def run_state(ctx, *args):
    it = iter(zip(args, is_ref))
    bufs, refs = [], []
    for aval, init in zip(avals, is_initialized):
      buf = allocate(aval.shape, aval.dtype, params)
      ref = False
      if init:
        x, ref = next(it)
        if ref:
          buf = x
        else:
          buf[...] = x
      bufs.append(buf)
      refs.append(ref)
    plan(ctx, *bufs)
    if waits_wgmma:
      wait = getattr(races.current(), "wgmma_wait", None)
      if wait is not None:
        wait(0)
    return [b if ref else np.array(b) for b, ref in zip(bufs, refs)]
  return run_state


def _discharged(e, jaxpr, is_initialized):
  closed = jc.discharge_run_state(jaxpr)
  plan = e.compiler.compile(closed).fn
  if all(is_initialized):
    return plan
  avals = [v.aval for v in getattr(closed, "jaxpr", closed).invars]

  def run_state(ctx, *args):
    it = iter(args)
    full = [next(it) if init else np.zeros(a.shape, a.dtype)
            for init, a in zip(is_initialized, avals)]
    return plan(ctx, *full)
  return run_state
