"""Elementwise coverage: numpy mode vs interpret=True, many ops per kernel
(one XLA compile each). Integer results bit-exact; floats within a few ulp."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from tests.kernel_fn import both

rng = np.random.default_rng(0)


def ulp_close(got, want, ulps, floor=1e-30):
  got = np.asarray(got)
  want = np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape
  if got.dtype.kind in "biu":
    np.testing.assert_array_equal(got, want)
    return
  eps = float(np.finfo(got.dtype).eps) if got.dtype != ml_dtypes.bfloat16 else 2.0 ** -7
  g = got.astype(np.float64)
  w = want.astype(np.float64)
  same_nan = np.isnan(g) == np.isnan(w)
  assert same_nan.all(), f"NaN mismatch at {np.argwhere(~same_nan)[:5]}"
  ok = np.isnan(w) | (g == w) | (np.abs(g - w) <= ulps * eps * np.maximum(np.abs(w), floor)) \
      | (np.abs(g - w) < 1e-30)
  assert ok.all(), f"max rel err {np.max(np.abs(g - w)[~ok] / np.abs(w)[~ok])} at {np.argwhere(~ok)[:5].tolist()}"


UNARY = {
    "exp": jnp.exp, "exp2": jnp.exp2, "log": jnp.log, "log1p": jnp.log1p, "expm1": jnp.expm1,
    "tanh": jnp.tanh, "logistic": jax.nn.sigmoid, "sin": jnp.sin, "cos": jnp.cos, "tan": jnp.tan,
    "asin": jnp.arcsin, "acos": jnp.arccos, "atan": jnp.arctan, "sinh": jnp.sinh,
    "cosh": jnp.cosh, "asinh": jnp.arcsinh, "acosh": jnp.arccosh, "atanh": jnp.arctanh,
    "sqrt": jnp.sqrt, "rsqrt": lax.rsqrt, "cbrt": jnp.cbrt, "square": jnp.square,
    "erf": lax.erf, "erfc": lax.erfc, "erf_inv": lax.erf_inv, "lgamma": lax.lgamma,
    "digamma": lax.digamma, "floor": jnp.floor, "ceil": jnp.ceil, "sign": jnp.sign,
    "abs": jnp.abs, "neg": jnp.negative, "round_even": lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN),
    "round_away": lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO),
    "is_finite": jnp.isfinite, "ipow3": lambda x: lax.integer_pow(x, 3),
    "ipow_m2": lambda x: lax.integer_pow(x, -2), "reciprocal": lambda x: 1 / x,
}
# ulps allowed per op for float32 (XLA's CPU math library vs NumPy/SciPy).
LOOSE = {"lgamma": 64, "digamma": 64, "erf_inv": 16, "tan": 8, "acosh": 8, "atanh": 8,
         "asinh": 8, "expm1": 8, "log1p": 8, "cosh": 8, "sinh": 8, "exp2": 8, "erfc": 32,
         "tanh": 8, "logistic": 8, "cbrt": 8, "exp": 4, "asin": 8, "acos": 8}


def _float_inputs(dtype, n=256):
  x = rng.standard_normal(n).astype(np.float32) * 3
  specials = np.array([0.0, -0.0, 0.5, -0.5, 1.5, 2.5, -2.5, 1.0, -1.0, np.inf, -np.inf,
                       np.nan, 1e-3, 0.999, 1.0001, 10.0], np.float32)
  x[:len(specials)] = specials
  return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_unary_float_math(dtype):
  x = _float_inputs(dtype)
  names = list(UNARY)
  got, want = both(lambda v: [UNARY[n](v) for n in names], x)
  low = dtype != np.float32
  errors = []
  for n, g, w in zip(names, got, want):
    try:
      ulp_close(g, w, 2 if low else LOOSE.get(n, 2),
                floor=1.0 if n in ("lgamma", "digamma") else 1e-30)
    except AssertionError as err:
      errors.append(f"{n} ({np.dtype(dtype).name}): {err}")
  assert not errors, "\n".join(errors)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_binary_float_math(dtype):
  x = _float_inputs(dtype)
  y = np.roll(_float_inputs(dtype), 7)
  y[:4] = np.array([np.nan, 0.0, -0.0, 2.0], np.float32).astype(dtype)
  ops = {
      "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "div": jnp.divide,
      "rem": lax.rem, "pow": lax.pow, "atan2": jnp.arctan2, "max": lax.max, "min": lax.min,
      "nextafter": jnp.nextafter, "eq": jnp.equal, "lt": jnp.less, "ge": jnp.greater_equal,
      "clamp": lambda a, b: lax.clamp(np.array(-1, a.dtype), a, b),
      "select": lambda a, b: jnp.where(a > b, a, b),
  }
  names = list(ops)
  got, want = both(lambda a, b: [ops[n](a, b) for n in names], x, y)
  for n, g, w in zip(names, got, want):
    try:
      ulp_close(g, w, 2 if dtype != np.float32 else 8)
    except AssertionError as err:
      raise AssertionError(f"{n} ({np.dtype(dtype).name}): {err}") from None


def test_max_min_nan_semantics():
  x = np.array([np.nan, 1.0, -np.inf, 0.0, -0.0, np.nan], np.float32)
  y = np.array([1.0, np.nan, np.nan, -0.0, 0.0, np.nan], np.float32)
  got, want = both(lambda a, b: [lax.max(a, b), lax.min(a, b), jnp.maximum(a, b),
                                 jnp.fmax(a, b), jnp.nanmax(jnp.stack([a, b]), axis=0)], x, y)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g.view(np.uint32)[~np.isnan(w)], w.view(np.uint32)[~np.isnan(w)])
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))


def test_special_functions():
  a = np.abs(rng.standard_normal(64)).astype(np.float32) * 3 + 0.1
  x = np.abs(rng.standard_normal(64)).astype(np.float32) * 2 + 0.05
  b = np.abs(rng.standard_normal(64)).astype(np.float32) * 2 + 0.5
  u = rng.uniform(0.01, 0.99, 64).astype(np.float32)
  got, want = both(lambda a, x, b, u: [lax.igamma(a, x), lax.igammac(a, x),
                                       lax.zeta(a + 1.5, x), lax.polygamma(jnp.ones_like(x), x),
                                       lax.betainc(a, b, u), lax.bessel_i0e(x), lax.bessel_i1e(x)],
                   a, x, b, u)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-6)


INT_DTYPES = [np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32]


def _int_inputs(dtype, n=128):
  info = np.iinfo(dtype)
  x = rng.integers(0, 2 ** 64, n, dtype=np.uint64).astype(dtype)
  specials = [0, 1, 2, 3, 7, info.max, info.min, info.max - 1]
  if info.min < 0:
    specials += [-1, -2, -7, info.min + 1]
  x[:len(specials)] = np.array(specials).astype(dtype)
  return x


def _int_ops(dtype):
  bits = np.iinfo(dtype).bits
  return {
      "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "div": lax.div,
      "rem": lax.rem, "max": lax.max, "min": lax.min, "and": jnp.bitwise_and,
      "or": jnp.bitwise_or, "xor": jnp.bitwise_xor, "not": lambda a, b: ~a,
      "neg": lambda a, b: -a, "abs": lambda a, b: lax.abs(a) if np.dtype(dtype).kind == "i" else a,
      "sign": lambda a, b: lax.sign(a), "popcnt": lambda a, b: lax.population_count(a),
      "clz": lambda a, b: lax.clz(a), "mulhi": lambda a, b: lax.mulhi(a, b),
      "shl": lambda a, b: lax.shift_left(a, b % (2 * bits)),
      "shr_l": lambda a, b: lax.shift_right_logical(a, b % (2 * bits)),
      "shr_a": lambda a, b: lax.shift_right_arithmetic(a, b % (2 * bits)),
      "shl_raw": lax.shift_left, "shr_l_raw": lax.shift_right_logical,
      "shr_a_raw": lax.shift_right_arithmetic,
      "ipow": lambda a, b: lax.integer_pow(a, 3),
      "eq": jnp.equal, "lt": jnp.less, "clamp": lambda a, b: lax.clamp(jnp.minimum(a, b), a, jnp.maximum(a, b)),
  }


def _check_int_ops(dtype):
  x = _int_inputs(dtype)
  y = np.roll(_int_inputs(dtype), 5)
  y[:3] = np.array([0, 0, 1]).astype(dtype)
  ops = _int_ops(dtype)
  names = list(ops)
  got, want = both(lambda a, b: [ops[n](a, b) for n in names], x, y)
  for n, g, w in zip(names, got, want):
    assert g.dtype == w.dtype, n
    np.testing.assert_array_equal(g, w, err_msg=n)


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_integer_ops_bit_exact(dtype):
  _check_int_ops(dtype)


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_integer_ops_64bit(dtype):
  with jax.enable_x64(True):
    _check_int_ops(dtype)


ALL_DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32,
              np.float16, ml_dtypes.bfloat16, np.float32, ml_dtypes.float8_e4m3fn,
              ml_dtypes.float8_e5m2]


@pytest.mark.parametrize("src", [np.float32, ml_dtypes.bfloat16, np.float16, np.int32,
                                 np.uint8, np.bool_, ml_dtypes.float8_e4m3fn])
def test_convert_element_type_matrix(src):
  if np.dtype(src).kind == "f" or np.dtype(src) in (np.dtype(ml_dtypes.bfloat16),
                                                    np.dtype(ml_dtypes.float8_e4m3fn)):
    x = np.array([0.0, -0.0, 0.4, 0.5, 0.6, -0.5, -1.7, 1.5, 2.5, 127.9, 128.0, 255.5, 256.0,
                  -129.0, 3e4, -3e4, 65504, 1e9, -1e9, 3e9, 5e9, np.inf, -np.inf, np.nan,
                  2.0 ** 31, -2.0 ** 31, 1e-8, 448, -448, 500], np.float32).astype(src)
  elif np.dtype(src) == np.bool_:
    x = np.array([True, False, True])
  else:
    x = _int_inputs(src, 64)
  dsts = ALL_DTYPES
  got, want = both(lambda v: [lax.convert_element_type(v, d) for d in dsts], x)
  for d, g, w in zip(dsts, got, want):
    assert g.dtype == w.dtype
    gv = np.asarray(g)
    if gv.dtype.kind in "biu":
      np.testing.assert_array_equal(gv, w, err_msg=f"{np.dtype(src).name}->{np.dtype(d).name}")
    else:  # bit-exact floats (rounding + NaN) after the conversion
      np.testing.assert_array_equal(np.isnan(gv.astype(np.float32)), np.isnan(w.astype(np.float32)))
      m = ~np.isnan(w.astype(np.float32))
      np.testing.assert_array_equal(gv.astype(np.float32)[m], w.astype(np.float32)[m],
                                    err_msg=f"{np.dtype(src).name}->{np.dtype(d).name}")


def test_convert_64bit():
  with jax.enable_x64(True):
    x = np.array([0.0, -1.5, 2.5, 1e19, -1e19, 9.3e18, np.nan, np.inf, -np.inf, 2.0 ** 63,
                  2.0 ** 64, -2.0 ** 63, 4e9], np.float64)
    dsts = [np.int64, np.uint64, np.int32, np.uint32, np.float32, np.float16]
    got, want = both(lambda v: [lax.convert_element_type(v, d) for d in dsts], x)
    for d, g, w in zip(dsts, got, want):
      np.testing.assert_array_equal(g, w, err_msg=np.dtype(d).name)


def test_bitcast_convert_type():
  x = rng.standard_normal((4, 8)).astype(np.float32)
  got, want = both(lambda v: [lax.bitcast_convert_type(v, jnp.int32),
                              lax.bitcast_convert_type(v, jnp.uint8),
                              lax.bitcast_convert_type(v, jnp.bfloat16),
                              lax.bitcast_convert_type(lax.bitcast_convert_type(v, jnp.uint16),
                                                       jnp.float32),
                              lax.bitcast_convert_type(v.astype(jnp.bfloat16), jnp.int16)], x)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))


def test_reduce_precision_and_complex():
  x = _float_inputs(np.float32, 64)
  got, want = both(lambda v: [lax.reduce_precision(v, 5, 10), lax.reduce_precision(v, 8, 7),
                              lax.reduce_precision(v, 4, 3)], x)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    np.testing.assert_array_equal(g[~np.isnan(w)], w[~np.isnan(w)])
  re = rng.standard_normal(16).astype(np.float32)
  im = rng.standard_normal(16).astype(np.float32)
  got, want = both(lambda a, b: [jnp.real(lax.complex(a, b) * lax.complex(b, a)),
                                 jnp.imag(jnp.conj(lax.complex(a, b))),
                                 jnp.abs(lax.complex(a, b))], re, im)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def _exchange_network(a, b):
  """Compare-exchanges through reshapes, slices, flips and concatenates (a
  sorting network's shape), then max/min against a literal zero and against
  values computed mid-kernel."""
  x = jnp.concatenate([a, b], axis=0)
  for _ in range(3):
    y = x.reshape(x.shape[0] // 2, 2, x.shape[1])
    lo, hi = jnp.minimum(y[:, 0], y[:, 1]), jnp.maximum(y[:, 0], y[:, 1])
    x = jnp.concatenate([lo, jnp.flip(hi, 0)], 0)
  z = x * 0.0
  return x, jnp.maximum(x, 0.0), jnp.minimum(x, -0.0), jnp.maximum(z, jnp.flip(z, 1)), \
      jnp.minimum(z, x)


def _bits_equal(g, w):
  np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
  np.testing.assert_array_equal(g.view(np.uint32)[~np.isnan(w)], w.view(np.uint32)[~np.isnan(w)])


def test_max_min_zero_free_fast_path_plan():
  """Each max/min of the network is guarded by one has-zero check of the
  sources it was moved from, not by its own check; a literal zero operand
  keeps the exact rule."""
  from pallas_np.compiler import Compiler
  a = np.ones((8, 16), np.float32)
  plan = Compiler().compile(jax.make_jaxpr(_exchange_network)(a, a))
  # Sources: the two inputs and the mid-kernel product z.
  assert plan.source.count("_has_zero(") == 3, plan.source
  # 6 network ops + the two on z take the guarded fast path; max(x, 0.0) and
  # min(x, -0.0) do not.
  assert plan.source.count("_nz[z") == 8, plan.source


@pytest.mark.parametrize("zeros", ["none", "signed", "nan"])
def test_max_min_network_bitwise(zeros):
  a = rng.standard_normal((8, 128)).astype(np.float32)
  b = rng.standard_normal((8, 128)).astype(np.float32)
  if zeros == "signed":
    a[::2, ::3] = 0.0
    a[1::2, 1::3] = -0.0
    b[:, ::5] = -0.0
    b[:, 1::5] = 0.0
  elif zeros == "nan":
    a[::3, ::7] = np.nan
    b[1, :4] = [np.inf, -np.inf, -0.0, np.nan]
  got, want = both(_exchange_network, a, b)
  for g, w in zip(got, want):
    _bits_equal(g, w)


def test_max_min_guard_skips_sources_much_bigger_than_the_op():
  """max of one row of a big block: checking the whole block for zeros would
  cost more than the op's own check, so the exact rule runs unguarded."""
  from pallas_np.compiler import Compiler
  big = np.ones((64, 128), np.float32)
  row = np.ones((1, 128), np.float32)
  plan = Compiler().compile(jax.make_jaxpr(lambda x, r: jnp.maximum(x[:1], r))(big, row))
  assert "_has_zero(" not in plan.source, plan.source
  x = big.copy()
  x[0, :2] = [0.0, -0.0]
  r = row.copy()
  r[0, :2] = [-0.0, 0.0]
  got = plan(None, x, r)[0]
  _bits_equal(np.asarray(got), np.asarray(jax.jit(lambda x, r: jnp.maximum(x[:1], r))(x, r)))


def _against_constants(x):
  nonuniform = jnp.where(jnp.arange(x.shape[1]) % 2 == 0, 0.0, 1.0).astype(x.dtype)
  return (jnp.maximum(x, 0.0), jnp.maximum(0.0, x),  # ReLU, either side
          jnp.maximum(x, -1.5), jnp.minimum(x, 2.0), jnp.minimum(-3.0, x),
          jnp.maximum(x, jnp.nan),
          jnp.minimum(x, 0.0), jnp.maximum(x, -0.0), jnp.minimum(x, -0.0),  # exact rule
          jnp.maximum(x, nonuniform[None, :]))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_max_min_against_constants_bitwise(dtype):
  x = rng.standard_normal((8, 128)).astype(np.float32) * 3
  x[:, :8] = [0.0, -0.0, np.nan, np.inf, -np.inf, -1.5, 2.0, -3.0]
  x[1::2, 8::4] = -0.0
  x[::2, 9::4] = 0.0
  x = x.astype(dtype)
  got, want = both(_against_constants, x)
  for i, (g, w) in enumerate(zip(got, want)):
    assert g.dtype == w.dtype, i
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=str(i))
    ok = ~np.isnan(w.astype(np.float32))
    np.testing.assert_array_equal(g.view(np.uint8).reshape(*g.shape, -1)[ok],
                                  w.view(np.uint8).reshape(*w.shape, -1)[ok], err_msg=str(i))


def test_relu_plan_skips_the_zero_check():
  """max(x, 0.0) runs NumPy's max plus +0.0 (no zero check, no fix-up);
  a nonzero constant runs the bare ufunc."""
  from pallas_np.compiler import Compiler
  a = np.ones((8, 16), np.float32)
  plan = Compiler().compile(jax.make_jaxpr(lambda x: (jnp.maximum(x, 0.0), jnp.minimum(x, 2.0)))(a))
  called = [v for k, v in plan.fn.__globals__.items() if k.startswith("f")]
  assert any(getattr(f, "__name__", "") == "relu" for f in called), plan.source
  assert np.minimum in called, plan.source
