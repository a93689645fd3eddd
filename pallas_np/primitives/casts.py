"""Conversions with XLA's semantics: convert_element_type (int wrapping,
float->int saturation, sub-byte ints, bf16/fp8), bitcast_convert_type and
reduce_precision. All elementwise: a vectorized grid runs each rule on
lane-stacked operands as is (``batch=registry.ELEMENTWISE``)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from jax import lax

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import np_dtype, reduce_precision


@registry.register(lax.convert_element_type_p, batch=registry.ELEMENTWISE)
def _convert_element_type(e):
  src = np_dtype(e.in_avals[0].dtype)
  dst = np_dtype(e.params["new_dtype"])
  return make_converter(src, dst)


_SUB_BYTE_INTS = {np.dtype(getattr(ml_dtypes, n)) for n in ("int2", "uint2", "int4", "uint4")
                  if hasattr(ml_dtypes, n)}
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu) if hasattr(ml_dtypes, "float8_e8m0fnu") else None


_WIDE_FLOATS = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)}


def _is_int(dt) -> bool:
  return dt.kind in "biu" or dt in _SUB_BYTE_INTS


def _is_float(dt) -> bool:
  return dt.kind == "f" or (dt.kind == "V" and dt not in _SUB_BYTE_INTS)


_BF16 = np.dtype(ml_dtypes.bfloat16)
_BF16_BOOL_DAZ = jc.bf16_to_bool_flushes_denormals()


def _same_dtype(x):
  return x


# (a weak-type-only conversion: the compiler binds the result to the
# operand's value instead of emitting a line, ~0.1 us a loop iteration)
_same_dtype.is_identity = True


def make_converter(src, dst):
  """XLA's conversion. int->int wraps (sub-byte ints too: ml_dtypes
  saturates, so those go through int64); float->int truncates, NaN->0 and
  saturates at the range; float32->bool (and bfloat16->bool in newer
  jaxlibs) reads denormals as zero (XLA CPU runs with DAZ). NaN payloads and signs are NumPy's/ml_dtypes' except that
  a NaN becomes -0.0 in float4_e2m1fn (which has no NaN), as in XLA."""
  src = np.dtype(src)
  dst = np.dtype(dst)
  if src == dst:
    return _same_dtype
  if src.kind == "c" and dst.kind != "c":
    real = make_converter(np.real(np.zeros((), src)).dtype, dst)
    return lambda x: real(np.real(x))
  if dst == np.bool_:
    if src == np.float32 or (src == _BF16 and _BF16_BOOL_DAZ):
      tiny = np.asarray(np.finfo(np.float32).tiny, src)
      return lambda x: np.logical_not(np.abs(x) < tiny)  # NaN -> True
    if src == _E8M0:
      return lambda x: np.not_equal(np.asarray(x).astype(np.float32), 0)
    return lambda x: np.not_equal(x, 0)
  if _is_int(src) and _is_int(dst):
    return _int_to_int(src, dst)
  if _is_float(src) and _is_int(dst):
    return _float_to_int(src, dst)
  via = None
  if src in _SUB_BYTE_INTS:
    via = np.dtype(np.int8)   # exact; ml_dtypes lacks some sub-byte -> float casts
  elif _E8M0 is not None and _E8M0 in (src, dst) and src not in _WIDE_FLOATS:
    via = np.dtype(np.float32)  # exact; ml_dtypes has no fp8 <-> e8m0 casts
  if dst == np.dtype(getattr(ml_dtypes, "float4_e2m1fn", np.float32)) and _is_float(src):
    neg0 = np.zeros((), dst) * np.asarray(-1, dst)

    def to_f4(x):
      x = np.asarray(x)
      out = (x.astype(via) if via is not None else x).astype(dst)
      nan = np.isnan(x.astype(np.float32) if src.kind == "V" else x)
      return (np.where(nan, neg0, out) if nan.any() else out)[()]
    return to_f4
  if via is not None:
    return lambda x: np.asarray(x).astype(via).astype(dst)[()]
  return lambda x: np.asarray(x).astype(dst)[()]


def _int_to_int(src, dst):
  if src not in _SUB_BYTE_INTS and dst not in _SUB_BYTE_INTS:
    return lambda x: np.asarray(x).astype(dst)[()]  # NumPy wraps, as XLA
  bits = 2 if dst.name.endswith("int2") else 4 if dst.name.endswith("int4") else dst.itemsize * 8
  mask = np.int64((1 << bits) - 1)
  signed = dst.kind == "i" or dst.name.startswith("int")
  half, full = np.int64(1 << (bits - 1)), np.int64(1 << bits)

  def wrap(x):
    v = np.asarray(x).astype(np.int64) & mask
    if signed:
      v = np.where(v >= half, v - full, v)
    return v.astype(dst)[()]
  return wrap


def _float_to_int(src, dst):
  info = ml_dtypes.iinfo(dst)
  lo, hi = float(info.min), float(info.max)
  # XLA clamps with the range bounds converted to the source type: where a
  # bound rounds inside the range (float4_e2m1fn's 6.0 for int8's 127) the
  # values from there on saturate too. A bound that overflows to NaN/inf
  # clamps nothing more than the plain range does.
  def bound(v):
    b = float(np.asarray(np.asarray(v, np.float64).astype(src)).astype(np.float64))
    return b if np.isfinite(b) else None
  lo_src, hi_src = bound(lo), bound(hi)
  hi_in = hi_src is not None and hi_src < hi
  lo_in = lo_src is not None and lo_src > lo
  wide = src.itemsize == 8 and src.kind == "f"

  def f2i(x):
    x = np.asarray(x)
    if not wide:
      x = (x.astype(np.float32) if src.kind == "V" else x).astype(np.float64)
    r = np.clip(np.trunc(np.nan_to_num(x, nan=0.0, posinf=hi, neginf=lo)), lo, hi)
    if hi_in:
      r = np.where(x >= hi_src, hi, r)
    if lo_in:
      r = np.where(x <= lo_src, lo, r)
    out = r.astype(dst)
    if dst.itemsize == 8:  # float(max int64) rounds up to 2**63
      out = np.where(r >= 2.0 ** (63 if dst.kind == "i" else 64), np.array(info.max, dst), out)
    return out[()]
  return f2i


@registry.register(lax.bitcast_convert_type_p, batch=registry.ELEMENTWISE)
def _bitcast_convert_type(e):
  src = np_dtype(e.in_avals[0].dtype)
  dst = np_dtype(e.params["new_dtype"])
  if src.itemsize == dst.itemsize:
    return lambda x: np.asarray(x).view(dst)[()]
  if src.itemsize > dst.itemsize:
    # One element becomes a trailing dim of narrower elements.
    k = src.itemsize // dst.itemsize
    return lambda x: np.ascontiguousarray(x).view(dst).reshape(*np.shape(x), k)
  # Trailing dim of narrower elements folds into one wider element.
  return lambda x: np.ascontiguousarray(x).view(dst).reshape(np.shape(x)[:-1])


@registry.register(lax.reduce_precision_p, batch=registry.ELEMENTWISE)
def _reduce_precision(e):
  exponent_bits = int(e.params["exponent_bits"])
  mantissa_bits = int(e.params["mantissa_bits"])
  dt = np_dtype(e.in_avals[0].dtype)
  return lambda x: reduce_precision(x, exponent_bits, mantissa_bits, dt)
