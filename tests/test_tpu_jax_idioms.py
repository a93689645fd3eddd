"""Small idioms of JAX's TPU test files (``tpu_pallas_test.py``)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def test_dynamic_grid_bound_of_shape_one():
  """``grid=(n,)`` with ``n`` a shape-(1,) array (JAX accepts it): the
  kernel counts its grid points into an SMEM output."""
  def body(_, o_ref):
    o_ref[0] = jax.lax.cond(pl.program_id(0) == 0, lambda: 1, lambda: o_ref[0] + 1)

  def run(n):
    return pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
        grid_spec=pl.GridSpec(grid=(n,), in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
                              out_specs=pl.BlockSpec(memory_space=pltpu.SMEM)),
        interpret="numpy")(n)

  n = jnp.array([7], jnp.int32)
  np.testing.assert_array_equal(np.asarray(jax.jit(run)(n)), [7])
  np.testing.assert_array_equal(np.asarray(run(n)), [7])


def test_select_ref_picks_the_dma_operand_at_run_time():
  """``pl.select_ref(i, *refs)`` as a DMA source and semaphore (JAX's
  ``test_select_ref``): row block ``i`` of the output comes from input ``i``."""
  n = 3
  if not hasattr(pl, "select_ref"):
    return

  def kernel(*refs):
    *xs, y_ref, sems = refs

    @pl.loop(0, n)
    def _(i):
      pltpu.async_copy(pl.select_ref(i, *xs), y_ref.at[pl.ds(8 * i, 8)],
                       pl.select_ref(i % 2, sems.at[0], sems.at[1])).wait()

  xs = [np.full((8, 128), k + 1, np.float32) for k in range(n)]
  out = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((8 * n, 128), jnp.float32),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * n,
      out_specs=pl.BlockSpec(memory_space=pl.ANY),
      scratch_shapes=[pltpu.SemaphoreType.DMA((2,))], interpret="numpy")(*xs)
  np.testing.assert_array_equal(np.asarray(out), np.concatenate(xs))
