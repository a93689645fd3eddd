"""Typed pltpu PRNG keys (``key<pl>``) in kernels: their words
(``unwrap_pallas_seed``/``wrap_pallas_seed``: prng_split/prng_join) and
``jax.random.fold_in`` on them, against JAX's key data and JAX's TPU
interpret mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_np  # noqa: F401
from jax import random as jax_random
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

plrandom = pytest.importorskip("jax._src.pallas.mosaic.random")


def _smem(kernel, out_shape, interpret):
  return pl.pallas_call(kernel, in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
                        out_specs=pl.BlockSpec(memory_space=pltpu.SMEM),
                        out_shape=out_shape, interpret=interpret)


def _words(key):
  """A pallas_tpu key's two uint32 words (JAX's key data, outside the kernel)."""
  return np.asarray(jax.random.key_data(key), np.uint32).reshape(2)


@pytest.mark.parametrize("seed", [0, 7])
def test_key_words(seed):
  """unwrap_pallas_seed reads the key's words; wrap_pallas_seed joins
  words into a key again (here swapped, read back in the kernel)."""
  def body(key_ref, o_ref):
    w0, w1 = plrandom.unwrap_pallas_seed(key_ref[...])
    o_ref[0, 0] = w0
    o_ref[0, 1] = w1
    v0, v1 = plrandom.unwrap_pallas_seed(plrandom.wrap_pallas_seed(w1, w0, impl="pallas_tpu"))
    o_ref[0, 2] = v0
    o_ref[0, 3] = v1
  key = pltpu.to_pallas_key(jax_random.key(seed, impl="rbg"))
  out = np.asarray(_smem(body, jax.ShapeDtypeStruct((1, 4), jnp.uint32), "numpy")(key))
  w = _words(key)
  np.testing.assert_array_equal(out[0], [w[0], w[1], w[1], w[0]])


@pytest.mark.parametrize("data", [0, 2, 0xFFFFFFFF])
def test_fold_in(data):
  """jax.random.fold_in on a pltpu key: one threefry round over
  (k0, k1 + data) (pltpu's ``_fold_in``), in uint32 arithmetic."""
  def body(key_ref, o_ref):
    w0, w1 = plrandom.unwrap_pallas_seed(jax_random.fold_in(key_ref[...], jnp.uint32(data)))
    o_ref[0, 0] = w0
    o_ref[0, 1] = w1
  key = pltpu.to_pallas_key(jax_random.key(3, impl="rbg"))
  out = np.asarray(_smem(body, jax.ShapeDtypeStruct((1, 2), jnp.uint32), "numpy")(key))
  k0, k1 = (int(x) for x in _words(key))
  m = 0xFFFFFFFF
  v1 = (k1 + data) & m
  v0 = (k0 + v1) & m
  v1 = ((v1 << 13) | (v1 >> 19)) & m
  np.testing.assert_array_equal(out[0], np.array([v0, v0 ^ v1], np.uint32))


def test_fold_in_draws_differ():
  key = pltpu.to_pallas_key(jax_random.key(0, impl="rbg"))
  shape = jax.ShapeDtypeStruct((2, 8, 128), jnp.float32)
  out = np.asarray(pl.pallas_call(
      _fold_in_body, in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
      out_shape=shape, interpret="numpy")(key))
  assert ((out >= 0) & (out < 1)).all() and (out[0] != out[1]).mean() > 0.99


def _fold_in_body(key_ref, o_ref):
  key = key_ref[...]
  o_ref[0, ...] = jax_random.uniform(key, shape=o_ref[0, ...].shape)
  key = jax_random.fold_in(key, jnp.uint32(2))
  o_ref[1, ...] = jax_random.uniform(key, shape=o_ref[1, ...].shape)
