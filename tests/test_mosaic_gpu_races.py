"""Race detection in Mosaic GPU (plgpu) kernels: ``detect_races=True``.

JAX's GPU interpret mode has its own race detector but cannot run most of
these kernels (and reports differently), so the expectations come from the
semantics: on a GPU, warpgroups of a block run concurrently and are ordered
only by barrier arrive -> wait of the same phase; an asynchronous copy or
wgmma is ordered after its issue and before its completion wait; blocks are
never ordered with each other. Each racy kernel has a correct twin that
differs by exactly the missing edge, so a detector that ignored the edge
fails the twin, and one that invented it fails the racy kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from tests.mgpu_helpers import gpu_kernels, plgpu, producer_consumer  # noqa: F401

import pallas_np
from pallas_np.errors import KernelError

RACES = pallas_np.InterpretParams(detect_races=True)
F32 = jnp.float32


def _x(shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape, F32)


def _run(f, *args, params=RACES):
  with pallas_np.force_numpy_interpret(params):
    return f(*args)


def _race(f, *args):
  with pytest.raises(pallas_np.RaceError) as info:
    _run(f, *args)
  assert isinstance(info.value, KernelError)  # names the kernel line
  return str(info.value)


# -- warpgroups ordered by a barrier --------------------------------------------
def _handoff(wait: bool):
  """wg 0 writes SMEM and arrives; wg 1 (optionally) waits, then reads."""
  def body(x_ref, o_ref):
    def scoped(smem, bar):
      wg = jax.lax.axis_index("wg")

      @pl.when(wg == 0)
      def _():
        smem[...] = x_ref[...] + 1.0
        plgpu.barrier_arrive(bar)

      @pl.when(wg == 1)
      def _():
        if wait:
          plgpu.barrier_wait(bar)
        o_ref[...] = smem[...]
    pl.run_scoped(scoped, plgpu.SMEM((64, 128), F32), plgpu.Barrier(num_arrivals=1),
                  collective_axes="wg")
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 128), F32),
                      num_threads=2, thread_name="wg")


def test_barrier_orders_a_write_before_a_read_in_another_warpgroup():
  x = _x((64, 128))
  np.testing.assert_array_equal(_run(_handoff(wait=True), x), np.asarray(x) + 1)


def test_read_without_the_barrier_wait_is_a_race():
  msg = _race(_handoff(wait=False), _x((64, 128)))
  assert "warpgroup 1 of block ()" in msg and "warpgroup 0 of block ()" in msg
  assert "SMEM" in msg and "test_mosaic_gpu_races.py" in msg


def _two_writers(sync: bool):
  def body(o_ref):
    def scoped(smem, bar):
      wg = jax.lax.axis_index("wg")

      @pl.when(wg == 0)
      def _():
        smem[...] = jnp.zeros_like(smem)
        plgpu.barrier_arrive(bar)

      @pl.when(wg == 1)
      def _():
        if sync:
          plgpu.barrier_wait(bar)
        smem[0:8] = jnp.ones((8, 128), F32)
        o_ref[...] = smem[...]
    pl.run_scoped(scoped, plgpu.SMEM((64, 128), F32), plgpu.Barrier(num_arrivals=1),
                  collective_axes="wg")
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 128), F32),
                      num_threads=2, thread_name="wg")


def test_two_warpgroups_writing_the_same_smem():
  want = np.zeros((64, 128), np.float32)
  want[:8] = 1
  np.testing.assert_array_equal(_run(_two_writers(sync=True)), want)
  msg = _race(_two_writers(sync=False))
  assert "writes element (0, 0)" in msg


# -- TMA copies ------------------------------------------------------------------
def test_warp_specialized_pipeline_has_no_race():
  x = _x((256, 128))
  np.testing.assert_array_equal(_run(producer_consumer(), x), np.asarray(x) * 3)


def test_consumer_reading_before_the_copy_wait_is_a_race():
  msg = _race(producer_consumer(consumer_waits=False), _x((256, 128)))
  assert "warpgroup 1" in msg and "TMA copy issued by warpgroup 0" in msg


def test_producer_overwriting_a_slot_still_being_read_is_a_race():
  """A consumer that hands a slot back (arrives on ``free``) before reading
  it: the producer's next copy into the slot races the read (write after
  read), although this interleaving happens to read the right data."""
  msg = _race(producer_consumer(release_early=True), _x((256, 128)))
  assert "TMA copy issued by warpgroup 0" in msg and "warpgroup 1 of block ()" in msg
  assert " read;" in msg


def _self_read(wait_first: bool):
  def body(x_ref, o_ref):
    def scoped(smem, bar):
      plgpu.copy_gmem_to_smem(x_ref, smem, bar)
      if wait_first:
        plgpu.barrier_wait(bar)
      o_ref[...] = smem[...]
      if not wait_first:
        plgpu.barrier_wait(bar)
    pl.run_scoped(scoped, plgpu.SMEM((64, 128), F32), plgpu.Barrier(num_arrivals=1))
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 128), F32))


def test_reading_smem_a_copy_still_writes_is_reported():
  """Without detection this reads NaN (tests/test_mosaic_gpu.py); with it,
  an error naming the issuing warpgroup's copy, even in a one-warpgroup kernel."""
  x = _x((64, 128))
  np.testing.assert_array_equal(_run(_self_read(wait_first=True), x), x)
  msg = _race(_self_read(wait_first=False), x)
  assert "block () reads element" in msg and "a TMA copy issued by block ()" in msg


def _store_then_reuse(wait: bool):
  """SMEM -> GMEM copy, then the source buffer is overwritten: the TMA unit
  reads it until ``wait_smem_to_gmem``."""
  def body(x_ref, o_ref):
    def scoped(smem):
      smem[...] = x_ref[...]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(smem, o_ref.at[0])
      if wait:
        plgpu.wait_smem_to_gmem(0)
      smem[...] = x_ref[...] * 2.0
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(smem, o_ref.at[1])
      plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(scoped, plgpu.SMEM((64, 128), F32))
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((2, 64, 128), F32))


def test_reusing_a_store_source_before_its_wait_is_a_race():
  x = _x((64, 128))
  out = _run(_store_then_reuse(wait=True), x)
  np.testing.assert_array_equal(out, np.stack([x, x * 2]))
  msg = _race(_store_then_reuse(wait=False), x)
  assert "a TMA copy issued by block ()" in msg and " read;" in msg



def _cp_async(keep: int):
  """Two copies without a barrier (cp.async), ``wait_gmem_to_smem(keep)``,
  then a read of both slots: both copies are complete only with keep=0."""
  def body(x_ref, o_ref):
    def scoped(smem):
      plgpu.copy_gmem_to_smem(x_ref.at[0], smem.at[0], None)
      plgpu.copy_gmem_to_smem(x_ref.at[1], smem.at[1], None)
      plgpu.wait_gmem_to_smem(keep)
      o_ref[...] = smem[...]
    pl.run_scoped(scoped, plgpu.SMEM((2, 64, 128), F32))
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((2, 64, 128), F32))


def test_cp_async_read_before_its_wait_is_a_race():
  if not hasattr(plgpu, "wait_gmem_to_smem"):
    pytest.skip("copies without a barrier are JAX 0.12 API")  # 0.10: the barrier tests
  x = _x((2, 64, 128))
  np.testing.assert_array_equal(_run(_cp_async(keep=0), x), x)
  msg = _race(_cp_async(keep=1), x)  # the second copy may still be in flight
  assert "a TMA copy issued by block ()" in msg and "element (1, 0, 0)" in msg

# -- wgmma -----------------------------------------------------------------------
def _wgmma_then_overwrite(wait: bool):
  """An SMEM operand overwritten while a wgmma may still read it."""
  def body(a_ref, b_ref, o_ref):
    def scoped(a_smem, b_smem, acc):
      a_smem[...] = a_ref[...]
      b_smem[...] = b_ref[...]
      plgpu.commit_smem()
      plgpu.wgmma(acc, a_smem, b_smem)
      if wait:
        plgpu.wgmma_wait(0)
      a_smem[...] = jnp.zeros_like(a_smem)
      o_ref[...] = acc[...]
    pl.run_scoped(scoped, plgpu.SMEM((64, 64), jnp.float16), plgpu.SMEM((64, 128), jnp.float16),
                  plgpu.ACC((64, 128), F32))
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 128), F32))


def test_overwriting_a_wgmma_operand_before_wgmma_wait_is_a_race():
  a = _x((64, 64), 1).astype(jnp.float16)
  b = _x((64, 128), 2).astype(jnp.float16)
  out = _run(_wgmma_then_overwrite(wait=True), a, b)
  want = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
  np.testing.assert_allclose(out, want, atol=1e-4, rtol=1e-5)
  msg = _race(_wgmma_then_overwrite(wait=False), a, b)
  assert "an MMA (wgmma/tcgen05) issued by block ()" in msg


# -- blocks ------------------------------------------------------------------------
def _blocks_write(shared: bool, atomic: bool = False):
  def body(x_ref, o_ref):
    b = jax.lax.axis_index("b")
    row = 0 if shared else b
    if atomic:
      plgpu.atomic_add(o_ref.at[pl.ds(row * 8, 8)], x_ref[pl.ds(b * 8, 8)])
    else:
      o_ref[pl.ds(row * 8, 8)] = x_ref[pl.ds(b * 8, 8)]
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((16, 128), F32),
                      grid=(2,), grid_names=("b",))


def test_blocks_writing_the_same_gmem_is_a_race_atomics_are_not():
  x = _x((16, 128))
  np.testing.assert_array_equal(_run(_blocks_write(shared=False), x), x)
  msg = _race(_blocks_write(shared=True), x)
  assert "block (1,)" in msg and "block (0,)" in msg and "output 0" in msg
  params = pallas_np.InterpretParams(detect_races=True, uninitialized="zero")
  out = _run(_blocks_write(shared=True, atomic=True), x, params=params)
  np.testing.assert_allclose(out[:8], x[:8] + x[8:], rtol=1e-6)


# -- JAX's kernels are race-free -----------------------------------------------------
def _normal(seed, shape, dtype=jnp.float16):
  # NumPy's generator: jax.random would compile an XLA program per shape.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32)
                     .astype(jnp.dtype(dtype)))


def test_jax_kernels_have_no_race(gpu_kernels):  # noqa: F811
  """JAX's Hopper matmul, ragged dot and attention (warp-specialised, with
  wgmma, TMA and barrier pipelines) run clean and still match."""
  hm, rd, am = gpu_kernels["matmul"], gpu_kernels["ragged"], gpu_kernels["attention"]
  a, b = _normal(0, (256, 128)), _normal(1, (128, 256))
  cfg = hm.TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                        epi_tile_m=64, epi_tile_n=64)
  out = _run(lambda a, b: hm.matmul(a, b, None, cfg), a, b)
  want = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2, rtol=2e-3)
  lhs, rhs = _normal(0, (256, 128)), _normal(1, (4, 128, 128))
  group_sizes = jnp.array([64, 0, 100, 92], jnp.int32)
  out = _run(lambda l, r: rd.ragged_dot(l, r, group_sizes=group_sizes, block_m=64, block_n=64,
                                        block_k=64, max_concurrent_steps=2, grid_block_n=1),
             lhs, rhs)
  want = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=F32)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2, rtol=2e-3)
  q, k, v = (_normal(i, (1, 128, 2, 64)) for i in range(3))
  acfg = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=True)
  out = _run(lambda q, k, v: am.attention(q, k, v, acfg), q, k, v)
  want = am.attention_reference(q, k, v, causal=True)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             atol=3e-3)


def test_jax_attention_backward_has_no_race(gpu_kernels):  # noqa: F811
  """The backward kernels read wgmma results through ``pl.run_state`` over an
  accumulator, which waits for the wgmmas (an edge the detector needs)."""
  am = gpu_kernels["attention"]
  q, k, v = (_normal(i, (1, 128, 2, 64)) for i in range(3))
  cfg = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, block_q_dkv=64,
                        block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)

  def grads(attn):
    loss = lambda q, k, v: (attn(q, k, v).astype(F32) ** 2).sum()  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  ours = _run(lambda: grads(lambda q, k, v: am.attention(q, k, v, cfg)))
  for got, ref in zip(ours, grads(am.attention_reference)):
    scale = float(np.abs(np.asarray(ref, np.float32)).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2 * scale)
