"""Transcendentals and special functions computed by NumPy/SciPy: XLA has
its own approximations of these, which the rules do not reproduce (a few ulp
apart; bounds in ``pallas_np.conformance``). None depends on the CPU's SIMD
code path: NumPy float32 ufuncs with dispatched loops run in float64
(``in_float64``), SciPy's are scalar C. Bit-exact ones: ``xla_math.py``.
"""
from __future__ import annotations

import numpy as np
from jax import lax

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import is_low_precision_float, np_dtype
from pallas_np.primitives.elementwise import binary_float, unary_float


def scipy_special(name: str):
  """``scipy.special.<name>``, imported on its first call: ``scipy.special``
  is ~40% of ``import pallas_np``'s own cost (``python -X importtime``), and
  most programs never run these primitives."""
  def call(*args):
    import scipy.special  # deferred on purpose: see the docstring
    return getattr(scipy.special, name)(*args)
  call.__name__ = call.__qualname__ = f"scipy_special_{name}"
  return call


_PSI = scipy_special("psi")
_BETAINC = scipy_special("betainc")


def _reg_unary(prim, fn):
  registry.register(prim, batch=registry.ELEMENTWISE)(unary_float(fn))


# (exp, exp2, cosh, sin, cos, tan, asin, acos, atan, atan2, cbrt, pow: in
# xla_math.py, XLA's formulas and C library calls)
def in_float64(fn):
  """``fn`` (a NumPy ufunc whose float32 loop takes a CPU-dependent SIMD
  path) computed in float64 and rounded once to float32: the float32 result
  is the correctly rounded value unless the exact value lies within
  float64's error (an ulp of float64, ~2^-29 of a float32 ulp) of a float32
  rounding midpoint, so the bits no longer depend on the CPU in practice.
  These are XLA's own expansions, which this does not reproduce: their
  measured distance to XLA is in pallas_np.conformance."""
  def f(x):
    dt = np.asarray(x).dtype
    if dt != np.float32:
      return fn(x)
    return fn(np.asarray(x, np.float64)).astype(np.float32)
  return f


for _p, _f in [(lax.expm1_p, in_float64(np.expm1)), 
               (lax.sinh_p, in_float64(np.sinh)), (lax.asinh_p, in_float64(np.arcsinh)),
               (lax.acosh_p, in_float64(np.arccosh)), (lax.atanh_p, in_float64(np.arctanh)),
               (lax.sqrt_p, np.sqrt),
               (lax.floor_p, np.floor), (lax.ceil_p, np.ceil),
               (lax.erf_p, scipy_special("erf")), (lax.erfc_p, scipy_special("erfc")),
               (lax.lgamma_p, scipy_special("gammaln")),
               (lax.bessel_i0e_p, scipy_special("i0e")),
               (lax.bessel_i1e_p, scipy_special("i1e"))]:
  _reg_unary(_p, _f)

_DIGAMMA_AT_ZERO = jc.digamma_at_zero()


def _digamma(x):
  # XLA: NaN at the poles (non-positive integers); at ±0 what the installed
  # XLA gives (see _compat.digamma_at_zero).
  pole = (x <= 0) & (x == np.floor(x))
  return np.where(pole, np.where(x == 0, _DIGAMMA_AT_ZERO, np.nan), _PSI(x))


_reg_unary(lax.digamma_p, _digamma)


_reg_unary(lax.rsqrt_p, lambda x: np.reciprocal(np.sqrt(x)))



# -- more special functions (scipy.special; XLA agrees within a few ulp) -----
for _name, _f in [("igamma_p", scipy_special("gammainc")), ("igammac_p", scipy_special("gammaincc")),
                  ("zeta_p", scipy_special("zeta"))]:
  if hasattr(lax, _name):
    registry.register(getattr(lax, _name), batch=registry.ELEMENTWISE)(binary_float(_f))


if hasattr(lax, "polygamma_p"):
  registry.register(lax.polygamma_p, batch=registry.ELEMENTWISE)(
      binary_float(scipy_special("polygamma")))


if hasattr(lax, "regularized_incomplete_beta_p"):
  @registry.register(lax.regularized_incomplete_beta_p, batch=registry.ELEMENTWISE)
  def _betainc(e):
    dt = np_dtype(e.in_avals[0].dtype)
    work = np.float32 if is_low_precision_float(dt) else dt

    def betainc(a, b, x):
      a, b, x = (np.asarray(v, work) for v in (a, b, x))
      return np.asarray(_BETAINC(a, b, x), dt)[()]
    return betainc
