"""``pl.run_state`` (``run_state_p``): run a stateful body on fresh refs
holding the operands' values; the results are the refs' final values.

Two forms reach a kernel or an eager program:
- an operand that is itself a ref (a kernel ref passed through, as Mosaic
  GPU's ``emit_pipeline`` does) is handed to the body as is: writes land in it;
- ``pl.core_map`` used on values (a stateful core_map, or JAX 0.12's
  stateful ``mpmd_map``, inside ``run_state``): the body is discharged as
  JAX's own impl does, so it becomes the ``mpmd_map`` on values that
  pallas_np.meshes runs.

A body that *returns* values: JAX's own rule (the discharge every other
backend uses) drops them. Mosaic GPU's lowering (``_run_state_lowering_rule``)
does not: it lowers the discharged body, whose results are the body's return
values followed by the final values of the discharged operands (accumulators
and value operands), and hands out the first of those for the discharged
operands, so a returned value takes the place of the first accumulator's final
value (JAX's ``test_fori_loop_accumulator`` relies on it). A run_state over a
``plgpu.ACC`` accumulator exists only in Mosaic GPU kernels, so that is where
this convention is followed (``_mosaic_gpu_results``)."""
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
  over_accumulator = any(jc.is_wgmma_acc_aval(v.aval) for v in jaxpr.invars)
  waits_wgmma = params.detect_races and over_accumulator
  returns_values = over_accumulator and bool(getattr(jaxpr, "jaxpr", jaxpr).outvars)
  if returns_values:
    operand_is_ref = iter(is_ref)
    _check_mosaic_gpu_results(e, jaxpr, [init and next(operand_is_ref)
                                         for init in is_initialized])

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
    returned = plan(ctx, *bufs)
    if waits_wgmma:
      wait = getattr(races.current(), "wgmma_wait", None)
      if wait is not None:
        wait(0)
    finals = [b if ref else np.array(b) for b, ref in zip(bufs, refs)]
    if returns_values:
      return _mosaic_gpu_results(returned, finals, refs)
    return finals
  return run_state


def _check_mosaic_gpu_results(e, jaxpr, is_ref):
  """Mosaic GPU's lowering hands the body's return values out as results of
  the discharged operands (``_mosaic_gpu_results``); where their types differ
  the GPU kernel is ill-typed, so refuse it."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  finals = [v.aval.inner_aval for v, r in zip(jaxpr.invars, is_ref) if not r]
  seq = [v.aval for v in jaxpr.outvars] + finals
  for got, want in zip(seq, finals):
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
      raise e.unsupported(
          "pl.run_state over a plgpu.ACC accumulator whose body returns a value of type "
          f"{got.str_short()} in place of an operand of type {want.str_short()}: Mosaic "
          "GPU's lowering hands the body's return values out as the operands' results; "
          "return nothing from the body to get the accumulator's final value")


def _mosaic_gpu_results(returned, finals, is_ref):
  """The results Mosaic GPU's run_state lowering gives a body that returns
  values: the sequence (returned values, then the discharged operands' final
  values) handed out in order to the discharged (non-ref) operands."""
  seq = iter([*returned, *(f for f, r in zip(finals, is_ref) if not r)])
  return [f if r else np.array(next(seq)) for f, r in zip(finals, is_ref)]


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
