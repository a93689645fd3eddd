"""Grid vectorization: run many independent grid points in one NumPy pass.

A grid loop costs Python per grid point; with small blocks (one row per
step) that overhead dwarfs the NumPy work. Where grid points are provably
independent, we instead run a *slab* of them at once: every block ref gains a
leading lane axis (lane = one grid point of the batched axes), program_id of
a batched axis becomes an int32 array, and the kernel is compiled a second
time by ``BatchCompiler`` with batched rules (values carry a leading lane axis
or are shared by all lanes).

When is it safe (the analysis, all of it conservative):

* Every output block is owned by one lane: no two grid points that differ in
  a batched coordinate touch the same output block (checked on the index
  maps evaluated over the whole grid, so scalar-prefetch-driven maps are
  covered). Any grid axis may be batched; the first candidate set that
  passes wins (all axes, then grid prefixes, then single axes).
* Outputs every grid point sees whole (Triton style, no BlockSpec) own no
  block. Without scratch they are batched over every axis anyway and checked
  while the pass runs: ``SharedOutputs`` records, per element, which lane
  touched it, and lanes that meet send the grid back to the loop.
* Scratch persists across grid points. Kernels with scratch batch only a
  grid prefix (lanes consecutive in grid order) and run with lane-private
  scratch, recording every lane's state (scratch and output blocks) after
  its first sequential grid point. A check then re-runs that first point
  only, each lane starting from the previous lane's final scratch: equal
  states prove each lane started from its grid-order state (induction), so
  the pass is the sequential result; otherwise the sequential loop runs.
  ``dimension_semantics`` is thus checked, never trusted.
* The kernel writes no input (aliased inputs are private copies, but shared
  by every grid point), no output has ``Element`` dims (overlapping
  windows), and no debugging option that observes grid order is on.
* Every primitive has a batched rule, or is pure / touches only its own ref
  operands, so it can be run lane by lane inside the pass ("lane loop").
  Anything else (context-dependent TPU/GPU primitives, callbacks, prints)
  raises ``NotBatchable`` and the grid runs sequentially.

Layout: a pass stores its lane-stacked values lanes-first or, for kernels
whose values have short last axes, lanes-last (the lane axis contiguous in
memory; see "the lanes-last layout" below). Same values either way.

Sequential axes stay sequential: each slab of lanes walks the sequential
grid points in JAX order, with its own lane-private scratch. Control flow that
depends on a batched value runs per lane group: ``cond`` splits lanes by
branch (contiguous lane ranges use views, others copy in and out), a
``while`` whose predicate differs per lane keeps iterating the lanes still
active. If anything fails in a vectorized run, the kernel is re-run
sequentially from fresh buffers, so errors name the exact grid point.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import math
import threading
from typing import Any

import numpy as np

from pallas_np import _compat as jc
from pallas_np import blas, registry
from pallas_np.compiler import Compiler, RunContext, lanes_last_empty
from pallas_np.compiler import INLINE_CALLS as _INLINE_CALLS


class NotBatchable(Exception):
  """The kernel (or an index map) cannot be evaluated lane-batched."""


class LaneOutOfBounds(NotBatchable, IndexError):
  """A lane accessed outside its ref: the sequential rerun raises it at its
  grid point and line (or clamps, with ``bounds_check="clamp"``)."""


# -- the batch compiler --------------------------------------------------------
_BATCH_RULES: dict[str, Any] = {}


def batch_rule(*names):
  """Register ``rule(compiler, reg_rule, info, in_batched) -> (fn, needs_ctx,
  out_batched)`` for primitives by name (names keep optional primitives
  optional)."""
  def deco(fn):
    for n in names:
      _BATCH_RULES[n] = fn
    return fn
  return deco


class BatchCompiler(Compiler):
  """Compiles a jaxpr whose values may carry a leading lane axis."""

  batched = True

  def __init__(self, params, name, batched_pid_axes: frozenset, lanes_last=False):
    super().__init__(params, name)
    self.batched_pid_axes = frozenset(batched_pid_axes)
    self.lanes_last = lanes_last  # buffers it allocates: lane-minor (see _SlabRunner)
    self.lane_access_bytes = 0  # see _count_lane_bytes

  def lower_eqn(self, rule, info, in_batched):
    eqn = info.eqn
    if (not any(in_batched) and not rule.needs_ctx and not _has_subjaxprs(eqn)
        and all(isinstance(eff, _REF_EFFECTS) for eff in eqn.effects)):
      # Same value for every lane: computed once per pass. (Batch rules
      # therefore only see eqns with some batched operand, or that need
      # the run context or have sub-jaxprs.)
      fn = rule.compile(info)
      if isinstance(fn, registry.NeedsCtx):
        raise NotBatchable(f"'{info.primitive.name}' needs the run context")
      refs = [k for k, a in enumerate(info.in_avals) if isinstance(a, jc.AbstractRef)]
      if refs:
        fn = _refusing_shared(fn, refs, f"'{info.primitive.name}' run once for every lane")
      return fn, False, (False,) * len(info.out_avals)
    brule = _BATCH_RULES.get(info.primitive.name)
    if brule is not None:
      return brule(self, rule, info, in_batched)
    return _lane_loop(rule, info, in_batched)

  def check_wrapper(self, fn, info, multiple, out_batched):
    return _checked_batched(fn, info, multiple, out_batched)


def _refusing_shared(fn, refs, why):
  """``fn`` that first makes sure no ref operand is a shared output: every
  lane would touch it at once, with nothing recorded."""
  def guarded(*args):
    shared = _shared()
    if shared is not None:
      shared.refuse([args[k] for k in refs], why)
    return fn(*args)
  return guarded


_JAXPR_TYPES = jc.JAXPR_TYPES


def _has_subjaxprs(eqn) -> bool:
  for v in eqn.params.values():
    if isinstance(v, _JAXPR_TYPES):
      return True
    if isinstance(v, (tuple, list)):
      for x in v:  # a plain loop: this runs on every eqn of the analyses
        if isinstance(x, _JAXPR_TYPES):
          return True
  return False


_REF_EFFECTS = tuple(t for t in (jc.ReadEffect, jc.WriteEffect, jc.AccumEffect) if t is not None)


def _lane_loop(rule, info, in_batched):
  """Run the unbatched rule once per lane: lanes never share refs, so a
  primitive that is pure or only touches its own ref operands is correct
  this way (just not fast)."""
  eqn = info.eqn
  if rule.needs_ctx or _has_subjaxprs(eqn) or any(
      not isinstance(eff, _REF_EFFECTS) for eff in eqn.effects):
    raise NotBatchable(f"no batched rule for '{info.primitive.name}'")
  for a, b in zip(info.in_avals, in_batched):
    if isinstance(a, jc.AbstractRef) and not b and _writes_ref(eqn):
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
    shared = _shared()
    if shared is not None:  # the unbatched rule would not mark what it touches
      shared.refuse([args[k] for k in refs], why)
    n = next(a.shape[0] for a, f in zip(args, flags) if f)
    results = [fn(*[a[b] if f else a for a, f in zip(args, flags)]) for b in range(n)]
    if multiple:
      return [np.stack([r[j] for r in results]) if used[j] else None for j in range(nout)]
    return np.stack(results) if used[0] else None
  return lane_loop, False, (True,) * nout


def _writes_ref(eqn) -> bool:
  return any(isinstance(eff, (jc.WriteEffect, jc.AccumEffect)) for eff in eqn.effects)


def _checked_batched(fn, info, multiple, out_batched):
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


# -- elementwise ------------------------------------------------------------------
_ELEMENTWISE = """add sub mul div rem pow max min and or xor not eq ne lt le gt ge neg
sign abs floor ceil round is_finite exp exp2 log log1p expm1 tanh logistic sin cos
tan asin acos atan atan2 sinh cosh asinh acosh atanh sqrt rsqrt cbrt integer_pow
square erf erfc erf_inv lgamma digamma igamma igammac polygamma zeta bessel_i0e
bessel_i1e nextafter select_n clamp shift_left shift_right_logical
shift_right_arithmetic population_count clz convert_element_type reduce_precision
real imag complex conj bitcast_convert_type reciprocal mulhi log2 one_minus_square
polynomial""".split()


@batch_rule(*_ELEMENTWISE)
def _elementwise(bc, rule, info, in_batched):
  fn = rule.compile(info)
  if info.primitive.name == "select_n" and len(in_batched) == 2:
    # select_n with one case returns it as is.
    return (lambda p, c: c), False, (in_batched[1],)
  out_rank = len(info.out_aval.shape)
  expand = [b and len(a.shape) < out_rank and len(in_batched) > 1
            for a, b in zip(info.in_avals, in_batched)]
  if not any(expand):
    return fn, False, (True,)
  # A batched lower-rank operand (a scalar next to an array) must be aligned
  # on the lane axis: (lanes,) -> (lanes, 1, ..., 1).
  pads = [out_rank - len(a.shape) if e else 0 for a, e in zip(info.in_avals, expand)]

  def aligned(*args):
    return fn(*[a.reshape((a.shape[0],) + (1,) * p + a.shape[1:]) if p else a
                for a, p in zip(args, pads)])
  return aligned, False, (True,)


@batch_rule("multiple_of", "max_contiguous", "copy", "copy_p", "stop_gradient",
            "pvary", "sharding_constraint")
def _identity(bc, rule, info, in_batched):
  return (lambda x: x), False, (in_batched[0],)


@batch_rule("optimization_barrier")
def _identity_multi(bc, rule, info, in_batched):
  return (lambda *xs: xs), False, tuple(in_batched)


# -- pallas --------------------------------------------------------------------------
@batch_rule("program_id")
def _program_id(bc, rule, info, in_batched):
  axis = int(info.params["axis"])
  return (lambda ctx: ctx.program_ids[axis]), True, (axis in bc.batched_pid_axes,)


@batch_rule("num_programs")
def _num_programs(bc, rule, info, in_batched):
  return rule.compile(info), True, (False,)


# -- shapes ---------------------------------------------------------------------------
def _to_lanes(x, n):
  return np.broadcast_to(x, (n,) + np.shape(x))


def _unary_batched(make):
  """A rule for a one-operand primitive: ``make(info)`` returns the batched
  callable (operand has a lane axis)."""
  def brule(bc, rule, info, in_batched):
    if not in_batched[0]:
      return rule.compile(info), False, (False,) * len(info.out_avals)
    return make(info), False, (True,) * len(info.out_avals)
  return brule


def _shift(axes):
  return tuple(int(a) + 1 for a in axes)


batch_rule("transpose")(_unary_batched(
    lambda e: (lambda x, perm=(0, *_shift(e.params["permutation"])): np.transpose(x, perm))))
batch_rule("squeeze")(_unary_batched(
    lambda e: (lambda x, d=_shift(e.params["dimensions"]): np.squeeze(x, axis=d))))
batch_rule("expand_dims")(_unary_batched(
    lambda e: (lambda x, d=_shift(e.params["dimensions"]): np.expand_dims(x, d))))
batch_rule("rev")(_unary_batched(
    lambda e: (lambda x, d=_shift(e.params["dimensions"]): np.flip(x, d))))


@batch_rule("reshape")
def _reshape(bc, rule, info, in_batched):
  if not in_batched[0]:
    return rule.compile(info), False, (False,)
  if info.params.get("dimensions") is not None:
    raise NotBatchable("reshape with dimensions")
  new_sizes = tuple(info.params["new_sizes"])
  return (lambda x, *dyn: np.reshape(x, (x.shape[0], *new_sizes))), False, (True,)


def _lane_broadcast(shape, expanded):
  """Broadcast a lane-stacked operand laid out as ``expanded`` to ``shape``."""
  from pallas_np.primitives.shape import broadcast
  size = math.prod(shape)

  def bcast(x):
    n = x.shape[0]
    return broadcast(x, (n, *expanded), (n, *shape), n * size)
  return bcast, False, (True,)


@batch_rule("broadcast_in_dim")
def _broadcast_in_dim(bc, rule, info, in_batched):
  if not in_batched[0]:
    return rule.compile(info), False, (False,)
  if len(in_batched) > 1:
    raise NotBatchable("dynamic broadcast_in_dim")
  from pallas_np.primitives.shape import broadcast_geometry
  return _lane_broadcast(*broadcast_geometry(info))


@batch_rule("broadcast_to")
def _broadcast_to(bc, rule, info, in_batched):
  """The state primitive Triton-style kernels emit: right-aligned."""
  from pallas_np.primitives.triton import broadcast_to_geometry
  return _lane_broadcast(*broadcast_to_geometry(info))


@batch_rule("slice")
def _slice(bc, rule, info, in_batched):
  if not in_batched[0]:
    return rule.compile(info), False, (False,)
  starts = info.params["start_indices"]
  limits = info.params["limit_indices"]
  strides = info.params["strides"] or (1,) * len(starts)
  idx = (slice(None),) + tuple(slice(s, l, st) for s, l, st in zip(starts, limits, strides))
  return (lambda x: x[idx]), False, (True,)


@batch_rule("concatenate")
def _concatenate(bc, rule, info, in_batched):
  dim = int(info.params["dimension"]) + 1
  flags = tuple(in_batched)

  def concat(*xs):
    n = next(x.shape[0] for x, f in zip(xs, flags) if f)
    return np.concatenate([x if f else _to_lanes(x, n) for x, f in zip(xs, flags)], axis=dim)
  return concat, False, (True,)


@batch_rule("split")
def _split(bc, rule, info, in_batched):
  if not in_batched[0]:
    return rule.compile(info), False, (False,) * len(info.out_avals)
  sizes = tuple(info.params["sizes"])
  axis = int(info.params["axis"]) + 1
  bounds = np.cumsum(sizes)[:-1]
  return (lambda x: np.split(x, bounds, axis=axis)), False, (True,) * len(sizes)


@batch_rule("pad")
def _pad(bc, rule, info, in_batched):
  if in_batched[1]:
    return _lane_loop(rule, info, in_batched)
  from pallas_np.primitives.shape import pad_array
  config = ((0, 0, 0),) + tuple(info.params["padding_config"])
  dt = np.dtype(jc.physical_dtype(info.out_aval.dtype))
  return (lambda x, v: pad_array(x, v, config, dt)), False, (True,)


@batch_rule("dynamic_slice")
def _dynamic_slice(bc, rule, info, in_batched):
  if any(in_batched[1:]):
    return _lane_loop(rule, info, in_batched)
  sizes = tuple(info.params["slice_sizes"])
  shape = tuple(info.in_avals[0].shape)
  from pallas_np.primitives.shape import _clamped_starts

  def dynamic_slice(x, *starts):
    st = _clamped_starts(starts, shape, sizes)
    return x[(slice(None),) + tuple(slice(s, s + z) for s, z in zip(st, sizes))]
  return dynamic_slice, False, (True,)


@batch_rule("dynamic_update_slice")
def _dynamic_update_slice(bc, rule, info, in_batched):
  if any(in_batched[2:]):
    return _lane_loop(rule, info, in_batched)
  shape = tuple(info.in_avals[0].shape)
  upd_shape = tuple(info.in_avals[1].shape)
  from pallas_np.primitives.shape import _clamped_starts
  x_batched = in_batched[0]

  def dynamic_update_slice(x, update, *starts):
    st = _clamped_starts(starts, shape, upd_shape)
    if x_batched:
      out = np.array(x)
    else:
      out = np.array(_to_lanes(x, update.shape[0]))
    out[(slice(None),) + tuple(slice(s, s + z) for s, z in zip(st, upd_shape))] = update
    return out
  return dynamic_update_slice, False, (True,)


# -- reductions: the unbatched rule with axes shifted past the lane axis -----------
def _shifted_rule(param, single=False):
  def brule(bc, rule, info, in_batched):
    if len(in_batched) != 1:
      return _lane_loop(rule, info, in_batched)
    shifted = registry.EqnInfo(info.eqn, bc, info.outvars_used, info.folded)
    params = dict(info.params)
    v = params[param]
    params[param] = int(v) + 1 if single else _shift(v)
    shifted.params = params
    fn = rule.compile(shifted)
    if bc.lanes_last and info.primitive.name in _ORDERED_REDUCTIONS and np.dtype(
        jc.physical_dtype(info.in_avals[0].dtype)).kind in "fc":
      # NumPy sums pairwise along a contiguous axis but one element after
      # another across a strided one: a lanes-last operand would round
      # differently from the grid loop. Lanes first, it adds in its order.
      return (lambda x: fn(np.ascontiguousarray(x))), False, (True,) * len(info.out_avals)
    return fn, False, (True,) * len(info.out_avals)
  return brule


_ORDERED_REDUCTIONS = frozenset(("reduce_sum", "reduce_prod"))


for _n in ("reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "reduce_and",
           "reduce_or", "reduce_xor", "argmax", "argmin"):
  batch_rule(_n)(_shifted_rule("axes"))
for _n in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
  batch_rule(_n)(_shifted_rule("axis", single=True))


@batch_rule("dot_general")
def _dot_general(bc, rule, info, in_batched):
  """One ``np.matmul`` over every lane whose per-lane products are the very
  BLAS calls the grid loop makes (the same shapes, operand layouts and
  thread count). Folding the lanes into the lhs rows (one big GEMM)
  is faster, but BLAS rounds a GEMM's rows differently with the row count
  (measured: most elements of a 64-lane 1x32 @ 32x16 product moved by an
  ulp on an AVX2 EPYC), and vectorized grids must stay bitwise equal to
  the sequential ones."""
  from pallas_np.primitives.dot import DotGeometry
  g = DotGeometry(info)
  Bd, M, K, N = g.B, g.M, g.K, g.N
  out_shape, acc, out = g.out_shape, g.acc, g.out
  bool_out = out == np.bool_
  lb_, rb_ = in_batched
  lperm = (0, *[d + 1 for d in g.lperm]) if lb_ else g.lperm
  rperm = (0, *[d + 1 for d in g.rperm]) if rb_ else g.rperm
  matmul = blas.matmul_for(Bd * M * K * N)  # the grid loop's choices
  layout = g.layout

  def dot(x, y):
    n = x.shape[0] if lb_ else y.shape[0]
    x = np.transpose(np.asarray(x, dtype=acc), lperm)
    y = np.transpose(np.asarray(y, dtype=acc), rperm)
    x = layout(x.reshape((n, Bd, M, K) if lb_ else (Bd, M, K)))
    y = layout(y.reshape((n, Bd, K, N) if rb_ else (Bd, K, N)))
    r = matmul(x, y)  # (n, Bd, M, N); an unbatched operand broadcasts
    if bool_out:
      r = r != 0
    return np.asarray(r.reshape((n, *out_shape)), dtype=out)
  return dot, False, (True,)


# -- outputs every lane shares: who read and wrote what -------------------------------
class SharedOutputs:
  """Outputs every lane of a pass sees whole (Triton-style whole-array
  outputs written at program_id-dependent offsets). They stay one unbatched
  buffer that the lanes write in place, and every access through a batched
  rule records, per element, which lane wrote it and which lane(s) read it.
  Lanes of a pass then provably commute -- and the pass equals grid order
  -- when no element is written by two lanes or written by one lane and
  read by another; the first access that breaks this raises NotBatchable
  (the grid loop reruns from fresh buffers). Anything that would touch a
  tracked buffer unseen (a lane loop running the unbatched rule, an eqn
  every lane runs as one, a view of it) raises NotBatchable too. Slabs run
  one after another, each with fresh records: a later slab seeing what an
  earlier one wrote is grid order."""

  def __init__(self, lanes: int):
    self.regions = []  # (base, start, end, state)
    self.lane_ids = np.arange(lanes, dtype=np.int64)  # a lane group narrows it (_LaneGroup.run)

  # Per element: -1 untouched, -2 read by several lanes (none wrote it), or
  # 4 * lane + (1 if read) + (2 if written) for the one lane that touched it.
  def add(self, base: np.ndarray):
    start = base.__array_interface__["data"][0]
    self.regions.append((base, start, start + base.nbytes, np.full(base.size, -1, np.int64)))

  def region(self, ref):
    if not isinstance(ref, np.ndarray):
      return None
    ptr = ref.__array_interface__["data"][0]
    for r in self.regions:
      if r[1] <= ptr < r[2]:
        if ref is not r[0]:
          raise NotBatchable("a shared output accessed through a view")
        return r
    return None

  def refuse(self, args, why):
    for a in args:
      if self.region(a) is not None:
        raise NotBatchable(f"a shared output is touched by {why}")

  def access(self, ref, coords, full, on, kind):
    """Record the elements ``ref[coords]`` (broadcast to ``full`` = (lanes,
    *shape), where ``on``) each lane touches; ``kind``: read/write/readwrite."""
    region = self.region(ref)
    if region is None:
      return
    base, _, _, state = region
    lane = self.lane_ids.reshape((-1,) + (1,) * (len(full) - 1))
    if on is None:
      pick = lambda c: np.broadcast_to(c, full).ravel()
    else:
      on = np.broadcast_to(on, full)
      pick = lambda c: np.broadcast_to(c, full)[on]
    me = pick(lane * 4)
    if base.ndim == 1:
      elems = pick(coords[0])
    elif base.ndim:
      elems = np.ravel_multi_index(tuple(pick(c) for c in coords), base.shape)
    else:
      elems = np.zeros(me.shape, np.intp)
    s = state[elems]
    other = (s >= 0) & ((s & ~3) != me)
    if kind == "read":
      if (other & ((s & 2) != 0)).any():
        raise NotBatchable("a lane read a shared output element another lane wrote")
      new = np.where(s == -1, me + 1, np.where(other | (s == -2), -2, s | 1))
    else:
      if (other | (s == -2)).any():
        raise NotBatchable("a lane wrote a shared output element another lane touched")
      new = me + 3
    state[elems] = new
    clash = state[elems] != new  # one op, several lanes on one element
    if clash.any():
      if kind != "read":
        raise NotBatchable("two lanes write one shared output element")
      state[elems[clash]] = -2

  def access_span(self, ref, span, kind):
    """``access`` for a _Span of a 1-D ref: slices instead of gathers (each
    element at most once, so no same-op clash)."""
    region = self.region(ref)
    if region is None or span.a >= span.b:
      return
    state = region[3]
    me = np.repeat(self.lane_ids * 4, span.per_lane)[span.inner]
    s = state[span.a:span.b]
    other = (s >= 0) & ((s & ~3) != me)
    if kind == "read":
      bad = other & ((s & 2) != 0)
      new = np.where(s == -1, me + 1, np.where(other | (s == -2), -2, s | 1))
    else:
      bad = other | (s == -2)
      new = me + 3
    on = span.on_inner
    if on is not None:
      bad &= on
      new = np.where(on, new, s)
    if bad.any():
      raise NotBatchable("lanes meet on a shared output element")
    state[span.a:span.b] = new


_tracking = threading.local()


def _shared():
  """The active SharedOutputs of this thread's pass, or None."""
  return getattr(_tracking, "shared", None)


# -- refs --------------------------------------------------------------------------
class _Span:
  """Elements ``lo..hi-1`` of a 1-D ref, lane after lane (``full`` = (lanes,
  per_lane)); ``[a, b)`` is the part inside the ref. A masked-on (or
  unmasked) element outside raises IndexError: the sequential rerun names it."""
  __slots__ = ("lo", "hi", "a", "b", "full", "per_lane", "on", "inner", "on_inner")

  def __init__(self, lo, hi, n, full, on):
    self.lo, self.hi, self.full, self.per_lane, self.on = lo, hi, full, full[1], on
    self.a, self.b = min(max(lo, 0), n), max(min(hi, n), 0)
    self.inner = slice(self.a - lo, max(self.b - lo, self.a - lo))
    if self.b - self.a != hi - lo:
      outside = np.ones(hi - lo, bool)
      outside[self.inner] = False
      if on is None or (on & outside).any():
        raise LaneOutOfBounds("out-of-bounds ref access in a vectorized pass")
    self.on_inner = None if on is None else on[self.inner]

  def gather(self, ref, fill, dtype):
    """Every element, ``fill`` outside the ref, as a new (lanes, per_lane) array."""
    if self.b - self.a == self.hi - self.lo:
      return np.array(ref[self.a:self.b], dtype=dtype).reshape(self.full)
    out = np.full(self.hi - self.lo, fill, dtype=dtype)
    out[self.inner] = ref[self.a:self.b]
    return out.reshape(self.full)

  def scatter(self, ref, val):
    """``ref[lo:hi] = val`` where on and inside."""
    v = np.broadcast_to(np.asarray(val, dtype=ref.dtype), self.full).reshape(-1)[self.inner]
    if self.on_inner is None:
      ref[self.a:self.b] = v
    else:
      np.copyto(ref[self.a:self.b], v, where=self.on_inner)


class _LaneIndexed:
  """A lone-indexer access whose indices differ per lane (program_id-based
  offsets, Triton style), on a lane-stacked ref or on one every lane
  shares: per-element coordinates of all lanes, one NumPy gather/scatter."""

  def __init__(self, access, ref_batched, leaf_batched):
    self.access = access
    self.ref_batched = ref_batched
    self.leaf_batched = tuple(leaf_batched)
    self.shape = tuple(access.result_shape)

  @staticmethod
  def make(access, ref_batched, leaf_batched):
    """None unless the access is one indexer with static slice sizes."""
    from pallas_np.state.indexing import _DimSlice, _static
    steps = access.steps
    if len(steps) != 1 or steps[0][0] != "index" or any(
        isinstance(d, _DimSlice) and not _static(d.size) for d in steps[0][1]):
      return None
    return _LaneIndexed(access, ref_batched, leaf_batched)

  def coords(self, leaves):
    """Per-element coordinates of every lane (RefAccess.lane_coords)."""
    return self.access.lane_coords(leaves, self.leaf_batched)

  def span(self, ref, coords, lanes, mask):
    """A _Span when the lanes' elements are one run ``ref[lo:hi]`` of a 1-D
    ref every lane shares, lane after lane (Triton's ``program_id * BLOCK +
    arange(BLOCK)``): slices then replace gathers and scatters. Else None."""
    if self.ref_batched or ref.ndim != 1 or len(self.shape) != 1:
      return None
    (c,) = coords
    full = (lanes, *self.shape)
    flat = np.broadcast_to(c, full).reshape(-1)
    lo = int(flat[0])
    if flat.size > 1 and (int(flat[-1]) != lo + flat.size - 1 or (np.diff(flat) != 1).any()):
      return None
    on = None if mask is None else np.broadcast_to(np.asarray(mask, bool), full).reshape(-1)
    return _Span(lo, lo + flat.size, ref.shape[0], full, on)

  def index(self, ref, coords, lanes, mask):
    """``(index, in_bounds, full)``: ``ref[index]`` broadcasts to ``full`` =
    (lanes, *shape); out-of-bounds coordinates are redirected to 0 and
    ``in_bounds`` (None: all in) says where. A masked-on (or unmasked) lane
    out of bounds raises IndexError: the sequential rerun names it."""
    full = (lanes, *self.shape)
    dims = ref.shape[1:] if self.ref_batched else ref.shape
    in_bounds = None
    safe = []
    for c, n in zip(coords, dims):
      if c.size and (c.min() < 0 or c.max() >= n):
        ok = (c >= 0) & (c < n)
        in_bounds = ok if in_bounds is None else in_bounds & ok
        c = np.where(ok, c, 0)
      safe.append(c)
    if self.ref_batched:
      safe.insert(0, np.arange(lanes).reshape((lanes,) + (1,) * len(self.shape)))
    if in_bounds is not None:
      in_bounds = np.broadcast_to(in_bounds, full)
      bad = ~in_bounds if mask is None else np.broadcast_to(mask, full) & ~in_bounds
      if bad.any():
        raise LaneOutOfBounds("out-of-bounds ref access in a vectorized pass")
    return tuple(safe), in_bounds, full

  @staticmethod
  def active(index, full, on):
    """``index`` restricted to the elements where ``on`` (None: all)."""
    if on is None:
      return tuple(np.broadcast_to(c, full).ravel() for c in index)
    on = np.broadcast_to(on, full)
    return tuple(np.broadcast_to(c, full)[on] for c in index)


def _lanes_of(args, flags):
  return next(a.shape[0] for a, f in zip(args, flags) if f)


def _lane_index(idx):
  return (slice(None), *idx) if isinstance(idx, tuple) else (slice(None), Ellipsis)


def _dyn_flags(access, leaf_batched):
  return tuple(leaf_batched[p] for p in access.dynamic_positions)


def _tracked(ref):
  """The SharedOutputs recording writes to ``ref``, a ref every lane shares
  (only a shared output may be written that way)."""
  shared = _shared()
  if shared is None or shared.region(ref) is None:
    raise NotBatchable("write to a ref shared by all lanes")
  return shared


def _count_lane_bytes(bc, lane_acc, dtype):
  """Per-lane bytes a lane-indexed access moves: the auto mode weighs them
  like block bytes (a Triton kernel's blocks are such accesses)."""
  bc.lane_access_bytes += math.prod(lane_acc.shape) * np.dtype(jc.physical_dtype(dtype)).itemsize


def _on(mask, in_bounds):
  """Elements a masked access really touches (None: all)."""
  if mask is None:
    return in_bounds
  mask = np.asarray(mask, bool)
  return mask if in_bounds is None else mask & in_bounds


def _read_lanes_last(x):
  """``refs._read`` keeping the memory order ('K'): a copy of a lanes-last
  block stays lanes-last (a 'C' copy would put the lanes first again)."""
  return x.copy(order="K") if x.flags.writeable else x


@batch_rule("get")
def _get(bc, rule, info, in_batched):
  from pallas_np.state.refs import _access, _dyn, _read
  access = _access(info, info.in_avals[0], info.eqn.invars[1:], info.params["tree"])
  ref_b, leaf_b = in_batched[0], _dyn_flags(access, in_batched[1:])
  resolve = access.resolve
  if ref_b and not any(leaf_b) and access.plain():
    read = _read_lanes_last if bc.lanes_last else _read

    def get(ref, *leaves):
      view, idx = resolve(ref, _dyn(access, leaves))
      return read(view[_lane_index(idx)])
    return get, False, (True,)
  lane_acc = None if access.clamp else _LaneIndexed.make(access, ref_b, leaf_b)
  if lane_acc is None:
    return _lane_loop(rule, info, in_batched)
  flags = tuple(in_batched)

  _count_lane_bytes(bc, lane_acc, info.out_aval.dtype)

  def get_lanes(ref, *leaves):
    dyn, lanes = _dyn(access, leaves), _lanes_of((ref, *leaves), flags)
    coords = lane_acc.coords(dyn)
    span = None if ref_b else lane_acc.span(ref, coords, lanes, None)
    if span is not None:
      shared = _shared()
      if shared is not None:
        shared.access_span(ref, span, "read")
      return span.gather(ref, 0, ref.dtype)
    index, _, full = lane_acc.index(ref, coords, lanes, None)
    shared = None if ref_b else _shared()
    if shared is not None:
      shared.access(ref, index, full, None, "read")
    return np.ascontiguousarray(np.broadcast_to(ref[_trailing_slices(index, full)], full))
  return get_lanes, False, (True,)


def _trailing_slices(index, full):
  """``index`` (coordinate arrays broadcastable to ``full``) with its
  trailing arrays that are plain ranges along their own result axis, the
  same for every lane (``k_ref[pl.ds(start_of_lane, 128), :]``'s columns),
  as slices: NumPy then copies runs instead of gathering element by element
  (a Triton decode kernel's (8, 128, 64) K tile: ~4x). The same elements in
  the same order once broadcast to ``full``; unchanged when in doubt."""
  nres = len(full)
  cut = len(index)
  slices = []
  while cut > 0:
    c = index[cut - 1]
    axis = nres - len(slices) - 1
    if (axis < 1 or c.ndim != nres or c.shape[axis] not in (1, full[axis])
        or any(n != 1 for a, n in enumerate(c.shape) if a != axis)):
      break
    v = c.reshape(-1)
    if v.size > 1:
      step = int(v[1] - v[0])
      if step <= 0 or (np.diff(v) != step).any():
        break
      slices.append(slice(int(v[0]), int(v[-1]) + 1, step))
    else:
      slices.append(slice(int(v[0]), int(v[0]) + 1))
    cut -= 1
  if not slices:
    return index
  keep = nres - len(slices)  # result axes the remaining arrays index
  rest = []
  for c in index[:cut]:
    if any(n != 1 for n in c.shape[keep:]):
      return index
    rest.append(c.reshape(c.shape[:keep]))
  return (*rest, *reversed(slices))


@batch_rule("swap")
def _swap(bc, rule, info, in_batched):
  from pallas_np.state.refs import _access, _dyn
  access = _access(info, info.in_avals[0], info.eqn.invars[2:], info.params["tree"])
  ref_b = in_batched[0]
  leaf_b = _dyn_flags(access, in_batched[2:])
  resolve = access.resolve
  want_old = info.outvars_used[0]
  kind = "readwrite" if want_old else "write"
  if ref_b and not any(leaf_b) and access.plain():
    order = "K" if bc.lanes_last else "C"

    def swap(ref, val, *leaves):
      view, idx = resolve(ref, _dyn(access, leaves))
      bidx = _lane_index(idx)
      old = view[bidx].copy(order=order) if want_old else None
      view[bidx] = val
      return old
    if not want_old and access.num_dynamic == 0:
      from pallas_np.state.refs import store_target
      swap.store_target = store_target(access, _lane_index)
    return swap, False, (True,)
  lane_acc = None if access.clamp else _LaneIndexed.make(access, ref_b, leaf_b)
  if lane_acc is None:
    if not ref_b:
      raise NotBatchable("write to a ref shared by all lanes")
    return _lane_loop(rule, info, in_batched)
  _count_lane_bytes(bc, lane_acc, info.in_avals[1].dtype)
  flags = tuple(in_batched)

  def swap_lanes(ref, val, *leaves):
    dyn, lanes = _dyn(access, leaves), _lanes_of((ref, val, *leaves), flags)
    coords = lane_acc.coords(dyn)
    span = None if ref_b else lane_acc.span(ref, coords, lanes, None)
    if span is not None:
      _tracked(ref).access_span(ref, span, kind)
      old = span.gather(ref, 0, ref.dtype) if want_old else None
      span.scatter(ref, val)
      return old
    index, _, full = lane_acc.index(ref, coords, lanes, None)
    if not ref_b:  # a shared output: no two lanes may meet (checked first)
      _tracked(ref).access(ref, index, full, None, kind)
      index = tuple(np.broadcast_to(c, full) for c in index)
    old = np.ascontiguousarray(ref[index]) if want_old else None
    ref[index] = val  # repeated indices: the last in C order wins, as per lane
    return old
  return swap_lanes, False, (True,)


@batch_rule("addupdate")
def _addupdate(bc, rule, info, in_batched):
  from pallas_np.state.refs import _access, _dyn
  access = _access(info, info.in_avals[0], info.eqn.invars[2:], info.params["tree"])
  if not in_batched[0]:
    raise NotBatchable("write to a ref shared by all lanes")
  if any(in_batched[2:]) or not access.plain():
    return _lane_loop(rule, info, in_batched)
  resolve = access.resolve

  def addupdate(ref, val, *leaves):
    view, idx = resolve(ref, _dyn(access, leaves))
    bidx = _lane_index(idx)
    view[bidx] += val
    return []
  return addupdate, False, ()


# -- masked (Triton-style) accesses: one NumPy index of the lane-stacked ref --------
def _masked_access_for_lanes(info, in_batched):
  """``(operand positions, access, fancy, lane_indexed)``. ``access`` is set
  when every lane indexes its own ref block with the same indices (the loop
  counters and column vectors Triton-style kernels use), so that one index
  of the lane-stacked ref does all lanes; ``fancy``: an integer-array index
  (NumPy then gives a copy, not a view). Otherwise ``lane_indexed`` (a
  _LaneIndexed) when the indices differ per lane (program_id offsets) or the
  ref is shared by all lanes; both None: run lane by lane."""
  from pallas_np.state.indexing import _DimArray, _DimSlice
  from pallas_np.state.masked import MaskedAccess, split_args
  positions = split_args(info)
  ref_pos, transforms_pos = positions[:2]
  acc = MaskedAccess(info, ref_pos, transforms_pos)
  if acc.note is not None:
    return positions, None, False, None
  leaf_b = tuple(in_batched[p] for p in acc.dyn_positions)
  if not in_batched[ref_pos] or any(leaf_b):
    return positions, acc, False, _LaneIndexed.make(acc.access, in_batched[ref_pos], leaf_b)
  steps = acc.access.steps
  if len(steps) > 1 or (steps and steps[0][0] != "index"):
    return positions, None, False, None
  dims = steps[0][1] if steps else ()
  adv = [i for i, d in enumerate(dims) if not isinstance(d, _DimSlice)]
  fancy = any(isinstance(dims[i], _DimArray) for i in adv)
  if fancy and adv[-1] - adv[0] != len(adv) - 1:
    # NumPy would move split integer indices before the lanes.
    return positions, acc, False, _LaneIndexed.make(acc.access, True, leaf_b)
  return positions, acc, fancy, None


def _lane_ref_args(args, ref_pos):
  """``args`` with the ref replaced by lane 0's block (same shape for all)."""
  args = list(args)
  args[ref_pos] = args[ref_pos][0]
  return args


@batch_rule("masked_load")
def _masked_load(bc, rule, info, in_batched):
  (ref_pos, _, mask_pos, other_pos), acc, _, lane_acc = _masked_access_for_lanes(
      info, in_batched)
  dtype = np.dtype(jc.physical_dtype(info.out_aval.dtype))
  if lane_acc is not None:
    flags = tuple(in_batched)
    ref_b = in_batched[ref_pos]
    _count_lane_bytes(bc, lane_acc, dtype)

    def load_lanes(*args):
      ref = args[ref_pos]
      mask = None if mask_pos is None else args[mask_pos]
      coords, lanes = lane_acc.coords(acc.leaves(args)), _lanes_of(args, flags)
      span = None if ref_b else lane_acc.span(ref, coords, lanes, mask)
      if span is not None:
        shared = _shared()
        if shared is not None:
          shared.access_span(ref, span, "read")
        val = span.gather(ref, acc.fill, dtype)
        if mask is not None and other_pos is not None:
          val = np.where(mask, val, args[other_pos])
        return np.ascontiguousarray(np.broadcast_to(val, span.full), dtype=dtype)
      index, in_bounds, full = lane_acc.index(ref, coords, lanes, mask)
      shared = None if ref_b else _shared()
      if shared is not None:
        shared.access(ref, index, full, _on(mask, in_bounds), "read")
      val = ref[index]
      if in_bounds is not None:
        val = np.where(in_bounds, val, acc.fill)
      if mask is not None and other_pos is not None:
        val = np.where(mask, val, args[other_pos])
      return np.ascontiguousarray(np.broadcast_to(val, full), dtype=dtype)
    return load_lanes, False, (True,)
  if acc is None:
    return _lane_loop(rule, info, in_batched)

  def load(*args):
    ref = args[ref_pos]
    hit = acc.resolve(args)
    if hit is not None:
      bidx = _lane_index(hit[1])
      # C order: NumPy lays ``a[:, idx]`` out lanes-inner, and a later
      # reduction would then add in another order than the sequential run.
      val = np.array(ref[bidx], dtype=dtype, order="C")
    elif mask_pos is None:
      raise IndexError("out-of-bounds masked load")  # the sequential rerun names it
    else:
      _, safe, in_bounds, mask = acc.lanes(_lane_ref_args(args, ref_pos), args[mask_pos])
      bidx = (slice(None), *safe)
      if not ref[0].size:
        val = np.full((ref.shape[0], *acc.shape), acc.fill, dtype=dtype)
      else:
        val = np.where(in_bounds, ref[bidx], acc.fill).astype(dtype, copy=False)
    if mask_pos is not None and other_pos is not None:
      val = np.where(args[mask_pos], val, args[other_pos]).astype(dtype, copy=False)
    return np.ascontiguousarray(val)
  return load, False, (True,)


@batch_rule("masked_swap")
def _masked_swap(bc, rule, info, in_batched):
  (ref_pos, _, val_pos, mask_pos), acc, fancy, lane_acc = _masked_access_for_lanes(
      info, in_batched)
  ref_b = in_batched[ref_pos]
  if not ref_b and lane_acc is None:
    raise NotBatchable("write to a ref shared by all lanes")
  want_old = info.outvars_used[0]
  kind = "readwrite" if want_old else "write"
  if lane_acc is not None:
    flags = tuple(in_batched)
    _count_lane_bytes(bc, lane_acc, info.in_avals[val_pos].dtype)

    def swap_lanes(*args):
      ref, val = args[ref_pos], args[val_pos]
      mask = None if mask_pos is None else args[mask_pos]
      coords, lanes = lane_acc.coords(acc.leaves(args)), _lanes_of(args, flags)
      span = None if ref_b else lane_acc.span(ref, coords, lanes, mask)
      if span is not None:
        _tracked(ref).access_span(ref, span, kind)
        old = span.gather(ref, acc.fill, ref.dtype) if want_old else None
        span.scatter(ref, val)
        if old is None:
          return None
        if mask is not None:
          old = np.where(mask, old, val)
        return np.ascontiguousarray(np.broadcast_to(old, span.full), dtype=ref.dtype)
      index, in_bounds, full = lane_acc.index(ref, coords, lanes, mask)
      on = _on(mask, in_bounds)
      if not ref_b:  # a shared output: no two lanes may meet (checked first)
        _tracked(ref).access(ref, index, full, on, kind)
      old = None
      if want_old:
        old = np.broadcast_to(ref[index], full)
        if in_bounds is not None:
          old = np.where(in_bounds, old, acc.fill)
      active = _LaneIndexed.active(index, full, on)
      val = np.broadcast_to(np.asarray(val, dtype=ref.dtype), full)
      ref[active] = val.ravel() if on is None else val[np.broadcast_to(on, full)]
      if old is None:
        return None
      old = np.broadcast_to(old, full)
      if mask is not None:
        old = np.where(mask, old, val)
      return np.ascontiguousarray(old, dtype=ref.dtype)
    return swap_lanes, False, (True,)
  if acc is None:
    return _lane_loop(rule, info, in_batched)

  def swap(*args):
    ref, val = args[ref_pos], args[val_pos]
    hit = acc.resolve(args)
    if hit is not None:
      bidx = _lane_index(hit[1])
      if mask_pos is None:
        old = np.array(ref[bidx], order="C") if want_old else None
        ref[bidx] = val
        return old
      mask = args[mask_pos]
      region = ref[bidx]
      old = np.array(region, order="C") if want_old or fancy else None
      if fancy:
        ref[bidx] = np.where(mask, val, old)
      else:
        np.copyto(region, np.broadcast_to(val, region.shape),
                  where=np.broadcast_to(mask, region.shape))
      if not want_old:
        return None
      return np.ascontiguousarray(np.where(mask, old, val).astype(old.dtype, copy=False))
    if mask_pos is None:
      raise IndexError("out-of-bounds masked store")  # the sequential rerun names it
    _, safe, in_bounds, mask = acc.lanes(_lane_ref_args(args, ref_pos), args[mask_pos])
    lanes = ref.shape[0]
    full = (lanes, *acc.shape)
    old = None
    if want_old:
      old = np.where(in_bounds, ref[(slice(None), *safe)], acc.fill).astype(ref.dtype, copy=False)
    active = np.broadcast_to(mask & in_bounds, full)
    lane = np.arange(lanes).reshape((lanes,) + (1,) * len(acc.shape))
    index = tuple(np.broadcast_to(c, full)[active] for c in (lane, *safe))
    ref[index] = np.broadcast_to(np.asarray(val, dtype=ref.dtype), full)[active]
    return None if old is None else np.ascontiguousarray(np.where(mask, old, val))
  return swap, False, (True,)


@batch_rule("run_scoped")
def _run_scoped(bc, rule, info, in_batched):
  """Scoped buffers are lane-private: allocated with a lane axis."""
  from pallas_np.grid import allocate
  jaxpr = info.params["jaxpr"]
  scoped = [v.aval.inner_aval if isinstance(v.aval, jc.AbstractRef) else v.aval
            for v in jaxpr.invars]
  compiled = bc.compile(jaxpr, constvars_as_args=True,
                        in_batched=(*in_batched, *([True] * len(scoped))))
  plan = compiled.fn
  params = bc.params

  def run_scoped(ctx, *consts):
    n = ctx.batch_size
    return plan(ctx, *consts, *[allocate((n, *a.shape), a.dtype, params) for a in scoped])
  return run_scoped, True, tuple(compiled.out_batched)


# -- control flow: lane groups ------------------------------------------------------
class _LaneGroup:
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
    shared = _shared()
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
    sub.extra = ctx.extra
    sub.program_ids = tuple(p[self.sel] if b else p
                            for p, b in zip(ctx.program_ids, pid_batched))
    sub.batch_size = self.count
    return sub


def _pid_batched(bc, ctx):
  return tuple(i in bc.batched_pid_axes for i in range(len(ctx.program_ids)))


def _lift(vals, have, want, n):
  """Give unbatched values a lane axis where ``want`` says batched."""
  return [_to_lanes(v, n) if w and not h else v for v, h, w in zip(vals, have, want)]


def _fixpoint_carry(compile_body, n_carry, carry_in):
  """Carry batchedness of a loop: batched if batched on entry or made
  batched by the body. ``carry_in``: the entry batchedness, or a guess
  above it (``_carry_guess``): the compile that confirms it is the last."""
  carry = tuple(carry_in)
  for _ in range(n_carry + 2):
    plan = compile_body(carry)
    out = tuple(plan.out_batched[:n_carry])
    new = tuple(a or b for a, b in zip(carry, out))
    if new == carry:
      return carry, plan
    carry = new
  raise NotBatchable("loop carry batchedness did not converge")


def _computed_from_batched(jaxpr, in_batched) -> tuple:
  """Per output of ``jaxpr``: whether it is computed from a batched input
  (an eqn's outputs count as computed from all of its inputs). Batch rules
  batch no output of unbatched inputs but program_id's, which this does not
  see: a cheap first guess of out_batched, never trusted alone."""
  tainted = {v for v, b in zip(jaxpr.invars, in_batched) if b}
  for eqn in jaxpr.eqns:
    if any(v in tainted for v in eqn.invars if isinstance(v, jc.Var)):
      tainted.update(eqn.outvars)
  return tuple(isinstance(v, jc.Var) and v in tainted for v in jaxpr.outvars)


def _carry_guess(body_jaxpr, consts_b, carry_in, xs_b=()) -> tuple:
  """Loop carries computed from batched values (``_computed_from_batched``
  to a fixpoint): the first carry batchedness ``_fixpoint_carry`` compiles
  the body with, so that one compile usually suffices."""
  carry = tuple(carry_in)
  n = len(carry)
  for _ in range(n + 1):
    out = _computed_from_batched(body_jaxpr, consts_b + carry + xs_b)[:n]
    new = tuple(a or b for a, b in zip(carry, out))
    if new == carry:
      break
    carry = new
  return carry


@batch_rule("cond")
def _cond(bc, rule, info, in_batched):
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
        outs = _lift(outs, lifts[i], out_b, ctx.batch_size)
      return outs
    return cond, True, out_b

  out_b = (True,) * n_out

  def cond_lanes(ctx, index, *ops):
    index = np.clip(np.asarray(index).astype(np.int64), 0, last)
    first = int(index[0])
    if (index == first).all():  # every lane takes one branch
      outs = fns[first](ctx, *ops)
      return _lift(outs, lifts[first], out_b, ctx.batch_size)
    n = ctx.batch_size
    results = [np.empty((n, *s), d) for s, d in zip(out_shapes, out_dtypes)]
    pid_b = _pid_batched(bc, ctx)
    for k in range(last + 1):
      mask = index == k
      if not mask.any():
        continue
      group = _LaneGroup(mask)
      sub_ops = group.take(ops, ops_b)
      outs = group.run(fns[k], group.ctx(ctx, pid_b), *sub_ops)
      group.put_back_refs(ops, sub_ops, ops_b, is_ref)
      for r, o in zip(results, outs):
        r[group.sel] = o
    return results
  return cond_lanes, True, out_b


@batch_rule("while")
def _while(bc, rule, info, in_batched):
  p = info.params
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cc_b = tuple(in_batched[:nc])
  bc_b = tuple(in_batched[nc:nc + nb])
  carry0 = tuple(in_batched[nc + nb:])
  n_carry = len(carry0)
  guess = _carry_guess(p["body_jaxpr"].jaxpr, bc_b, carry0)
  if _computed_from_batched(p["cond_jaxpr"].jaxpr, cc_b + guess)[0]:
    # A lane-dependent trip count (causal attention's kv loop): every carry
    # ends up batched; no fixpoint to compile the body for.
    pred_b, body = True, None
  else:
    carry_b, body = _fixpoint_carry(
        lambda cb: bc.compile(p["body_jaxpr"], in_batched=bc_b + cb), n_carry, guess)
    cond = bc.compile(p["cond_jaxpr"], in_batched=cc_b + carry_b)
    pred_b = cond.out_batched[0]
  carry_avals = info.in_avals[nc + nb:]
  carry_is_ref = [isinstance(a, jc.AbstractRef) for a in carry_avals]
  body_written = jc.written_invar_positions(p["body_jaxpr"].jaxpr)
  bconst_is_ref = [i in body_written for i in range(nb)]  # refs to copy back
  if any(carry_is_ref):
    raise NotBatchable("refs in a while carry")

  if not pred_b:
    body_fn, cond_fn = body.fn, cond.fn
    body_lift = tuple(body.out_batched)

    def while_loop(ctx, *args):
      cconsts = args[:nc]
      bconsts = args[nc:nc + nb]
      carry = _lift(args[nc + nb:], carry0, carry_b, ctx.batch_size)
      while cond_fn(ctx, *cconsts, *carry)[0]:
        carry = body_fn(ctx, *bconsts, *carry)
        if body_lift != carry_b:
          carry = _lift(carry, body_lift, carry_b, ctx.batch_size)
      return carry
    return while_loop, True, carry_b

  carry_b = (True,) * n_carry
  if body is None or tuple(body.out_batched) != carry_b:  # once every carry is batched
    body = bc.compile(p["body_jaxpr"], in_batched=bc_b + carry_b)
  body_fn, body_lift = body.fn, tuple(body.out_batched)
  cond = bc.compile(p["cond_jaxpr"], in_batched=cc_b + carry_b)
  cond_fn = cond.fn

  def while_lanes(ctx, *args):
    cconsts = args[:nc]
    bconsts = args[nc:nc + nb]
    n = ctx.batch_size
    carry = [np.array(_to_lanes(v, n)) if not b else np.array(v)
             for v, b in zip(args[nc + nb:], carry0)]
    pid_b = _pid_batched(bc, ctx)
    while True:
      pred = np.asarray(cond_fn(ctx, *cconsts, *carry)[0])
      if not pred.any():
        return carry
      if pred.all():
        new = body_fn(ctx, *bconsts, *carry)
        carry = [np.array(v) for v in _lift(new, body_lift, carry_b, n)]
        continue
      group = _LaneGroup(pred)
      sub_ctx = group.ctx(ctx, pid_b)
      sub_b = group.take(bconsts, bc_b)
      new = group.run(body_fn, sub_ctx, *sub_b, *[c[group.sel] for c in carry])
      group.put_back_refs(bconsts, sub_b, bc_b, bconst_is_ref)
      for c, v in zip(carry, _lift(new, body_lift, carry_b, group.count)):
        c[group.sel] = v
  return while_lanes, True, carry_b


@batch_rule("scan")
def _scan(bc, rule, info, in_batched):
  p = info.params
  num_consts, num_carry = jc.scan_counts(p)
  length = int(p["length"])
  reverse = bool(p["reverse"])
  consts_b = tuple(in_batched[:num_consts])
  carry0 = tuple(in_batched[num_consts:num_consts + num_carry])
  xs_b = tuple(in_batched[num_consts + num_carry:])
  if any(isinstance(a, jc.AbstractRef) for a in info.in_avals[num_consts:]):
    raise NotBatchable("refs in a scan carry")
  carry_b, body = _fixpoint_carry(
      lambda cb: bc.compile(p["jaxpr"], in_batched=consts_b + cb + xs_b), num_carry,
      _carry_guess(p["jaxpr"].jaxpr, consts_b, carry0, xs_b))
  body_fn = body.fn
  body_lift = tuple(body.out_batched[:num_carry])
  ys_b = tuple(body.out_batched[num_carry:])
  y_avals = info.out_avals[num_carry:]
  order = range(length - 1, -1, -1) if reverse else range(length)

  def scan(ctx, *args):
    n = ctx.batch_size
    consts = args[:num_consts]
    carry = _lift(args[num_consts:num_consts + num_carry], carry0, carry_b, n)
    xs = args[num_consts + num_carry:]
    ys = [np.empty((n, *a.shape) if b else tuple(a.shape),
                   np.dtype(jc.physical_dtype(a.dtype))) for a, b in zip(y_avals, ys_b)]
    for i in order:
      out = body_fn(ctx, *consts, *carry, *[x[:, i] if b else x[i] for x, b in zip(xs, xs_b)])
      carry = out[:num_carry]
      if body_lift != carry_b:
        carry = _lift(carry, body_lift, carry_b, n)
      for y, v, b in zip(ys, out[num_carry:], ys_b):
        if b:
          y[:, i] = v
        else:
          y[i] = v
    return (*carry, *ys)
  return scan, True, carry_b + ys_b


# -- the grid side -------------------------------------------------------------------
MAX_GRID = 1 << 20           # points evaluated up front for the analysis
_SLAB_BYTES = 8 << 20        # block bytes per vectorized pass
# vectorize=None (auto) batches only grids whose per-grid-point blocks are
# small: there the Python cost per grid point dominates. With bigger blocks
# NumPy is already busy and the batched temporaries only fall out of cache.
# Kernels with scratch also pay the hand-over check (their first sequential
# grid point once more), hence less (_auto_lane_limit); with a single
# sequential point that is a second whole pass: _AUTO_LANE_BYTES_SCRATCH.
_AUTO_LANE_BYTES = 128 << 10      # exclusive
# Lanes last, a batched pass stays ahead of the grid loop with bigger blocks
# (bitonic 1024x1024 in 32-row blocks, 256 KiB per lane: 38 -> 27 ms warm).
_AUTO_LANE_BYTES_LANES_LAST = 512 << 10  # exclusive
_AUTO_LANE_BYTES_SCRATCH = 16 << 10
_MAX_LANES = 1 << 14


class GridVectorizer:
  """Per KernelPlan: the static part of the analysis and the compiled
  batched kernels/index maps (built lazily, once)."""

  def __init__(self, kp, compiler_params=None):
    self.kp = kp
    self.reason = None
    self.last_failure = None
    self.candidates: tuple[int, ...] = ()
    self._kernels: dict[Any, Any] = {}
    self._maps: dict[Any, Any] = {}
    self._chosen: dict[Any, Any] = {}
    # Cleared when a pass with shared outputs found lanes that communicate.
    self.shared_outputs_ok = True
    self._lanes_last = None  # prefers_lanes_last(kp), computed once
    self._loop_axes = None  # loop_axes(kp), computed once
    self._partly_read = None  # partly_read_operands(kp), computed once
    self.last_layout = None  # the last pass's: "lanes-first" or "lanes-last"
    self.last_axes = None  # the grid axes the last pass batched
    params = kp.params
    self.reason = order_free_reason(kp)
    if self.reason is not None:
      return
    self.candidates = tuple(range(len(kp.grid)))
    if not self.candidates:
      self.reason = "no grid"
      return
    if params.vectorize is None:
      # Outputs and scratch are batched whatever the analysis finds: when
      # they alone are too big, skip the (costly, first-call) analysis.
      # (Whole-array outputs may be shared ones, written in place.)
      outs_only = (False,) * kp.num_inputs + tuple(
          bool(kp.scratch_avals) or not geo.whole for geo in kp.blocks[kp.num_inputs:])
      if _lane_bytes(kp, outs_only) >= _auto_lane_limit(kp, self.lanes_last):
        self.reason = _TOO_BIG

  @property
  def lanes_last(self) -> bool:
    """The layout of this kernel's batched passes (LANES_LAST overrides)."""
    if LANES_LAST is not None:
      return LANES_LAST
    if self._lanes_last is None:
      self._lanes_last = prefers_lanes_last(self.kp)
    return self._lanes_last

  # -- compiled pieces ----------------------------------------------------------
  def index_maps(self, batched_axes):
    key = batched_axes
    hit = self._maps.get(key)
    if hit is None:
      kp = self.kp
      comp = BatchCompiler(kp.params, kp.name + "_index_map", frozenset())
      flags = tuple(d in batched_axes for d in range(len(kp.grid))) + (False,) * kp.num_index
      hit = [comp.compile(bm.index_map_jaxpr, in_batched=flags, first_calls=True)
             for bm in kp.grid_mapping.block_mappings]
      self._maps[key] = hit
    return hit

  def kernel(self, batched_axes, operand_batched, lanes_last=False):
    key = (batched_axes, operand_batched, lanes_last)
    hit = self._kernels.get(key)
    if hit is None:
      kp = self.kp
      local = kp.local_dims
      pid_axes = frozenset(local.index(d) for d in batched_axes if d in local)
      comp = BatchCompiler(kp.params, kp.name, pid_axes, lanes_last=lanes_last)
      flags = ((False,) * kp.num_index + operand_batched
               + (True,) * len(kp.scratch_avals))
      try:
        hit = comp.compile(kp.kernel_jaxpr, in_batched=flags, first_calls=True)
        hit.lane_access_bytes = comp.lane_access_bytes
      except NotBatchable as e:  # remembered: the next call skips the compile
        hit = e
      self._kernels[key] = hit
    if isinstance(hit, NotBatchable):
      raise hit
    return hit

  # -- analysis on a concrete grid -----------------------------------------------
  def choose(self, grid, index_ops):
    """(batched_axes, block indices of every grid point per operand) or None.
    Cached per grid when the index maps depend on nothing else (no scalar
    prefetch)."""
    return per_grid(self._chosen, self.kp, grid, index_ops, self._choose)

  def _choose(self, grid, index_ops):
    total = math.prod(grid)
    if not self.candidates or total <= 1 or total > MAX_GRID:
      return None
    ndim = len(grid)
    coords = np.indices(grid, dtype=np.int32).reshape(ndim, -1)
    maps = self.index_maps(tuple(range(ndim)))
    ctx = RunContext(self.kp.name, self.kp.params)
    ctx.batch_size = total
    block_idx = []
    for m, geo in zip(maps, self.kp.blocks):
      outs = m.fn(ctx, *coords, *index_ops)
      cols = [np.broadcast_to(np.asarray(o, np.int64), (total,)) for o in outs]
      block_idx.append(cols)
    n_in = self.kp.num_inputs
    if self._loop_axes is None:
      self._loop_axes = loop_axes(self.kp)
    axes = lane_axes(grid, coords, block_idx[n_in:], bool(self.kp.scratch_avals),
                     self._loop_axes)
    if axes is not None:
      return axes, block_idx, frozenset()
    if self.kp.scratch_avals or not self.shared_outputs_ok:
      return None
    # Outputs every grid point sees whole (Triton style): batch every axis,
    # each lane with a private copy, checked and merged after the pass.
    axes = tuple(d for d in range(ndim) if grid[d] > 1)
    shared = frozenset(n_in + o for o, cols in enumerate(block_idx[n_in:])
                       if all((c == c[0]).all() for c in cols))
    owned = [cols for o, cols in enumerate(block_idx[n_in:]) if n_in + o not in shared]
    if not shared or not _owned(grid, coords, axes, owned):
      return None
    return axes, block_idx, shared


def per_grid(cache: dict, kp, grid, index_ops, compute):
  """``compute(grid, index_ops)``, cached per grid when the index maps
  depend on nothing else (no scalar prefetch); bounded for dynamic grids."""
  if kp.num_index:
    return compute(grid, index_ops)
  if grid not in cache:
    if len(cache) >= 16:
      cache.clear()
    cache[grid] = compute(grid, index_ops)
  return cache[grid]


def order_free_reason(kp) -> str | None:
  """Why grid points of ``kp`` may not run out of grid order (batched or on
  threads), before looking at the index maps; None if they may."""
  params = kp.params
  if params.trace is not None or params.pdb or params.records_accesses:
    return "an option that observes grid order (trace/pdb/detect_races/explain) is on"
  if kp.written_inputs:
    return "the kernel writes an input ref"
  for geo in kp.blocks[kp.num_inputs:]:
    if "element" in geo.kinds:
      return "an output has Element block dims"
  return None


_LOOP_FREE_MIN_LANES = 8  # fewer lanes than this: batching a loop axis too may still pay


def lane_axes(grid, coords, out_block_idx, scratch: bool, avoid=frozenset()):
  """The grid axes whose coordinates make a *lane* such that every output
  block is touched by one lane only, or None. ``coords``: (ndim, points)
  grid coordinates in grid order; ``out_block_idx``: per output, the block
  index columns over those points. Tried in order: all axes, grid prefixes,
  single axes (longest first); sets of at least 8 lanes without an
  ``avoid`` axis (see ``loop_axes``) before the others. With scratch, lanes
  must be consecutive in grid order (batched axes before sequential ones)
  for the vectorizer's scratch hand-over check to be exact: prefixes only."""
  ndim = len(grid)
  cands = [d for d in range(ndim) if grid[d] > 1]
  options = [] if scratch else [tuple(cands)]
  for m in range(ndim, 0, -1):
    options.append(tuple(d for d in cands if d < m))
  if not scratch:
    options += sorted(((d,) for d in cands), key=lambda t: -grid[t[0]])
  if avoid:  # loop-free sets of at least _LOOP_FREE_MIN_LANES lanes first (stable)
    options.sort(key=lambda axes: any(d in avoid for d in axes) or math.prod(
        grid[d] for d in axes) < _LOOP_FREE_MIN_LANES)
  seen = set()
  for axes in options:
    if not axes or axes in seen:
      continue
    seen.add(axes)
    if _owned(grid, coords, axes, out_block_idx):
      return axes
  return None


def _owned(grid, coords, axes, out_block_idx):
  """Every output block is touched by grid points of one lane only."""
  lane = np.ravel_multi_index(tuple(coords[d] for d in axes), tuple(grid[d] for d in axes))
  for cols in out_block_idx:
    if not cols:
      return False  # a 0-d output: one block shared by everyone
    # Sort grid points by (block, lane); a block seen with two lanes fails.
    order = np.lexsort((lane, *reversed(cols)))
    same_block = np.ones(len(order) - 1, bool)
    for c in cols:
      cs = c[order]
      same_block &= cs[1:] == cs[:-1]
    ls = lane[order]
    if np.any(same_block & (ls[1:] != ls[:-1])):
      return False
  return True


def _windows(buf, geo):
  """View of ``buf`` indexed by block position: W[i0, i1, ...] is the block."""
  pos_shape, strides = [], []
  blk_shape, blk_strides = [], []
  for d, (kind, b) in enumerate(zip(geo.kinds, geo.sizes)):
    mult = b if kind == "blocked" else 1
    n = geo.padded_shape[d]
    pos_shape.append((n - b) // mult + 1 if n >= b else 0)
    strides.append(buf.strides[d] * mult)
    if kind != "squeezed":
      blk_shape.append(b)
      blk_strides.append(buf.strides[d])
  return np.lib.stride_tricks.as_strided(
      buf, shape=(*pos_shape, *blk_shape), strides=(*strides, *blk_strides),
      writeable=buf.flags.writeable)


def run_vectorized(kp, gv: GridVectorizer, prepare):
  """Run the whole grid vectorized; the output buffers, or None (nothing
  returned, fall back to the sequential loop) when the analysis says no.

  ``prepare()`` gives fresh (grid, index_ops, buffers, out_bufs).

  Scratch persists across grid points, so in grid order lane ``l`` starts
  from the scratch lane ``l-1`` left. Kernels (nearly) always re-initialise
  it, so we run with lane-private scratch, then re-run each lane's first
  sequential point starting from the previous lane's final scratch: if every
  lane reaches the same state (scratch, output blocks) as in the pass, each
  lane started from exactly the state it has in grid order (by induction over
  lanes), so the pass is the sequential result (``_run_checked``).
  Otherwise: sequential loop."""
  grid, index_ops, buffers, out_bufs = prepare()
  chosen = gv.choose(grid, index_ops)
  if chosen is None:
    return None
  axes, block_idx, shared = chosen
  n_in = kp.num_inputs
  maps = gv.index_maps(axes)
  # Operands whose block does not depend on a batched axis are shared; so
  # are outputs every lane sees whole (written in place, SharedOutputs).
  operand_batched = tuple((i not in shared) if i >= n_in else any(m.out_batched)
                          for i, m in enumerate(maps))
  auto = kp.params.vectorize is None
  lanes_last = gv.lanes_last and not shared
  limit = _auto_lane_limit(kp, lanes_last, math.prod(grid) // math.prod(grid[d] for d in axes))
  weighed = operand_batched
  if auto:
    weighed = _weighed_operands(kp, gv, grid, axes, block_idx, buffers, operand_batched)
  if auto and _lane_bytes(kp, weighed) >= limit:
    gv.last_failure = _TOO_BIG
    return None
  plan = gv.kernel(axes, operand_batched, lanes_last)  # may raise NotBatchable
  gv.last_layout = "lanes-last" if lanes_last else "lanes-first"
  gv.last_axes = axes
  if auto and _lane_bytes(kp, weighed) + plan.lane_access_bytes >= limit:
    gv.last_failure = _TOO_BIG
    return None
  kernel = plan.fn
  runner = _SlabRunner(kp, grid, axes, block_idx, operand_batched, kernel, shared,
                       plan.lane_access_bytes, lanes_last)
  from pallas_np import debugging
  checked = runner.n_lanes if kp.scratch_avals else 0  # the hand-over check's points
  runner.progress = debugging.progress_bar(kp.name, math.prod(grid) + checked, kp.params)
  try:
    return _run_checked(kp, gv, runner, prepare, index_ops, buffers, out_bufs)
  except NotBatchable:
    if shared:  # lanes that communicate, or an access the pass cannot see
      gv.shared_outputs_ok = False
      gv._chosen.clear()
    raise
  finally:
    if runner.progress is not None:
      runner.progress.close()


def _run_checked(kp, gv, runner, prepare, index_ops, buffers, out_bufs):
  if not kp.scratch_avals:
    runner.run(index_ops, buffers, None)
    return out_bufs
  # The hand-over check. A lane's state after its first sequential grid
  # point (scratch and output blocks: inputs are read-only here) determines
  # the rest of its run, so re-running that point alone from the handed
  # scratch is as good a proof as a second whole pass, at 1/n_seq the cost.
  states = _FirstStates(kp, runner)
  finals = runner.run(index_ops, buffers, None, states)
  handed = [np.concatenate([np.full((1, *a.shape), _fill(a.dtype, kp.params), f.dtype), f[:-1]])
            for a, f in zip(kp.scratch_avals, finals)]
  states.checking = True
  _, check_ops, check_buffers, _ = prepare()  # fresh outputs: the first point's start
  runner.run(check_ops, check_buffers, handed, states, runner.seq_points[:1])
  if states.differ:
    gv.last_failure = "scratch carried from one lane to the next"
    return None
  return out_bufs


class _FirstStates:
  """Every lane's scratch and output blocks right after its first sequential
  grid point: recorded by the pass, then compared (bit for bit) by the
  hand-over check. Slabs touch disjoint lane ranges, so threads may share it."""

  def __init__(self, kp, runner):
    if not all(runner.operand_batched[kp.num_inputs:]):
      raise NotBatchable("an output block shared by the lanes of a kernel with scratch")
    n = runner.n_lanes
    self.scratch = [np.empty((n, *a.shape), np.dtype(jc.physical_dtype(a.dtype)))
                    for a in kp.scratch_avals]
    self.outputs = {
        b: np.empty((n, *[size for kind, size in zip(geo.kinds, geo.sizes) if kind != "squeezed"]),
                    np.dtype(jc.physical_dtype(geo.dtype)))
        for b, geo in enumerate(kp.blocks) if b >= kp.num_inputs}
    self.checking = False
    self.differ = False

  def visit(self, lo, hi, scratch, blocks):
    """``scratch``: the slab's lane-stacked scratch; ``blocks``: output
    operand -> its lanes' blocks (lanes first)."""
    pairs = [*zip(self.scratch, scratch), *((self.outputs[b], v) for b, v in blocks.items())]
    for rec, now in pairs:
      if not self.checking:
        rec[lo:hi] = now
      elif rec[lo:hi].tobytes() != np.ascontiguousarray(now).tobytes():
        self.differ = True


_TOO_BIG = "blocks too big to gain from batching (auto mode)"


def _auto_lane_limit(kp, lanes_last=False, n_seq=None):
  """Per-lane bytes below which auto mode batches. With scratch the check
  re-runs the first of ``n_seq`` sequential points: a pass costs 1 + 1/n_seq
  (``None``: not known yet, the most lenient). Paged-attention decode (16
  pages per sequence, ~70 KiB per lane) runs 17.5 -> 12.4 ms batched."""
  limit = _AUTO_LANE_BYTES_LANES_LAST if lanes_last else _AUTO_LANE_BYTES
  if not kp.scratch_avals or n_seq is None:
    return limit
  if n_seq < 2:  # the check is a second whole pass
    return _AUTO_LANE_BYTES_SCRATCH
  return limit * n_seq // (n_seq + 1)


def _weighed_operands(kp, gv, grid, axes, block_idx, buffers, operand_batched):
  """The batched operands the auto limit weighs: all but inputs the kernel
  reads only in windows smaller than the block (``partly_read_operands``)
  whose lanes are views of the input (no copy; checked at the first
  sequential grid point): a lane moves only those windows, which the batched
  plan counts as accesses. Causal attention reading 64-row tiles of whole
  K/V blocks batches over (batch, head) that way."""
  if gv._partly_read is None:
    gv._partly_read = partly_read_operands(kp)
  if not gv._partly_read:
    return operand_batched
  flat = _lane_points(grid, axes)
  weighed = list(operand_batched)
  for b in gv._partly_read:
    if b < kp.num_inputs and operand_batched[b]:
      cols = [c[flat] for c in block_idx[b]]
      if _lane_view(_windows(buffers[b], kp.blocks[b]), cols) is not None:
        weighed[b] = False
  return tuple(weighed)


def _lane_points(grid, axes, lane_coords=None):
  """Flat grid index of every lane (in lane order) at the first sequential
  grid point; ``lane_coords``: the lanes' coordinates on ``axes``."""
  if lane_coords is None:
    lane_coords = np.indices(tuple(grid[d] for d in axes)).reshape(len(axes), -1)
  return sum(lane_coords[k].astype(np.int64) * math.prod(grid[d + 1:])
             for k, d in enumerate(axes))


def _lane_bytes(kp, operand_batched):
  """Bytes of the blocks and scratch one lane owns."""
  n = sum(int(np.prod(geo.sizes)) * np.dtype(jc.physical_dtype(geo.dtype)).itemsize
          for geo, b in zip(kp.blocks, operand_batched) if b)
  return n + sum(int(np.prod(a.shape)) * np.dtype(jc.physical_dtype(a.dtype)).itemsize
                 for a in kp.scratch_avals)


class _SlabRunner:
  """Walks the lanes slab by slab, each slab through every sequential grid
  point in order."""

  def __init__(self, kp, grid, axes, block_idx, operand_batched, kernel, shared=frozenset(),
               access_bytes=0, lanes_last=False):
    self.kp, self.grid, self.axes = kp, grid, axes
    self.lanes_last = lanes_last
    self.shared = shared  # operands whose one block every lane shares (SharedOutputs)
    self.block_idx = block_idx
    self.operand_batched = operand_batched
    self.kernel = kernel
    blocks = kp.blocks
    self.seq_axes = tuple(d for d in range(len(grid)) if d not in axes)
    lane_shape = tuple(grid[d] for d in axes)
    self.n_lanes = math.prod(lane_shape)
    lane_bytes = _lane_bytes(kp, operand_batched) + access_bytes
    per_slab = max(1, min(_MAX_LANES, _SLAB_BYTES // max(lane_bytes, 1)))
    # Auto (None) keeps batched slabs on one thread: no reliable gain (benchmarks/PERF_LOG.md).
    self.threads = max(1, int(kp.params.num_threads or 1))
    if shared:  # slabs run in grid order, each seeing the ones before it
      self.threads = 1
    if self.threads > 1:
      per_slab = min(per_slab, -(-self.n_lanes // self.threads))
    self.slabs = [(s, min(s + per_slab, self.n_lanes)) for s in range(0, self.n_lanes, per_slab)]
    self.lane_coords = np.indices(lane_shape, dtype=np.int32).reshape(len(axes), -1)
    self.lane_flat = _lane_points(grid, axes, self.lane_coords)
    self.num_programs = tuple(np.int32(grid[d]) for d in kp.local_dims)
    self.seq_points = list(itertools.product(*[range(grid[d]) for d in self.seq_axes]))
    self.grid_strides = [math.prod(grid[d + 1:]) for d in range(len(grid))]
    self.progress = None
    self.done = 0

  def run(self, index_ops, buffers, scratch_init, first_states=None, seq_points=None):
    """Walks every slab through ``seq_points`` (default: all sequential grid
    points); returns the final scratch of every lane. ``first_states``
    (_FirstStates) sees each slab's state after its first point."""
    kp = self.kp
    windows = [_windows(buf, geo) for buf, geo in zip(buffers, kp.blocks)]
    finals = [np.empty((self.n_lanes, *a.shape), np.dtype(jc.physical_dtype(a.dtype)))
              for a in kp.scratch_avals]
    if seq_points is None:
      seq_points = self.seq_points
    args = (index_ops, windows, scratch_init, finals, first_states, seq_points)
    if self.threads > 1 and len(self.slabs) > 1:
      with concurrent.futures.ThreadPoolExecutor(self.threads) as pool:
        futures = [pool.submit(self._slab, lo, hi, *args) for lo, hi in self.slabs]
        for f in futures:
          f.result()
    else:
      for lo, hi in self.slabs:
        self._slab(lo, hi, *args)
    return finals

  def _slab(self, lo, hi, index_ops, windows, scratch_init, finals, first_states, seq_points):
    kp = self.kp
    params = kp.params
    blocks = kp.blocks
    grid, axes, local = self.grid, self.axes, kp.local_dims
    operand_batched = self.operand_batched
    n_in = kp.num_inputs
    n_ops = len(windows)
    pos_limits = [w.shape[:len(geo.kinds)] for w, geo in zip(windows, blocks)]
    n = hi - lo
    ctx = RunContext(kp.name, params)
    ctx.num_programs = self.num_programs
    ctx.batch_size = n
    ctx.grid_point = None
    ids = [None] * len(grid)
    for k, d in enumerate(axes):
      ids[d] = self.lane_coords[k, lo:hi]
    lane_flat = self.lane_flat[lo:hi]
    lanes_last = self.lanes_last and n >= _LANES_LAST_MIN_LANES
    if scratch_init is None:
      scratch = [_lane_full(n, a.shape, _fill(a.dtype, params),
                            np.dtype(jc.physical_dtype(a.dtype)), lanes_last)
                 for a in kp.scratch_avals]
    else:
      scratch = [_lanes_last_copy(s[lo:hi]) if lanes_last else np.array(s[lo:hi])
                 for s in scratch_init]
    shared_last = [None] * n_ops
    shared_view = [None] * n_ops
    kernel = self.kernel
    if self.shared:
      assert len(self.seq_points) == 1, "shared outputs batch every grid axis"
      return self._shared_slab(n, ctx, ids, lane_flat, index_ops, windows, pos_limits)
    for step, point in enumerate(seq_points):
      flat = lane_flat
      for d, v in zip(self.seq_axes, point):
        ids[d] = np.int32(v)
        flat = flat + v * self.grid_strides[d]
      ctx.program_ids = tuple(ids[d] for d in local)
      views = [None] * n_ops
      step_cols = [None] * n_ops
      writeback = []
      relaid = []  # (block view, its lanes-last copy the kernel writes)
      for b in range(n_ops):
        cols = [c[flat] for c in self.block_idx[b]]
        cols = step_cols[b] = _check_positions(cols, pos_limits[b], kp.clamp, blocks[b])
        if not operand_batched[b]:
          key = tuple(int(c[0]) for c in cols)
          if key != shared_last[b]:
            shared_last[b] = key
            shared_view[b] = windows[b][key] if key else windows[b]
          views[b] = shared_view[b]
          continue
        view, copied = _gather(windows[b], cols)
        views[b] = view
        if copied and b >= n_in:
          writeback.append((b, cols, view))
        if lanes_last:
          views[b] = _lanes_last_copy(view)
          if b >= n_in:
            relaid.append((view, views[b]))
          else:
            views[b].flags.writeable = False  # read-only, as the input block
      kernel(ctx, *index_ops, *views, *scratch)
      for view, copy in relaid:
        np.copyto(view, copy)
      for b, cols, view in writeback:
        windows[b][tuple(cols)] = view
      if step == 0 and first_states is not None:
        first_states.visit(lo, hi, scratch, {b: _gather(windows[b], step_cols[b])[0]
                                             for b in range(n_in, n_ops)})
      if self.progress is not None:
        self.done += n
        self.progress.tick(self.done)
    for f, s in zip(finals, scratch):
      f[lo:hi] = s


  def _shared_slab(self, n, ctx, ids, flat, index_ops, windows, pos_limits):
    """One slab of a pass with shared outputs, written in place while a
    SharedOutputs records who touched what (fresh for every slab)."""
    kp = self.kp
    blocks = kp.blocks
    for d in self.seq_axes:
      ids[d] = np.int32(0)
    ctx.program_ids = tuple(ids[d] for d in kp.local_dims)
    shared = SharedOutputs(n)
    views, writeback = [], []
    for b in range(len(windows)):
      cols = [c[flat] for c in self.block_idx[b]]
      cols = _check_positions(cols, pos_limits[b], kp.clamp, blocks[b])
      if not self.operand_batched[b]:
        key = tuple(int(c[0]) for c in cols)
        view = windows[b][key] if key else windows[b]
        if b in self.shared:
          shared.add(view)
        views.append(view)
        continue
      view, copied = _gather(windows[b], cols)
      if copied and b >= kp.num_inputs:
        writeback.append((b, cols, view))
      views.append(view)
    _tracking.shared = shared
    try:
      self.kernel(ctx, *index_ops, *views)
    finally:
      _tracking.shared = None
    for b, cols, view in writeback:
      windows[b][tuple(cols)] = view
    if self.progress is not None:
      self.done += n
      self.progress.tick(self.done)


# -- the lanes-last layout -------------------------------------------------------
# A batched value is (lanes, *per-lane shape). Stored lanes-first (C order),
# every NumPy op's contiguous inner run is the per-lane value's last axis (or
# less: a bitonic sort's compare-exchange on a (256, 1) column reads runs of
# 1, 2, 4, ... elements), and ufuncs over short strided runs cost ~3x per
# element. Stored lanes-last (the lane axis contiguous, the logical shape
# unchanged) every elementwise op, slice, reshape and reduction runs over
# all lanes contiguously, and NumPy keeps that layout ('K' order) through
# ufunc results, slices, transposes and fused concatenate buffers. The slab
# runner copies the lanes' blocks and scratch into that layout and the
# output blocks back; results are the same values in either layout.
# Chosen per kernel: lanes-last when the typical (size-weighted median) eqn
# result has a short last axis, and never with GEMMs (BLAS wants contiguous
# rows; the lanes fold into them).
_LANES_LAST_MAX_INNER = 64
_LANES_LAST_MIN_LANES = 8
LANES_LAST = None  # True/False: force the layout of every batched pass (tests)
GEMMS = frozenset(("dot_general", "ragged_dot", "ragged_dot_general"))


def all_eqns(jaxpr) -> list:
  """The eqns of ``jaxpr`` and of every sub-jaxpr (each sub-jaxpr's right
  after the eqn that holds it)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  out = []
  for eqn in jaxpr.eqns:
    out.append(eqn)
    if eqn.params and _has_subjaxprs(eqn):
      for v in eqn.params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
          if isinstance(x, _JAXPR_TYPES):
            out += all_eqns(x)
  return out


def _sub_bindings(eqn):
  """[(sub-jaxpr, the eqn atoms its invars take)] for the call-like and
  control-flow eqns whose operands map onto sub-jaxpr inputs; None for any
  other eqn with sub-jaxprs (the callers then assume the worst)."""
  name, params, ins = eqn.primitive.name, eqn.params, list(eqn.invars)
  unwrap = lambda j: getattr(j, "jaxpr", j)
  if name == "cond":
    return [(unwrap(b), ins[1:]) for b in params["branches"]]
  if name == "while":
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    carry = ins[nc + nb:]
    return [(unwrap(params["cond_jaxpr"]), ins[:nc] + carry),
            (unwrap(params["body_jaxpr"]), ins[nc:nc + nb] + carry)]
  if name == "scan":
    return [(unwrap(params["jaxpr"]), ins)]
  if name == "run_scoped":
    body = unwrap(params["jaxpr"])
    return [(body.replace(invars=[*body.constvars, *body.invars], constvars=[]), ins)]
  callee = params.get(_INLINE_CALLS.get(name, ""))
  if callee is not None:
    return [(unwrap(callee), ins)]
  return None if _has_subjaxprs(eqn) else []


def loop_axes(kp) -> frozenset:
  """Grid dims whose program_id reaches a ``while`` loop's operands (a
  ``fori_loop`` with a program_id-dependent trip count, as in causal
  attention): batching such an axis makes the lanes' trip counts differ,
  and the pass iterates every lane until the longest is done. A heuristic
  for the choice of axes only: correctness never depends on it."""
  local = kp.local_dims
  found: set = set()
  none = frozenset()
  var = jc.Var

  def walk(jaxpr, taint) -> frozenset:
    """Taints ``jaxpr``'s values; returns every axis seen in it (the taint
    of a call or loop's outputs: a coarse but safe over-approximation)."""
    seen = none.union(*taint.values())
    for eqn in jaxpr.eqns:
      # Most eqns read nothing tainted and call nothing: one cheap test each
      # (this walk is on every vectorized kernel's first call).
      axes = none
      if taint:
        hits = [taint[v] for v in eqn.invars if isinstance(v, var) and v in taint]
        if hits:
          axes = none.union(*hits)
      name = eqn.primitive.name
      if name == "program_id":
        axes = axes | {local[eqn.params["axis"]]}
      elif name == "while":
        found.update(axes)
      if eqn.params and _has_subjaxprs(eqn):
        for sub, atoms in _sub_bindings(eqn) or ():
          axes = axes | walk(sub, {v: taint[a] for v, a in zip(sub.invars, atoms)
                                   if isinstance(a, var) and a in taint})
      if axes:
        seen = seen | axes
        for o in eqn.outvars:
          taint[o] = axes
    return seen
  walk(kp.kernel_jaxpr, {})
  return frozenset(found)


def partly_read_operands(kp) -> frozenset:
  """Operands (block positions) the kernel only ever reads or writes in
  windows smaller than their block (``k_ref[pl.ds(start, 64), :]`` of a
  whole K block): a lane's real traffic is then those windows, not its
  block. Any other use of the ref (whole-block access, a primitive this
  walk does not know) counts as whole."""
  whole: set = set()
  partial: set = set()
  getters = ("get", "swap", "masked_load", "masked_swap", "addupdate")

  def walk(jaxpr, refs):
    for eqn in jaxpr.eqns:
      used = [(k, refs[v]) for k, v in enumerate(eqn.invars)
              if isinstance(v, jc.Var) and v in refs]
      if not used:
        continue
      name = eqn.primitive.name
      if name in getters and used == [(0, used[0][1])]:
        ref_aval = eqn.invars[0].aval
        moved = (eqn.outvars or eqn.invars[1:])[0].aval  # what a read/swap moves
        size = math.prod(getattr(moved, "shape", ()) or (1,))
        block = math.prod(getattr(ref_aval, "shape", ()) or (1,))
        (partial if 2 * size <= block else whole).add(used[0][1])
        continue
      subs = _sub_bindings(eqn)
      if not subs or name in getters:  # an unknown use (a DMA, an atomic, ...)
        whole.update(op for _, op in used)
        continue
      for sub, atoms in subs:
        walk(sub, {v: refs[a] for v, a in zip(sub.invars, atoms)
                   if isinstance(a, jc.Var) and a in refs})

  jaxpr = kp.kernel_jaxpr
  ops = jaxpr.invars[kp.num_index:kp.num_index + len(kp.blocks)]
  walk(jaxpr, {v: b for b, v in enumerate(ops)})
  return frozenset(partial - whole)


def prefers_lanes_last(kp) -> bool:
  inner = []  # (last-axis length, elements) per eqn result
  for eqn in all_eqns(kp.kernel_jaxpr):
    if eqn.primitive.name in GEMMS:
      return False
    for v in eqn.outvars:
      shape = getattr(v.aval, "shape", None)
      if shape and not isinstance(v.aval, jc.AbstractRef):
        size = math.prod(shape)
        if size > 1:
          inner.append((shape[-1], size))
  if not inner:
    return False
  inner.sort()
  half, seen = sum(w for _, w in inner) / 2, 0
  for last, w in inner:
    seen += w
    if seen >= half:
      return last <= _LANES_LAST_MAX_INNER
  return False


def _lanes_last_copy(x):
  out = lanes_last_empty(x.shape[0], x.shape[1:], x.dtype)
  np.copyto(out, x)
  return out


def _lane_full(n, shape, fill, dtype, lanes_last):
  if not lanes_last:
    return np.full((n, *shape), fill, dtype)
  out = lanes_last_empty(n, tuple(shape), dtype)
  out[...] = fill
  return out


def _fill(dtype, params):
  from pallas_np.grid import fill_value
  return fill_value(dtype, params)


def _check_positions(cols, limits, clamp, geo):
  out = []
  for d, (c, lim) in enumerate(zip(cols, limits)):
    if c.size and (c.min() < 0 or c.max() >= lim):
      if not clamp:
        raise IndexError(f"block index out of bounds on dimension {d} of {geo.origin}")
      c = np.clip(c, 0, lim - 1)
    out.append(c)
  return out


def _gather(window, cols):
  """The lanes' blocks as one array with a leading lane axis: a view when
  possible (``_lane_view``); else a copy (written back after the step for
  outputs)."""
  view = _lane_view(window, cols)
  if view is not None:
    return view, False
  return window[tuple(cols)], True


def _lane_view(window, cols):
  """The lanes' blocks as a view of ``window``, or None: when one block
  coordinate steps by one from lane to lane and the others are fixed, or
  when the lanes walk consecutive block positions of several adjacent dims
  in C order (lanes over (batch, head) of a (B, H, ...) operand) whose
  windows merge into one axis without a copy."""
  n = len(cols[0])
  varying = [d for d, c in enumerate(cols) if not (c == c[0]).all()]
  if len(varying) <= 1:
    d = varying[0] if varying else 0
    c = cols[d]
    start = int(c[0])
    if not varying and n == 1 or varying and int(c[-1]) - start == n - 1 and (
        n < 3 or (np.diff(c) == 1).all()):
      idx = tuple(slice(start, start + n) if k == d else int(cols[k][0])
                  for k in range(len(cols)))
      return window[idx]
    return None
  lo, hi = varying[0], varying[-1] + 1
  extents = window.shape[lo:hi]
  flat = np.ravel_multi_index(tuple(cols[lo:hi]), extents)
  start = int(flat[0])
  if int(flat[-1]) - start != n - 1 or not (np.diff(flat) == 1).all():
    return None
  run = window[tuple(slice(None) if lo <= k < hi else int(cols[k][0])
                     for k in range(len(cols)))]
  merged = hi - lo  # the first ``merged`` axes of ``run`` fold into one
  if any(run.strides[k] != run.strides[k + 1] * run.shape[k + 1] for k in range(merged - 1)):
    return None
  return np.lib.stride_tricks.as_strided(
      run, (math.prod(extents), *run.shape[merged:]),
      (run.strides[merged - 1], *run.strides[merged:]))[start:start + n]
