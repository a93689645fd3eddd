"""while_loop and carry-only fori_loop run as loops written out for their
arity (``control_flow.loops._while_loop``/``_carry_loop``): against
interpret=True bit for bit, with 0 iterations, aliased carries, carries of
different dtypes and shapes, consts in cond and body, and nesting."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from tests.helpers import assert_identical


def _call(kernel, x, interpret, n_out=1):
  out = [jax.ShapeDtypeStruct(x.shape, x.dtype)] * n_out
  return pl.pallas_call(kernel, out_shape=out, interpret=interpret)(x)


def _both(kernel, x, n_out=1):
  got = [np.asarray(v) for v in _call(kernel, x, "numpy", n_out)]
  want = [np.asarray(v) for v in _call(kernel, x, True, n_out)]
  for g, w in zip(got, want):
    assert_identical(w, g)
  return got


@pytest.mark.parametrize("limit", [0, 1, 5])
def test_while_mixed_carries_and_consts(limit):
  """Carries of three dtypes/shapes (one passed twice: aliased), a cond
  const and body consts; limit 0 runs no iteration."""
  x = np.arange(16 * 128, dtype=np.float32).reshape(16, 128) / 8  # exact in every step

  def kernel(x_ref, o_ref, p_ref):
    x = x_ref[...]
    scale = jnp.float32(1.5)
    lim = jnp.int32(limit)

    def cond(c):
      i, _, _, _ = c
      return i < lim

    def body(c):
      i, a, b, s = c
      return i + 1, (a + b) * scale, b - a, s + jnp.sum(a[0]).astype(jnp.int8)
    i, a, b, s = lax.while_loop(cond, body, (jnp.int32(0), x, x, jnp.int8(3)))
    o_ref[...] = a + i.astype(jnp.float32)
    p_ref[...] = b + s.astype(jnp.float32)
  got = _both(kernel, x, n_out=2)
  if limit == 0:
    np.testing.assert_array_equal(got[0], x)


@pytest.mark.parametrize("upper", [0, 3])
def test_nested_fori_loops(upper):
  """Carry-only fori_loops (static trip counts: scans) nested in a
  while-shaped fori_loop (the inner bound depends on the outer index)."""
  x = np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32)

  def kernel(x_ref, o_ref):
    def outer(p, acc):
      def inner(q, a):
        return (a + jnp.float32(q)) * 0.5
      return lax.fori_loop(0, p, inner, acc) + 1.0
    acc = lax.fori_loop(0, upper, outer, x_ref[...])
    acc = lax.fori_loop(0, 4, lambda i, a: a - jnp.float32(i), acc)
    o_ref[...] = acc
  got = _both(kernel, x)
  if upper == 0:
    np.testing.assert_array_equal(got[0], ((x - np.float32(1)) - np.float32(2)) - np.float32(3))


def test_fori_loop_with_only_the_index_carry():
  """A fori_loop whose body only writes a ref (the index is the one carry)."""
  x = np.random.default_rng(1).standard_normal((8, 128)).astype(np.float32)

  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)

    @pl.loop(0, 8)
    def _(r):
      o_ref[pl.ds(r, 1), :] = x_ref[pl.ds(r, 1), :] * 2 + o_ref[pl.ds(jnp.maximum(r - 1, 0), 1), :]
  _both(kernel, x)
