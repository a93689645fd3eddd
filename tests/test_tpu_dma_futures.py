"""DMAs that outlive their kernel, and kernels that close over refs.

A DMA "future" (JAX's ``tpu_pallas_async_test``): one pallas_call starts a
DMA into an output whose semaphore is also an output, a later pallas_call
waits on that semaphore. pallas_np completes such a DMA when the first kernel
ends (``state.dma.check_finished``); a DMA whose semaphore or destination is
scratch still raises "still in flight". A pallas_call that closes over the
refs of an enclosing ``run_state`` and returns nothing must still run (it was
dropped as dead code, leaving the refs unchanged)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax._src.state import discharge as state_discharge

import pallas_np


def _copy_start(x, index=None):
  def kernel(x_ref, aliased_x_ref, o_ref, sem):
    del aliased_x_ref
    src = x_ref if index is None else x_ref.at[index]
    pltpu.make_async_copy(src, o_ref, sem).start()
  out_shape = x.shape if index is None else x.shape[1:]
  return pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct.like(x), jax.ShapeDtypeStruct(out_shape, x.dtype),
                 pltpu.SemaphoreType.DMA(())),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=(pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY),
                 pl.BlockSpec(memory_space=pltpu.SEMAPHORE)),
      input_output_aliases={0: 0})(x)


def _copy_done(x, out, sem, index=None):
  def kernel(x_ref, o_ref, sem, aliased_o_ref):
    del aliased_o_ref
    src = x_ref if index is None else x_ref.at[index]
    pltpu.make_async_copy(src, o_ref, sem).wait()
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pltpu.SEMAPHORE)],
      out_specs=pl.BlockSpec(memory_space=pl.ANY),
      input_output_aliases={1: 0})(x, out, sem)


@pytest.mark.parametrize("index", [None, 2])
def test_dma_future_across_kernels(index):
  @jax.jit
  def f(x):
    x, out, sem = _copy_start(x, index)
    x2, out2, sem2 = _copy_start(x, index)  # two futures in flight at once
    return _copy_done(x, out, sem, index), _copy_done(x2, out2, sem2, index)

  x = np.random.default_rng(0).standard_normal((4, 8, 128)).astype(np.float32)
  with pallas_np.force_numpy_interpret():
    y, y2 = f(x)
  want = x if index is None else x[index]
  np.testing.assert_array_equal(np.asarray(y), want)
  np.testing.assert_array_equal(np.asarray(y2), want)


def test_dma_on_scratch_semaphore_never_waited_raises():
  def kernel(x_ref, o_ref, sem):
    pltpu.make_async_copy(x_ref, o_ref, sem).start()

  call = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pl.ANY),
      scratch_shapes=[pltpu.SemaphoreType.DMA(())], interpret="numpy")
  with pytest.raises(Exception, match="still in flight"):
    jax.block_until_ready(call(jnp.ones((8, 128), jnp.float32)))


def test_kernel_closing_over_run_state_refs_runs():
  def f(x):
    def body(refs):
      x_ref, y_ref = refs

      def kernel():
        y_ref[...] = x_ref[...] * 2 + 1
      pl.pallas_call(kernel, out_shape=())()
    _, y = state_discharge.run_state(body)((x, jnp.zeros_like(x)))
    return y

  x = np.arange(8 * 128, dtype=np.float32).reshape(8, 128)
  with pallas_np.force_numpy_interpret():
    y = jax.jit(f)(x)
  np.testing.assert_array_equal(np.asarray(y), x * 2 + 1)


def test_dma_future_over_run_state_refs():
  """The future's kernels close over ``run_state`` refs (JAX's stateful
  async tests): jit lowers them through XLA host callbacks, which carry the
  semaphore output to the waiting kernel as int32."""
  def start(x_ref, o_ref):
    def kernel(sem):
      pltpu.make_async_copy(x_ref.at[1], o_ref, sem).start()
    return pl.pallas_call(kernel, out_shape=pltpu.SemaphoreType.DMA(()),
                          out_specs=pl.BlockSpec(memory_space=pltpu.SEMAPHORE))()

  def done(x_ref, o_ref, sem):
    def kernel(sem):
      pltpu.make_async_copy(x_ref.at[1], o_ref, sem).wait()
    pl.pallas_call(kernel, out_shape=(),
                   in_specs=[pl.BlockSpec(memory_space=pltpu.SEMAPHORE)])(sem)

  def f(x):
    def body(refs):
      x_ref, y_ref = refs
      done(x_ref, y_ref, start(x_ref, y_ref))
    _, y = state_discharge.run_state(body)((x, jnp.zeros(x.shape[1:], x.dtype)))
    return y

  x = np.random.default_rng(1).standard_normal((3, 8, 128)).astype(np.float32)
  with pallas_np.force_numpy_interpret():
    y = jax.jit(f)(x)
  np.testing.assert_array_equal(np.asarray(y), x[1])
