"""The batch compiler: a kernel compiled for a *slab* of grid points at once.

A vectorized grid (``pallas_np.grid.vectorize``) runs many independent grid
points in one NumPy pass: every block ref gains a leading lane axis (lane =
one grid point of the batched axes) and program_id of a batched axis becomes
an int32 array. ``BatchCompiler`` compiles the kernel for that: each value
either carries a leading lane axis ("batched") or is shared by all lanes, and
each eqn goes through its primitive's batched rule, registered with its
sequential rule (``registry.register(prim, batch=...)``):

* a callable ``rule(bc, seq_rule, info, in_batched) -> (fn, needs_ctx,
  out_batched)``, defined next to the sequential rule;
* a standard kind: ``registry.ELEMENTWISE``, ``registry.IDENTITY``
  (implemented here);
* ``registry.unbatched(why)`` (or nothing): the sequential rule runs once per
  lane (``lane_loop``) when the primitive is pure or touches only its own ref
  operands; anything else (context-dependent TPU/GPU primitives, callbacks,
  prints) raises ``NotBatchable`` and the grid runs sequentially.

An eqn none of whose operands is batched computes one value for every lane,
once per pass. This module knows nothing of grids: the slab runner lives in
``pallas_np.grid.slab_runner``.
"""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.errors import LaneOutOfBounds, NotBatchable  # noqa: F401  (re-exported)
from pallas_np.compiler import Compiler
from pallas_np.shared_outputs import active as shared_outputs


class BatchCompiler(Compiler):
  """Compiles a jaxpr whose values may carry a leading lane axis."""

  batched = True

  def __init__(self, params, name, batched_pid_axes: frozenset, lanes_last=False):
    super().__init__(params, name)
    self.batched_pid_axes = frozenset(batched_pid_axes)
    self.lanes_last = lanes_last  # buffers it allocates: lane-minor (see slab_runner)
    self.lane_access_bytes = 0  # see state.lane_access.count_lane_bytes

  def lower_eqn(self, rule, info, in_batched):
    eqn = info.eqn
    if (not any(in_batched) and not rule.needs_ctx and not has_subjaxprs(eqn)
        and all(isinstance(eff, REF_EFFECTS) for eff in eqn.effects)):
      # Same value for every lane: computed once per pass. (Batch rules
      # therefore only see eqns with some batched operand, or that need
      # the run context or have sub-jaxprs.)
      fn = rule.compile(info)
      if isinstance(fn, registry.NeedsCtx):
        raise NotBatchable(f"'{info.primitive.name}' needs the run context")
      refs = [k for k, a in enumerate(info.in_avals) if isinstance(a, jc.AbstractRef)]
      if refs:
        fn = refusing_shared(fn, refs, f"'{info.primitive.name}' run once for every lane")
      return fn, False, (False,) * len(info.out_avals)
    batch = rule.batch
    if batch is registry.ELEMENTWISE:
      return elementwise(self, rule, info, in_batched)
    if batch is registry.IDENTITY:
      return identity(self, rule, info, in_batched)
    if batch is None or isinstance(batch, registry.unbatched):
      return lane_loop(rule, info, in_batched)
    return batch(self, rule, info, in_batched)

  def check_wrapper(self, fn, info, multiple, out_batched):
    return checked_batched(fn, info, multiple, out_batched)


def refusing_shared(fn, refs, why):
  """``fn`` that first makes sure no ref operand is a shared output: every
  lane would touch it at once, with nothing recorded."""
  def guarded(*args):
    shared = shared_outputs()
    if shared is not None:
      shared.refuse([args[k] for k in refs], why)
    return fn(*args)
  return guarded


JAXPR_TYPES = jc.JAXPR_TYPES


def has_subjaxprs(eqn) -> bool:
  for v in eqn.params.values():
    if isinstance(v, JAXPR_TYPES):
      return True
    if isinstance(v, (tuple, list)):
      for x in v:  # a plain loop: this runs on every eqn of the analyses
        if isinstance(x, JAXPR_TYPES):
          return True
  return False


REF_EFFECTS = tuple(t for t in (jc.ReadEffect, jc.WriteEffect, jc.AccumEffect) if t is not None)


def lane_loop(rule, info, in_batched):
  """Run the unbatched rule once per lane: lanes never share refs, so a
  primitive that is pure or only touches its own ref operands is correct
  this way (just not fast)."""
  eqn = info.eqn
  if rule.needs_ctx or has_subjaxprs(eqn) or any(
      not isinstance(eff, REF_EFFECTS) for eff in eqn.effects):
    raise NotBatchable(f"no batched rule for '{info.primitive.name}'")
  for a, b in zip(info.in_avals, in_batched):
    if isinstance(a, jc.AbstractRef) and not b and writes_ref(eqn):
      raise NotBatchable("write to a ref shared by all lanes")
  fn = rule.compile(info)
  if isinstance(fn, registry.NeedsCtx):
    raise NotBatchable(f"'{info.primitive.name}' needs the run context")
  flags = tuple(in_batched)
  multiple = info.primitive.multiple_results
  used = info.outvars_used
  nout = len(info.out_avals)
  refs = [k for k, a in enumerate(info.in_avals) if isinstance(a, jc.AbstractRef)]
  why = f"'{info.primitive.name}' run lane by lane"

  def lane_loop(*args):
    shared = shared_outputs()
    if shared is not None:  # the unbatched rule would not mark what it touches
      shared.refuse([args[k] for k in refs], why)
    n = next(a.shape[0] for a, f in zip(args, flags) if f)
    results = [fn(*[a[b] if f else a for a, f in zip(args, flags)]) for b in range(n)]
    if multiple:
      return [np.stack([r[j] for r in results]) if used[j] else None for j in range(nout)]
    return np.stack(results) if used[0] else None
  return lane_loop, False, (True,) * nout


def writes_ref(eqn) -> bool:
  return any(isinstance(eff, (jc.WriteEffect, jc.AccumEffect)) for eff in eqn.effects)


def checked_batched(fn, info, multiple, out_batched):
  name = info.primitive.name

  def check(val, aval, batched):
    if aval is None or isinstance(aval, jc.AbstractRef) or not hasattr(aval, "shape"):
      return
    shape = tuple(np.shape(val))
    want_shape = tuple(aval.shape)
    got = shape[1:] if batched else shape
    if batched and len(shape) != len(want_shape) + 1:
      got = None
    dtype = getattr(val, "dtype", None)
    want = np.dtype(jc.physical_dtype(aval.dtype))
    if got != want_shape or dtype is None or np.dtype(dtype) != want:
      raise AssertionError(
          f"pallas_np internal check (vectorized): rule for '{name}' returned "
          f"{dtype}{list(shape)}, expected {want}{['lanes'] if batched else []}"
          f"{list(want_shape)} (at {info.source})")

  avals = [a if u else None for a, u in zip(info.out_avals, info.outvars_used)]

  def wrapped(*args):
    out = fn(*args)
    if multiple:
      for val, aval, b in zip(out, avals, out_batched):
        check(val, aval, b)
    else:
      check(out, avals[0], out_batched[0])
    return out
  return wrapped


# -- the standard kinds ------------------------------------------------------------
def elementwise(bc, rule, info, in_batched):
  """``registry.ELEMENTWISE``: the unbatched rule on lane-stacked operands."""
  fn = rule.compile(info)
  out_rank = len(info.out_aval.shape)
  expand = [b and len(a.shape) < out_rank and len(in_batched) > 1
            for a, b in zip(info.in_avals, in_batched)]
  out_b = (True,) * len(info.out_avals)
  if not any(expand):
    return fn, False, out_b
  # A batched lower-rank operand (a scalar next to an array) must be aligned
  # on the lane axis: (lanes,) -> (lanes, 1, ..., 1).
  pads = [out_rank - len(a.shape) if e else 0 for a, e in zip(info.in_avals, expand)]

  def aligned(*args):
    return fn(*[a.reshape((a.shape[0],) + (1,) * p + a.shape[1:]) if p else a
                for a, p in zip(args, pads)])
  return aligned, False, out_b


def identity(bc, rule, info, in_batched):
  """``registry.IDENTITY``: the operands pass through, lanes and all."""
  if info.primitive.multiple_results:
    return (lambda *xs: xs), False, tuple(in_batched)
  return (lambda x: x), False, (in_batched[0],)


# -- helpers of batched rules -------------------------------------------------------
def to_lanes(x, n):
  return np.broadcast_to(x, (n,) + np.shape(x))


def unary_batched(make):
  """A rule for a one-operand primitive: ``make(info)`` returns the batched
  callable (operand has a lane axis)."""
  def brule(bc, rule, info, in_batched):
    if not in_batched[0]:
      return rule.compile(info), False, (False,) * len(info.out_avals)
    return make(info), False, (True,) * len(info.out_avals)
  return brule


def shift_axes(axes):
  """Axes of a per-lane value, as axes of its lane-stacked value."""
  return tuple(int(a) + 1 for a in axes)


def lift(vals, have, want, n):
  """Give unbatched values a lane axis where ``want`` says batched."""
  return [to_lanes(v, n) if w and not h else v for v, h, w in zip(vals, have, want)]

