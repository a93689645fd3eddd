"""DMAs sharing one semaphore complete in the order they were started.

Library kernels (tokamax's SparseCore ``ragged_gather``) start many
same-sized DMAs on one semaphore, then wait for them one chunk at a time and
use each chunk right after its wait, relying on the DMA engine's in-order
completion ("the order of the wait is the same as order of start"). pallas_np
runs queued copies lazily, at the wait, and now oldest first: JAX's TPU
interpret mode (``dma_execution_mode="on_wait"``) runs them newest first,
under which such a kernel reads chunks that have not landed (a wrong answer
the TPU does not give). The expected values are written from the semantics
with NumPy."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np  # noqa: F401  (interpret="numpy")


def _chunked_gather(x, rows):
  """Start one row DMA per index on one semaphore; wait and scale one at a time."""
  n = len(rows)

  def kernel(x_ref, o_ref, buf, sem):
    for i, r in enumerate(rows):
      pltpu.make_async_copy(x_ref.at[r], buf.at[i], sem).start()
    for i in range(n):
      # The wait's descriptor only says how many bytes to wait for (row 0).
      pltpu.make_async_copy(x_ref.at[0], buf.at[0], sem).wait()
      o_ref[i] = buf[i] * 2.0

  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((n, x.shape[1]), x.dtype),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      scratch_shapes=[pltpu.VMEM((n, x.shape[1]), x.dtype), pltpu.SemaphoreType.DMA(())],
      interpret="numpy")(x)


def test_dmas_on_one_semaphore_land_in_start_order():
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  rows = (5, 2, 7, 0, 3)
  got = np.asarray(_chunked_gather(x, rows))
  np.testing.assert_array_equal(got, np.asarray(x)[list(rows)] * 2.0)


def test_dma_order_under_jit():
  x = jnp.arange(4 * 128, dtype=jnp.float32).reshape(4, 128) - 100.0
  rows = (3, 1, 2)
  got = np.asarray(jax.jit(lambda a: _chunked_gather(a, rows))(x))
  np.testing.assert_array_equal(got, np.asarray(x)[list(rows)] * 2.0)
