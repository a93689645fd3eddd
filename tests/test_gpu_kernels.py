"""jax.experimental.pallas.ops.gpu (the Triton-path ops) under
``force_numpy_interpret()`` on CPU, against each module's reference."""
import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import (attention, decode_attention, layer_norm,
                                             paged_attention, rms_norm, softmax)

import pallas_np

KEYS = list(range(12))  # seeds of _normal (NumPy: jax.random compiled an XLA program per shape)


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


@contextlib.contextmanager
def numpy_mode():
  """force_numpy_interpret, recording the kernels our interpreter ran (so a
  test cannot pass by silently running JAX's interpreter instead)."""
  ran = []
  params = pallas_np.InterpretParams(
      check_avals=True, trace=lambda name, point: ran.append(name))
  with pallas_np.force_numpy_interpret(params):
    yield ran
  assert ran, "no kernel ran in numpy mode"


def close(got, want, tol=2e-5):
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                             rtol=tol, atol=tol)


# -- attention (flash attention forward and backward) --------------------------
B, S, H, D = 2, 64, 2, 16
Q = _normal(KEYS[0], (B, S, H, D))
K = _normal(KEYS[1], (B, S, H, D))
V = _normal(KEYS[2], (B, S, H, D))
SEGMENTS = jnp.concatenate([jnp.zeros((B, 24), jnp.int32), jnp.ones((B, S - 24), jnp.int32)], 1)
BLOCKS = attention.BlockSizes(block_q=32, block_k=32, block_q_dkv=32, block_kv_dkv=32,
                              block_q_dq=32, block_kv_dq=32)


@pytest.mark.parametrize("causal,segmented", [(False, False), (True, True)])
def test_mha_forward(causal, segmented):
  seg = SEGMENTS if segmented else None
  with numpy_mode() as ran:
    got = attention.mha(Q, K, V, seg, sm_scale=0.5, causal=causal, block_sizes=BLOCKS)
  assert "mha_forward" in ran
  close(got, attention.mha_reference(Q, K, V, seg, sm_scale=0.5, causal=causal))


def test_mha_backward_causal_segment_ids():
  def loss(attn):
    return lambda q, k, v: (attn(q, k, v) * jnp.cos(q)).sum()
  mha = lambda q, k, v: attention.mha(q, k, v, SEGMENTS, causal=True, block_sizes=BLOCKS)
  ref = lambda q, k, v: attention.mha_reference(q, k, v, SEGMENTS, causal=True)
  with numpy_mode() as ran:
    got = jax.grad(loss(mha), argnums=(0, 1, 2))(Q, K, V)
  assert "mha_backward" in ran
  want = jax.grad(loss(ref), argnums=(0, 1, 2))(Q, K, V)
  for g, w in zip(got, want):
    close(g, w, tol=1e-4)


# -- normalization and softmax --------------------------------------------------
X = _normal(KEYS[3], (2, 3, 200))  # 200: masked tail in a 256 block
W = _normal(KEYS[4], (200,))
BIAS = _normal(KEYS[5], (200,))


@pytest.mark.parametrize("module,fn,ref", [
    (layer_norm, "layer_norm", "layer_norm_reference"),
    (rms_norm, "rms_norm", "rms_norm_reference")])
def test_norm_forward_and_backward(module, fn, ref):
  kernel, reference = getattr(module, fn), getattr(module, ref)
  loss = lambda f: (lambda x, w, b: (f(x, w, b) ** 2 * jnp.sin(x)).sum())
  with numpy_mode() as ran:
    out = kernel(X, W, BIAS)
    grads = jax.grad(loss(kernel), argnums=(0, 1, 2))(X, W, BIAS)
  names = set(ran)  # forward, dx and dw/db kernels all ran in numpy mode
  assert any("dx" in n for n in names) and any("dw_db" in n for n in names), names
  assert any("forward" in n for n in names), names
  close(out, reference(X, W, BIAS))
  for g, w in zip(grads, jax.grad(loss(reference), argnums=(0, 1, 2))(X, W, BIAS)):
    close(g, w, tol=1e-4)


def test_softmax():
  with numpy_mode():
    got = softmax.softmax(X * 3)
  close(got, jax.nn.softmax(X * 3, axis=-1), tol=1e-6)


# -- decoding --------------------------------------------------------------------
BD, NQ, SK, DD, KVH = 2, 16, 128, 32, 2
QD = _normal(KEYS[6], (BD, NQ, DD))
START = jnp.array([0, 8], jnp.int32)
LENGTHS = jnp.array([100, 128], jnp.int32)


def test_decode_attention_mqa():
  k = _normal(KEYS[7], (BD, SK, DD))
  v = _normal(KEYS[8], (BD, SK, DD))
  with numpy_mode():
    got = decode_attention.mqa(QD, k, v, START, LENGTHS, block_h=16, block_k=32, k_splits=4)
  close(got, decode_attention.mqa_reference(QD, k, v, START, LENGTHS))


def test_decode_attention_gqa():
  k = _normal(KEYS[7], (BD, SK, KVH, DD))
  v = _normal(KEYS[8], (BD, SK, KVH, DD))
  with numpy_mode():
    got = decode_attention.gqa(QD, k, v, START, LENGTHS, block_h=16, block_k=32, k_splits=4)
  close(got, decode_attention.gqa_reference(QD, k, v, START, LENGTHS))


def test_paged_attention():
  page_size, pages_per_seq = 8, 8
  total_pages = BD * pages_per_seq
  k_pages = _normal(KEYS[9], (KVH, total_pages, page_size, DD))
  v_pages = _normal(KEYS[10], (KVH, total_pages, page_size, DD))
  tables = jnp.asarray(np.random.default_rng(KEYS[11]).permutation(total_pages)
                       .reshape(BD, pages_per_seq).astype(np.int32))
  tables = tables.astype(jnp.int32)
  lengths = jnp.array([37, 64], jnp.int32)
  # The kernel multiplies by a huge mask value on purpose: IEEE inf, no warning.
  with numpy_mode(), warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    got = paged_attention.paged_attention(QD, k_pages, v_pages, tables, lengths,
                                          block_h=16, pages_per_compute_block=2, k_splits=2)
  # Un-page K/V into [batch, seq, kv_heads, head_dim] for the reference.
  def unpage(pages):
    x = pages[:, tables].reshape(KVH, BD, pages_per_seq * page_size, DD)
    return x.transpose(1, 2, 0, 3)
  want = paged_attention.paged_attention_reference(QD, unpage(k_pages), unpage(v_pages), lengths)
  close(got, want)
