"""A ref read through an index array in a compiled loop (a gather, as the
GPU paged attention reads its pages: ``k_pages_ref[block_tables]``;
pallas_np/native/masked.py ``array_access``), and exp2, with the NumPy
path's bits and errors. Before, the loop was refused ("array ref
indices", "exp2")."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from pallas_np import native
from tests.native_elig_util import bits, compiled_equals_numpy


def _paged_kernel(tbl_ref, k_ref, o_ref):
  def body(i, acc):
    pages = tbl_ref[pl.ds(i * 4, 4)]  # int32[4]
    k = k_ref[pages]  # (4, 16, 8): gathered pages
    return acc + jnp.exp2(k * 0.5).sum(axis=0)
  o_ref[...] = lax.fori_loop(0, tbl_ref.shape[0] // 4, body, jnp.zeros(o_ref.shape, jnp.float32))


def _make(interp):
  return pl.pallas_call(_paged_kernel, out_shape=jax.ShapeDtypeStruct((16, 8), jnp.float32),
                        interpret=interp)


def test_gather_by_index_array_bit_exact():
  rng = np.random.default_rng(8)
  tbl = jnp.asarray(rng.permutation(32)[:12], jnp.int32)
  k = jnp.asarray(rng.standard_normal((32, 16, 8)), jnp.float32)
  compiled_equals_numpy(_make, tbl, k, rtol=1e-4)


@pytest.mark.parametrize("bad", [32, -3])
@pytest.mark.parametrize("clamp", [False, True])
def test_gather_out_of_bounds_as_numpy(bad, clamp):
  """An index past either end: the NumPy rule's IndexError (same message),
  or under bounds_check="clamp" its clamped read."""
  tbl = np.arange(12, dtype=np.int32)
  tbl[6] = bad
  k = jnp.asarray(np.random.default_rng(9).standard_normal((32, 16, 8)), jnp.float32)

  def make(native_loops):
    return _make(pallas_np.InterpretParams(native_loops=native_loops,
                                           bounds_check="clamp" if clamp else "raise"))
  if clamp:
    before = native.stats()["native_calls"]
    got = make("sync")(jnp.asarray(tbl), k)
    assert native.stats()["native_calls"] > before
    np.testing.assert_array_equal(bits(got), bits(make("off")(jnp.asarray(tbl), k)))
    return
  with pytest.raises(IndexError) as want:
    make("off")(jnp.asarray(tbl), k)
  pallas_np.clear_caches()  # (a fresh plan: its loop is compiled, or loaded, anew)
  compiled = native.stats()["compiled"]
  with pytest.raises(IndexError) as got:
    make("sync")(jnp.asarray(tbl), k)
  assert str(bad) in str(want.value)
  assert str(got.value) == str(want.value)
  assert native.stats()["compiled"] > compiled, "the loop was not compiled"
