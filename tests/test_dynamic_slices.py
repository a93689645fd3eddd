"""Dynamically sized ref slices (``pl.ds(start, n)`` with a traced ``n``) in
DMAs, and ``pl.BoundedSlice`` block dims of ``emit_pipeline``.

Oracle: TPU interpret mode (``pltpu.InterpretParams()``) runs all of these on
CPU; interpret=True cannot (a traced size is not a static shape for its
discharge), so each test also checks a NumPy reference.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from tests.tpu_helpers import compare, numpy_mode, tpu_interpret

f32 = jnp.float32
X = jnp.arange(64 * 128, dtype=f32).reshape(64, 128)


def _ragged_copy(n_and_start, x):
  def kernel(n_ref, x_hbm, o_ref, buf):
    n, start = n_ref[0], n_ref[1]
    buf[...] = jnp.zeros_like(buf)
    pltpu.sync_copy(x_hbm.at[pl.ds(start, n)], buf.at[pl.ds(0, n)])  # RAGGED_LINE
    o_ref[...] = buf[...]
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((16, 128), f32),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
      scratch_shapes=[pltpu.VMEM((16, 128), f32)])(jnp.asarray(n_and_start, jnp.int32), x)


@pytest.mark.parametrize("n,start", [(5, 2), (16, 48), (0, 7), (1, 63)])
def test_ragged_sync_copy_with_traced_size(n, start):
  got = compare(lambda: _ragged_copy([n, start], X), oracle=tpu_interpret)
  want = np.zeros((16, 128), np.float32)
  want[:n] = np.asarray(X)[start:start + n]
  np.testing.assert_array_equal(np.asarray(got), want)


def test_async_copies_with_traced_sizes_wait_for_their_bytes():
  """Two DMAs of different traced sizes on one semaphore: each wait takes
  the bytes of its own (dynamic) source."""
  def kernel(n_ref, x_hbm, o_ref, buf, sem):
    a, b = n_ref[0], n_ref[1]
    buf[...] = jnp.full_like(buf, -1.0)
    c1 = pltpu.make_async_copy(x_hbm.at[pl.ds(0, a)], buf.at[pl.ds(0, a)], sem)
    c2 = pltpu.make_async_copy(x_hbm.at[pl.ds(32, b)], buf.at[pl.ds(8, b)], sem)
    c1.start()
    c2.start()
    c2.wait()
    c1.wait()
    o_ref[...] = buf[...]
  fn = lambda: pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((16, 128), f32),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
      scratch_shapes=[pltpu.VMEM((16, 128), f32), pltpu.SemaphoreType.DMA])(
          jnp.array([3, 6], jnp.int32), X)
  got = compare(fn, oracle=tpu_interpret)
  want = np.full((16, 128), -1.0, np.float32)
  want[:3] = np.asarray(X)[:3]
  want[8:14] = np.asarray(X)[32:38]
  np.testing.assert_array_equal(np.asarray(got), want)


def test_grouped_matmul_with_group_sizes_from_scalar_prefetch():
  """Megablox-style: group g's rows of lhs start at offsets[g] and number
  sizes[g] (scalar prefetch); each grid step DMAs just those rows."""
  rng = np.random.RandomState(0)
  lhs = jnp.asarray(rng.randint(-3, 4, (64, 128)).astype(np.float32))
  rhs = jnp.asarray(rng.randint(-3, 4, (4, 128, 128)).astype(np.float32))
  sizes = np.array([10, 0, 32, 22], np.int32)
  offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int32)

  def kernel(off_ref, size_ref, lhs_hbm, rhs_ref, o_ref, buf):
    g = pl.program_id(0)
    start, n = off_ref[g], size_ref[g]
    buf[...] = jnp.zeros_like(buf)
    pltpu.sync_copy(lhs_hbm.at[pl.ds(start, n)], buf.at[pl.ds(0, n)])
    o_ref[...] = jnp.dot(buf[...], rhs_ref[...], preferred_element_type=f32)
  fn = lambda: pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((4, 32, 128), f32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(4,),
          in_specs=[pl.BlockSpec(memory_space=pl.ANY),
                    pl.BlockSpec((None, 128, 128), lambda g, o, s: (g, 0, 0))],
          out_specs=pl.BlockSpec((None, 32, 128), lambda g, o, s: (g, 0, 0)),
          scratch_shapes=[pltpu.VMEM((32, 128), f32)]))(
              jnp.asarray(offsets), jnp.asarray(sizes), lhs, rhs)
  got = compare(fn, oracle=tpu_interpret)
  want = np.zeros((4, 32, 128), np.float32)
  for g in range(4):
    rows = np.asarray(lhs)[offsets[g]:offsets[g] + sizes[g]]
    want[g, :sizes[g]] = rows @ np.asarray(rhs)[g]
  np.testing.assert_array_equal(np.asarray(got), want)


def test_emit_pipeline_over_bounded_slice_blocks():
  """Ragged blocks: the index map returns pl.ds(start, size) for a
  BoundedSlice(24) dim; only `size` rows move each way."""
  pallas_np.assume_tpu_chip("v5e")
  starts = jnp.array([0, 8, 16, 40], jnp.int32)
  sizes = jnp.array([8, 8, 24, 16], jnp.int32)

  def outer(st_ref, sz_ref, x_hbm, o_hbm):
    def inner(x_ref, o_ref):
      o_ref[...] = x_ref[...] * 2

    def imap(i):
      return (pl.ds(st_ref[i], sz_ref[i]), 0)
    pltpu.emit_pipeline(inner, grid=(4,),
                        in_specs=[pl.BlockSpec((pl.BoundedSlice(24), 128), imap)],
                        out_specs=[pl.BlockSpec((pl.BoundedSlice(24), 128), imap)])(x_hbm, o_hbm)
  fn = lambda: pl.pallas_call(
      outer, out_shape=jax.ShapeDtypeStruct((64, 128), f32),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] * 2 + [pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pl.ANY))(starts, sizes, X)
  got = np.asarray(compare(fn, oracle=tpu_interpret))
  np.testing.assert_array_equal(got[:56], np.asarray(X)[:56] * 2)
  assert np.isnan(got[56:]).all()  # never written: uninitialized (NaN), as in TPU interpret mode


def _value_read_with_traced_size():
  """JAX (both versions) gives a traced-size *value* no type: only refs
  (DMA operands) may be dynamically sized."""
  def kernel(n_ref, x_ref, o_ref):
    o_ref[pl.ds(0, n_ref[0]), :] = x_ref[pl.ds(0, n_ref[0]), :]
  with numpy_mode(), pytest.raises(AssertionError, match="DShapedArray"):
    pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 128), f32),
                   in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                             pl.BlockSpec(memory_space=pltpu.VMEM)])(
        jnp.array([3], jnp.int32), X[:16])


def _line(marker):
  import inspect
  src, first = inspect.getsourcelines(_ragged_copy)
  return first + next(i for i, l in enumerate(src) if marker in l)


@pytest.mark.parametrize("n,start,what", [(10, 60, r"\[60:70\]"), (20, 0, "larger than the axis")])
def test_out_of_bounds_traced_size_raises_with_kernel_line(n, start, what):
  with numpy_mode(), pytest.raises(IndexError, match=what) as err:
    _ragged_copy([n, start], X)
  msg = str(err.value)
  assert "grid point ()" in msg and f"test_dynamic_slices.py:{_line('RAGGED_LINE')}" in msg
  with tpu_interpret(), pytest.raises(Exception, match="Out-of-bounds"):  # the oracle raises too
    jax.block_until_ready(_ragged_copy([n, start], X))


def test_out_of_bounds_traced_size_clamps_on_request():
  _value_read_with_traced_size()
  with pallas_np.force_numpy_interpret(pallas_np.InterpretParams(bounds_check="clamp")):
    got = np.asarray(_ragged_copy([10, 60], X))
  want = np.zeros((16, 128), np.float32)
  want[:10] = np.asarray(X)[54:64]  # the start clamped, as lax.dynamic_slice does
  np.testing.assert_array_equal(got, want)
