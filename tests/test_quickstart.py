"""The Pallas quickstart examples, numpy mode vs interpret=True."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

import pallas_np
from tests.helpers import run_both


def add_vectors_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] + y_ref[...]


def add_vectors(interpret):
  return lambda x, y: pl.pallas_call(
      add_vectors_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      interpret=interpret)(x, y)


def test_add_vectors():
  run_both(add_vectors, jnp.arange(8.0), jnp.arange(8.0))


def test_add_vectors_pallas_np_entry():
  x = jnp.arange(8, dtype=jnp.int32)
  out = pallas_np.pallas_call(add_vectors_kernel,
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, x)
  np.testing.assert_array_equal(np.asarray(out), np.arange(8) * 2)


def iota_kernel(o_ref):
  i = pl.program_id(0)
  o_ref[i] = i


def test_iota_grid():
  def make(interpret):
    return lambda: pl.pallas_call(
        iota_kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.int32),
        out_specs=pl.BlockSpec(memory_space=pl.ANY) if False else pl.BlockSpec((8,), lambda i: (0,)),
        grid=(8,), interpret=interpret)()
  run_both(make)


def matmul_kernel(x_ref, y_ref, z_ref, *, activation=None):
  z = x_ref[...] @ y_ref[...]
  z_ref[...] = activation(z) if activation else z


def matmul(x, y, *, interpret, activation=None):
  return pl.pallas_call(
      functools.partial(matmul_kernel, activation=activation),
      out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), x.dtype),
      grid=(2, 2),
      in_specs=[pl.BlockSpec((x.shape[0] // 2, x.shape[1]), lambda i, j: (i, 0)),
                pl.BlockSpec((y.shape[0], y.shape[1] // 2), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((x.shape[0] // 2, y.shape[1] // 2), lambda i, j: (i, j)),
      interpret=interpret)(x, y)


def _xy(n=1024):
  k1, k2 = jax.random.split(jax.random.key(0))
  return jax.random.normal(k1, (n, n)), jax.random.normal(k2, (n, n))


def test_blockspec_matmul_1024():
  x, y = _xy()
  run_both(lambda interp: functools.partial(matmul, interpret=interp), x, y,
           rtol=1e-4, atol=1e-3)


def test_fused_activation_matmul():
  x, y = _xy(256)
  run_both(lambda interp: functools.partial(matmul, interpret=interp,
                                            activation=jax.nn.relu), x, y,
           rtol=1e-4, atol=1e-3)


def test_vmapped_matmul():
  k1, k2 = jax.random.split(jax.random.key(1))
  x = jax.random.normal(k1, (4, 128, 128))
  y = jax.random.normal(k2, (4, 128, 128))
  run_both(lambda interp: jax.vmap(functools.partial(matmul, interpret=interp)),
           x, y, rtol=1e-4, atol=1e-3)
