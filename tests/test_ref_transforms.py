"""Ref transforms: width-changing ``ref.bitcast`` (packed along the
second-minor dim, as Mosaic's memref_bitcast and JAX's ``state.utils.bitcast``
do), ``ref.reshape`` of views, and both through DMAs.

Oracles: interpret=True implements the same bitcast rule (reads on every
JAX; writes through a bitcast ref from the JAX whose discharge handles
them); TPU interpret mode does not run bitcast refs. Every test also checks
an independent NumPy reference.
"""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.state import discharge as jax_discharge
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tests.tpu_helpers import compare, hlo_interpret, numpy_mode

i32 = jnp.int32
X = np.random.RandomState(0).randint(-2**31, 2**31 - 1, size=(16, 128), dtype=np.int64).astype(np.int32)
# Does interpret=True write through a bitcast ref? (its swap discharge's write phase)
_WRITE_PHASE = inspect.getsource(jax_discharge.transform_swap_array).split("Write phase")[-1]
HLO_WRITES_BITCAST = "BitcastTransform" in _WRITE_PHASE


def packed(x: np.ndarray, dtype) -> np.ndarray:
  """The TPU rule, written out: narrowing by r puts byte j (little-endian) of
  row m in row r*m + j; widening is its inverse."""
  dtype = np.dtype(dtype)
  a, b = x.dtype.itemsize, dtype.itemsize
  m, n = x.shape
  if a > b:
    r = a // b
    out = np.empty((m * r, n), dtype)
    chunks = x.view(dtype).reshape(m, n, r)
    for j in range(r):
      out[j::r] = chunks[:, :, j]
    return out
  r = b // a
  stacked = np.stack([x[j::r] for j in range(r)], axis=-1)  # (m/r, n, r)
  return np.ascontiguousarray(stacked).view(dtype).reshape(m // r, n)


def _read_kernel(x_ref, o8_ref, o16_ref, ow_ref):
  o8_ref[...] = x_ref.bitcast(jnp.int8)[...]
  o16_ref[...] = x_ref.bitcast(jnp.bfloat16).bitcast(jnp.int16)[pl.ds(8, 16), :]
  ow_ref[...] = x_ref.bitcast(jnp.int8).bitcast(jnp.int32)[...] + x_ref.bitcast(jnp.int8)[4:20, :].astype(i32)


def test_width_changing_bitcast_reads():
  outs = [jax.ShapeDtypeStruct((64, 128), jnp.int8), jax.ShapeDtypeStruct((16, 128), jnp.int16),
          jax.ShapeDtypeStruct((16, 128), i32)]
  fn = lambda: pl.pallas_call(_read_kernel, out_shape=outs)(jnp.asarray(X))
  o8, o16, ow = compare(fn, oracle=hlo_interpret)
  np.testing.assert_array_equal(np.asarray(o8), packed(X, np.int8))
  np.testing.assert_array_equal(np.asarray(o16), packed(X, np.int16)[8:24])
  np.testing.assert_array_equal(np.asarray(ow), X + packed(X, np.int8)[4:20].astype(np.int32))


def _write_kernel(x_ref, o_ref, o2_ref, o3_ref, accumulate=True):
  o_ref.bitcast(i32)[...] = x_ref[...]
  o2_ref[...] = x_ref[...]
  o2_ref.bitcast(jnp.int16)[pl.ds(8, 8), :] = x_ref.bitcast(jnp.int16)[pl.ds(0, 8), :] + 1
  o3_ref[...] = jnp.zeros_like(o3_ref)
  if accumulate:
    o3_ref.bitcast(jnp.int8)[1:3, :] += x_ref.bitcast(jnp.int8)[0:2, :]
  else:  # interpret=True has no += through a bitcast: the same, as a store
    o3_ref.bitcast(jnp.int8)[1:3, :] = x_ref.bitcast(jnp.int8)[0:2, :]


def test_width_changing_bitcast_writes():
  outs = [jax.ShapeDtypeStruct((64, 128), jnp.int8), jax.ShapeDtypeStruct((16, 128), i32),
          jax.ShapeDtypeStruct((16, 128), i32)]
  fn = lambda: pl.pallas_call(_write_kernel, out_shape=outs)(jnp.asarray(X))
  with numpy_mode():
    got = [np.asarray(a) for a in fn()]
  want2 = packed(X, np.int16)
  want2[8:16] = packed(X, np.int16)[0:8] + 1
  want3 = np.zeros((64, 128), np.int8)
  want3[1:3] = packed(X, np.int8)[0:2]
  np.testing.assert_array_equal(got[0], packed(X, np.int8))
  np.testing.assert_array_equal(got[1], packed(want2, np.int32))
  np.testing.assert_array_equal(got[2], packed(want3, np.int32))
  if HLO_WRITES_BITCAST:
    with hlo_interpret():
      want = pl.pallas_call(lambda *refs: _write_kernel(*refs, accumulate=False),
                            out_shape=outs)(jnp.asarray(X))
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, np.asarray(w))
  else:
    with hlo_interpret(), pytest.raises(NotImplementedError, match="Unsupported transform"):
      fn()


def test_bitcast_and_reshape_through_dmas():
  """HBM int32 seen as int8/bf16 on both sides of DMAs, a dynamic slice of a
  bitcast ref, and a reshaped (non-contiguous) VMEM view."""
  def kernel(x_hbm, o_hbm, o2_ref, buf8, buf16, sem):
    pltpu.sync_copy(x_hbm.bitcast(jnp.int8), buf8)  # (64, 128) int8
    buf8[...] = buf8[...] + jnp.int8(1)
    pltpu.sync_copy(buf8, o_hbm.bitcast(jnp.int8))
    c = pltpu.make_async_copy(x_hbm.bitcast(jnp.bfloat16).at[pl.ds(8, 8)], buf16, sem)
    c.start()
    c.wait()
    o2_ref[...] = jnp.zeros_like(o2_ref)
    o2_ref.at[:, pl.ds(0, 64)].reshape(16, 2, 32)[:, 1, :] = (
        buf16.bitcast(i32)[...][:, :32].reshape(4, 32).repeat(4, axis=0))
  outs = [jax.ShapeDtypeStruct((16, 128), i32), jax.ShapeDtypeStruct((16, 128), i32)]
  with numpy_mode():
    o, o2 = pl.pallas_call(
        kernel, out_shape=outs,
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pltpu.VMEM)],
        scratch_shapes=[pltpu.VMEM((64, 128), jnp.int8), pltpu.VMEM((8, 128), jnp.bfloat16),
                        pltpu.SemaphoreType.DMA])(jnp.asarray(X))
  np.testing.assert_array_equal(np.asarray(o), packed(packed(X, np.int8) + np.int8(1), np.int32))
  b16 = packed(X, np.int16)[8:16]
  want2 = np.zeros((16, 128), np.int32)
  want2[:, 32:64] = packed(b16, np.int32)[:, :32].reshape(4, 32).repeat(4, axis=0)
  np.testing.assert_array_equal(np.asarray(o2), want2)


def test_smem_bitcast():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref.bitcast(jnp.int16)[...]
  with numpy_mode():
    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 8), jnp.int16),
                         in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
                         out_specs=pl.BlockSpec(memory_space=pltpu.SMEM))(jnp.asarray(X[:4, :8]))
  np.testing.assert_array_equal(np.asarray(got), packed(X[:4, :8], np.int16))
  np.testing.assert_array_equal(packed(packed(X, np.int8), np.int32), X)  # the reference round-trips


def test_sub_byte_bitcast_raises():
  """A width-changing bitcast to or from a sub-byte type (int4: two per byte)
  cannot be a NumPy array of the right shape: numpy mode must refuse it
  rather than return a wrongly shaped ref."""
  import pallas_np

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref.bitcast(jnp.int4)[...].astype(jnp.int32)[:16]

  call = lambda: pallas_np.pallas_call(  # noqa: E731
      kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.int32))(X)
  try:
    jax.make_jaxpr(lambda x: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.int32), interpret=True)(x))(X)
  except Exception as e:  # this JAX refuses the kernel while tracing: so must we
    with pytest.raises(type(e)):
      call()
    return
  with pytest.raises(pallas_np.UnsupportedError, match="sub-byte"):
    call()
