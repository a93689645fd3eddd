"""The registry is the one place a primitive's rules and properties live:
its sequential rule, its batched rule (or the reason it has none) and its
properties, registered in one call (see "Adding a primitive")."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import batching as jax_batching
from jax.experimental import pallas as pl
from jax.extend.core import Primitive

import pallas_np
from pallas_np import _compat as jc
from pallas_np import batching, registry

# JAX batches these like elementwise ops (vectorized_batcher), but their
# NumPy values carry PRNG key data in trailing dims the logical shape lacks.
_KEY_DATA = {"random_seed", "random_split", "random_bits", "random_fold_in"}


def _jax_elementwise(prim) -> bool:
  """JAX batches ``prim`` as an elementwise op (broadcasting or not)."""
  b = jax_batching.fancy_primitive_batchers.get(prim)
  return isinstance(b, functools.partial) and b.func in (
      jax_batching.broadcast_batcher, jax_batching.vectorized_batcher)


def _has_batched_rule(rule) -> bool:
  return rule.batch is registry.ELEMENTWISE or rule.batch is registry.IDENTITY or (
      callable(rule.batch) and not isinstance(rule.batch, registry.unbatched))


def test_every_elementwise_primitive_has_a_batched_rule():
  missing = sorted(p.name for p, rule in registry._RULES.items()
                   if _jax_elementwise(p) and p.name not in _KEY_DATA
                   and not _has_batched_rule(rule))
  assert not missing, f"elementwise primitives registered without batch=: {missing}"
  # The list JAX gives is not empty (the check above checks something).
  assert sum(_jax_elementwise(p) for p in registry._RULES) > 40


def test_every_primitive_has_a_batched_rule_or_a_reason():
  """``batch=`` is a batched rule, a standard kind, or ``unbatched(why)``:
  never left out."""
  bare = sorted(p.name for p, rule in registry._RULES.items()
                if rule.batch is None)
  assert not bare, f"registered without batch= (a batched rule or unbatched(why)): {bare}"
  for p, rule in registry._RULES.items():
    if isinstance(rule.batch, registry.unbatched):
      assert rule.batch.why.strip(), p.name


def test_properties_are_registered_with_the_rule():
  from jax import lax
  assert registry.properties(lax.dot_general_p).gemm
  assert registry.properties(lax.transpose_p).data_movement
  assert not registry.properties(lax.add_p).data_movement
  assert registry.properties(lax.while_p).context_free
  assert registry.properties(lax.add_p).batch is registry.ELEMENTWISE
  assert not registry.properties(Primitive("not_registered")).needs_ctx


@pytest.fixture
def twice_p():
  """A new elementwise primitive, registered with one call."""
  p = Primitive("pallas_np_test_twice")
  p.def_abstract_eval(lambda x: x)
  p.def_impl(lambda x: x * 2)
  registry.register_numpy(p, lambda x: x * x.dtype.type(2), batch=registry.ELEMENTWISE)
  yield p
  registry._RULES.pop(p)


def test_a_new_elementwise_primitive_is_batched(twice_p, monkeypatch):
  lane_looped = []
  orig = batching.lane_loop

  def recording(rule, info, in_batched):
    lane_looped.append(info.primitive.name)
    return orig(rule, info, in_batched)
  monkeypatch.setattr(batching, "lane_loop", recording)

  def kernel(x_ref, o_ref):
    o_ref[...] = twice_p.bind(x_ref[...]) + 1.0

  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  pallas_np.clear_caches()
  out = pallas_np.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(8,),
      in_specs=[pl.BlockSpec((1, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((1, 128), lambda i: (i, 0)))(x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2 + 1)
  report = pallas_np.grid_report()[-1]
  assert report["mode"] == "vectorized", report
  assert lane_looped == [], lane_looped
