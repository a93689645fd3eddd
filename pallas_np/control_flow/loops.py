"""while_loop and scan (``fori_loop``, ``pl.loop`` lower to these)."""
from __future__ import annotations

import numpy as np

from jax import lax

from pallas_np import _compat as jc, registry
from pallas_np.dtypes import np_dtype


@registry.register(lax.while_p, needs_ctx=True)
def _while(e):
  p = e.params
  cond = e.compiler.compile(p["cond_jaxpr"]).fn
  body = e.compiler.compile(p["body_jaxpr"]).fn
  nc, nb = p["cond_nconsts"], p["body_nconsts"]

  def while_loop(ctx, *args):
    cconsts = args[:nc]
    bconsts = args[nc:nc + nb]
    carry = args[nc + nb:]
    while cond(ctx, *cconsts, *carry)[0]:
      carry = body(ctx, *bconsts, *carry)
    return carry
  return while_loop


@registry.register(lax.scan_p, needs_ctx=True)
def _scan(e):
  p = e.params
  body = e.compiler.compile(p["jaxpr"]).fn
  num_consts, num_carry = jc.scan_counts(p)
  length = int(p["length"])
  reverse = bool(p["reverse"])
  y_avals = e.out_avals[num_carry:]
  y_specs = [(tuple(a.shape), np_dtype(a.dtype)) for a in y_avals]  # (length, ...)
  order = range(length - 1, -1, -1) if reverse else range(length)
  n_xs = len(e.in_avals) - num_consts - num_carry

  if not y_specs and n_xs == 0:
    def scan_carry_only(ctx, *args):
      consts = args[:num_consts]
      carry = args[num_consts:]
      for _ in order:
        carry = body(ctx, *consts, *carry)
      return carry
    return scan_carry_only

  def scan(ctx, *args):
    consts = args[:num_consts]
    carry = args[num_consts:num_consts + num_carry]
    xs = args[num_consts + num_carry:]
    ys = [np.empty(shape, dt) for shape, dt in y_specs]
    for i in order:
      out = body(ctx, *consts, *carry, *[x[i] for x in xs])
      carry = out[:num_carry]
      for y, v in zip(ys, out[num_carry:]):
        y[i] = v
    return (*carry, *ys)
  return scan
