"""Transcendentals that follow XLA's own fixed formulas, for bit-exactness on
every CPU.

XLA's CPU backend expands some functions into polynomials in the operand's
type (float32; bf16/f16 are upcast to float32 and rounded back); the formulas
here were read from the LLVM IR that XLA emits (``XLA_FLAGS=--xla_dump_to``)
and are followed op for op. XLA's CPU backend contracts ``a*b + c`` into a
fused multiply-add: ``exp``/``log`` are written in LLVM IR with
``llvm.fma.f32`` and compiled (``libm.define``); the NumPy-side formulas use
``fma_f32`` (exact) or ``_fma`` (one float64 multiply-add rounded to float32:
double rounding can differ from a true FMA in rare halfway cases; measured
bit-exact). Functions XLA leaves to the C library (sin, cos, tan, atan,
atan2, cbrt, pow) call it the same way (``libm.py``). None of these uses a
NumPy ufunc whose float32 loop is chosen by the CPU. Where XLA or JAX changed
a formula between versions (exp; asin's lowering) both are here and a probe
of the installed one picks (``exp_generation``, ``asin_expands_to_atan2``).
Claims and measurements: ``pallas_np.conformance``.
"""
from __future__ import annotations

import threading

import jax
import numpy as np
from jax import lax

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import is_low_precision_float, np_dtype
from pallas_np.primitives import libm, libm_cache
from pallas_np.primitives.elementwise import binary_float, unary_float
from pallas_np.primitives.special import scipy_special

_F32 = np.float32


def _fma(a, b, c):
  return (np.asarray(a, np.float64) * b + c).astype(_F32)


_MID_MASK, _MID = np.uint64((1 << 29) - 1), np.uint64(1 << 28)


def fma_f32(a, b, c):
  """A float32 fused multiply-add, correctly rounded (what the CPU's FMA
  instruction gives). The product of two float32s is exact in float64; the
  float64 sum rounds once more, which can only change the float32 result
  when it lands exactly on a float32 rounding midpoint (29 low bits
  100...0): there the exact sum's error (Knuth's TwoSum) decides the
  direction (round to odd), so the result is the true FMA's."""
  p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
  c = np.asarray(c, np.float64)
  with np.errstate(invalid="ignore", over="ignore"):
    s = p + c
    mid = (np.asarray(s).view(np.uint64) & _MID_MASK) == _MID
    if mid.any():
      bp = s - p
      err = (p - (s - bp)) + (c - bp)  # p + c == s + err exactly
      nudge = np.where(mid & (err != 0), np.where((err > 0) == (s > 0), 1, -1), 0)
      s = (np.asarray(s).view(np.int64) + nudge).view(np.float64)
    return np.asarray(s).astype(_F32)


def _bits_f32(u):
  return np.uint32(u).view(_F32)


# XLA's float32 exp (its CPU intrinsic, read from the LLVM IR XLA emits):
# Cephes' polynomial after n = floor(x log2(e) + 1/2), every multiply-add
# contracted to an FMA (as XLA compiles it on FMA machines).
_EXP_C1, _EXP_C2 = _bits_f32(0x3F318000), _bits_f32(0xB95E8083)
_EXP_P = [_bits_f32(b) for b in (0x39506967, 0x3AB743CE, 0x3C088908, 0x3D2AA9C1, 0x3E2AAAAA)]


class _Ssa:
  """Writes a scalar LLVM IR function, one SSA line per call."""

  def __init__(self, name, nargs):
    self.name, self.k = name, 0
    self.args = [f"%a{i}" for i in range(nargs)]
    self.lines = []

  def __call__(self, text):
    self.k += 1
    self.lines.append(f"  %t{self.k} = {text}")
    return f"%t{self.k}"

  def fma(self, a, b, c):
    return self(f"call float @llvm.fma.f32(float {a}, float {b}, float {c})")

  def select(self, cond, a, b):
    return self(f"select i1 {cond}, float {a}, float {b}")

  def define(self, result):
    params = ", ".join(f"float {a}" for a in self.args)
    body = "\n".join(self.lines)
    libm.define(self.name, len(self.args),
                f"define internal float @{self.name}({params}) {{\n{body}\n  ret float {result}\n}}")
    return libm.unary(self.name) if len(self.args) == 1 else libm.binary(self.name)


def _c(v):
  """A float32 constant in LLVM IR (the double-precision hex of its value)."""
  return "0x%016X" % np.float64(_F32(v)).view(np.uint64)


def _exp_ir(name, split_scale):
  """XLA's float32 exp in LLVM IR. Two generations: JAX 0.10's XLA clamps
  n to [-127, 127] and multiplies by 2^n built from its exponent bits
  (Cephes' ln 2 split); newer XLA (JAX 0.12's) clamps n to [-127, 128],
  reduces with another ln 2 split and scales in two steps (an integer add
  to the result's exponent, then a multiply by 2^min(n, 127)), so exp(88.7)
  no longer overflows early. Both read from the code XLA emits
  (``XLA_FLAGS=--xla_dump_to``)."""
  b = _Ssa(name, 1)
  x0 = b.args[0]
  x = b.select(b(f"fcmp uge float {x0}, {_c(-87.8)}"), x0, _c(-87.8))  # NaN stays NaN
  x = b.select(b(f"fcmp ule float {x}, {_c(88.8)}"), x, _c(88.8))
  n = b(f"call float @llvm.floor.f32(float {b.fma(x, _c(_bits_f32(0x3FB8AA3B)), _c(0.5))})")
  n = b.select(b(f"fcmp uge float {n}, {_c(-127)}"), n, _c(-127))
  n = b.select(b(f"fcmp ule float {n}, {_c(128 if split_scale else 127)}"), n,
               _c(128 if split_scale else 127))
  if split_scale:
    r = b.fma(n, _c(_bits_f32(0xB5BFBE8E)), b.fma(n, _c(_bits_f32(0xBF317200)), x))
  else:
    minus_n = b(f"fneg float {n}")
    r = b.fma(minus_n, _c(_EXP_C2), b.fma(minus_n, _c(_EXP_C1), x))
  z = b.fma(r, _c(_EXP_P[0]), _c(_EXP_P[1]))
  for c in _EXP_P[2:] + [_F32(0.5)]:
    z = b.fma(z, r, _c(c))
  z = b(f"fadd float {b.fma(z, b(f'fmul float {r}, {r}'), r)}, {_c(1)}")
  # 2^n from its exponent bits (n = -127: +0.0, XLA's flush); NaN: n = 0
  # (the hardware's conversion gives 0x80000000, whose shift is 0 too).
  n = b.select(b(f"fcmp uno float {n}, 0.0"), "0.0", n)
  n_int = b(f"fptosi float {n} to i32")
  bits = b(f"shl i32 {b(f'add i32 {n_int}, 127')}, 23")
  if not split_scale:
    return b.define(b(f"fmul float {z}, {b(f'bitcast i32 {bits} to float')}"))
  low = b(f"select i1 {b(f'icmp ult i32 {bits}, 2130706432')}, i32 {bits}, i32 2130706432")
  z_bits = b(f"add i32 {b(f'bitcast float {z} to i32')}, {b(f'sub i32 {bits}, {low}')}")
  return b.define(b(f"fmul float {b(f'bitcast i32 {z_bits} to float')}, "
                    f"{b(f'bitcast i32 {low} to float')}"))


# (the two generations' loops; exp_f32 picks the installed XLA's)
_exp_clamped, _exp_split = _exp_ir("xla_expf", False), _exp_ir("xla_expf_split", True)


def exp_f32(x, out=None):
  """XLA's float32 exp, compiled (libm.define): Cephes' polynomial after
  n = floor(x log2(e) + 1/2), every multiply-add an FMA, as XLA's IR has it;
  the generation the installed XLA computes (``exp_generation``)."""
  return (_exp_split if exp_generation() == "split" else _exp_clamped)(x, out=out)


exp_f32.ufunc_like, exp_f32.nin, exp_f32.nout = True, 1, 1


# Inputs where the two generations' bits differ (found by comparing them
# over a dense float32 sweep), and each generation's exp of them (the bits
# its loop gives: tests/test_libm_sweep.py checks they still do), so the
# probe compiles neither loop.
_EXP_PROBE = np.uint32([0x41ECB14D, 0x426D1935, 0x42B0CC81, 0xC1B187E6]).view(_F32)
_EXP_PROBE_BITS = {"split": np.uint32([0x54CDB355, 0x6A36EF9B, 0x7F39428C, 0x2F7D49F3]),
                   "clamped": np.uint32([0x54CDB356, 0x6A36EF9C, 0x7F39428D, 0x2F7D49F2])}
_generation: list = []
_generation_lock = threading.Lock()


def exp_generation() -> str:
  """Which of XLA's exp formulas the installed XLA computes, ``"clamped"``
  (JAX 0.10's) or ``"split"`` (newer): the installed XLA's own exp (jit on
  the CPU) over ``_EXP_PROBE``, compared with both. Once per process,
  remembered on disk with the compiled loops (``libm_cache``; keyed by the
  jaxlib build, so a new jaxlib probes again): a jit costs ~0.1 s of CPU."""
  if not _generation:
    with _generation_lock:
      if not _generation:
        _generation.append(_probe_exp_generation())
  return _generation[0]


def _probe_exp_generation() -> str:
  import jaxlib
  key = libm_cache.key("exp generation", jaxlib.__version__, str(jaxlib.__file__),
                       _EXP_PROBE.tobytes().hex())
  cached = libm_cache.read(key, ".txt")
  if cached in (b"clamped", b"split"):
    return cached.decode()
  want = _xla_exp(_EXP_PROBE)
  if want is None:  # no CPU backend to ask: the newest formula
    return "split"
  for name, bits in _EXP_PROBE_BITS.items():
    if (want.view(np.uint32) == bits).all():
      libm_cache.write(key, name.encode(), ".txt")
      return name
  return "split"  # neither (a newer XLA): the nearer, not cached


def _xla_exp(x):
  """``jax.jit(lax.exp)(x)`` on the CPU, or None where it cannot run. On a
  thread of its own: outside any trace the caller is in (JAX's trace state
  is per thread), and a rule running inside an XLA host callback does not
  wait on XLA's own threads beyond the timeout."""
  result = []

  def run():
    try:
      cpu = jax.devices("cpu")[0]
      result.append(np.asarray(jax.jit(lax.exp)(jax.device_put(x, cpu))))
    except Exception:  # noqa: BLE001 (no CPU backend, ...: the caller's default)
      pass
  thread = threading.Thread(target=run, name="pallas_np-exp-probe", daemon=True)
  thread.start()
  thread.join(60)
  return result[0] if result else None


def _horner(x, coeffs):
  p = np.full(np.shape(x), coeffs[0], _F32)
  for c in coeffs[1:]:
    p = _fma(p, x, c)
  return p


# XLA ElementalIrEmitter::EmitLog1p: the Cephes rational approximation for
# |x| < sqrt(2) - 1; above, XLA's own log(1 + x) (bit-exact both).
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
    large = log_f32(x + _F32(1))
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


# XLA's float32 log (its CPU intrinsic: Cephes' polynomial as in Eigen's
# plog, read from the LLVM IR XLA emits), FMAs where XLA's code has them.
_LOG_P = [_bits_f32(b) for b in (0x3D9021BB, 0xBDEBD1B8, 0x3DEF251A, 0xBDFE5D4F, 0x3E11E9BF,
                                 0xBE2AAE50, 0x3E4CCEAC, 0xBE7FFFFC, 0x3EAAAAAA)]


def _log_ir():
  b = _Ssa("xla_logf", 1)
  x0 = b.args[0]
  tiny = _c(1.17549435e-38)
  x = b.select(b(f"fcmp ogt float {x0}, {tiny}"), x0, tiny)  # NaN -> tiny
  bits = b(f"bitcast float {x} to i32")
  mantissa = b(f"and i32 {bits}, -2139095041")
  m = b(f"bitcast i32 {b(f'or i32 {mantissa}, 1056964608')} to float")  # in [0.5, 1)
  exponent = b(f"lshr i32 {bits}, 23")
  e = b(f"sitofp i32 {b(f'sub i32 {exponent}, 127')} to float")
  e = b(f"fadd float {e}, {_c(1)}")
  small = b(f"fcmp olt float {m}, {_c(_bits_f32(0x3F3504F3))}")  # sqrt(1/2)
  e = b(f"fsub float {e}, {b.select(small, _c(1), '0.0')}")
  x = b(f"fadd float {b(f'fsub float {m}, {_c(1)}')}, {b.select(small, m, '0.0')}")
  x2 = b(f"fmul float {x}, {x}")
  x3 = b(f"fmul float {x2}, {x}")
  p = [_c(v) for v in _LOG_P]
  y = b.fma(b.fma(x, p[0], p[1]), x, p[2])
  y1 = b.fma(b.fma(x, p[3], p[4]), x, p[5])
  y2 = b.fma(b.fma(x, p[6], p[7]), x, p[8])
  y = b.fma(b.fma(b.fma(y, x3, y1), x3, y2), x3, b(f"fmul float {_c(_EXP_C2)}, {e}"))
  r = b.fma(_c(_EXP_C1), e, b(f"fadd float {b.fma(_c(-0.5), x2, x)}, {y}"))
  r = b.select(b(f"fcmp ogt float {x0}, 0.0"), r, "0x7FF8000000000000")
  r = b.select(b(f"fcmp oeq float {x0}, 0.0"), "0xFFF0000000000000", r)
  return b.define(b.select(b(f"fcmp oeq float {x0}, 0x7FF0000000000000"),
                           "0x7FF0000000000000", r))


log_f32 = _log_ir()
log_f32.__doc__ = """XLA's float32 log, compiled (libm.define): Cephes' polynomial as in
Eigen's plog, FMAs where XLA's IR has them; -inf at ±0, NaN below 0."""


_TANH_NUM = [_bits_f32(b) for b in (0xA59F25C0, 0x2A61337E, 0xAEBD37FF, 0x335C0041, 0x3779434A,
                                     0x3A270DED, 0x3BA059DC)]
_TANH_DEN = [_bits_f32(b) for b in (0x35A0D3D8, 0x38F895D6, 0x3B14AA05, 0x3BA059DD)]


def _tanh_ir():
  b = _Ssa("xla_tanhf", 1)
  x0 = b.args[0]
  ax = b(f"call float @llvm.fabs.f32(float {x0})")
  lim = _bits_f32(0x40FFF644)
  x = b.select(b(f"fcmp olt float {x0}, {_c(-lim)}"), _c(-lim), x0)  # NaN stays NaN
  x = b.select(b(f"fcmp ogt float {x}, {_c(lim)}"), _c(lim), x)
  x2 = b(f"fmul float {x}, {x}")
  num = b.fma(x2, _c(_TANH_NUM[0]), _c(_TANH_NUM[1]))
  for c in _TANH_NUM[2:]:
    num = b.fma(x2, num, _c(c))
  den = b.fma(x2, _c(_TANH_DEN[0]), _c(_TANH_DEN[1]))
  for c in _TANH_DEN[2:]:
    den = b.fma(x2, den, _c(c))
  r = b(f"fdiv float {b(f'fmul float {x}, {num}')}, {den}")
  r = b.select(b(f"fcmp olt float {ax}, {_c(0.0004)}"), x0, r)
  one = b(f"call float @llvm.copysign.f32(float {_c(1)}, float {x0})")
  return b.define(b.select(b(f"fcmp oge float {ax}, {_c(20)}"), one, r))


tanh_f32 = _tanh_ir()
tanh_f32.__doc__ = """XLA's float32 tanh, compiled (libm.define): x itself below 4e-4,
±1 from 20 on, else its rational approximation on x clamped to ±7.9988,
every multiply-add an FMA."""


def _asin_acos(is_asin):
  """XLA's asin/acos, expanded before its float normalisation, so in
  bf16/f16 every step is rounded to the dtype (``dt``), with
  root = sqrt((1 - x)(1 + x)): acos(x) = atan2(root, x);
  asin(x) = 2 atan2(x, 1 + root) where JAX lowers asin to ``chlo.asin``
  (JAX 0.10), atan2(x, root) where JAX expands it so itself (JAX 0.12:
  ``asin_expands_to_atan2``); atan2 is the C library's."""
  def fn(x, dt=_F32):
    r = (lambda v: v) if dt == _F32 else (lambda v: np.asarray(v, dt).astype(_F32))
    x = np.asarray(x, _F32)
    one = _F32(1)
    with np.errstate(invalid="ignore"):
      root = r(np.sqrt(r(r(one - x) * r(one + x))))
      if not is_asin:
        return libm.call("atan2f", root, x)
      if asin_expands_to_atan2():
        return libm.call("atan2f", x, root)
      a = r(libm.call("atan2f", x, r(one + root)))
      return a + a
  return fn


_asin_lowering: list = []


def asin_expands_to_atan2() -> bool:
  """Whether JAX lowers float asin itself as atan2(x, sqrt((1-x)(1+x)))
  (JAX 0.12 on CPU) rather than to ``chlo.asin`` (which XLA expands as
  2 atan2(x, 1 + sqrt(...))): read from the installed JAX's lowering of a
  float32 asin (its StableHLO text; no compilation), once per process."""
  if not _asin_lowering:
    text = jax.jit(lax.asin).lower(jax.ShapeDtypeStruct((), np.float32)).as_text()
    _asin_lowering.append("chlo.asin" not in text and "atan2" in text)
  return _asin_lowering[0]


asin_f32, acos_f32 = _asin_acos(True), _asin_acos(False)


def logistic_f32(x, dt=_F32):
  """XLA's logistic: 1 / (1 + exp(-x)), with XLA's exp; in bf16/f16 (an
  expansion before the float normalisation) each step rounded to ``dt``."""
  r = (lambda v: v) if dt == _F32 else (lambda v: np.asarray(v, dt).astype(_F32))
  x = np.asarray(x, _F32)
  one = _F32(1)
  with np.errstate(over="ignore"):
    return one / r(one + r(exp_f32(-x)))


_MINUS_LN2 = _bits_f32(0xBF317218)


def cosh_f32(x):
  """XLA's cosh: exp(x - ln 2) + exp(-ln 2 - x), with XLA's exp."""
  x = np.asarray(x, _F32)
  with np.errstate(over="ignore"):
    return exp_f32(x + _MINUS_LN2) + exp_f32(_MINUS_LN2 - x)


def _f32_rule(f32_fn, fallback):
  """float32 (and bf16/f16/fp8 through float32) use XLA's formula; other
  dtypes (float64) keep ``fallback``."""
  def compile_rule(e):
    dt = np_dtype(e.in_avals[0].dtype)
    if dt == np.float32:
      if getattr(f32_fn, "ufunc_like", False):
        # Allocates its result and takes ``out=`` as a ufunc does, so the
        # compiler may write it into a dying operand (passes.in_place):
        # softmax's exp(x - m) / s reuses one buffer.
        def rule(*xs, out=None):
          return f32_fn(*xs, out=out)[()]
        rule.ufunc_like, rule.nin, rule.nout = True, f32_fn.nin, 1
        return rule
      return lambda *xs: f32_fn(*xs)[()]
    if is_low_precision_float(dt):
      if f32_fn in (asin_f32, acos_f32, logistic_f32):
        return lambda x: f32_fn(x, dt).astype(dt)[()]
      return lambda *xs: f32_fn(*[np.asarray(x, _F32) for x in xs]).astype(dt)[()]
    return fallback(e)
  return compile_rule


def _pow_f32(x, y):
  return libm.call("powf", x, y)


@registry.register(lax.pow_p, batch=registry.ELEMENTWISE)
def _pow(e):
  """Float pow is the C library's powf (float32 and through it bf16/f16);
  an integer exponent is converted to the base's type first (as JAX lowers
  it); integer pow is NumPy's (exact, wrapping)."""
  dt = np_dtype(e.in_avals[0].dtype)
  if dt.kind in "iu":
    return np.power
  if np_dtype(e.in_avals[1].dtype).kind in "iu":
    return _f32_rule(lambda x, y: _pow_f32(x, np.asarray(y, _F32)),
                     binary_float(lambda x, y: np.power(x, y.astype(x.dtype))))(e)
  return _f32_rule(_pow_f32, binary_float(np.power))(e)


# Primitive -> (float32 rule, float64 rule): the float32 rule is XLA's own
# expansion (written out above) or the C library's function XLA calls
# (``libm``); neither depends on NumPy's CPU-dispatched SIMD code.
FLOAT32_RULES = {
    lax.erf_inv_p: (erf_inv_f32, unary_float(scipy_special("erfinv"))),
    lax.log1p_p: (log1p_f32, unary_float(np.log1p)),
    lax.exp_p: (exp_f32, unary_float(np.exp)),
    lax.log_p: (log_f32, unary_float(np.log)),
    lax.tanh_p: (tanh_f32, unary_float(np.tanh)),
    lax.logistic_p: (logistic_f32, unary_float(scipy_special("expit"))),
    lax.cosh_p: (cosh_f32, unary_float(np.cosh)),
    lax.asin_p: (asin_f32, unary_float(np.arcsin)),
    lax.acos_p: (acos_f32, unary_float(np.arccos)),
    lax.sin_p: (libm.unary("sinf"), unary_float(np.sin)),
    lax.cos_p: (libm.unary("cosf"), unary_float(np.cos)),
    lax.tan_p: (libm.unary("tanf"), unary_float(np.tan)),
    lax.atan_p: (libm.unary("atanf"), unary_float(np.arctan)),
    lax.cbrt_p: (libm.unary("cbrtf"), unary_float(np.cbrt)),
    lax.atan2_p: (libm.binary("atan2f"), binary_float(np.arctan2)),
}


_LN2 = 0.6931471805599453  # (a literal: NumPy's float64 log takes a CPU-chosen path)


@registry.register(lax.exp2_p, batch=registry.ELEMENTWISE)
def _exp2(e):
  """XLA expands exp2(x) as exp(x * ln 2), the product rounded to x's
  dtype, then its exp."""
  dt = np_dtype(e.in_avals[0].dtype)
  ln2 = np.asarray(_LN2, dt)
  exp = _f32_rule(exp_f32, unary_float(np.exp))(e)
  return lambda x: exp(np.multiply(x, ln2, dtype=dt))


_LOG2_E = 1.4426950408889634  # XLA lowers log2(x) as log(x) * (1 / ln 2)
if hasattr(lax, "log2_p"):
  @registry.register(lax.log2_p, batch=registry.ELEMENTWISE)
  def _log2(e):
    log = _f32_rule(log_f32, unary_float(np.log))(e)
    dt = np_dtype(e.in_avals[0].dtype)
    scale = np.asarray(_LOG2_E, dt)
    if is_low_precision_float(dt):
      f32 = np.float32
      return lambda x: np.multiply(np.asarray(log(x), f32), np.asarray(scale, f32)).astype(dt)[()]
    return lambda x: np.multiply(log(x), scale)


def register():
  for prim, (f32_fn, fallback) in FLOAT32_RULES.items():
    registry.register(prim, batch=registry.ELEMENTWISE)(_f32_rule(f32_fn, fallback))


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
