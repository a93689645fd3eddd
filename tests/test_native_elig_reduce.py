"""Float reduce_sum/max/min in a compiled loop (pallas_np/native/reductions.py):
a sum in NumPy's own order (pairwise along the innermost axis, from 0.0;
slice after slice across outer axes), max/min with XLA's signed zeros and
NaN propagation. Each test compares ``native_loops="sync"`` with ``"off"``
bit for bit and checks the loop ran compiled: before these emitters a loop
holding a float reduction was refused (NumPy path)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_np import native
from pallas_np.native import codegen
from tests.native_elig_util import OFF, SYNC, bits, compiled_equals_numpy


def _softmax_sums_kernel(x_ref, o_ref, c_ref, t_ref):
  """Row sums (pairwise; 300 > 128 elements: split halves), column sums
  (leading axis: row after row), a total (both axes, coalesced) and row
  maxima, as an online softmax has them."""
  def body(i, carry):
    acc, col, tot = carry
    s = x_ref[...] * (1.0 + i.astype(jnp.float32) * 0.25)  # (8, 300)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    return (acc + p / l, col + jnp.sum(p, axis=0), tot + jnp.sum(p) + jnp.min(s))
  acc, col, tot = lax.fori_loop(
      0, 3, body, (jnp.zeros(o_ref.shape, jnp.float32), jnp.zeros(c_ref.shape, jnp.float32),
                   jnp.float32(0)))
  o_ref[...] = acc
  c_ref[...] = col
  t_ref[...] = jnp.full(t_ref.shape, tot)


def test_float_sums_and_maxima_bit_exact():
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((16, 300)) * 4, jnp.float32)

  def make(interp):
    return pl.pallas_call(
        _softmax_sums_kernel,
        out_shape=(jax.ShapeDtypeStruct((16, 300), jnp.float32),
                   jax.ShapeDtypeStruct((2, 300), jnp.float32),
                   jax.ShapeDtypeStruct((2, 128), jnp.float32)),
        grid=(2,), in_specs=[pl.BlockSpec((8, 300), lambda i: (i, 0))],
        out_specs=(pl.BlockSpec((8, 300), lambda i: (i, 0)),
                   pl.BlockSpec((1, 300), lambda i: (i, 0)),
                   pl.BlockSpec((1, 128), lambda i: (i, 0))), interpret=interp)
  compiled_equals_numpy(make, x, rtol=1e-4, atol=1e-4)


def _extrema_kernel(x_ref, o_ref):
  def body(i, acc):
    y = x_ref[...] * jnp.float32(1.0)
    mx = jnp.max(y, axis=1, keepdims=True)
    mn = jnp.min(y, axis=1, keepdims=True)
    return acc + jnp.concatenate([mx, mn, jnp.max(y, axis=0, keepdims=True).T[:8]], axis=1)
  o_ref[...] = lax.fori_loop(0, 2, body, jnp.zeros(o_ref.shape, jnp.float32))


def test_float_extrema_signed_zeros_and_nans():
  """Rows of zeros of either sign, NaNs, infinities: max/min as the NumPy
  rule (XLA's -0.0 < +0.0, NaN wins)."""
  x = np.zeros((8, 16), np.float32)
  x[0] = -0.0
  x[1, :8] = -0.0
  x[2, 3] = np.nan
  x[3] = -np.inf
  x[4] = np.inf
  x[5] = np.linspace(-3, 3, 16)
  x[6, 5] = -0.0
  x[6, 7] = np.nan
  x[7] = -np.linspace(-3, 3, 16)

  def make(interp):
    return pl.pallas_call(_extrema_kernel, out_shape=jax.ShapeDtypeStruct((8, 3), jnp.float32),
                          interpret=interp)
  before = native.stats()["native_calls"]
  got = make(SYNC)(jnp.asarray(x))
  assert native.stats()["native_calls"] > before, "the compiled loop did not run"
  np.testing.assert_array_equal(bits(got), bits(make(OFF)(jnp.asarray(x))))
  got, want = np.asarray(got), np.asarray(make(True)(jnp.asarray(x)))
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  num = ~np.isnan(want)
  np.testing.assert_array_equal(got[num], want[num])
  np.testing.assert_array_equal(np.signbit(got[num]), np.signbit(want[num]))


def test_sum_of_an_unknown_layout_is_refused():
  """A float sum whose operand's NumPy layout is not known here (a
  transposed value: NumPy would add in another order) keeps the loop on
  the NumPy path, with the reason."""
  def kernel(x_ref, o_ref):
    def body(i, acc):
      return acc + jnp.sum(x_ref[...].T * 2.0, axis=1)
    o_ref[...] = lax.fori_loop(0, 2, body, jnp.zeros(o_ref.shape, jnp.float32))
  x = jnp.ones((8, 128), jnp.float32)
  closed = jax.make_jaxpr(lambda x: pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((128,), jnp.float32), interpret=True)(x))(x)
  kjaxpr = next(e for e in closed.jaxpr.eqns if e.primitive.name == "pallas_call").params["jaxpr"]
  loop = next(e for e in kjaxpr.eqns if e.primitive.name in ("scan", "while"))
  try:
    codegen.loop_source(loop, False, "nan")
  except codegen.Refused as e:
    assert "NumPy summation order" in str(e)
  else:
    raise AssertionError("a sum of a transposed value was compiled")


def _exp_kernel(x_ref, s_ref, o_ref, p_ref):
  def body(i, carry):
    a, b = carry
    x = x_ref[...] - i.astype(jnp.float32) * 0.0  # (8, 128): the vectorised loop
    s = s_ref[...] * 1.0  # (4,): the formula per element
    return (a + jnp.exp(x) + jnp.exp2(x * 0.01) + jnp.log(jnp.abs(x) + 1.0) + jnp.tanh(x),
            b + jnp.exp(s))
  a, b = lax.fori_loop(0, 2, body, (jnp.zeros(o_ref.shape, jnp.float32),
                                    jnp.zeros(p_ref.shape, jnp.float32)))
  o_ref[...] = a
  p_ref[...] = b


def test_exp_family_is_the_installed_xlas_generation():
  """exp/exp2/log/tanh over arrays (the NumPy rule's own vectorised loop)
  and small values (the formula per element), on inputs where XLA's two
  generations of exp differ by an ulp (the newer JAX computes the split
  one): the NumPy path's bits either way."""
  probe = np.uint32([0x41ECB14D, 0x426D1935, 0x42B0CC81, 0xC1B187E6]).view(np.float32)
  rng = np.random.default_rng(10)
  x = rng.uniform(-100, 88, (8, 128)).astype(np.float32)
  x.flat[:64] = np.tile(probe, 16)

  def make(interp):
    return pl.pallas_call(
        _exp_kernel, out_shape=(jax.ShapeDtypeStruct((8, 128), jnp.float32),
                                jax.ShapeDtypeStruct((4,), jnp.float32)),
        interpret=interp)
  before = native.stats()["native_calls"]
  got = make(SYNC)(jnp.asarray(x), jnp.asarray(probe))
  assert native.stats()["native_calls"] > before, "the compiled loop did not run"
  want = make(OFF)(jnp.asarray(x), jnp.asarray(probe))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(bits(g), bits(w))
