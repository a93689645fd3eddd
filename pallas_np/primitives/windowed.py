"""reduce_window (sum/max/min and the generic form with a monoid jaxpr).

The operand is padded (base dilation = interior padding) with the init value,
windows are a strided ``sliding_window_view`` (window dilation = a stride
inside the window), and each window is reduced. bf16/f16 sums accumulate in
float32 and round once (XLA rounds per add: results may differ by an ulp).
"""
from __future__ import annotations

import dataclasses

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.compiler import Compiler
from pallas_np.dtypes import np_dtype, is_low_precision_float

_wr = jc.optional_primitive("lax.windowed_reductions", "reduce_window_sum_p")


def _windows(x, init, p):
  """(view of shape out_shape + window_shape, out_shape)."""
  dims = tuple(p["window_dimensions"])
  strides = tuple(p["window_strides"])
  padding = tuple(tuple(pp) for pp in p["padding"])
  base = tuple(p.get("base_dilation") or (1,) * len(dims))
  wdil = tuple(p.get("window_dilation") or (1,) * len(dims))
  x = np.asarray(x)
  if any(b > 1 for b in base):
    shape = tuple((n - 1) * b + 1 if n else 0 for n, b in zip(x.shape, base))
    y = np.full(shape, init, x.dtype)
    y[tuple(slice(None, None, b) for b in base)] = x
    x = y
  if any(lo or hi for lo, hi in padding):
    pos = [(max(lo, 0), max(hi, 0)) for lo, hi in padding]
    x = np.pad(x, pos, constant_values=init)
    x = x[tuple(slice(-lo if lo < 0 else 0, n + hi if hi < 0 else n)
                for (lo, hi), n in zip(padding, x.shape))]
  eff = tuple((w - 1) * d + 1 for w, d in zip(dims, wdil))
  view = sliding_window_view(x, eff)
  nd = len(dims)
  view = view[tuple(slice(None, None, s) for s in strides) + tuple(slice(None, None, d) for d in wdil)]
  return view, nd


def _simple(kind):
  def compile_rule(e):
    p = e.params
    dt = np_dtype(e.out_aval.dtype)
    if kind == "sum":
      init = np.zeros((), dt)
    else:
      init = np.array(-np.inf if kind == "max" else np.inf, dt) if dt.kind in "fV" or \
          is_low_precision_float(dt) else np.array(
              np.iinfo(dt).min if kind == "max" else np.iinfo(dt).max, dt) if dt.kind in "iu" \
          else np.array(kind != "max")
    acc = np.float32 if is_low_precision_float(dt) else dt

    def reduce_window(x):
      view, nd = _windows(x, init, p)
      axes = tuple(range(view.ndim - nd, view.ndim))
      if kind == "sum":
        r = np.sum(view, axis=axes, dtype=acc) if dt != np.bool_ else np.any(view, axis=axes)
      elif kind == "max":
        r = np.max(view, axis=axes, initial=init)
      else:
        r = np.min(view, axis=axes, initial=init)
      return np.asarray(r, dt)
    return reduce_window
  return compile_rule


if _wr is not None:
  _w = jc.internal_module("lax.windowed_reductions")
  _PER_LANE = registry.unbatched("rare in kernels: run lane by lane")
  registry.register(_w.reduce_window_sum_p, batch=_PER_LANE)(_simple("sum"))
  registry.register(_w.reduce_window_max_p, batch=_PER_LANE)(_simple("max"))
  registry.register(_w.reduce_window_min_p, batch=_PER_LANE)(_simple("min"))

  @registry.register(_w.reduce_window_p, batch=registry.unbatched(
      "a reducer jaxpr: no batched rule (the grid runs sequentially)"))
  def _reduce_window(e):
    p = e.params
    n = len(e.out_avals)
    compiler = Compiler(dataclasses.replace(e.compiler.params, check_avals=False), e.compiler.name)
    combine = compiler.compile(p["jaxpr"], p["consts"]).fn
    dts = [np_dtype(a.dtype) for a in e.out_avals]

    def reduce_window(*args):
      operands, inits = args[:n], args[n:]
      views = [_windows(x, np.asarray(i, dt), p) for x, i, dt in zip(operands, inits, dts)]
      nd = views[0][1]
      flat = [v.reshape(*v.shape[:v.ndim - nd], -1) for v, _ in views]
      out_shape = flat[0].shape[:-1]
      acc = [np.broadcast_to(np.asarray(i, dt), out_shape) for i, dt in zip(inits, dts)]
      for k in range(flat[0].shape[-1]):
        acc = combine(None, *acc, *[f[..., k] for f in flat])
      return [np.asarray(a, dt).reshape(out_shape) for a, dt in zip(acc, dts)]
    return reduce_window
