"""Transcendentals and special functions computed by NumPy/SciPy: XLA has
its own approximations of these, which the rules do not reproduce (a few ulp
apart; bounds in ``pallas_np.conformance``). None depends on the CPU's SIMD
code path: expm1, sinh, asinh, acosh and atanh are the C library's double
functions in a compiled loop (``in_float64``: NumPy's float32 and float64
loops for them have AVX-512 variants), SciPy's are scalar C. Bit-exact
ones: ``xla_math.py``.
"""
from __future__ import annotations

import numpy as np
from jax import lax

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import is_low_precision_float, np_dtype
from pallas_np.primitives import libm
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
def in_float64(c_name: str):
  """The C library's double function ``c_name`` (``libm.DOUBLE_FUNCTIONS``)
  over a float32 (or float64) array, rounded once to float32: the correctly
  rounded value unless the exact one lies within the C library's float64
  error of a float32 rounding midpoint. Not NumPy's ufunc: its float32 and
  float64 loops take a SIMD path chosen by the CPU (AVX-512 variants,
  ``numpy.lib.introspect.opt_func_info``), so its bits could change with
  the machine; the C library's scalar code gives the same bits on every
  CPU (as ``sinf`` does for XLA). These are not XLA's own expansions: their
  measured distance to XLA is in pallas_np.conformance."""
  def f(x):
    x = np.asarray(x)
    r = libm.call(c_name, x)
    return r.astype(np.float32) if x.dtype == np.float32 else r
  f.__name__ = f.__qualname__ = f"c_double_{c_name}"
  return f


for _p, _f in [(lax.expm1_p, in_float64("expm1")),
               (lax.sinh_p, in_float64("sinh")), (lax.asinh_p, in_float64("asinh")),
               (lax.acosh_p, in_float64("acosh")), (lax.atanh_p, in_float64("atanh")),
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
