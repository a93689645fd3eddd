"""Float max/min in a compiled loop on integer order keys, and a tile of
unit reps read in place (pallas_np/native/reductions.py, shapes.py): the
generated loop has the new form, and its bits equal the NumPy path's
(``native_loops="off"``) on the values where a max/min is delicate:
signed zeros, infinities, NaNs of either sign, subnormals, rows that are
all -inf or all NaN."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_np import native
from tests.native_elig_util import OFF, SYNC, bits, loop_source_of


def _extrema(x_ref, o_ref):
  def body(i, acc):
    y = x_ref[...] * jnp.float32(1.0)  # (12, 16)
    cols = jnp.concatenate([jnp.max(y, axis=0, keepdims=True), jnp.min(y, axis=0, keepdims=True)],
                           axis=0).T[:12]  # (12, 2)
    rows = jnp.concatenate([jnp.max(y, axis=1, keepdims=True), jnp.min(y, axis=1, keepdims=True)],
                           axis=1)
    return acc + jnp.concatenate([rows, cols], axis=1)
  o_ref[...] = lax.fori_loop(0, 2, body, jnp.zeros(o_ref.shape, jnp.float32))


def _delicate_rows():
  x = np.random.default_rng(3).standard_normal((12, 16)).astype(np.float32)
  x[0] = -0.0
  x[1, :8], x[1, 8:] = 0.0, -0.0  # (+0 before -0 and after it, by axis)
  x[2] = -np.inf
  x[3] = np.inf
  x[4, 5] = np.float32(np.nan)
  x[5, 9] = -np.float32(np.nan)  # (a NaN with the sign bit: the lowest key)
  x[5, 2] = np.inf
  x[6] = np.float32(1e-45) * np.arange(-8, 8, dtype=np.float32)  # (subnormals, both signs)
  x[7] = np.nan
  x[8, :] = -3.0
  x[8, 15] = -np.inf
  x[9, 0] = -0.0
  x[9, 1:] = -1.0
  x[10] = np.finfo(np.float32).max
  x[10, 3] = -np.finfo(np.float32).max
  x[11, 7] = -np.float32(np.nan)
  x[11, 8] = np.float32(np.nan)
  return x


def test_float_extrema_on_order_keys_bit_exact():
  x = jnp.asarray(_delicate_rows())

  def make(interp):
    return pl.pallas_call(_extrema, out_shape=jax.ShapeDtypeStruct((12, 4), jnp.float32),
                          interpret=interp)
  text = loop_source_of(make, x)
  assert ".view(np.int32)" in text and "_math.copysign" not in text, text
  before = native.stats()["native_calls"]
  got = make(SYNC)(x)
  assert native.stats()["native_calls"] > before, "the compiled loop did not run"
  np.testing.assert_array_equal(bits(got), bits(make(OFF)(x)))
  want = np.asarray(make(True)(x))
  got = np.asarray(got)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  num = ~np.isnan(want)
  num[6, :2] = False  # (row 6's subnormals: XLA flushes them, docs/limits.md)
  np.testing.assert_array_equal(got[num], want[num])
  np.testing.assert_array_equal(np.signbit(got[num]), np.signbit(want[num]))


def _tiled(x_ref, o_ref):
  def body(i, acc):
    y = x_ref[...] * (1.0 + i.astype(jnp.float32))
    return acc + jnp.tile(y, (1, 1)) * 0.5 + jnp.tile(y[:, :8], (1, 2))
  o_ref[...] = lax.fori_loop(0, 3, body, jnp.zeros(o_ref.shape, jnp.float32))


def test_unit_rep_tile_is_its_operand():
  """``tile`` with every rep 1 (flash attention's ``pltpu.repeat`` by 1)
  reads its operand's buffer: no copy loop; reps of 2 still gather."""
  x = jnp.asarray(np.random.default_rng(5).standard_normal((8, 16)), jnp.float32)

  def make(interp):
    return pl.pallas_call(_tiled, out_shape=jax.ShapeDtypeStruct((8, 16), jnp.float32),
                          interpret=interp)
  text = loop_source_of(make, x)
  gathers = [line for line in text.splitlines() if " % " in line]
  assert len(gathers) == 1 and " % 16)" not in gathers[0], text  # (the (1, 2) tile's only)
  before = native.stats()["native_calls"]
  got = make(SYNC)(x)
  assert native.stats()["native_calls"] > before, "the compiled loop did not run"
  np.testing.assert_array_equal(bits(got), bits(make(OFF)(x)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(make(True)(x)), rtol=1e-5, atol=1e-6)
