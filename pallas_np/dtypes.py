"""dtype helpers: JAX dtypes as NumPy dtypes (bf16/fp8 via ml_dtypes)."""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from pallas_np import _compat as jc


@functools.lru_cache(maxsize=None)
def np_dtype(dtype) -> np.dtype:
  """The NumPy dtype that holds values of a (possibly logical) JAX dtype."""
  return np.dtype(jc.physical_dtype(dtype))


_LOW_PRECISION = set()
for _name in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz",
              "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e3m4", "float8_e4m3",
              "float8_e8m0fnu", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"):
  if hasattr(ml_dtypes, _name):
    _LOW_PRECISION.add(np.dtype(getattr(ml_dtypes, _name)))
_LOW_PRECISION.add(np.dtype(np.float16))


def is_low_precision_float(dtype) -> bool:
  """Floats XLA's CPU backend computes in float32 and rounds back."""
  return np.dtype(dtype) in _LOW_PRECISION


def reduce_precision(x, exponent_bits: int, mantissa_bits: int, dtype):
  """Round ``x`` to a float format with the given exponent/mantissa bits
  (XLA ReducePrecision): round-to-nearest-even on the mantissa, overflow to
  inf, underflow flushes through denormals, NaN stays NaN."""
  dtype = np.dtype(dtype)
  work = np.asarray(x, np.float64)
  bits = work.view(np.uint64)
  src_mant = 52
  src_exp = 11
  if mantissa_bits < src_mant:
    shift = src_mant - mantissa_bits
    last = (bits >> np.uint64(shift)) & np.uint64(1)
    bias = (np.uint64(1) << np.uint64(shift - 1)) - np.uint64(1) + last
    mask = ~((np.uint64(1) << np.uint64(shift)) - np.uint64(1))
    rounded = (bits + bias) & mask
    bits = np.where(np.isnan(work), bits, rounded)
  if exponent_bits < src_exp:
    src_bias = (1 << (src_exp - 1)) - 1
    dst_bias = (1 << (exponent_bits - 1)) - 1
    exp = ((bits >> np.uint64(src_mant)) & np.uint64((1 << src_exp) - 1)).astype(np.int64)
    sign = bits & np.uint64(1 << 63)
    overflow = exp > src_bias + dst_bias
    underflow = exp <= src_bias - dst_bias
    bits = np.where(overflow, sign | np.uint64(0x7FF0000000000000), bits)
    bits = np.where(underflow, sign, bits)
    bits = np.where(np.isnan(work), np.asarray(work).view(np.uint64), bits)
  return np.asarray(bits.view(np.float64)).astype(dtype)[()]


# Bit pattern of -0.0, by float width: the sign bit alone.
_NEGATIVE_ZERO = {1: (np.uint8, 0x80), 2: (np.uint16, 0x8000), 4: (np.uint32, 0x80000000),
                  8: (np.uint64, 1 << 63)}


def has_negative_zero(x) -> bool:
  """Whether a float array holds a -0.0 (one compare of its bits and one
  reduction). Zero-sign fixes only matter then: without a -0.0, every zero
  NumPy's max/min return is +0.0, as XLA's. Conservative (True) for types
  it cannot read bitwise."""
  x = np.asarray(x)
  bits = _NEGATIVE_ZERO.get(x.dtype.itemsize)
  if x.dtype.kind not in "fV" or bits is None:
    return x.dtype.kind not in "biu"
  unsigned, pattern = bits
  return bool((x.view(unsigned) == pattern).any())


def bit_width(dtype) -> int:
  """Bits per element: NumPy's itemsize says 1 byte for ml_dtypes' sub-byte
  types (int4, uint2, float4_e2m1fn, ...), which hold 4 or 2 bits."""
  dt = np.dtype(dtype)
  if dt.kind in "iu" or dt.kind == "V" and "int" in dt.name:
    try:
      return int(ml_dtypes.iinfo(dt).bits)
    except (TypeError, ValueError):
      pass
  if dt.kind in "fV":
    try:
      return int(ml_dtypes.finfo(dt).bits)
    except (TypeError, ValueError):
      pass
  return dt.itemsize * 8
