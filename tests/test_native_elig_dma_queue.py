"""The compiled DMA queue (pallas_np/native/dma_queue.py): local
``dma_start``/``dma_wait`` of a compiled loop run in machine code, with the
NumPy path's semantics (the source read when a wait pops the copy, oldest
first per semaphore, the same counts and errors). Before, every one of them
called back into its NumPy rule (``dma_calls``): the call counts below fail
without the queue."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np import native

from tests.native_elig_util import bits

R, STEPS = 8, 6


def _params(mode, **kw):
  return pallas_np.InterpretParams(native_loops=mode, **kw)


def _double_buffered(x_hbm, o_ref, buf, sem):
  """Double buffering through chained ``.at`` windows: a strided column
  block of a 3-D source (rows of ``x_hbm[i]``, every other column pair),
  the first copy started before the loop, the last waited after it."""
  def copy(i, slot):
    return pltpu.make_async_copy(x_hbm.at[i % 2].at[pl.ds(i * R, R), pl.ds(8, 64)],
                                 buf.at[slot], sem.at[slot])
  copy(0, 0).start()
  o_ref[...] = jnp.zeros_like(o_ref)

  def body(i, carry):
    slot = i % 2
    copy(i + 1, 1 - slot).start()
    copy(i, slot).wait()
    o_ref[...] = o_ref[...] * 0.5 + buf[slot]
    return carry
  lax.fori_loop(0, STEPS, body, 0)
  copy(STEPS, STEPS % 2).wait()
  o_ref[...] += buf[STEPS % 2]


def _make(interp, kernel=_double_buffered):
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((R, 64), jnp.float32),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
      scratch_shapes=[pltpu.VMEM((2, R, 64), jnp.float32), pltpu.SemaphoreType.DMA((2,))],
      interpret=interp)


def _x():
  return jnp.asarray(np.random.default_rng(7).standard_normal((2, (STEPS + 1) * R, 80)),
                     jnp.float32)


def test_loop_dmas_run_compiled(dma_callbacks):
  """2 * STEPS DMA sites run; only the first wait (of the copy the NumPy
  path started before the loop) and the exit's hand-over of the copy still
  in flight call back. Bits equal the NumPy path's and JAX's TPU
  interpret mode's."""
  x = _x()
  want = _make(_params("off"))(x)
  before, calls = native.stats()["native_calls"], dma_callbacks[0]
  got = _make(_params("sync"))(x)
  assert native.stats()["native_calls"] > before, "the compiled loop did not run"
  assert dma_callbacks[0] - calls <= 2, f"{dma_callbacks[0] - calls} dma_callbacks of {2 * STEPS} sites"
  np.testing.assert_array_equal(bits(got), bits(want))
  np.testing.assert_array_equal(bits(got), bits(_make(pltpu.InterpretParams())(x)))


def _source_written_before_wait(x_hbm, o_ref, src, buf, sem):
  """The source changes between a copy's start and its wait: the copy
  moves what the source holds at the wait (TPU interpret mode's on_wait)."""
  o_ref[...] = jnp.zeros_like(o_ref)

  def body(i, carry):
    src[...] = jnp.full_like(src, i.astype(jnp.float32))
    cp = pltpu.make_async_copy(src.at[pl.ds(0, R)], buf, sem.at[0])
    cp.start()
    src[...] = src[...] + 100.0
    cp.wait()
    o_ref[...] = o_ref[...] + buf[...]
    return carry
  lax.fori_loop(0, STEPS, body, 0)


def test_source_read_at_wait(dma_callbacks):
  make = lambda interp: pl.pallas_call(
      _source_written_before_wait, out_shape=jax.ShapeDtypeStruct((R, 128), jnp.float32),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
      scratch_shapes=[pltpu.VMEM((2 * R, 128), jnp.float32), pltpu.VMEM((R, 128), jnp.float32),
                      pltpu.SemaphoreType.DMA((1,))],
      interpret=interp)
  x = jnp.zeros((R, 128), jnp.float32)
  calls = dma_callbacks[0]
  got = make(_params("sync"))(x)
  assert dma_callbacks[0] == calls, "the loop's DMAs called back"
  np.testing.assert_array_equal(bits(got), bits(make(_params("off"))(x)))
  np.testing.assert_array_equal(bits(got), bits(make(pltpu.InterpretParams())(x)))
  assert float(np.asarray(got)[0, 0]) == sum(i + 100.0 for i in range(STEPS))


def _fifo(x_hbm, o_ref, buf, sem):
  """Two copies into one buffer on one semaphore, waited one at a time:
  the oldest lands first (the NumPy path's DMA engine order)."""
  o_ref[...] = jnp.zeros_like(o_ref)

  def body(i, carry):
    a = pltpu.make_async_copy(x_hbm.at[pl.ds(i * R, R)], buf, sem.at[0])
    b = pltpu.make_async_copy(x_hbm.at[pl.ds(i * R + R, R)], buf, sem.at[0])
    a.start()
    b.start()
    a.wait()
    o_ref[...] = o_ref[...] * 2.0 + buf[...]
    b.wait()
    o_ref[...] = o_ref[...] * 3.0 + buf[...]
    return carry
  lax.fori_loop(0, STEPS, body, 0)


def test_same_semaphore_oldest_first(dma_callbacks):
  make = lambda interp: pl.pallas_call(
      _fifo, out_shape=jax.ShapeDtypeStruct((R, 128), jnp.float32),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
      scratch_shapes=[pltpu.VMEM((R, 128), jnp.float32), pltpu.SemaphoreType.DMA((1,))],
      interpret=interp)
  x = jnp.asarray(np.random.default_rng(3).standard_normal(((STEPS + 1) * R, 128)), jnp.float32)
  calls = dma_callbacks[0]
  got = make(_params("sync"))(x)
  assert dma_callbacks[0] == calls, "the loop's DMAs called back"
  np.testing.assert_array_equal(bits(got), bits(make(_params("off"))(x)))
  xs = np.asarray(x).reshape(STEPS + 1, R, 128)
  acc = np.zeros((R, 128), np.float32)
  for i in range(STEPS):
    acc = acc * np.float32(2) + xs[i]
    acc = acc * np.float32(3) + xs[i + 1]
  np.testing.assert_array_equal(np.asarray(got), acc)


def _left_in_flight(x_hbm, o_ref, buf, sem):
  """Copies started in the loop on two semaphores, the last two never
  waited: the kernel's end names the first one still in flight."""
  o_ref[...] = jnp.zeros_like(o_ref)

  def body(i, carry):
    for s in (0, 1):
      pltpu.make_async_copy(x_hbm.at[pl.ds(i * R, R)], buf.at[s], sem.at[s]).start()

    @pl.when(i < STEPS - 1)
    def _():
      for s in (1, 0):
        pltpu.make_async_copy(x_hbm.at[pl.ds(i * R, R)], buf.at[s], sem.at[s]).wait()
    o_ref[...] += buf[0]
    return carry
  lax.fori_loop(0, STEPS, body, 0)


@pytest.mark.parametrize("mode", ["off", "sync"])
def test_in_flight_at_kernel_end_as_numpy(mode):
  make = lambda interp: pl.pallas_call(
      _left_in_flight, out_shape=jax.ShapeDtypeStruct((R, 128), jnp.float32),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
      scratch_shapes=[pltpu.VMEM((2, R, 128), jnp.float32), pltpu.SemaphoreType.DMA((2,))],
      interpret=interp)
  x = jnp.zeros((STEPS * R, 128), jnp.float32)
  with pytest.raises(RuntimeError, match="2 DMA") as want:
    make(_params("off"))(x)
  with pytest.raises(RuntimeError) as got:
    make(_params(mode))(x)
  assert str(got.value) == str(want.value)


G, LONG = 3, 40


def _across_grid_points(x_hbm, o_ref, buf, sem):
  """Paged attention's pattern: the next copy started in one grid point's
  loop is waited in the next grid point's (its rows outlive the loop
  call: ``dma_stash``); 3 * 40 copies pass through a 64-row queue."""
  p = pl.program_id(0)
  o_ref[...] = jnp.zeros_like(o_ref)

  def copy(g):
    return pltpu.make_async_copy(x_hbm.at[pl.ds(g * R, R)], buf.at[g % 2], sem.at[g % 2])

  def body(i, carry):
    g = p * LONG + i

    @pl.when(g == 0)
    def _():
      copy(g).start()

    @pl.when(g + 1 < G * LONG)
    def _():
      copy(g + 1).start()
    copy(g).wait()
    o_ref[...] = o_ref[...] * 3 + buf[g % 2]  # (int32: exact in XLA too)
    return carry
  lax.fori_loop(0, LONG, body, 0)


def test_dmas_waited_in_the_next_grid_point(dma_callbacks):
  make = lambda interp: pl.pallas_call(
      _across_grid_points, grid=(G,),
      out_shape=jax.ShapeDtypeStruct((G * R, 128), jnp.int32),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((R, 128), lambda p: (p, 0)),
      scratch_shapes=[pltpu.VMEM((2, R, 128), jnp.int32), pltpu.SemaphoreType.DMA((2,))],
      interpret=interp)
  x = jnp.asarray(np.random.default_rng(11).integers(-2**31, 2**31, (G * LONG * R, 128)),
                  jnp.int32)
  want = make(_params("off"))(x)
  calls = dma_callbacks[0]
  got = make(_params("sync"))(x)
  assert dma_callbacks[0] == calls, f"{dma_callbacks[0] - calls} dma_callbacks"
  np.testing.assert_array_equal(bits(got), bits(want))
  np.testing.assert_array_equal(bits(got), bits(make(pltpu.InterpretParams())(x)))


def _left_for_the_end(x_hbm, o_ref, buf, sem):
  """Grid point 0's loop starts a copy nobody waits for; grid point 1's
  loop runs (the row stays queued through it): the kernel's end names
  the grid point that started it."""
  p = pl.program_id(0)
  o_ref[...] = jnp.zeros_like(o_ref)

  def body(i, carry):
    @pl.when(jnp.logical_and(p == 0, i == STEPS - 1))
    def _():
      pltpu.make_async_copy(x_hbm.at[pl.ds(i * R, R)], buf.at[0], sem.at[0]).start()
    o_ref[...] += jnp.float32(1)
    return carry
  lax.fori_loop(0, STEPS, body, 0)


def test_in_flight_names_its_grid_point(dma_callbacks):
  make = lambda interp: pl.pallas_call(
      _left_for_the_end, grid=(2,), out_shape=jax.ShapeDtypeStruct((2 * R, 128), jnp.float32),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((R, 128), lambda p: (p, 0)),
      scratch_shapes=[pltpu.VMEM((2, R, 128), jnp.float32), pltpu.SemaphoreType.DMA((2,))],
      interpret=interp)
  x = jnp.zeros((STEPS * R, 128), jnp.float32)
  with pytest.raises(RuntimeError, match=r"grid point \(0,\)") as want:
    make(_params("off"))(x)
  calls = dma_callbacks[0]
  with pytest.raises(RuntimeError) as got:
    make(_params("sync"))(x)
  assert dma_callbacks[0] == calls, "the start called back"
  assert str(got.value) == str(want.value)


def _strided(x_ref, o_ref, buf, sem):
  """Windows of stride 2 and 3 on both sides (an element at a time) from
  a whole VMEM ref, on a 0-d semaphore."""
  o_ref[...] = jnp.zeros_like(o_ref)
  buf[...] = jnp.zeros_like(buf)

  def body(i, carry):
    cp = pltpu.make_async_copy(x_ref.at[pl.ds(i % 2, 4, stride=2), pl.ds(1, 32, stride=3)],
                               buf.at[pl.ds(1, 4), pl.ds(2, 32, stride=2)], sem)
    cp.start()
    cp.wait()
    o_ref[...] = o_ref[...] * 2.0 + buf[...]
    buf[...] = buf[...] * 0.5
    return carry
  lax.fori_loop(0, STEPS, body, 0)


def test_strided_windows(dma_callbacks):
  make = lambda interp: pl.pallas_call(
      _strided, out_shape=jax.ShapeDtypeStruct((R, 128), jnp.float32),
      in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
      scratch_shapes=[pltpu.VMEM((R, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
      interpret=interp)
  x = jnp.arange(R * 128, dtype=jnp.float32).reshape(R, 128)
  calls = dma_callbacks[0]
  got = make(_params("sync"))(x)
  assert dma_callbacks[0] == calls, "the loop's DMAs called back"
  np.testing.assert_array_equal(bits(got), bits(make(_params("off"))(x)))
  np.testing.assert_array_equal(bits(got), bits(make(pltpu.InterpretParams())(x)))


def _signals(o_ref, sem):
  """Local signals and decrementing waits in the loop, compiled (counts
  in place); the count read after it on the NumPy path."""
  def body(i, carry):
    pl.semaphore_signal(sem, i + 2)
    pl.semaphore_wait(sem, i + 1)
    return carry + 1
  n = lax.fori_loop(0, STEPS, body, jnp.int32(0))
  o_ref[0] = pl.semaphore_read(sem) * 100 + n


def test_semaphore_signal_and_wait_compiled(dma_callbacks):
  make = lambda interp: pl.pallas_call(
      _signals, out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
      out_specs=pl.BlockSpec(memory_space=pltpu.SMEM),
      scratch_shapes=[pltpu.SemaphoreType.REGULAR], interpret=interp)
  calls = dma_callbacks[0]
  got = make(_params("sync"))()
  # (at most the read after the loop: the body is compiled with its loop,
  # docs/native_bodies.md, and its semaphore_read calls back)
  assert dma_callbacks[0] - calls <= 1, "the loop's signals and waits called back"
  np.testing.assert_array_equal(np.asarray(got), np.asarray(make(_params("off"))()))
  assert int(np.asarray(got)[0]) == STEPS * 100 + STEPS
