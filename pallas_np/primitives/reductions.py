"""Reductions, argmin/argmax and cumulative ops, accumulating in the operand
dtype as XLA does (NumPy would widen int32 sums to int64)."""
from __future__ import annotations

import numpy as np

from jax import lax

from pallas_np import registry
from pallas_np.dtypes import np_dtype, is_low_precision_float


def _axes(e):
  return tuple(int(a) for a in e.params["axes"])


def _float_acc(dt):
  return np.float32 if is_low_precision_float(dt) else dt


@registry.register(lax.reduce_sum_p)
def _reduce_sum(e):
  axes = _axes(e)
  dt = np_dtype(e.in_avals[0].dtype)
  acc = _float_acc(dt)
  if dt == np.bool_:
    return lambda x: np.any(x, axis=axes)
  return lambda x: np.asarray(np.sum(x, axis=axes, dtype=acc), dtype=dt)[()]


@registry.register(lax.reduce_prod_p)
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


@registry.register(lax.reduce_max_p)
def _reduce_max(e):
  axes = _axes(e)
  dt = np_dtype(e.in_avals[0].dtype)
  init = _identity(dt, "max")
  return lambda x: np.max(x, axis=axes, initial=init)


@registry.register(lax.reduce_min_p)
def _reduce_min(e):
  axes = _axes(e)
  dt = np_dtype(e.in_avals[0].dtype)
  init = _identity(dt, "min")
  return lambda x: np.min(x, axis=axes, initial=init)


def _bitwise_reduce(ufunc, bool_fn):
  def compile_rule(e):
    axes = _axes(e)
    dt = np_dtype(e.in_avals[0].dtype)
    if dt == np.bool_:
      return lambda x: bool_fn(x, axis=axes)
    return lambda x: ufunc.reduce(x, axis=axes, dtype=dt)
  return compile_rule


registry.register(lax.reduce_and_p)(_bitwise_reduce(np.bitwise_and, np.all))
registry.register(lax.reduce_or_p)(_bitwise_reduce(np.bitwise_or, np.any))
registry.register(lax.reduce_xor_p)(_bitwise_reduce(
    np.bitwise_xor, lambda x, axis: np.logical_xor.reduce(x, axis=axis)))


def _arg(fn):
  def compile_rule(e):
    axis = _axes(e)[0]
    out = np_dtype(e.params["index_dtype"])
    return lambda x: np.asarray(fn(x, axis=axis), dtype=out)[()]
  return compile_rule


registry.register(lax.argmax_p)(_arg(np.argmax))
registry.register(lax.argmin_p)(_arg(np.argmin))


def _cumulative(accumulate):
  def compile_rule(e):
    axis = int(e.params["axis"])
    reverse = bool(e.params["reverse"])
    dt = np_dtype(e.in_avals[0].dtype)
    low = is_low_precision_float(dt)

    def f(x):
      if low:
        x = np.asarray(x, np.float32)
      if reverse:
        x = np.flip(x, axis)
      y = accumulate(x, axis, dt if not low else np.float32)
      if reverse:
        y = np.flip(y, axis)
      return np.asarray(y, dtype=dt)
    return f
  return compile_rule


registry.register(lax.cumsum_p)(_cumulative(
    lambda x, axis, dt: np.cumsum(x, axis=axis, dtype=dt) if dt != np.bool_
    else np.logical_or.accumulate(x, axis=axis)))
registry.register(lax.cumprod_p)(_cumulative(
    lambda x, axis, dt: np.cumprod(x, axis=axis, dtype=dt)))
registry.register(lax.cummax_p)(_cumulative(
    lambda x, axis, dt: np.maximum.accumulate(x, axis=axis)))
registry.register(lax.cummin_p)(_cumulative(
    lambda x, axis, dt: np.minimum.accumulate(x, axis=axis)))
registry.register(lax.cumlogsumexp_p)(_cumulative(
    lambda x, axis, dt: np.logaddexp.accumulate(x, axis=axis)))
