"""cond (``pl.when``, ``lax.cond``, ``lax.switch``)."""
from __future__ import annotations

from jax import lax

from pallas_np import registry


@registry.register(lax.cond_p, needs_ctx=True)
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
