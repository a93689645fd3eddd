"""Typed PRNG keys as kernel operands and outputs moved by DMA.

A key array (``key<fry>``, ``key<pl>``) is held as its key data; a DMA of it
moves (and its wait counts) the key data's bytes, and a kernel output of key
dtype crosses the traced path's host callback as key data, wrapped back into
keys (JAX's ``tpu_pallas_random_test.test_output_physical_key``)."""
import jax
import numpy as np
import pytest
from jax import random as jax_random
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np


def _copy_keys(keys, memory_space):
  def body(x_ref, o_ref):
    pltpu.sync_copy(x_ref, o_ref)
  return pl.pallas_call(
      body, out_shape=jax.ShapeDtypeStruct(keys.shape, jax.typeof(keys).dtype),
      in_specs=[pl.BlockSpec(memory_space=memory_space)],
      out_specs=pl.BlockSpec(memory_space=memory_space))(keys)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@pytest.mark.parametrize("pallas_key", [False, True])
def test_key_output_through_dma(impl, pallas_key):
  key = jax_random.key(3, impl=impl)
  if pallas_key:
    key = pltpu.to_pallas_key(key)
  space = pltpu.SMEM if key.ndim == 0 else pl.ANY
  with pallas_np.force_numpy_interpret():
    out = jax.jit(lambda k: _copy_keys(k, space))(key)
  assert jax.typeof(out).dtype == jax.typeof(key).dtype
  np.testing.assert_array_equal(jax_random.key_data(out), jax_random.key_data(key))


def test_key_array_output_through_dma():
  keys = jax_random.split(jax_random.key(5), 4)
  with pallas_np.force_numpy_interpret():
    out = jax.jit(lambda k: _copy_keys(k, pl.ANY))(keys)
  np.testing.assert_array_equal(jax_random.key_data(out), jax_random.key_data(keys))
