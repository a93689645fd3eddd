"""Shape/data movement, gather/scatter, reductions, scans, sort, top_k,
dot_general: numpy mode vs interpret=True (integers bit-exact)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from tests.conftest import assert_same
from tests.kernel_fn import both

rng = np.random.default_rng(1)


def check(fn, *args, rtol=1e-5, atol=1e-5):
  got, want = both(fn, *args)
  assert len(got) == len(want)
  for i, (g, w) in enumerate(zip(got, want)):
    try:
      assert_same(g, w, rtol=rtol, atol=atol)
    except AssertionError as err:
      raise AssertionError(f"output {i}: {err}") from None


@pytest.mark.parametrize("shape,dtype", [
    ((128, 1024), np.float32),  # 4 KiB rows: 8-row slabs
    ((37, 512), np.float32),  # rows not a multiple of the slab
    ((3, 40, 256), np.int32),  # batched swap of the last two axes
    ((64, 1024), ml_dtypes.bfloat16),  # 2 KiB rows of a 2-byte type
    ((8, 128), np.float32),  # small: NumPy's plain copy
])
def test_transpose_blocked_copy_bit_exact(shape, dtype):
  from pallas_np.primitives import shape as shape_rules
  rows, cols = shape[-2:]
  uses_slabs = shape_rules._transpose_slab_rows(rows, cols, np.dtype(dtype).itemsize) > 0
  assert uses_slabs == (shape != (8, 128))  # the cases exercise both paths
  x = (rng.standard_normal(shape) * 100).astype(dtype)
  perm = (*range(len(shape) - 2), len(shape) - 1, len(shape) - 2)
  got, want = both(lambda x: [jnp.transpose(x, perm), jnp.transpose(x, perm) + x.swapaxes(-1, -2)], x)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
  np.testing.assert_array_equal(got[0], np.transpose(x, perm))


def test_shape_ops():
  x = rng.standard_normal((6, 8)).astype(np.float32)
  i = np.array([2, -3], np.int32)
  check(lambda x, i: [
      lax.pad(x, np.float32(-1), [(2, -1, 1), (-2, 3, 2)]),
      lax.pad(x, np.float32(7), [(-3, -2, 0), (0, 0, 3)]),
      lax.rev(x, (0, 1)), x[1:6:2, ::3], lax.slice(x, (0, 1), (5, 8), (2, 3)),
      lax.dynamic_slice(x, (i[0], i[1]), (3, 4)),  # negative start clamps
      lax.dynamic_slice(x, (i[0] + 10, i[1]), (3, 4)),
      lax.dynamic_update_slice(x, jnp.ones((2, 3), x.dtype), (i[1], i[0] + 9)),
      jnp.concatenate([x, x[:2]], axis=0), *jnp.split(x, [2, 5], axis=1),
      jnp.transpose(x), x.reshape(4, 12), jnp.expand_dims(x, 1), x[None, :, None][0, :, 0],
      lax.broadcast_in_dim(x[:, :1], (6, 8, 2), (0, 1)), jnp.tile(x[:2], (2, 3)),
      jnp.stack([x, 2 * x], axis=1), lax.iota(jnp.int32, 5),
      lax.broadcasted_iota(jnp.uint8, (3, 4), 1),
      lax.select_n(i[0] > 0, x, -x), lax.select_n(jnp.arange(48).reshape(6, 8) % 3, x, -x, 2 * x),
      lax.clamp(-0.5, x, 0.5)], x, i)


def test_gather_forms_from_jnp_indexing():
  x = rng.standard_normal((8, 6)).astype(np.float32)
  idx = np.array([3, 0, 7, 7, -1], np.int32)
  big = np.array([1, 9, -12, 4], np.int32)
  b3 = rng.standard_normal((3, 5, 4)).astype(np.float32)
  col = np.array([[0, 3], [1, 1], [4, 2]], np.int32)
  check(lambda x, idx, big, b3, col: [
      x[idx], x[:, idx[:3]], x[idx[:3], idx[1:4]], x[idx[:2], 1:4],
      jnp.take(x, big, axis=0, mode="clip"), jnp.take(x, big, axis=1, mode="fill", fill_value=-5.0),
      x.at[big].get(mode="fill"), jnp.take_along_axis(b3, jnp.broadcast_to(col[:, :, None], (3, 2, 4)) % 5, axis=1),
      x[idx[0]], x[jnp.array([True, False] * 4)] if False else x[::-1],
      b3[:, col[0, 1], :], b3[jnp.arange(3), col[:, 0]]],
      x, idx, big, b3, col)


def test_scatter_forms_from_jnp_indexing():
  x = rng.standard_normal((8, 6)).astype(np.float32)
  xi = rng.integers(-50, 50, (8, 6)).astype(np.int32)
  idx = np.array([3, 0, 6, 5], np.int32)
  dup = np.array([1, 1, 2, 9, -20], np.int32)
  u = rng.standard_normal((4, 6)).astype(np.float32)
  check(lambda x, xi, idx, dup, u: [
      x.at[idx].set(u), x.at[idx].add(u), x.at[idx].multiply(u), x.at[idx].min(u),
      x.at[idx].max(u), x.at[:, idx[:2]].set(0.0), x.at[idx[0], 2].add(10.0),
      xi.at[dup].add(1), xi.at[dup].add(1, mode="drop"), xi.at[dup].add(3, mode="clip"),
      xi.at[dup, dup].set(7, mode="drop"), xi.at[idx, idx[::-1]].add(xi[0, :4]),
      xi.at[idx].apply(lambda v: v * 2 + 1),
      xi.at[1:5:2].add(100)], x, xi, idx, dup, u)


@pytest.mark.parametrize("dtype", [np.float32, np.int32, ml_dtypes.bfloat16, np.bool_, np.uint8])
def test_reductions(dtype):
  x = (rng.standard_normal((5, 7, 4)) * 10).astype(dtype)
  if np.dtype(dtype).kind == "f" or dtype == ml_dtypes.bfloat16:
    x[0, 0, 0] = np.nan
    x[1, 2, :] = -0.0
    x[1, 3, :2] = 0.0
  def ops(x):
    out = [jnp.sum(x, axis=1), jnp.max(x, axis=(0, 2)), jnp.min(x, axis=2),
           jnp.argmax(x, axis=1), jnp.argmin(x, axis=0), jnp.max(x), jnp.argmax(x.reshape(-1))]
    if x.dtype != jnp.bool_:
      out += [jnp.prod(x[:, :3], axis=1), jnp.cumsum(x, axis=1), jnp.cumsum(x, axis=0, reverse=True) if False
              else lax.cumsum(x, axis=0, reverse=True), lax.cummax(x, axis=2),
              lax.cummin(x, axis=1, reverse=True), lax.cumprod(x[:, :3], axis=1)]
    if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
      out += [lax.reduce_and(x, (1,)), lax.reduce_or(x, (0, 2)), lax.reduce_xor(x, (2,))]
    if jnp.issubdtype(x.dtype, jnp.floating):
      out += [lax.cumlogsumexp(x, axis=1), jax.nn.logsumexp(x, axis=2)]
    return out
  check(ops, x, rtol=2e-2 if dtype == ml_dtypes.bfloat16 else 1e-5, atol=1e-3)


def test_max_signed_zero_reduction():
  x = np.array([[0.0, -0.0], [-0.0, -0.0], [-0.0, 0.0]], np.float32)
  got, want = both(lambda x: [jnp.max(x, axis=1), jnp.min(x, axis=1)], x)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.signbit(g), np.signbit(w))


def test_generic_reduce():
  x = rng.integers(-9, 9, (4, 6)).astype(np.int32)
  y = rng.standard_normal((4, 6)).astype(np.float32)
  def argmax_pair(x, y):
    return lax.reduce((x, y), (np.int32(-100), np.float32(0)),
                      lambda a, b: (jnp.maximum(a[0], b[0]), a[1] + b[1]), (1,))
  check(argmax_pair, x, y)


def test_sort_multi_operand_stable_nan_signed_zero():
  k = np.array([[3.0, np.nan, -0.0, 0.0, -np.inf, 1.0, 0.0, -0.0, np.nan, -1.0]] * 2, np.float32)
  k[1] = k[1][::-1]
  k[1, 1] = -np.nan
  payload = np.arange(20, dtype=np.int32).reshape(2, 10)
  ik = rng.integers(0, 3, (2, 10)).astype(np.int32)
  def ops(k, p, ik):
    return [*lax.sort((k, p), dimension=1, is_stable=True, num_keys=1),
            *lax.sort((ik, k, p), dimension=1, is_stable=True, num_keys=2),
            jnp.sort(k, axis=1), jnp.argsort(k, axis=1, stable=True),
            jnp.sort(ik, axis=0), jnp.argsort(ik, axis=1, stable=True, descending=True)]
  got, want = both(ops, k, payload, ik)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


def test_top_k():
  x = rng.standard_normal((3, 16)).astype(np.float32)
  x[0, :4] = [np.nan, np.inf, 0.0, -0.0]
  x[1, :4] = [2.0, 2.0, 2.0, -0.0]
  xi = rng.integers(-5, 5, (3, 16)).astype(np.int32)
  got, want = both(lambda x, xi: [*lax.top_k(x, 5), *lax.top_k(xi, 7)], x, xi)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


def test_dot_general_forms():
  a8 = rng.integers(-128, 128, (2, 16, 32)).astype(np.int8)
  b8 = rng.integers(-128, 128, (2, 32, 8)).astype(np.int8)
  a = rng.standard_normal((4, 3, 5)).astype(np.float32)
  b = rng.standard_normal((5, 4, 6)).astype(np.float32)
  ab = a.astype(ml_dtypes.bfloat16)
  bb = b.astype(ml_dtypes.bfloat16)
  def ops(a8, b8, a, b, ab, bb):
    return [
        lax.dot_general(a8, b8, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.int32),
        jnp.einsum("bij,bjk->bik", a8.astype(jnp.int32), b8.astype(jnp.int32)),
        lax.dot_general(a, b, (((2,), (0,)), ((0,), (1,)))),  # batch 0/1, contract in the middle
        lax.dot_general(a, b, (((0, 2), (1, 0)), ((), ()))),
        lax.dot_general(ab, bb, (((2,), (0,)), ((0,), (1,))), preferred_element_type=jnp.float32),
        lax.dot_general(ab, bb, (((2,), (0,)), ((0,), (1,)))),
        jnp.dot(a[0], b[:, 0, :], precision=lax.Precision.HIGHEST),
    ]
  got, want = both(ops, a8, b8, a, b, ab, bb)
  for i, (g, w) in enumerate(zip(got, want)):
    assert g.dtype == w.dtype, i
    if g.dtype.kind in "iu":
      np.testing.assert_array_equal(g, w)
    else:
      np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=1e-2, atol=1e-2)
