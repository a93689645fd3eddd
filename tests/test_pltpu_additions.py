"""pltpu primitives added in JAX 0.12 (issue 28): ``has_memory_space``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np  # noqa: F401  (installs interpret="numpy")

needs_has_memory_space = pytest.mark.skipif(
    not hasattr(pltpu, "has_memory_space"), reason="pltpu.has_memory_space is JAX >= 0.12")


@needs_has_memory_space
@pytest.mark.parametrize("space,want", [("HBM", 1.0), ("VMEM", 7.0)])
def test_has_memory_space_of_an_any_ref(space, want):
  """A pl.ANY operand lives in HBM here, as TPU interpret mode places it.
  No JAX oracle: neither interpret=True nor TPU interpret mode can lower
  has_memory_space on CPU ("MLIR translation rule ... not found")."""
  def kernel(x_hbm, o_ref):
    def copy():
      pltpu.sync_copy(x_hbm, o_ref)

    def fill():
      o_ref[...] = jnp.full(o_ref.shape, 7.0, o_ref.dtype)
    jax.lax.cond(pltpu.has_memory_space(x_hbm, getattr(pltpu, space)), copy, fill)
  x = jnp.ones((8, 128), jnp.float32)

  def run(interpret):
    return np.asarray(pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)], interpret=interpret)(x))
  np.testing.assert_array_equal(run("numpy"), np.full(x.shape, want, np.float32))
  with pytest.raises(NotImplementedError, match="has_memory_space"):
    run(pltpu.InterpretParams())  # if this starts to run, make it the oracle
