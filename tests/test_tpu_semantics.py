"""TPU semantics under numpy mode: DMAs and semaphores (with TPU interpret
mode's visibility rules), memory spaces, scratch, TPU-only primitives."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from tests.tpu_helpers import compare, numpy_mode, tpu_interpret

f32 = jnp.float32


def _call(kernel, out_shape, **kw):
  return pl.pallas_call(kernel, out_shape=out_shape, **kw)


# -- DMAs -------------------------------------------------------------------------
def _late_write_kernel(x_hbm, o_ref, buf, sem):
  """Starts a copy, then overwrites its source before waiting: TPU interpret
  mode (on_wait) copies what the source holds at the wait."""
  pltpu.sync_copy(x_hbm, buf)
  cp = pltpu.make_async_copy(buf, o_ref, sem)
  cp.start()
  buf[...] = buf[...] + 1.0
  cp.wait()


def test_dma_reads_source_at_wait_like_tpu_interpret():
  x = jnp.arange(8 * 128, dtype=f32).reshape(8, 128)
  fn = lambda: _call(_late_write_kernel, jax.ShapeDtypeStruct(x.shape, f32),
                     in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                     out_specs=pl.BlockSpec(memory_space=pl.ANY),
                     scratch_shapes=[pltpu.VMEM(x.shape, f32), pltpu.SemaphoreType.DMA])(x)
  got = compare(fn, oracle=tpu_interpret)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x) + 1)


def _double_buffer_kernel(x_hbm, o_ref, buf, sems):
  """Double-buffered DMAs of row blocks, LIFO-executed waits."""
  n = x_hbm.shape[0] // 8

  def copy(i, slot):
    return pltpu.make_async_copy(x_hbm.at[pl.ds(i * 8, 8)], buf.at[slot], sems.at[slot])
  copy(0, 0).start()

  def body(i, carry):
    slot = i % 2

    @pl.when(i + 1 < n)
    def _():
      copy(i + 1, 1 - slot).start()
    copy(i, slot).wait()
    o_ref[pl.ds(i * 8, 8), :] = buf[slot] * 2.0
    return carry
  jax.lax.fori_loop(0, n, body, 0)


def test_double_buffered_dma_loop():
  x = jnp.arange(32 * 128, dtype=f32).reshape(32, 128)
  fn = lambda: _call(_double_buffer_kernel, jax.ShapeDtypeStruct(x.shape, f32),
                     in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                     scratch_shapes=[pltpu.VMEM((2, 8, 128), f32),
                                     pltpu.SemaphoreType.DMA((2,))])(x)
  got = compare(fn)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x) * 2)


def _never_signalled_kernel(x_hbm, o_ref, sem):
  pltpu.make_async_copy(x_hbm, o_ref, sem).wait()  # never started


def test_wait_that_can_never_complete_raises():
  x = jnp.ones((8, 128), f32)
  with numpy_mode(), pytest.raises(Exception) as info:
    jax.block_until_ready(_call(
        _never_signalled_kernel, jax.ShapeDtypeStruct(x.shape, f32), grid=(2,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA])(x))
  msg = str(info.value)
  assert "deadlock" in msg and "grid point (0,)" in msg
  assert "test_tpu_semantics.py" in msg  # names the kernel line


def _mismatched_dma_kernel(x_hbm, o_ref, buf, sem):
  @pl.when(pl.program_id(0) == 1)  # only the second grid point copies
  def _():
    cp = pltpu.make_async_copy(x_hbm.at[pl.ds(0, 8)], buf.at[pl.ds(0, 4)], sem)
    cp.start()
    cp.wait()
  o_ref[...] = buf[...]


def test_dma_shape_mismatch_raises_where_it_runs():
  """JAX traces a DMA whose source and destination shapes differ; numpy mode
  raises when that DMA runs, naming its grid point (the shapes are checked
  once, when the plan is built)."""
  x = jnp.ones((16, 128), f32)
  with numpy_mode(), pytest.raises(ValueError, match=r"DMA shape mismatch: source \(8, 128\), "
                                   r"destination \(4, 128\)") as info:
    jax.block_until_ready(_call(
        _mismatched_dma_kernel, jax.ShapeDtypeStruct((8, 128), f32), grid=(2,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((8, 128), f32), pltpu.SemaphoreType.DMA])(x))
  assert "grid point (1,)" in str(info.value)


def _leaky_kernel(x_hbm, o_ref, sem):
  pltpu.make_async_copy(x_hbm, o_ref, sem).start()  # never waited


def test_dma_in_flight_at_kernel_end_is_reported():
  x = jnp.ones((8, 128), f32)
  with numpy_mode(), pytest.raises(Exception, match="still in flight"):
    jax.block_until_ready(_call(
        _leaky_kernel, jax.ShapeDtypeStruct(x.shape, f32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA])(x))


def _remote_to_self_kernel(x_ref, o_ref, send_sem, recv_sem):
  barrier = pltpu.get_barrier_semaphore()
  pl.semaphore_signal(barrier, 1, device_id=0, device_id_type=pl.DeviceIdType.LOGICAL)
  pl.semaphore_wait(barrier, 1)
  cp = pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem, device_id=0,
                                    device_id_type=pl.DeviceIdType.LOGICAL)
  cp.start()
  cp.wait()


def test_local_remote_copy_and_barrier_semaphore():
  x = jnp.arange(8 * 128, dtype=f32).reshape(8, 128)
  with numpy_mode():
    got = _call(_remote_to_self_kernel, jax.ShapeDtypeStruct(x.shape, f32),
                in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                out_specs=pl.BlockSpec(memory_space=pl.ANY),
                scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
                compiler_params=pltpu.CompilerParams(collective_id=0))(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x))


# -- semaphores, scratch of every kind, run_scoped -------------------------------------
def _semaphore_kernel(o_ref, sems, smem):
  pl.semaphore_signal(sems.at[0], 3)
  pl.semaphore_signal(sems.at[1], 5)
  pl.semaphore_wait(sems.at[1], 2)
  smem[0] = pl.semaphore_read(sems.at[0])
  smem[1] = pl.semaphore_read(sems.at[1])
  pl.semaphore_wait(sems.at[0], 3)
  pl.semaphore_wait(sems.at[1], 3)
  smem[2] = pl.semaphore_read(sems.at[0]) + pl.semaphore_read(sems.at[1])

  def scoped(vmem, sem):
    vmem[...] = jnp.full(vmem.shape, smem[0] * 10 + smem[1], jnp.int32)
    pltpu.async_copy(vmem, o_ref, sem).wait()
  pl.run_scoped(scoped, pltpu.VMEM(o_ref.shape, jnp.int32), pltpu.SemaphoreType.DMA)
  o_ref[0, 0] = smem[2]


def test_semaphores_scratch_and_run_scoped():
  fn = lambda: _call(_semaphore_kernel, jax.ShapeDtypeStruct((8, 128), jnp.int32),
                     scratch_shapes=[pltpu.SemaphoreType.REGULAR((2,)),
                                     pltpu.SMEM((4,), jnp.int32)])()
  with numpy_mode():
    got = np.asarray(fn())
  # counts 3 and 5-2 read back, both waited down to 0, then copied via a scoped DMA
  assert got[0, 0] == 0 and (got.ravel()[1:] == 33).all()


# -- TPU-only primitives ------------------------------------------------------------
@pytest.mark.parametrize("stride", [None, 1])
def test_roll(stride):
  x = jnp.arange(8 * 128, dtype=f32).reshape(8, 128)

  def kernel(s_ref, x_ref, o_ref):
    kw = dict(stride=stride, stride_axis=0) if stride else {}
    o_ref[...] = pltpu.roll(x_ref[...], s_ref[0], 1, **kw) + pltpu.roll(x_ref[...], 3, 0)
  s = jnp.array([5], jnp.int32)
  fn = lambda: _call(kernel, jax.ShapeDtypeStruct(x.shape, f32),
                     in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec()])(s, x)
  compare(fn)


def test_bitcast_and_repeat():
  x = jnp.arange(16 * 128, dtype=jnp.int32).reshape(16, 128)

  def kernel(x_ref, packed_ref, wide_ref):
    v = x_ref[...]
    packed_ref[...] = pltpu.bitcast(v.astype(jnp.int16), jnp.int32)
    wide_ref[...] = jnp.tile(pltpu.bitcast(v, jnp.int16), (1, 2))  # what pltpu.repeat emits
  fn = lambda: _call(kernel, (jax.ShapeDtypeStruct((8, 128), jnp.int32),
                              jax.ShapeDtypeStruct((32, 256), jnp.int16)))(x)
  compare(fn)


def test_prng_seed_random_bits_and_stateful_sampling():
  def kernel(seed_ref, bits_ref, uni_ref, nrm_ref):
    pltpu.prng_seed(seed_ref[0], seed_ref[1])
    bits_ref[...] = pltpu.prng_random_bits((64, 128))
    uni_ref[...] = pltpu.stateful_uniform((64, 128), jnp.float32, minval=2.0, maxval=4.0)
    nrm_ref[...] = pltpu.stateful_normal((64, 128), jnp.float32)
  shapes = (jax.ShapeDtypeStruct((64, 128), jnp.int32),
            jax.ShapeDtypeStruct((64, 128), f32), jax.ShapeDtypeStruct((64, 128), f32))
  run = lambda seed: _call(kernel, shapes, in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)])(
      jnp.array([seed, 7], jnp.int32))
  with numpy_mode():
    a, b, c = ([np.asarray(x) for x in run(s)] for s in (1, 1, 2))
  for x, y in zip(a, b):  # deterministic per seed
    np.testing.assert_array_equal(x, y)
  assert not np.array_equal(a[0], c[0]) and not np.array_equal(a[1], c[1])
  bits, uni, nrm = a
  assert len(np.unique(bits)) > 8000  # 8192 draws of 32 bits: ~no repeats
  assert uni.min() >= 2 and uni.max() < 4 and abs(uni.mean() - 3) < 0.05
  assert abs(nrm.mean()) < 0.05 and abs(nrm.std() - 1) < 0.05


def test_delay_trace_scopes_and_trace_value():
  x = jnp.arange(8 * 128, dtype=f32).reshape(8, 128)

  def kernel(x_ref, o_ref):
    with jax.named_scope("scaled"):
      pl.delay(100)
      y = x_ref[...] * 2.0
      pltpu.trace_value("first", y[0, 0])
    o_ref[...] = y
  with numpy_mode():
    got = _call(kernel, jax.ShapeDtypeStruct(x.shape, f32))(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x) * 2)


# -- pipelines and grids ----------------------------------------------------------
def test_emit_pipeline():
  pallas_np.assume_tpu_chip("v5e")
  x = jnp.arange(64 * 256, dtype=f32).reshape(64, 256)

  def inner(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0

  def kernel(x_hbm, o_hbm):
    pltpu.emit_pipeline(inner, grid=(4, 2),
                        in_specs=[pl.BlockSpec((16, 128), lambda i, j: (i, j))],
                        out_specs=pl.BlockSpec((16, 128), lambda i, j: (i, j)))(x_hbm, o_hbm)
  fn = lambda: _call(kernel, jax.ShapeDtypeStruct(x.shape, f32),
                     in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                     out_specs=pl.BlockSpec(memory_space=pl.ANY))(x)
  got = compare(fn)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x) + 1)


def test_prefetch_scalar_grid_spec_and_dimension_semantics():
  x = jnp.arange(4 * 8 * 128, dtype=f32).reshape(32, 128)
  order = jnp.array([3, 1, 0, 2], jnp.int32)

  def kernel(order_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] * (order_ref[pl.program_id(0)] + 1).astype(f32)
  fn = lambda: _call(kernel, jax.ShapeDtypeStruct(x.shape, f32),
                     grid_spec=pltpu.PrefetchScalarGridSpec(
                         num_scalar_prefetch=1, grid=(4,),
                         in_specs=[pl.BlockSpec((8, 128), lambda i, o: (o[i], 0))],
                         out_specs=pl.BlockSpec((8, 128), lambda i, o: (i, 0))),
                     compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))(order, x)
  compare(fn)


def test_megacore_split_gives_each_core_its_own_scratch():
  def kernel(o_ref, acc):
    @pl.when(pl.program_id(1) == 0)
    def _():
      acc[0] = 0
    acc[0] += 1
    o_ref[0, 0] = acc[0]
  run = lambda: _call(kernel, jax.ShapeDtypeStruct((2, 8, 128), jnp.int32), grid=(2, 3),
                      out_specs=pl.BlockSpec((None, 8, 128), lambda c, i: (c, 0, 0)),
                      scratch_shapes=[pltpu.SMEM((1,), jnp.int32)],
                      compiler_params=pltpu.CompilerParams(
                          dimension_semantics=("parallel", "arbitrary")))()
  with numpy_mode(num_cores=2):
    got = np.asarray(run())
  assert got[0, 0, 0] == 3 and got[1, 0, 0] == 3


def test_emit_pipeline_with_allocations_reused_twice():
  pallas_np.assume_tpu_chip("v5e")
  x = jnp.arange(32 * 256, dtype=f32).reshape(32, 256)

  def inner(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 3.0

  spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
  pipeline, make_allocations = pltpu.emit_pipeline_with_allocations(
      inner, grid=(4, 2), in_specs=[spec], out_specs=[spec])

  def kernel(x_hbm, o_hbm, o2_hbm):
    def body(allocs):
      pipeline(x_hbm, o_hbm, allocations=allocs)
      pipeline(o_hbm, o2_hbm, allocations=allocs)
    pl.run_scoped(body, make_allocations(x_hbm, o_hbm))
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  fn = lambda: _call(kernel, (jax.ShapeDtypeStruct(x.shape, f32),) * 2,
                     in_specs=[any_spec], out_specs=(any_spec, any_spec))(x)
  with numpy_mode():
    o1, o2 = fn()
  np.testing.assert_array_equal(np.asarray(o1), np.asarray(x) * 3)
  np.testing.assert_array_equal(np.asarray(o2), np.asarray(x) * 9)


def test_accumulating_dma():
  x = jnp.arange(8 * 128, dtype=f32).reshape(8, 128)

  def kernel(x_hbm, o_ref, sem):
    o_ref[...] = jnp.ones_like(o_ref)
    pltpu.make_async_copy(x_hbm, o_ref, sem).start(add=True)
    pltpu.make_async_copy(x_hbm, o_ref, sem).wait()
  with numpy_mode():
    got = _call(kernel, jax.ShapeDtypeStruct(x.shape, f32),
                in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                scratch_shapes=[pltpu.SemaphoreType.DMA])(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x) + 1)


def test_race_detector_sees_dma_writes():
  """Two 'parallel' grid points DMA into the same output rows."""
  x = jnp.arange(16 * 128, dtype=f32).reshape(16, 128)

  def kernel(x_hbm, o_hbm, sem):
    i = pl.program_id(0)
    cp = pltpu.make_async_copy(x_hbm.at[pl.ds(i * 8, 8)], o_hbm.at[pl.ds(0, 8)], sem)
    cp.start()
    cp.wait()
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  with numpy_mode(detect_races=True), pytest.raises(Exception, match="(?i)race"):
    jax.block_until_ready(_call(
        kernel, jax.ShapeDtypeStruct(x.shape, f32), grid=(2,), in_specs=[any_spec],
        out_specs=any_spec, scratch_shapes=[pltpu.SemaphoreType.DMA],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))(x))
