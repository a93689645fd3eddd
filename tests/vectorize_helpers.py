"""Shared by the grid-vectorization tests (test_vectorize*.py): the
sequential and vectorized params, the ``modes`` fixture recording each run's
path, and ``check``, which compares vectorized, sequential and interpret=True."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from pallas_np.grid import KernelPlan
from tests.conftest import assert_same

def _normal(seed, shape):
  # NumPy's generator: jax.random would compile an XLA program per shape.
  return _rng_normal(np.random.default_rng(seed), shape)


def _rng_normal(rng, shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


VEC = pallas_np.InterpretParams(vectorize=True, check_avals=True)
SEQ = pallas_np.InterpretParams(vectorize=False, check_avals=True)


@pytest.fixture
def modes(monkeypatch):
  """Records KernelPlan.last_mode of every run."""
  seen = []
  orig = KernelPlan.run

  def run(self, *args):
    try:
      return orig(self, *args)
    finally:
      seen.append(self.last_mode)
  monkeypatch.setattr(KernelPlan, "run", run)
  return seen



def row_blocks(kernel, x, rows=1):
  """``make(interp)`` for a kernel over blocks of ``rows`` rows of ``x`` (one
  output block per grid point: the shape vectorization batches)."""
  def make(interp):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // rows,),
        in_specs=[pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0)), interpret=interp)
  return make

def check(make_call, *args, expect_mode, modes, rtol=1e-5, atol=1e-5, threads=None):
  """numpy vectorized == numpy sequential == interpret=True, with the lanes
  of a batched pass laid out first and last (vectorize.LANES_LAST); and the
  vectorized run took the expected path."""
  from pallas_np.grid import vectorize
  vec = VEC if threads is None else pallas_np.InterpretParams(
      vectorize=True, check_avals=True, num_threads=threads)
  seq = make_call(SEQ)(*args)
  assert modes[-1] == "sequential"
  want = make_call(True)(*args)
  for layout in (False, True):
    modes.clear()
    vectorize.LANES_LAST = layout
    try:
      got = make_call(vec)(*args)
    finally:
      vectorize.LANES_LAST = None
    assert modes and modes[-1] == expect_mode, (layout, modes)
    for g, s, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(seq),
                       jax.tree_util.tree_leaves(want)):
      assert_same(g, s, rtol=0, atol=0)  # same NumPy ops, lane by lane
      assert_same(g, w, rtol=rtol, atol=atol)
  return got


# -- a bitonic sort, one row per grid step (a batched kernel with loops) ----------
def _bitonic_rows(x):
  """Sort the last axis (power of two) with compare-exchange stages."""
  n = x.shape[-1]
  lead = x.shape[:-1]
  k = 2
  while k <= n:
    j = k // 2
    while j >= 1:
      y = x.reshape(*lead, n // (2 * j), 2, j)
      a, b = y[..., 0, :], y[..., 1, :]
      lo, hi = jnp.minimum(a, b), jnp.maximum(a, b)
      blk = lax.broadcasted_iota(jnp.int32, a.shape, len(lead))
      desc = ((blk * 2 * j) // k) % 2 == 1
      first = jnp.where(desc, hi, lo)
      second = jnp.where(desc, lo, hi)
      x = jnp.concatenate([first[..., None, :], second[..., None, :]], axis=-2).reshape(*lead, n)
      j //= 2
    k *= 2
  return x


def sort_kernel(x_ref, o_ref):
  o_ref[...] = _bitonic_rows(x_ref[...])
