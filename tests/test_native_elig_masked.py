"""Masked (Triton-style) loads and stores in a compiled loop
(pallas_np/native/masked.py): ``plgpu.load``/``plgpu.store`` with
``mask=``/``other=``, by array indices (``ref.at[cols]``) and by slices,
with masked-off lanes past the end. Each test compares
``native_loops="sync"`` with ``"off"`` bit for bit (and the errors), and
checks the loop ran compiled: before these emitters ``masked_load`` and
``masked_swap`` were refused."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import pallas_np
from pallas_np import native
from tests.native_elig_util import OFF, SYNC, bits, compiled_equals_numpy


def _norm_kernel(x_ref, w_ref, o_ref, *, block):
  """The library layer norm's loops (ops/gpu/layer_norm.py): column blocks
  by an index array, the last block running past the end, masked."""
  n = x_ref.shape[0]

  def mean_body(i, acc):
    cols = i * block + jnp.arange(block)
    return acc + plgpu.load(x_ref.at[cols], mask=cols < n, other=0.0)
  total = lax.fori_loop(0, pl.cdiv(n, block), mean_body, jnp.zeros(block, jnp.float32))
  mean = jnp.sum(total) / n

  @pl.loop(0, pl.cdiv(n, block))
  def _(i):
    cols = i * block + jnp.arange(block)
    mask = cols < n
    w = plgpu.load(w_ref.at[cols], mask=mask)  # no other: off lanes past the end read the fill
    x = plgpu.load(x_ref.at[cols], mask=mask, other=0.0)
    plgpu.store(o_ref.at[cols], (x - mean) * jnp.where(mask, w, 1.0), mask=mask)


def _call_norm(interp, n=1000, block=256, params=None):
  return pl.pallas_call(
      functools.partial(_norm_kernel, block=block),
      out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), interpret=interp)


def test_masked_array_index_loads_and_stores_bit_exact():
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal(1000), jnp.float32)
  w = jnp.asarray(rng.standard_normal(1000), jnp.float32)
  compiled_equals_numpy(_call_norm, x, w)


def _slices_kernel(k_ref, o_ref, *, block):
  """mha-style: a dynamic ``pl.ds`` of rows, a (1, d) column mask and a
  row mask past the end."""
  rows = k_ref.shape[0]
  cols = lax.broadcasted_iota(jnp.int32, (1, k_ref.shape[1]), 1)

  def body(j, acc):
    start = j * block
    row_ids = start + lax.broadcasted_iota(jnp.int32, (block, 1), 0)
    k = plgpu.load(k_ref.at[pl.ds(start, block), :], mask=(cols < 48) & (row_ids < rows),
                   other=0.0)
    return acc + jnp.exp(k * 0.5)
  acc = lax.fori_loop(0, pl.cdiv(rows, block), body, jnp.zeros(o_ref.shape, jnp.float32))
  o_ref[...] = acc


def test_masked_slice_loads_past_the_end_bit_exact():
  rng = np.random.default_rng(6)
  k = jnp.asarray(rng.standard_normal((100, 64)), jnp.float32)

  def make(interp):
    return pl.pallas_call(functools.partial(_slices_kernel, block=32),
                          out_shape=jax.ShapeDtypeStruct((32, 64), jnp.float32),
                          interpret=interp)
  compiled_equals_numpy(make, k)


def _scatter_kernel(idx_ref, v_ref, o_ref):
  """Stores by an index array with repeated indices, all in bounds: the
  NumPy rule writes every lane (masked-off ones with the old value), so
  the last of equal indices wins."""
  o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)

  def body(i, c):
    idx = idx_ref[...]
    mask = (jnp.arange(idx.shape[0]) + i) % 3 != 0
    plgpu.store(o_ref.at[idx], v_ref[...] + i.astype(jnp.float32), mask=mask)
    return c
  lax.fori_loop(0, 4, body, 0)


def test_masked_scatter_repeated_indices_bit_exact():
  idx = jnp.asarray([0, 3, 3, 5, 1, 0, 7, 7, 2, 3, 6, 4, 4, 5, 1, 0], jnp.int32)
  v = jnp.arange(16, dtype=jnp.float32) * 1.5

  def make(interp):
    return pl.pallas_call(_scatter_kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                          interpret=interp)
  before = native.stats()["native_calls"]
  got = make(SYNC)(idx, v)
  assert native.stats()["native_calls"] > before, "the compiled loop did not run"
  np.testing.assert_array_equal(bits(got), bits(make(OFF)(idx, v)))


@pytest.mark.parametrize("clamp", [False, True])
def test_masked_on_lane_out_of_bounds_errors_as_numpy(clamp):
  """A masked-on lane past the end: the NumPy rule's IndexError (the same
  message, naming the lane and the index), or under bounds_check="clamp"
  the fill, as the NumPy path."""
  def kernel(x_ref, o_ref):
    def body(i, acc):
      cols = i * 128 + jnp.arange(128)
      return acc + plgpu.load(x_ref.at[cols], mask=cols < 300, other=0.0)  # 300 > 200
    o_ref[...] = lax.fori_loop(0, 3, body, jnp.zeros(128, jnp.float32))

  def make(native_loops):
    params = pallas_np.InterpretParams(native_loops=native_loops,
                                       bounds_check="clamp" if clamp else "raise")
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), jnp.float32),
                          interpret=params)
  x = jnp.arange(200, dtype=jnp.float32)
  if clamp:
    before = native.stats()["native_calls"]
    got = make("sync")(x)
    assert native.stats()["native_calls"] > before
    np.testing.assert_array_equal(bits(got), bits(make("off")(x)))
    return
  with pytest.raises(IndexError) as want:
    make("off")(x)
  pallas_np.clear_caches()  # (a fresh plan: its loop is compiled, or loaded, anew)
  compiled = native.stats()["compiled"]
  with pytest.raises(IndexError) as got:
    make("sync")(x)
  assert "out-of-bounds masked ref access: lane (72,)" in str(want.value)
  assert str(got.value) == str(want.value)
  assert native.stats()["compiled"] > compiled, "the loop was not compiled"


@pytest.mark.parametrize("uninitialized", ["nan", "zero"])
def test_masked_off_lanes_past_the_end_read_the_fill(uninitialized):
  """Without ``other``, a masked-off lane past the end reads the
  ``uninitialized`` fill (NaN, or 0), as on the NumPy path."""
  def kernel(x_ref, o_ref):
    def body(i, c):
      cols = i * 128 + jnp.arange(128)
      o_ref[pl.ds(i * 128, 128)] = plgpu.load(x_ref.at[cols], mask=cols < 200) * 2.0
      return c
    lax.fori_loop(0, 2, body, 0)

  def make(native_loops):
    params = pallas_np.InterpretParams(native_loops=native_loops, uninitialized=uninitialized)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((256,), jnp.float32),
                          interpret=params)
  x = jnp.arange(200, dtype=jnp.float32)
  before = native.stats()["native_calls"]
  got = make("sync")(x)
  assert native.stats()["native_calls"] > before, "the compiled loop did not run"
  want = make("off")(x)
  np.testing.assert_array_equal(bits(got), bits(want))
  assert np.isnan(np.asarray(want)[200:]).all() == (uninitialized == "nan")
