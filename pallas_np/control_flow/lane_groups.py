"""Lane groups: control flow whose predicate differs per lane in a
vectorized pass. ``cond`` splits the lanes by branch, a ``while`` whose
predicate differs per lane keeps iterating the lanes still active; each
group runs on its own lanes (contiguous lane ranges as views, others copied
in and out). Also the loops' carry batchedness (a fixpoint over the body).
"""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np.errors import NotBatchable
from pallas_np.compiler import RunContext
from pallas_np.kernel_context import rule_state
from pallas_np.shared_outputs import active as shared_outputs


class LaneGroup:
  """Selects a subset of lanes from batched operands and writes refs back."""
  __slots__ = ("sel", "is_slice", "count")

  def __init__(self, mask):
    idx = np.flatnonzero(mask)
    self.count = len(idx)
    if self.count and idx[-1] - idx[0] + 1 == self.count:
      self.sel = slice(int(idx[0]), int(idx[-1]) + 1)
      self.is_slice = True
    else:
      self.sel = idx
      self.is_slice = False

  def take(self, args, flags):
    return [a[self.sel] if f else a for a, f in zip(args, flags)]

  def run(self, fn, ctx, *args):
    """``fn(ctx, *args)`` on this group; shared-output records see the
    group's lanes by their pass-wide numbers."""
    shared = shared_outputs()
    if shared is None:
      return fn(ctx, *args)
    lane_ids = shared.lane_ids
    shared.lane_ids = lane_ids[self.sel]
    try:
      return fn(ctx, *args)
    finally:
      shared.lane_ids = lane_ids

  def put_back_refs(self, full, sub, flags, is_ref):
    if self.is_slice:
      return  # views: writes already landed
    for a, s, f, r in zip(full, sub, flags, is_ref):
      if f and r:
        a[self.sel] = s

  def ctx(self, ctx, pid_batched):
    sub = RunContext(ctx.kernel_name, ctx.params)
    sub.num_programs = ctx.num_programs
    sub.grid_point = ctx.grid_point
    sub.family = ctx.family
    sub.rules = rule_state(ctx)  # one run's rule state, shared with every group
    sub.program_ids = tuple(p[self.sel] if b else p
                            for p, b in zip(ctx.program_ids, pid_batched))
    sub.batch_size = self.count
    return sub


def pid_batched(bc, ctx):
  return tuple(i in bc.batched_pid_axes for i in range(len(ctx.program_ids)))



def fixpoint_carry(compile_body, n_carry, carry_in):
  """Carry batchedness of a loop: batched if batched on entry or made
  batched by the body. ``carry_in``: the entry batchedness, or a guess
  above it (``carry_guess``): the compile that confirms it is the last."""
  carry = tuple(carry_in)
  for _ in range(n_carry + 2):
    plan = compile_body(carry)
    out = tuple(plan.out_batched[:n_carry])
    new = tuple(a or b for a, b in zip(carry, out))
    if new == carry:
      return carry, plan
    carry = new
  raise NotBatchable("loop carry batchedness did not converge")


def computed_from_batched(jaxpr, in_batched) -> tuple:
  """Per output of ``jaxpr``: whether it is computed from a batched input
  (an eqn's outputs count as computed from all of its inputs). Batch rules
  batch no output of unbatched inputs but program_id's, which this does not
  see: a cheap first guess of out_batched, never trusted alone."""
  tainted = {v for v, b in zip(jaxpr.invars, in_batched) if b}
  for eqn in jaxpr.eqns:
    if any(v in tainted for v in eqn.invars if isinstance(v, jc.Var)):
      tainted.update(eqn.outvars)
  return tuple(isinstance(v, jc.Var) and v in tainted for v in jaxpr.outvars)


def carry_guess(body_jaxpr, consts_b, carry_in, xs_b=()) -> tuple:
  """Loop carries computed from batched values (``computed_from_batched``
  to a fixpoint): the first carry batchedness ``fixpoint_carry`` compiles
  the body with, so that one compile usually suffices."""
  carry = tuple(carry_in)
  n = len(carry)
  for _ in range(n + 1):
    out = computed_from_batched(body_jaxpr, consts_b + carry + xs_b)[:n]
    new = tuple(a or b for a, b in zip(carry, out))
    if new == carry:
      break
    carry = new
  return carry
