"""pallas_np.jit: the whole traced program in the NumPy evaluator."""
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_np
from tests.helpers import assert_no_xla_compiles
from tests.conftest import assert_same


def _scale_kernel(x_ref, o_ref, *, factor):
  o_ref[...] = x_ref[...] * factor + pl.program_id(0)


def _program(x, w, factor=2.0, interpret=False):
  # XLA work around the kernel: a matmul, a reduction, a reshape.
  h = jnp.tanh(x @ w)
  y = pl.pallas_call(functools.partial(_scale_kernel, factor=factor),
                     out_shape=jax.ShapeDtypeStruct(h.shape, h.dtype), grid=(h.shape[0] // 8,),
                     in_specs=[pl.BlockSpec((8, h.shape[1]), lambda i: (i, 0))],
                     out_specs=pl.BlockSpec((8, h.shape[1]), lambda i: (i, 0)),
                     interpret=interpret)(h)
  return {"y": y.reshape(-1, 2 * h.shape[1]), "total": y.sum(axis=0)}


def _args(seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((32, 16)), jnp.float32),
          jnp.asarray(rng.standard_normal((16, 24)), jnp.float32))




def test_matches_jax_jit_interpret_true_and_compiles_nothing():
  x, w = _args()
  want = jax.jit(functools.partial(_program, interpret=True))(x, w)
  f = pallas_np.jit(_program)  # interpret=False inside: forced to numpy mode
  x2, w2 = _args(1)
  jax.block_until_ready((x2, w2))
  with assert_no_xla_compiles():
    got = f(x, w)
    got2 = f(x2, w2)
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  assert isinstance(got["y"], jax.Array)
  for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert_same(g, e, rtol=1e-5, atol=1e-5)
  want2 = jax.jit(functools.partial(_program, interpret=True))(x2, w2)
  assert_same(got2["total"], want2["total"], rtol=1e-5, atol=1e-5)


def test_static_argnums_and_argnames():
  x, w = _args(2)
  f = pallas_np.jit(_program, static_argnums=(2,), static_argnames=("interpret",))
  ref = jax.jit(_program, static_argnums=(2,), static_argnames=("interpret",))
  for factor in (3.0, -0.5):
    got = f(x, w, factor, interpret=False)
    want = ref(x, w, factor, interpret=True)
    assert_same(got["y"], want["y"], rtol=1e-5, atol=1e-5)
  # static by name (inferred from the signature like jax.jit does)
  got = pallas_np.jit(_program, static_argnames=("factor",))(x, w, factor=4.0)
  assert_same(got["total"], ref(x, w, 4.0, interpret=True)["total"], rtol=1e-5, atol=1e-5)


def test_under_outer_transform_falls_back_to_forced_jax_jit():
  x, w = _args(3)
  f = pallas_np.jit(_program, static_argnums=(2,))
  got = jax.jit(lambda a, b: f(a, b, 1.5)["total"])(x, w)
  want = jax.jit(lambda a, b: _program(a, b, 1.5, interpret=True)["total"])(x, w)
  assert_same(got, want, rtol=1e-5, atol=1e-5)


def test_megablox_gmm_vs_reference():
  # the package's ``gmm`` attribute is the function, not the module
  gmm_mod = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((3, 128, 128)), jnp.float32)
  group_sizes = jnp.array([128, 0, 128], jnp.int32)
  f = pallas_np.jit(lambda a, b, g: gmm_mod.gmm(a, b, g, tiling=(128, 128, 128)))
  jax.block_until_ready((lhs, rhs, group_sizes))
  with assert_no_xla_compiles():  # gmm's group metadata etc. run in NumPy too
    got = np.asarray(f(lhs, rhs, group_sizes))
  want = np.concatenate([np.asarray(lhs[:128]) @ np.asarray(rhs[0]),
                         np.asarray(lhs[128:]) @ np.asarray(rhs[2])])
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_unsupported_outer_primitive_raises():
  f = pallas_np.jit(lambda x: jnp.linalg.eigh(x)[0])
  with pytest.raises(pallas_np.UnsupportedError):
    f(jnp.eye(4, dtype=jnp.float32))
