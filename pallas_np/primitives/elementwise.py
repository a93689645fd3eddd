"""Elementwise arithmetic, comparison, logic and math with XLA's semantics.

NumPy already matches most lax elementwise ops bit for bit on same-dtype
operands (lax never mixes dtypes), so those register ``np.*`` directly. The
rest are the places NumPy and XLA disagree: integer division/remainder
(truncating, and x/0), shifts wider than the type, rounding, and low
precision floats (bf16/f16/fp8 are computed in float32 and rounded back, as
XLA's CPU backend does), signed zeros (sign, round, clamp, nextafter) and
XLA's rewrite of a division by a constant. Conversions live in ``casts.py``;
transcendentals in ``xla_math.py``/``libm.py`` (XLA's formulas, the C
library as XLA calls it) and ``special.py`` (NumPy/SciPy, a few ulp off).

Every rule here is elementwise with NumPy broadcasting, registered with
``batch=registry.ELEMENTWISE``: a vectorized grid runs it on lane-stacked
operands as is.
"""
from __future__ import annotations

import math

import numpy as np

from jax import lax

from pallas_np import _compat as jc
from pallas_np import batching, registry
from pallas_np.dtypes import has_negative_zero, is_low_precision_float, np_dtype



def reg(prim, fn):
  """A NumPy ufunc that is the whole rule, elementwise."""
  registry.register_numpy(prim, fn, batch=registry.ELEMENTWISE)


def _in_dtype(e):
  return np_dtype(e.in_avals[0].dtype)


def _out_dtype(e):
  return np_dtype(e.out_aval.dtype)


def unary_float(fn):
  """A float unary rule: low-precision floats go through float32; the result
  keeps the operand dtype."""
  def compile_rule(e):
    dt = _in_dtype(e)
    if is_low_precision_float(dt):
      return lambda x: np.asarray(fn(np.asarray(x, np.float32)), dtype=dt)[()]
    if _keeps_dtype(fn, dt, 1):
      return fn
    return lambda x: _cast(fn(x), dt)
  return compile_rule


def binary_float(fn):
  """``unary_float`` for binary rules."""
  def compile_rule(e):
    dt = _in_dtype(e)
    if is_low_precision_float(dt):
      f32 = np.float32
      return lambda x, y: np.asarray(fn(np.asarray(x, f32), np.asarray(y, f32)), dtype=dt)[()]
    if _keeps_dtype(fn, dt, 2):
      return fn
    return lambda x, y: _cast(fn(x, y), dt)
  return compile_rule


def _keeps_dtype(fn, dt, nin) -> bool:
  """``fn`` is a NumPy ufunc whose loop for ``dt`` operands returns ``dt``:
  the rule is then the ufunc itself (no cast wrapper; the evaluator may also
  let it write into a dying operand, see ``compiler.passes.in_place``)."""
  if not isinstance(fn, np.ufunc) or fn.nin != nin or fn.nout != 1:
    return False
  try:
    return fn.resolve_dtypes((dt,) * nin + (None,))[-1] == dt
  except (TypeError, ValueError):  # no loop for dt (e.g. complex)
    return False


def _cast(x, dt):
  if getattr(x, "dtype", None) == dt:
    return x
  return np.asarray(x, dtype=dt)[()]


def _native_or_f32(np_fn):
  """NumPy ufuncs that ml_dtypes implements natively for bf16 keep their dtype;
  others are evaluated in float32 for low-precision inputs."""
  return unary_float(np_fn)


# -- arithmetic ---------------------------------------------------------------
for _p, _f in [(lax.add_p, np.add), (lax.sub_p, np.subtract), (lax.mul_p, np.multiply),
               (lax.and_p, np.bitwise_and), (lax.or_p, np.bitwise_or),
               (lax.xor_p, np.bitwise_xor), (lax.not_p, np.invert),
               (lax.eq_p, np.equal), (lax.ne_p, np.not_equal), (lax.lt_p, np.less),
               (lax.le_p, np.less_equal), (lax.gt_p, np.greater),
               (lax.ge_p, np.greater_equal), (lax.neg_p, np.negative),
               (lax.is_finite_p, np.isfinite)]:
  reg(_p, _f)


@registry.register(lax.nextafter_p, batch=registry.ELEMENTWISE)
def _nextafter(e):
  # C's nextafter (XLA's) returns y when x == y, so nextafter(-0.0, +0.0) is
  # +0.0; NumPy's float16 loop returns x there (float32/bf16 return y).
  if _in_dtype(e) != np.float16:
    return np.nextafter
  return lambda x, y: np.where(x == y, y, np.nextafter(x, y))[()]


def _minmax(ufunc, is_max):
  def compile_rule(e):
    dt = _in_dtype(e)
    if dt.kind not in "fV" and not is_low_precision_float(dt):
      return ufunc
    # XLA: NaN propagates (as np.maximum) and +0.0 > -0.0; NumPy returns
    # either zero. x + y of two zeros is the XLA max; -(-x + -y) the min.
    if is_max:
      exact = lambda x, y: _fix_zero(ufunc(x, y), x, y, lambda a, b: a + b)
    else:
      exact = lambda x, y: _fix_zero(ufunc(x, y), x, y, lambda a, b: -((-a) + (-b)))
    # The zero check costs about as much as the max itself; the evaluator
    # skips it when it has proven the operands zero-free (sorting networks).
    return registry.const_specialised(registry.zero_sensitive(exact, ufunc),
                                      lambda consts: _minmax_given(ufunc, is_max, consts))
  return compile_rule


def _minmax_given(ufunc, is_max, consts):
  """Exact max/min against a uniform constant, without the zero check: a
  nonzero constant never ties with a zero, so NumPy's result is XLA's; and
  max(x, +0.0) (a ReLU) is NumPy's result plus +0.0, which turns the only
  wrong zero, -0.0, into +0.0 and changes nothing else (NaN stays NaN)."""
  known = [c for c in consts if c is not None]
  if len(known) != 1:
    return None
  c = np.asarray(known[0])
  if c.size == 0:
    return None
  v = c.flat[0]
  if not (np.all(c == v) or np.all(np.isnan(c))):
    return None
  if v != 0:  # also NaN: propagates either way
    return ufunc
  if is_max and not np.signbit(v):
    zero = c.dtype.type(0)

    def relu(x, y):
      r = ufunc(x, y)
      if isinstance(r, np.ndarray) and r.flags.writeable:
        return np.add(r, zero, out=r)
      return r + zero
    return relu
  return None


def _fix_zero(r, x, y, combine):
  if r.all() or not (has_negative_zero(x) or has_negative_zero(y)):
    return r  # no zero result, or every zero is +0.0 already
  both = (r == 0) & (np.asarray(x) == 0) & (np.asarray(y) == 0)
  return np.where(both, combine(x, y), r).astype(r.dtype, copy=False)[()]


registry.register(lax.max_p, batch=registry.ELEMENTWISE, data_movement=True)(
    _minmax(np.maximum, True))
registry.register(lax.min_p, batch=registry.ELEMENTWISE, data_movement=True)(
    _minmax(np.minimum, False))


@registry.register(lax.abs_p, batch=registry.ELEMENTWISE)
def _abs(e):
  dt = _in_dtype(e)
  if dt.kind == "c":
    out = _out_dtype(e)
    return lambda x: np.abs(x).astype(out)
  return np.abs


@registry.register(lax.sign_p, batch=registry.ELEMENTWISE)
def _sign(e):
  dt = _in_dtype(e)
  if dt.kind == "u":
    return lambda x: (x != 0).astype(dt)
  if dt.kind == "i":
    return np.sign
  # XLA: sign(±0.0) is the zero itself, NaN stays NaN; np.sign gives +0.0
  # for both zeros. The sign copied back fixes -0.0 and changes nothing else.
  return unary_float(_float_sign)(e)


def _float_sign(x):
  return np.copysign(np.sign(x), x)


@registry.register(lax.div_p, batch=registry.ELEMENTWISE)
def _div(e):
  dt = _in_dtype(e)
  if dt.kind in "iu":
    minus_one = np.array(-1).astype(dt) if dt.kind == "i" else np.array(np.iinfo(dt).max, dt)
    one = np.ones((), dt)

    def int_div(x, y):
      # XLA: truncate toward zero; x / 0 is -1 (all ones for unsigned).
      if y.all():  # (one pass) no zero divisor: the exact truncation alone
        return _trunc_div(x, y)
      zero = y == 0
      y_safe = np.where(zero, one, y)
      return np.where(zero, minus_one, _trunc_div(x, y_safe)).astype(dt, copy=False)[()]
    return registry.const_specialised(int_div, lambda consts: _int_by_const(_trunc_div, consts))
  div = binary_float(np.true_divide)(e)
  if dt not in RECIPROCAL_DTYPES:
    return div
  return registry.const_specialised(div, lambda consts: _float_by_const(consts, dt))


# Where XLA's CPU backend divides by a constant as a multiplication by its
# reciprocal rounded to the dtype (measured: float32 and float16; bf16
# divisions are indistinguishable from a true division in float32 there).
RECIPROCAL_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


def float_reciprocal(c, dt):
  """``1 / c`` rounded to ``dt`` (XLA's InvertConstant, computed in ``dt``)."""
  with np.errstate(divide="ignore"):
    return (np.ones((), dt) / np.asarray(c, dt)).astype(dt)


def _float_by_const(consts, dt):
  """XLA's algebraic simplifier rewrites ``x / c`` for a constant (or
  broadcast constant) ``c`` and non-constant ``x`` as ``x * (1 / c)``, the
  reciprocal rounded to the dtype: up to 1 ulp from a true division on most
  elements (``x / 3.0``). Constants meet constants in constant folding
  (a true division), as in XLA."""
  x, y = consts
  if y is None or x is not None:
    return None
  recip = float_reciprocal(y, dt)
  if dt == np.float16:
    f32 = np.float32
    return lambda x, y: np.multiply(np.asarray(x, f32), np.asarray(recip, f32)).astype(dt)[()]
  return lambda x, y: np.multiply(x, recip)


def _trunc_div(x, y):
  """XLA's integer division for nonzero ``y``: truncation toward zero.
  ``x - fmod(x, y)`` is an exact multiple of ``y`` (it never overflows: the
  remainder has the sign of ``x`` and a smaller magnitude), and flooring an
  exact quotient truncates; INT_MIN / -1 wraps to INT_MIN, as in XLA."""
  return np.floor_divide(np.subtract(x, np.fmod(x, y)), y)


def _int_by_const(op, consts):
  """``op`` alone when the divisor is a constant without zeros (asked at
  compile time): no zero handling is needed (div and rem)."""
  x, y = consts
  if y is None or x is not None or not np.all(y):
    return None
  return op


@registry.register(lax.rem_p, batch=registry.ELEMENTWISE)
def _rem(e):
  dt = _in_dtype(e)
  if dt.kind in "iu":
    one = np.ones((), dt)

    def int_rem(x, y):
      # XLA: the remainder takes the dividend's sign (C's %, NumPy's fmod);
      # x % 0 is x.
      if y.all():  # (one pass) no zero divisor
        return np.fmod(x, y)
      zero = y == 0
      y_safe = np.where(zero, one, y)
      return np.where(zero, x, np.fmod(x, y_safe)).astype(dt, copy=False)[()]
    return registry.const_specialised(int_rem, lambda consts: _int_by_const(np.fmod, consts))
  return binary_float(np.fmod)(e)


@registry.register(lax.integer_pow_p, batch=registry.ELEMENTWISE)
def _integer_pow(e):
  y = int(e.params["y"])
  dt = _in_dtype(e)
  low = is_low_precision_float(dt)

  def mul(a, b):
    # bf16/f16: each product of the chain rounded to the dtype (XLA
    # normalises every multiply of the lowered chain on its own).
    return np.asarray(a * b, dt).astype(np.float32) if low else a * b

  def ipow(x):
    # Same multiplication chain as JAX's lowering (repeated squaring).
    if low:
      x = np.asarray(x, np.float32)
    if y == 0:
      return np.ones(np.shape(x), dt)[()]
    n = -y if y < 0 else y
    acc = None
    base = x
    while n > 0:
      if n & 1:
        acc = base if acc is None else mul(acc, base)
      n >>= 1
      if n > 0:
        base = mul(base, base)
    if y < 0:
      acc = np.asarray(1, acc.dtype) / acc
    return _cast(acc, dt)
  return ipow


@registry.register(lax.square_p, batch=registry.ELEMENTWISE)
def _square(e):
  return unary_float(np.square)(e) if is_low_precision_float(_in_dtype(e)) else np.square


# (the transcendentals NumPy/SciPy compute: special.py; XLA's formulas and
# the C library: xla_math.py, libm.py)


# -- primitives of newer JAX versions (registered where they exist) -----------
# (log2: xla_math.py)
_one_minus_square_p = getattr(jc.lax_internal, "one_minus_square_p", None)
if _one_minus_square_p is not None:
  @registry.register(_one_minus_square_p, batch=registry.ELEMENTWISE)
  def _one_minus_square(e):
    # XLA: (1 + x) * (1 - x), each op rounded to x's dtype.
    dt = _in_dtype(e)
    work = np.float32 if is_low_precision_float(dt) else dt

    def one_minus_square(x):
      x = np.asarray(x, work)
      one = np.ones((), work)
      if is_low_precision_float(dt):
        a, b = _cast(one + x, dt), _cast(one - x, dt)
        return _cast(np.asarray(a, work) * np.asarray(b, work), dt)
      with np.errstate(over="ignore"):
        return (one + x) * (one - x)
    return one_minus_square


@registry.register(lax.round_p, batch=registry.ELEMENTWISE)
def _round(e):
  method = e.params.get("rounding_method")
  to_even = int(method) == int(lax.RoundingMethod.TO_NEAREST_EVEN)
  if to_even:
    return unary_float(np.rint)(e)
  return unary_float(_round_away_from_zero)(e)


def _round_away_from_zero(x):
  t = np.trunc(x)
  frac = np.abs(x - t)  # exact in floating point
  # x's sign copied back: -0.0 and (-0.5, 0] round to -0.0, as in XLA
  # (t + 0 * ... would make -0.0 of them +0.0).
  return np.copysign(t + np.sign(x) * (frac >= 0.5), x)


# -- comparisons/logic on bool ------------------------------------------------
def _select_n_batched(bc, rule, info, in_batched):
  if len(in_batched) == 2:  # select_n with one case returns it as is
    return (lambda p, c: c), False, (in_batched[1],)
  return batching.elementwise(bc, rule, info, in_batched)


def _select_of_bits(dt):
  """``specialise`` of a select whose predicate has the result's shape:
  between uniform constants 0 and 1 of an integer or bool type
  (``jnp.where(done, 0, 1)``), the predicate itself converted (~0.5-0.9 us
  against np.where's ~1.35 us)."""
  if dt.kind not in "biu":
    return lambda consts: None
  logical_not = np.logical_not

  def specialise(consts):
    _, c0, c1 = consts
    bits = []
    for c in (c0, c1):
      if c is None:
        return None
      flat = np.ravel(c)
      if flat.size == 0 or not (flat == flat[0]).all() or flat[0] not in (0, 1):
        return None
      bits.append(int(flat[0]))
    if bits == [0, 1]:
      return lambda p, c0, c1: p.astype(dt)
    if bits == [1, 0]:
      return lambda p, c0, c1: logical_not(p).astype(dt)
    return None
  return specialise


# Largest result (elements) a select writes into its dying operand: a masked
# copy costs less than np.where's allocation only on small blocks; from ~512
# elements on it is slower (2-3x at 4096 with a random mask: branches).
SELECT_INTO_MAX = 256


def _select_into_c0(p, c0, c1):
  np.copyto(c0, c1, where=p)
  return c0


def _select_into(k):
  """A two-way select writing into its dying case-0 operand
  (``passes.in_place``): one masked copy (~0.65 us on a small block)
  instead of ``np.where``'s fresh array (~1.35 us); None for other
  operands (writing into case 1 needs ``~p`` first, no faster). NumPy's
  copyto buffers an overlapping source. A select called with ``out=``
  (``passes.into_refs``) ignores it: the store then copies."""
  return _select_into_c0 if k == 1 else None


@registry.register(lax.select_n_p, batch=_select_n_batched, data_movement=True)
def _select_n(e):
  n_cases = len(e.in_avals) - 1
  pred_dt = np_dtype(e.in_avals[0].dtype)
  if n_cases == 1:
    return lambda p, c: c
  if n_cases == 2 and pred_dt == np.bool_:
    def select(p, c0, c1, out=None):
      return np.where(p, c1, c0)  # (``out``: see _select_into)
    # 0-d operands, no lane axis (compiler._scalar_form): no np.where call
    # (a reducer body of 0-d avals may run on arrays: then np.where)
    select.scalar_form = lambda p, c0, c1: (
        (c1 if p else c0) if p.__class__ is np.bool_ else np.where(p, c1, c0))
    if not e.compiler.batched and math.prod(e.out_avals[0].shape) <= SELECT_INTO_MAX:
      select.into_operand = _select_into
    if tuple(e.in_avals[0].shape) == tuple(e.out_avals[0].shape):
      registry.const_specialised(select, _select_of_bits(np_dtype(e.out_avals[0].dtype)))
    return select
  if n_cases == 2:
    return lambda p, c0, c1: np.where(p != 0, c1, c0)

  def select(p, *cases):
    shape = np.broadcast_shapes(np.shape(p), *[np.shape(c) for c in cases])
    return np.choose(np.asarray(p, np.int32), [np.broadcast_to(c, shape) for c in cases])
  return select


@registry.register(lax.clamp_p, batch=registry.ELEMENTWISE)
def _clamp(e):
  # XLA: min(max(x, lo), hi) with its max/min (+0.0 above -0.0, NaN
  # propagates), so clamp(-0.0, -0.0, +0.0) is -0.0 where NumPy's pair
  # may return either zero.
  dt = _in_dtype(e)
  if dt.kind in "iub":
    return lambda lo, x, hi: np.minimum(np.maximum(x, lo), hi)
  return lambda lo, x, hi: _exact_min(_exact_max(x, lo), hi)


def _exact_max(x, y):
  return _fix_zero(np.maximum(x, y), x, y, lambda a, b: a + b)


def _exact_min(x, y):
  return _fix_zero(np.minimum(x, y), x, y, lambda a, b: -((-a) + (-b)))


# -- shifts (XLA defines over-wide shifts) -----------------------------------
def _shift(kind):
  def compile_rule(e):
    dt = _in_dtype(e)
    bits = dt.itemsize * 8
    if kind == "left":
      def f(x, s):
        ok = (s >= 0) & (s < bits) if dt.kind == "i" else s < bits
        return np.where(ok, np.left_shift(x, np.where(ok, s, 0).astype(dt)), np.zeros((), dt))[()]
    elif kind == "logical":
      udt = np.dtype(f"uint{bits}")
      def f(x, s):
        ok = (s >= 0) & (s < bits) if dt.kind == "i" else s < bits
        ux = np.asarray(x).view(udt) if np.ndim(x) else np.asarray(x, dt).view(udt)
        r = np.right_shift(ux, np.where(ok, s, 0).astype(udt))
        return np.where(ok, r.view(dt) if np.ndim(r) else np.asarray(r).view(dt), np.zeros((), dt))[()]
    else:  # arithmetic: sign-extends the bit pattern, unsigned types too
      sdt = np.dtype(f"int{bits}")
      def f(x, s):
        ok = (s >= 0) & (s < bits) if dt.kind == "i" else s < bits
        s_eff = np.where(ok, s, bits - 1).astype(sdt)
        sx = np.asarray(x).view(sdt) if dt != sdt else x
        r = np.asarray(np.right_shift(sx, s_eff))
        return (r.view(dt) if dt != sdt else r)[()]
    f.scalar_form = _scalar_shift(kind, dt, f)
    return f
  return compile_rule


def _scalar_shift(kind, dt, exact):
  """A shift of NumPy scalars by an in-range amount as NumPy's scalar
  operator (a left shift, a logical right shift of an unsigned type, an
  arithmetic one of a signed type: the bits XLA defines); anything else,
  arrays included, takes the exact rule (compiler._scalar_form)."""
  bits = dt.itemsize * 8
  scalar = dt.type
  if kind == "left":
    return lambda x, s: (x << s if x.__class__ is scalar and s.__class__ is scalar
                         and 0 <= s < bits else exact(x, s))
  if (kind == "logical") != (dt.kind == "u"):
    return None
  return lambda x, s: (x >> s if x.__class__ is scalar and s.__class__ is scalar
                       and 0 <= s < bits else exact(x, s))


registry.register(lax.shift_left_p, batch=registry.ELEMENTWISE)(_shift("left"))
registry.register(lax.shift_right_logical_p, batch=registry.ELEMENTWISE)(_shift("logical"))
registry.register(lax.shift_right_arithmetic_p, batch=registry.ELEMENTWISE)(_shift("arithmetic"))


@registry.register(lax.population_count_p, batch=registry.ELEMENTWISE)
def _popcount(e):
  dt = _in_dtype(e)
  # np.bitwise_count counts |x| for signed ints; XLA counts the bit pattern.
  udt = np.dtype(f"uint{dt.itemsize * 8}")
  return lambda x: np.bitwise_count(np.asarray(x).view(udt)).astype(dt)[()]


@registry.register(lax.clz_p, batch=registry.ELEMENTWISE)
def _clz(e):
  dt = _in_dtype(e)
  bits = dt.itemsize * 8
  udt = np.dtype(f"uint{bits}")

  def clz(x):
    ux = np.asarray(x, dt).view(udt)
    n = np.zeros(ux.shape, np.int64)
    v = ux.astype(np.uint64)
    # position of the highest set bit via float log2 is inexact; use shifts.
    width = np.full(ux.shape, bits, np.int64)
    for shift in (32, 16, 8, 4, 2, 1):
      if shift >= bits:
        continue
      mask = v >> np.uint64(shift)
      has = mask != 0
      n = np.where(has, n + shift, n)
      v = np.where(has, mask, v)
    result = np.where(ux == 0, width, bits - 1 - n)
    return result.astype(dt)[()]
  return clz


# -- complex ------------------------------------------------------------------
@registry.register(lax.real_p, batch=registry.ELEMENTWISE)
def _real(e):
  out = _out_dtype(e)
  return lambda x: np.real(x).astype(out)[()]


@registry.register(lax.imag_p, batch=registry.ELEMENTWISE)
def _imag(e):
  out = _out_dtype(e)
  return lambda x: np.imag(x).astype(out)[()]


@registry.register(lax.complex_p, batch=registry.ELEMENTWISE)
def _complex(e):
  out = _out_dtype(e)
  return lambda x, y: (np.asarray(x) + 1j * np.asarray(y)).astype(out)[()]


@registry.register(lax.conj_p, batch=registry.ELEMENTWISE)
def _conj(e):
  out = _out_dtype(e)
  return lambda x, **_: np.conj(x).astype(out)[()]


# -- mulhi: the upper N bits of the 2N-bit product ------------------------------
def _mulhi_u64(x, y):
  """Upper 64 bits of the 128-bit product of uint64s, from 32-bit halves."""
  lo32 = np.uint64(0xFFFFFFFF)
  s32 = np.uint64(32)
  x_lo, x_hi, y_lo, y_hi = x & lo32, x >> s32, y & lo32, y >> s32
  ll, lh, hl, hh = x_lo * y_lo, x_lo * y_hi, x_hi * y_lo, x_hi * y_hi
  mid = (ll >> s32) + (lh & lo32) + (hl & lo32)
  return hh + (lh >> s32) + (hl >> s32) + (mid >> s32)


if hasattr(jc.lax_internal, "mulhi_p"):
  @registry.register(jc.lax_internal.mulhi_p, batch=registry.ELEMENTWISE)
  def _mulhi(e):
    dt = _in_dtype(e)
    bits = dt.itemsize * 8
    signed = dt.kind == "i"
    if bits <= 32:
      wide = np.int64 if signed else np.uint64
      return lambda x, y: ((np.asarray(x, wide) * np.asarray(y, wide)) >> bits).astype(dt)[()]

    def mulhi64(x, y):
      xu, yu = np.asarray(x).view(np.uint64), np.asarray(y).view(np.uint64)
      hi = _mulhi_u64(xu, yu)
      if signed:  # two's complement: subtract y where x < 0 and x where y < 0
        hi = hi - np.where(np.asarray(x) < 0, yu, np.uint64(0)) \
                - np.where(np.asarray(y) < 0, xu, np.uint64(0))
      return np.asarray(hi).view(dt)[()]
    return mulhi64
