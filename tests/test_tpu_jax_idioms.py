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
