"""cond (``pl.when``, ``lax.cond``, ``lax.switch``); in a vectorized pass
each lane takes its own branch (lane groups)."""
from __future__ import annotations

import numpy as np

from jax import lax

from pallas_np import _compat as jc
from pallas_np import batching, registry
from pallas_np.control_flow import lane_groups


def _cond_batched(bc, rule, info, in_batched):
  idx_b, *ops_b = in_batched
  ops_b = tuple(ops_b)
  branches = [bc.compile(b, in_batched=ops_b) for b in info.params["branches"]]
  n_out = len(info.out_avals)
  out_b = tuple(any(p.out_batched[j] for p in branches) for j in range(n_out))
  fns = [p.fn for p in branches]
  lifts = [tuple(p.out_batched) for p in branches]
  last = len(fns) - 1
  written = set()
  for b in info.params["branches"]:
    written |= jc.written_invar_positions(b.jaxpr)
  is_ref = [i in written for i in range(len(ops_b))]  # refs to copy back
  out_dtypes = [np.dtype(jc.physical_dtype(a.dtype)) for a in info.out_avals]
  out_shapes = [tuple(a.shape) for a in info.out_avals]

  if not idx_b:
    def cond(ctx, index, *ops):
      i = int(index)
      i = 0 if i < 0 else (last if i > last else i)
      outs = fns[i](ctx, *ops)
      if lifts[i] != out_b:
        outs = batching.lift(outs, lifts[i], out_b, ctx.batch_size)
      return outs
    return cond, True, out_b

  out_b = (True,) * n_out

  def cond_lanes(ctx, index, *ops):
    index = np.clip(np.asarray(index).astype(np.int64), 0, last)
    first = int(index[0])
    if (index == first).all():  # every lane takes one branch
      outs = fns[first](ctx, *ops)
      return batching.lift(outs, lifts[first], out_b, ctx.batch_size)
    n = ctx.batch_size
    results = [np.empty((n, *s), d) for s, d in zip(out_shapes, out_dtypes)]
    pid_b = lane_groups.pid_batched(bc, ctx)
    for k in range(last + 1):
      mask = index == k
      if not mask.any():
        continue
      group = lane_groups.LaneGroup(mask)
      sub_ops = group.take(ops, ops_b)
      outs = group.run(fns[k], group.ctx(ctx, pid_b), *sub_ops)
      group.put_back_refs(ops, sub_ops, ops_b, is_ref)
      for r, o in zip(results, outs):
        r[group.sel] = o
    return results
  return cond_lanes, True, out_b


@registry.register(lax.cond_p, needs_ctx=True, context_free=True, batch=_cond_batched)
def _cond(e):
  branches = [e.compiler.compile(b).fn for b in e.params["branches"]]
  last = len(branches) - 1
  if len(branches) == 2:
    f0, f1 = branches

    def cond2(ctx, index, *ops):
      return f1(ctx, *ops) if index else f0(ctx, *ops)
    return cond2

  def cond(ctx, index, *ops):
    # XLA clamps the branch index.
    i = int(index)
    return branches[0 if i < 0 else (last if i > last else i)](ctx, *ops)
  return cond
