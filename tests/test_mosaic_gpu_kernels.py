"""JAX's own Mosaic GPU kernels (``jax.experimental.pallas.ops.gpu.*_mgpu``)
in numpy mode at small shapes, against their reference functions (and, for
the Hopper matmul, JAX's GPU interpret mode: slow, deselected in CI).

The kernels query the GPU at trace time (SM count, CUDA runtime version);
``gpu_kernels`` stubs those queries (tests/mgpu_helpers.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.mgpu_helpers import assert_close, both, gpu_kernels  # noqa: F401

import pallas_np


def _normal(seed, shape, dtype=jnp.float16):
  # NumPy's generator: jax.random would compile an XLA program per shape.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32)
                     .astype(jnp.dtype(dtype)))


def _numpy(fn, *args, **kwargs):
  with pallas_np.force_numpy_interpret():
    return fn(*args, **kwargs)


def _matmul_config(hm):
  return hm.TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                         epi_tile_m=64, epi_tile_n=64)


@pytest.mark.parametrize("with_c", [False, True])
def test_hopper_matmul(gpu_kernels, with_c):
  hm = gpu_kernels["matmul"]
  a, b = _normal(0, (256, 128)), _normal(1, (128, 256))
  c = _normal(2, (256, 256), jnp.float32) if with_c else None
  out = _numpy(hm.matmul, a, b, c, _matmul_config(hm))
  want = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
  if with_c:
    assert out.dtype == jnp.float32
    assert_close(out, want + np.asarray(c), atol=1e-3, rtol=1e-5)
  else:
    assert out.dtype == jnp.float16
    # f32 accumulation over K tiles (another order than BLAS), one f16 rounding
    assert_close(out, want, atol=2e-2, rtol=2e-3)


@pytest.mark.slow
def test_hopper_matmul_vs_gpu_interpret(gpu_kernels):
  hm = gpu_kernels["matmul"]
  a, b = _normal(0, (256, 128)), _normal(1, (128, 256))
  ours, theirs = both(lambda a, b: hm.matmul(a, b, None, _matmul_config(hm)), a, b)
  np.testing.assert_array_equal(ours, theirs)


def test_hopper_mixed_type_matmul(gpu_kernels):
  mm = gpu_kernels["mixed"]
  a = jax.random.randint(jax.random.key(0), (128, 128), -128, 127, jnp.int8)
  b = jax.random.uniform(jax.random.key(1), (128, 256), jnp.bfloat16)
  cfg = mm.TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)
  out = _numpy(mm.mixed_matmul_kernel, a, b, out_dtype=jnp.bfloat16, config=cfg)
  assert_close(out, mm.reference(a, b, out_dtype=jnp.bfloat16), atol=0)


def _qkv():
  return [_normal(i, (1, 128, 2, 64)) for i in range(3)]


@pytest.mark.parametrize("causal", [False, True])
def test_attention_forward(gpu_kernels, causal):
  am = gpu_kernels["attention"]
  q, k, v = _qkv()
  cfg = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=causal)
  out = _numpy(am.attention, q, k, v, cfg)
  assert_close(out, am.attention_reference(q, k, v, causal=causal), atol=3e-3)


def test_attention_forward_residuals_and_pipeline_emitter(gpu_kernels):
  am = gpu_kernels["attention"]
  q, k, v = _qkv()
  cfg = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)
  out, (lse,) = _numpy(am.attention, q, k, v, cfg, save_residuals=True)
  want, want_lse = am.attention_reference(q, k, v, save_residuals=True)
  assert_close(out, want, atol=3e-3)
  assert_close(np.squeeze(lse), np.squeeze(want_lse), atol=1e-3)
  out = _numpy(am.attention_with_pipeline_emitter, q, k, v, cfg)
  assert_close(out, want, atol=3e-3)


def test_attention_backward(gpu_kernels):
  am = gpu_kernels["attention"]
  q, k, v = _qkv()
  cfg = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, block_q_dkv=64,
                        block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)

  def grads(attn):
    loss = lambda q, k, v: (attn(q, k, v).astype(jnp.float32) ** 2).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  ours = _numpy(grads, lambda q, k, v: am.attention(q, k, v, cfg))
  want = grads(am.attention_reference)
  for got, ref in zip(ours, want):
    scale = float(np.abs(np.asarray(ref, np.float32)).max())
    assert_close(got, ref, atol=2e-2 * scale)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_ragged_dot(gpu_kernels, transpose_rhs):
  rd = gpu_kernels["ragged"]
  lhs = _normal(0, (256, 128))
  rhs = _normal(1, (4, 128, 128))
  group_sizes = jnp.array([64, 0, 100, 92], jnp.int32)  # an empty and unaligned groups
  out = _numpy(rd.ragged_dot, lhs, rhs, group_sizes=group_sizes, block_m=64, block_n=64,
               block_k=64, max_concurrent_steps=2, grid_block_n=1,
               transpose_rhs=transpose_rhs)
  dense_rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
  want = jax.lax.ragged_dot(lhs, dense_rhs, group_sizes, preferred_element_type=jnp.float32)
  assert_close(out, want, atol=2e-2, rtol=2e-3)


def test_transposed_ragged_dot(gpu_kernels):
  trd = gpu_kernels["transposed_ragged"]
  lhs, rhs = _normal(0, (256, 128)), _normal(1, (256, 128))
  group_sizes = jnp.array([64, 0, 100, 92], jnp.int32)
  out = _numpy(trd.transposed_ragged_dot, lhs, rhs, group_sizes=group_sizes, block_m=64,
               block_n=64, block_k=64, max_concurrent_steps=2, grid_block_n=1)
  assert_close(out, trd.ref_transposed_ragged_dot(lhs, rhs, group_sizes), atol=2e-2, rtol=2e-3)
