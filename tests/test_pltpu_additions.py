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


needs_conv = pytest.mark.skipif(not hasattr(pltpu, "conv"), reason="pltpu.conv is JAX >= 0.12")


@needs_conv
@pytest.mark.parametrize("with_acc", [False, True])
def test_conv_nhwc_matches_xla(with_acc):
  """pltpu.conv inside a kernel vs lax.conv_general_dilated compiled by XLA
  outside it (no interpreter runs pltpu.conv: neither interpret=True nor TPU
  interpret mode has a CPU rule for it)."""
  key = jax.random.key(0)
  x = jax.random.normal(key, (2, 9, 10, 8), jnp.float32)
  w = jax.random.normal(jax.random.fold_in(key, 1), (3, 2, 8, 16), jnp.float32)
  acc = jax.random.normal(jax.random.fold_in(key, 2), (2, 5, 9, 16), jnp.float32)
  kw = dict(dimension_numbers=("NHWC", "HWIO", "NHWC"), window_strides=(2, 1),
            padding=((1, 1), (0, 1)), rhs_dilation=(1, 2))

  def kernel(x_ref, w_ref, a_ref, o_ref):
    a = a_ref[...] if with_acc else None
    o_ref[...] = pltpu.conv(x_ref[...], w_ref[...], a, **kw)
  got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(acc.shape, jnp.float32),
                       interpret="numpy")(x, w, acc)
  want = jax.lax.conv_general_dilated(x, w, precision=jax.lax.Precision.HIGHEST, **kw)
  if with_acc:
    want = want + acc
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


@needs_conv
def test_grouped_conv_is_unsupported():
  x = jnp.ones((1, 4, 4, 4), jnp.float32)
  w = jnp.ones((1, 1, 2, 4), jnp.float32)

  def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = pltpu.conv(x_ref[...], w_ref[...], dimension_numbers=("NHWC", "HWIO", "NHWC"),
                            feature_group_count=2)
  with pytest.raises(pallas_np.UnsupportedError, match="feature/batch groups"):
    pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1, 4, 4, 4), jnp.float32),
                   interpret="numpy")(x, w)
