"""Transcendentals that follow XLA's own fixed formulas, for bit-exactness.

XLA expands some functions into polynomials in the operand's type (float32;
bf16/f16 are upcast to float32 and rounded back). Where NumPy/SciPy compute
a more accurate value, results differ by a few ulp; these rules reproduce
XLA's expansion op for op instead. XLA's CPU backend contracts ``a*b + c``
into a fused multiply-add; ``_fma`` gets that from one float64 multiply-add
(the product of two float32s is exact in float64), rounded once more to
float32 (double rounding can differ from a true FMA in rare halfway cases).
Measured agreement is in ``pallas_np.conformance``.
"""
from __future__ import annotations

import numpy as np
import scipy.special
from jax import lax

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import is_low_precision_float, np_dtype
from pallas_np.primitives.elementwise import unary_float

_F32 = np.float32


def _fma(a, b, c):
  return (np.asarray(a, np.float64) * b + c).astype(_F32)


def _horner(x, coeffs):
  p = np.full(np.shape(x), coeffs[0], _F32)
  for c in coeffs[1:]:
    p = _fma(p, x, c)
  return p


# XLA ElementalIrEmitter::EmitLog1p: the Cephes rational approximation for
# |x| < sqrt(2) - 1 (bit-exact); above, XLA takes its own log(1 + x), for
# which NumPy's log1p is the closest stand-in measured (97% exact, <= 2 ulp).
_LOG1P_NUM = _F32([4.5270000862445199635215E-5, 4.9854102823193375972212E-1,
                   6.5787325942061044846969E0, 2.9911919328553073277375E1,
                   6.0949667980987787057556E1, 5.7112963590585538103336E1,
                   2.0039553499201281259648E1])
_LOG1P_DEN = _F32([1., 1.5062909083469192043167E1, 8.3047565967967209469434E1,
                   2.2176239823732856465394E2, 3.0909872225312059774938E2,
                   2.1642788614495947685003E2, 6.0118660497603843919306E1])


def log1p_f32(x):
  x = np.asarray(x, _F32)
  x2 = x * x
  with np.errstate(all="ignore"):
    small = _horner(x, _LOG1P_NUM) / _horner(x, _LOG1P_DEN)
    small = x + _fma(_F32(-0.5), x2, (x * x2) * small)
    large = np.log1p(x)
  return np.where(np.abs(x) < _F32(0.41421356237309504880), small, large)


# XLA ErfInv32 (xla/hlo/builder/lib/math.cc): Giles' single-precision
# polynomial in w = -log1p(-x*x), split at w = 5.
_ERFINV_LT5 = _F32([2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06,
                    0.00021858087, -0.00125372503, -0.00417768164, 0.246640727, 1.50140941])
_ERFINV_GE5 = _F32([-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844,
                    0.00573950773, -0.0076224613, 0.00943887047, 1.00167406, 2.83297682])


def erf_inv_f32(x):
  x = np.asarray(x, _F32)
  with np.errstate(all="ignore"):
    w = -log1p_f32(-(x * x))
    lt = w < _F32(5)
    w = np.where(lt, w - _F32(2.5), np.sqrt(w) - _F32(3)).astype(_F32)
    p = np.where(lt, _ERFINV_LT5[0], _ERFINV_GE5[0]).astype(_F32)
    for lo, hi in zip(_ERFINV_LT5[1:], _ERFINV_GE5[1:]):
      p = _fma(p, w, np.where(lt, lo, hi))
    return np.where(np.abs(x) == 1, x * _F32(np.inf), p * x).astype(_F32)


def _f32_rule(f32_fn, fallback):
  """float32 (and bf16/f16/fp8 through float32) use XLA's formula; other
  dtypes (float64) keep ``fallback``."""
  def compile_rule(e):
    dt = np_dtype(e.in_avals[0].dtype)
    if dt == np.float32:
      return lambda x: f32_fn(x)[()]
    if is_low_precision_float(dt):
      return lambda x: f32_fn(np.asarray(x, _F32)).astype(dt)[()]
    return fallback(e)
  return compile_rule


def register():
  registry.register(lax.erf_inv_p, batch=registry.ELEMENTWISE)(
      _f32_rule(erf_inv_f32, unary_float(scipy.special.erfinv)))
  registry.register(lax.log1p_p, batch=registry.ELEMENTWISE)(
      _f32_rule(log1p_f32, unary_float(np.log1p)))


register()


_polynomial_p = getattr(jc.lax_internal, "polynomial_p", None)  # JAX >= 0.12
if _polynomial_p is not None:
  @registry.register(_polynomial_p, batch=registry.ELEMENTWISE)
  def _polynomial(e):
    """XLA: Horner's rule from the highest coefficient, ``acc * x + c``; in
    float32 each step one FMA, in bf16/f16 each product and sum rounded to
    the dtype (computed in float32), in float64 plain product and sum."""
    dt = np_dtype(e.out_aval.dtype)
    low = is_low_precision_float(dt)

    def polynomial(x, *coeffs):
      if low:
        f32 = lambda v: np.asarray(v, _F32)  # noqa: E731
        acc = np.asarray(coeffs[-1], dt)
        for c in reversed(coeffs[:-1]):
          acc = np.asarray(f32(np.asarray(f32(acc) * f32(x), dt)) + f32(c), dt)
      elif dt == _F32:
        acc = np.asarray(coeffs[-1], _F32)
        for c in reversed(coeffs[:-1]):
          acc = _fma(acc, x, c)
      else:
        acc = np.asarray(coeffs[-1], dt)
        with np.errstate(over="ignore", invalid="ignore"):
          for c in reversed(coeffs[:-1]):
            acc = acc * x + c
      return np.broadcast_to(acc, e.out_aval.shape).astype(dt, copy=False)[()]
    return polynomial
