"""``pl.run_state`` (``run_state_p``): run a stateful body on fresh refs
holding the operands' values; the results are the refs' final values.

An operand that is itself a ref (a kernel ref passed through, as Mosaic GPU's
``emit_pipeline`` does) is handed to the body as is: writes land in it."""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.memory import allocate


@registry.register(jc.run_state_p, needs_ctx=True, foldable=False, context_free=True,
                   batch=registry.unbatched("rare in kernels; runs lane by lane"))
def _run_state(e):
  jaxpr = e.params["jaxpr"]
  is_initialized = e.params.get("is_initialized") or (True,) * len(jaxpr.invars)
  if not all(is_initialized):
    raise e.unsupported("run_state with uninitialized refs")
  plan = e.compiler.compile(jaxpr).fn
  params = e.compiler.params
  is_ref = [isinstance(a, jc.AbstractRef) for a in e.in_avals]
  avals = [v.aval.inner_aval for v in jaxpr.invars]

  def run_state(ctx, *args):
    bufs = []
    for x, ref, aval in zip(args, is_ref, avals):
      if ref:
        bufs.append(x)
      else:
        buf = allocate(aval.shape, aval.dtype, params)
        buf[...] = x
        bufs.append(buf)
    plan(ctx, *bufs)
    return [b if ref else np.array(b) for b, ref in zip(bufs, is_ref)]
  return run_state
