"""Reductions, argmin/argmax and cumulative ops, accumulating in the operand
dtype as XLA does (NumPy would widen int32 sums to int64)."""
from __future__ import annotations

import dataclasses

import math

import numpy as np

from jax import lax

from pallas_np import _compat as jc
from pallas_np import batching, registry
from pallas_np.compiler import Compiler
from pallas_np.dtypes import has_negative_zero, is_low_precision_float, np_dtype


def _axes(e):
  return tuple(int(a) for a in e.params["axes"])


def _float_acc(dt):
  return np.float32 if is_low_precision_float(dt) else dt


def _shifted_rule(param, single=False, ordered=False):
  """The batched rule: the unbatched rule with ``param``'s axes shifted past
  the lane axis. ``ordered``: a float sum/product, whose rounding depends on
  the order NumPy adds in."""
  def brule(bc, rule, info, in_batched):
    if len(in_batched) != 1:
      return batching.lane_loop(rule, info, in_batched)
    shifted = registry.EqnInfo(info.eqn, bc, info.outvars_used, info.folded)
    params = dict(info.params)
    v = params[param]
    params[param] = int(v) + 1 if single else batching.shift_axes(v)
    shifted.params = params
    fn = rule.compile(shifted)
    if bc.lanes_last and ordered and np.dtype(
        jc.physical_dtype(info.in_avals[0].dtype)).kind in "fc":
      # NumPy sums pairwise along a contiguous axis but one element after
      # another across a strided one: a lanes-last operand would round
      # differently from the grid loop. Lanes first, it adds in its order.
      return (lambda x: fn(np.ascontiguousarray(x))), False, (True,) * len(info.out_avals)
    return fn, False, (True,) * len(info.out_avals)
  return brule


_BY_AXES = _shifted_rule("axes")
_BY_AXIS = _shifted_rule("axis", single=True)


@registry.register(lax.reduce_sum_p, batch=_shifted_rule("axes", ordered=True))
def _reduce_sum(e):
  axes = _axes(e)
  dt = np_dtype(e.in_avals[0].dtype)
  acc = _float_acc(dt)
  if dt == np.bool_:
    return lambda x: np.any(x, axis=axes)
  if dt.kind in "fV" and math.prod(e.in_avals[0].shape[int(a)]  # (unbatched axes)
                                   for a in e.eqn.params["axes"]) == 1:
    # XLA simplifies a sum of one element to that element (its sign of
    # zero kept); NumPy adds it to +0.0 (-0.0 -> +0.0).
    return lambda x: np.squeeze(x, axis=axes).copy()
  if acc == dt:  # the ufunc method directly: half the cost of np.sum
    return lambda x: np.add.reduce(x, axis=axes, dtype=acc)
  return lambda x: np.asarray(np.add.reduce(x, axis=axes, dtype=acc), dtype=dt)[()]


@registry.register(lax.reduce_prod_p, batch=_shifted_rule("axes", ordered=True))
def _reduce_prod(e):
  axes = _axes(e)
  dt = np_dtype(e.in_avals[0].dtype)
  acc = _float_acc(dt)
  return lambda x: np.asarray(np.prod(x, axis=axes, dtype=acc), dtype=dt)[()]


def _identity(dt, kind):
  if dt.kind == "f" or dt.kind == "V" or is_low_precision_float(dt):
    return np.array(-np.inf if kind == "max" else np.inf, dt)
  if dt == np.bool_:
    return np.array(kind != "max")
  info = np.iinfo(dt)
  return np.array(info.min if kind == "max" else info.max, dt)


@registry.register(lax.reduce_max_p, batch=_BY_AXES)
def _reduce_max(e):
  axes = _axes(e)
  dt = np_dtype(e.in_avals[0].dtype)
  init = _identity(dt, "max")
  fast = lambda x: np.maximum.reduce(x, axis=axes, initial=init)
  if dt.kind in "fV":
    # The zero check runs on the (small) result: cheaper than any source check.
    return lambda x: _signed_zero_fix(fast(x), x, axes, True)
  return fast


@registry.register(lax.reduce_min_p, batch=_BY_AXES)
def _reduce_min(e):
  axes = _axes(e)
  dt = np_dtype(e.in_avals[0].dtype)
  init = _identity(dt, "min")
  fast = lambda x: np.minimum.reduce(x, axis=axes, initial=init)
  if dt.kind in "fV":
    return lambda x: _signed_zero_fix(fast(x), x, axes, False)
  return fast


def _signed_zero_fix(r, x, axes, is_max):
  """XLA orders -0.0 below +0.0 in max/min; NumPy returns either zero."""
  x = np.asarray(x)
  # No zero result (NaN is truthy, -0.0 falsy), or no -0.0 to misplace.
  if r.all() or not has_negative_zero(x):
    return r
  zero = r == 0
  neg = np.signbit(x) & (x == 0)
  pos = ~np.signbit(x) & (x == 0)
  if is_max:  # -0.0 only if no +0.0 among the maxima
    sign_neg = ~np.any(pos, axis=axes)
  else:
    sign_neg = np.any(neg, axis=axes)
  fixed = np.where(sign_neg, np.array(-0.0, r.dtype), np.array(0.0, r.dtype))
  return np.where(zero, fixed, r).astype(r.dtype, copy=False)[()]


def _bool_all_axes(ufunc):
  """An and/or over every axis of a bool array as one ``count_nonzero``
  (~0.4 us against ~1.2 us for the ufunc's reduce: a while loop's
  ``jnp.any(x != 1)`` condition runs once per iteration). Counting nonzero
  bytes reads any nonzero byte as True, as the reduce does."""
  true, false = np.True_, np.False_
  count = np.count_nonzero
  if ufunc is np.bitwise_or:
    return lambda x: true if count(x) else false
  return lambda x: true if count(x) == x.size else false


def _bitwise_reduce(ufunc, bool_fn):
  def compile_rule(e):
    axes = _axes(e)
    dt = np_dtype(e.in_avals[0].dtype)
    ndim = len(e.in_avals[0].shape)
    if dt == np.bool_ and ndim and tuple(sorted(axes)) == tuple(range(ndim)) \
        and ufunc is not np.bitwise_xor:
      return _bool_all_axes(ufunc)
    if dt == np.bool_:
      return lambda x: bool_fn(x, axis=axes)
    return lambda x: ufunc.reduce(x, axis=axes, dtype=dt)
  return compile_rule


# (the ufuncs' reduce, not np.all/np.any: their Python wrapper costs ~2 us,
# the whole reduction of a small block in a while loop's condition)
registry.register(lax.reduce_and_p, batch=_BY_AXES)(_bitwise_reduce(
    np.bitwise_and, np.logical_and.reduce))
registry.register(lax.reduce_or_p, batch=_BY_AXES)(_bitwise_reduce(
    np.bitwise_or, np.logical_or.reduce))
registry.register(lax.reduce_xor_p, batch=_BY_AXES)(_bitwise_reduce(
    np.bitwise_xor, lambda x, axis: np.logical_xor.reduce(x, axis=axis)))


def _arg(fn):
  def compile_rule(e):
    axis = _axes(e)[0]
    out = np_dtype(e.params["index_dtype"])
    return lambda x: np.asarray(fn(x, axis=axis), dtype=out)[()]
  return compile_rule


registry.register(lax.argmax_p, batch=_BY_AXES)(_arg(np.argmax))
registry.register(lax.argmin_p, batch=_BY_AXES)(_arg(np.argmin))


def _cumulative(accumulate, init_zero=False):
  """``init_zero``: a sum, which XLA computes as a reduce-window whose every
  window starts from (and is padded with) +0.0: no float partial sum is -0.0
  (``_plus_zero``)."""
  def compile_rule(e):
    axis = int(e.params["axis"])
    reverse = bool(e.params["reverse"])
    dt = np_dtype(e.in_avals[0].dtype)
    low = is_low_precision_float(dt)
    plus_zeros = init_zero and (low or dt.kind == "f")

    def f(x):
      plus_zeros_here = plus_zeros and _window_kept(np.shape(x)[axis], dt)
      if low:
        y = _low_precision_scan(x, axis, reverse, accumulate, dt)
        return _plus_zero(y, dt) if plus_zeros_here else y
      if reverse:
        x = np.flip(x, axis)
      y = accumulate(x, axis, dt if not low else np.float32)
      if reverse:
        y = np.flip(y, axis)
      y = np.asarray(y, dtype=dt)
      return _plus_zero(y, dt) if plus_zeros_here else y
    return f
  return compile_rule


def _window_kept(n, dt) -> bool:
  """XLA's simplifier turns a reduce-window of size 1 (a scan along an
  axis of length 1) into its operand, -0.0 kept; bf16's window is widened to
  float32 first and survives (checked against jax.jit on the CPU)."""
  return n != 1 or dt.name == "bfloat16"


def _plus_zero(y, dt):
  """-0.0 -> +0.0, everything else (NaN included) unchanged."""
  return np.add(y, np.zeros((), dt), dtype=dt)


def _low_precision_scan(x, axis, reverse, accumulate, dt):
  """bf16/f16 scans round every partial result back to the dtype, as XLA's
  elementwise upcast-compute-round does (bit-exact for short scans; XLA
  switches to a tree for long ones)."""
  x = np.moveaxis(np.asarray(x), axis, 0)
  n = x.shape[0]

  def add(acc, v):
    pair = np.stack([acc, v]).astype(np.float32)
    return np.asarray(accumulate(pair, 0, np.float32)[1], dt)
  if reverse and n <= 64:
    # XLA's reduce-window sums each suffix window left to right.
    out = np.empty_like(x)
    for i in range(n):
      acc = x[i]
      for k in range(i + 1, n):
        acc = add(acc, x[k])
      out[i] = acc
    return np.moveaxis(out, 0, axis)
  if reverse:
    x = x[::-1]
  out = np.empty_like(x)
  acc = None
  for k in range(x.shape[0]):
    acc = x[k] if acc is None else add(acc, x[k])
    out[k] = acc
  if reverse:
    out = out[::-1]
  return np.moveaxis(out, 0, axis)


registry.register(lax.cumsum_p, batch=_BY_AXIS)(_cumulative(
    lambda x, axis, dt: np.cumsum(x, axis=axis, dtype=dt) if dt != np.bool_
    else np.logical_or.accumulate(x, axis=axis), init_zero=True))
registry.register(lax.cumprod_p, batch=_BY_AXIS)(_cumulative(
    lambda x, axis, dt: np.cumprod(x, axis=axis, dtype=dt)))
registry.register(lax.cummax_p, batch=_BY_AXIS)(_cumulative(
    lambda x, axis, dt: np.maximum.accumulate(x, axis=axis)))
registry.register(lax.cummin_p, batch=_BY_AXIS)(_cumulative(
    lambda x, axis, dt: np.minimum.accumulate(x, axis=axis)))
registry.register(lax.cumlogsumexp_p, batch=_BY_AXIS)(_cumulative(
    lambda x, axis, dt: np.logaddexp.accumulate(x, axis=axis)))


@registry.register(lax.reduce_p, batch=registry.unbatched(
    "a reducer jaxpr: no batched rule (the grid runs sequentially)"))
def _reduce(e):
  """``lax.reduce`` with a custom (possibly variadic) monoid: a sequential
  left fold over the reduced elements, the computation applied to whole
  slices at a time (it is elementwise by construction)."""
  dims = tuple(int(d) for d in e.params["dimensions"])
  closed = e.params["jaxpr"]
  n = len(e.out_avals)
  # The monoid's jaxpr is written for scalars; we feed it arrays.
  compiler = Compiler(dataclasses.replace(e.compiler.params, check_avals=False),
                      e.compiler.name)
  combine = compiler.compile(closed).fn
  out_dts = [np_dtype(a.dtype) for a in e.out_avals]

  def reduce(*args):
    operands, inits = args[:n], args[n:]
    moved = [np.moveaxis(np.asarray(x), dims, tuple(range(-len(dims), 0))) for x in operands]
    lead = moved[0].shape[:moved[0].ndim - len(dims)]
    flat = [m.reshape(*lead, -1) for m in moved]
    acc = [np.broadcast_to(np.asarray(i, dt), lead) for i, dt in zip(inits, out_dts)]
    for k in range(flat[0].shape[-1]):
      acc = combine(None, *acc, *[f[..., k] for f in flat])
    return [np.asarray(a, dt).reshape(lead) for a, dt in zip(acc, out_dts)]
  return reduce
