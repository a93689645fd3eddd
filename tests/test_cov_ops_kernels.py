"""Kernels from jax.experimental.pallas.ops, numpy mode vs interpret=True,
plus reduce_window and the coverage report itself."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_np
from pallas_np import coverage
from tests.conftest import assert_same
from tests.kernel_fn import both

rng = np.random.default_rng(3)


def _both_ways(fn, *args, **tol):
  got = fn("numpy", *args)
  want = fn(True, *args)
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert_same(g, w, **tol)


def test_gpu_softmax_layer_norm_rms_norm():
  from jax.experimental.pallas.ops.gpu import layer_norm, rms_norm, softmax
  x = rng.standard_normal((2, 3, 96)).astype(np.float32)
  w = rng.standard_normal((96,)).astype(np.float32)
  b = rng.standard_normal((96,)).astype(np.float32)
  _both_ways(lambda i, x: softmax.softmax(x, interpret=i), x[0])
  _both_ways(lambda i, x, w, b: layer_norm.layer_norm(x, w, b, interpret=i), x, w, b)
  _both_ways(lambda i, x, w, b: rms_norm.rms_norm(x, w, b, interpret=i), x, w, b)


def test_gpu_decode_attention():
  from jax.experimental.pallas.ops.gpu import decode_attention
  q = rng.standard_normal((2, 16, 32)).astype(np.float32)
  k = rng.standard_normal((2, 64, 32)).astype(np.float32)
  v = rng.standard_normal((2, 64, 32)).astype(np.float32)
  _both_ways(lambda i, q, k, v: decode_attention.mqa(q, k, v, block_k=32, k_splits=2,
                                                     interpret=i), q, k, v, rtol=1e-4, atol=1e-5)


def test_tpu_matmul_forced_numpy():
  from jax.experimental.pallas.ops.tpu import matmul
  x = rng.standard_normal((256, 256)).astype(np.float32)
  y = rng.standard_normal((256, 256)).astype(np.float32)
  with pallas_np.force_numpy_interpret():
    got = jax.jit(functools.partial(matmul.matmul, block_shape=(128, 128), block_k=128))(x, y)
  np.testing.assert_allclose(np.asarray(got), x @ y, rtol=1e-4, atol=1e-3)


def test_reduce_window_and_broadcast_to():
  x = rng.standard_normal((6, 9)).astype(np.float32)
  xi = rng.integers(-9, 9, (6, 9)).astype(np.int32)
  from jax._src.lax import windowed_reductions as wr
  def ops(x, xi):
    return [
        lax.reduce_window(x, 0.0, lax.add, (2, 3), (1, 2), ((1, 0), (2, 1))),
        lax.reduce_window(x, -jnp.inf, lax.max, (3, 2), (2, 1), "SAME"),
        lax.reduce_window(xi, jnp.int32(2 ** 31 - 1), lax.min, (2, 2), (1, 1), "VALID"),
        wr._reduce_window_sum(xi, (2, 2), (1, 1), ((0, 1), (1, 0)), (2, 1), (1, 2)),
        lax.reduce_window(xi, jnp.int32(1), lambda a, b: a * b % 7, (2, 2), (2, 2), "VALID"),
    ]
  got, want = both(ops, x, xi)
  for g, w in zip(got, want):
    assert_same(g, w)


def test_coverage_report_no_lax_gap_in_ops_kernels(capsys):
  report = coverage.build_report(with_ops=True)
  lax_gaps = [u for u in report["ops_used_unsupported"] if "[lax]" in u or "[pallas/state]" in u]
  assert not lax_gaps, lax_gaps
  assert len(report["ops_traced"]) >= 15, report["ops_failed"]
  sup, unsup = report["categories"]["lax"]
  for name in ("sort", "gather", "scatter-add", "threefry2x32", "top_k", "cumsum", "dot_general"):
    assert name in sup
  assert "ppermute" in unsup  # collectives are not interpretable in one kernel
  md = coverage.format_markdown(report)
  assert "| lax |" in md and "gpu.attention.mha" in md
