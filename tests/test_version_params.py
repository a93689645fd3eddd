"""Eqn params that moved between JAX 0.10 and 0.12, read through
``_compat.versions`` accessors: kernels that bind the primitives involved,
numpy mode against interpret=True (and the accessors on both param layouts)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

import pallas_np  # noqa: F401  (installs interpret="numpy")
from pallas_np import _compat as jc


def _composite_kernel(x_ref, o_ref):
  def scaled_plus_one(v):
    return v * 2.0 + 1.0
  scaled_plus_one = jax.lax.composite(scaled_plus_one, name="pallas_np_test.scaled_plus_one")

  o_ref[...] = scaled_plus_one(x_ref[...])


def test_composite_body_in_a_kernel_vs_interpret():
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128) / 7
  out = jax.ShapeDtypeStruct(x.shape, x.dtype)
  got = pl.pallas_call(_composite_kernel, out_shape=out, interpret="numpy")(x)
  want = pl.pallas_call(_composite_kernel, out_shape=out, interpret=True)(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_accessors_read_both_layouts():
  assert jc.composite_body({"jaxpr": "j10"}) == "j10"
  assert jc.composite_body({"call_jaxpr": "j12", "name": "c"}) == "j12"
  assert jc.mesh_kernel_meshes({"mesh": "m"}) == ("m",)
  assert jc.mesh_kernel_meshes({"meshes": ("a", "b")}) == ("a", "b")
  assert jc.mesh_kernel_bodies({"jaxpr": "j"}) == ("j",)
  assert jc.mesh_kernel_bodies({"jaxprs": ("j", "k")}) == ("j", "k")
  assert jc.static_wait_count({}) is None and jc.static_wait_count({"n": 2}) == 2
  assert jc.copy_has_barrier({}) is True and jc.copy_has_barrier({"has_barrier": False}) is False
  assert jc.has_user_predicate({}) is False and jc.has_user_predicate({"has_user_predicate": True})
  assert jc.tpu_bitcast_dim({"ty": "x"}) is None and jc.tpu_bitcast_dim({"dim": 0}) == 0
  assert jc.tmem_load_reduction({}) is None
