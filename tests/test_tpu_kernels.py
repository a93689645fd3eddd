"""JAX's built-in TPU kernels (jax.experimental.pallas.ops.tpu) under
force_numpy_interpret, each against interpret=True (or TPU interpret mode)."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tpu_helpers import compare, hlo_interpret, numpy_mode

from jax.experimental.pallas.ops.tpu import example_kernel, flash_attention as fa, matmul as tpu_matmul
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as pak
from jax.experimental.pallas.ops.tpu.paged_attention import quantization_utils as qu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

gmm_mod = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _normal(seed, shape, dtype=jnp.float32):
  # NumPy's generator: jax.random would compile an XLA program per shape.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32)
                     .astype(jnp.dtype(dtype)))


def test_example_double():
  x = jnp.arange(16.0).reshape(2, 8)
  compare(lambda: example_kernel.double(x))


def test_matmul():
  x, y = _normal(0, (256, 256)), _normal(1, (256, 256))
  with numpy_mode():
    got = tpu_matmul.matmul(x, y, block_shape=(128, 128))
  np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ np.asarray(y), rtol=1e-4, atol=1e-3)


_FA_BLOCKS = fa.BlockSizes(
    block_q=128, block_k_major=128, block_k=128, block_b=1,
    block_q_major_dkv=128, block_k_major_dkv=128, block_k_dkv=128, block_q_dkv=128,
    block_k_major_dq=128, block_k_dq=128, block_q_dq=128)


def _fa_inputs(with_ab=False, with_seg=False):
  B, H, S, D = 1, 2, 256, 64
  q, k, v = _normal(2, (B, H, S, D)), _normal(3, (B, H, S, D)), _normal(4, (B, H, S, D))
  ab = _normal(5, (B, H, S, S)) if with_ab else None
  seg = None
  if with_seg:
    ids = jnp.concatenate([jnp.zeros((B, 100), jnp.int32), jnp.ones((B, S - 100), jnp.int32)], 1)
    seg = fa.SegmentIds(q=ids, kv=ids)
  return q, k, v, ab, seg


def test_flash_attention_fwd_causal_segments_bias():
  q, k, v, ab, seg = _fa_inputs(with_ab=True, with_seg=True)
  with numpy_mode():
    got = fa.flash_attention(q, k, v, ab=ab, segment_ids=seg, causal=True, block_sizes=_FA_BLOCKS)
  want = fa.mha_reference(q, k, v, ab, segment_ids=seg, causal=True)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_flash_attention_bwd():
  q, k, v, ab, seg = _fa_inputs(with_seg=True)

  def grads(fn):
    return jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)
  with numpy_mode():
    got = grads(lambda q, k, v: fa.flash_attention(
        q, k, v, segment_ids=seg, causal=True, block_sizes=_FA_BLOCKS))
  want = grads(lambda q, k, v: fa.mha_reference(q, k, v, None, segment_ids=seg, causal=True))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-3, atol=1e-3)


def _paged_inputs():
  nkv, nq, hd, page, ppseq, total_pages, bsz = 2, 4, 128, 16, 4, 16, 2
  q = _normal(6, (bsz, nq, hd))
  k_pages, v_pages = _normal(7, (nkv, total_pages, page, hd)), _normal(8, (nkv, total_pages, page, hd))
  lengths = jnp.array([37, 60], jnp.int32)
  page_indices = jax.random.permutation(jax.random.key(9), total_pages)[:bsz * ppseq]
  return q, k_pages, v_pages, lengths, page_indices.reshape(bsz, ppseq).astype(jnp.int32)


@pytest.mark.parametrize("megacore_mode,inline", [(None, True), ("kv_head", False), ("batch", True)])
def test_paged_attention(megacore_mode, inline):
  q, kp, vp, lengths, pidx = _paged_inputs()
  fn = lambda: pak.paged_attention(q, kp, vp, lengths, pidx, pages_per_compute_block=2,
                                   megacore_mode=megacore_mode, inline_seq_dim=inline)
  got = compare(fn, num_cores=2 if megacore_mode else 1, rtol=1e-5, atol=1e-5) \
      if megacore_mode is None else None
  if megacore_mode is not None:
    # On one core these modes hang on a TPU (and under interpret=True they
    # need the per-core scratch): compare with the non-megacore result.
    with numpy_mode(num_cores=2):
      got = fn()
    with hlo_interpret():
      want = pak.paged_attention(q, kp, vp, lengths, pidx, pages_per_compute_block=2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_paged_attention_quantized():
  q, kp, vp, lengths, pidx = _paged_inputs()
  kq, vq = qu.quantize_to_int8(kp), qu.quantize_to_int8(vp)
  compare(lambda: pak.paged_attention(q, kq, vq, lengths, pidx, pages_per_compute_block=2),
          rtol=1e-5, atol=1e-5)


def test_paged_attention_megacore_needs_cores():
  q, kp, vp, lengths, pidx = _paged_inputs()
  with numpy_mode(), pytest.raises(Exception, match="num_cores=2"):
    jax.block_until_ready(pak.paged_attention(q, kp, vp, lengths, pidx, pages_per_compute_block=2,
                                              megacore_mode="batch"))


@pytest.mark.parametrize("num_seqs,extra", [
    (4, {}),
    # Only 3 of the 4 sequences are live (the dynamic num_seqs), with a
    # sliding window and soft-capped logits.
    (3, {"sliding_window": 16, "soft_cap": 20.0})])
def test_ragged_paged_attention(num_seqs, extra):
  nq, nkv, hd, page, pps, tp = 8, 2, 128, 16, 4, 32
  q_lens, kv_lens = [5, 1, 20, 1], [30, 17, 64, 9]
  q = _normal(10, (32, nq, hd))
  kv_pages = _normal(11, (tp, page, 2 * nkv, hd))
  page_indices = jax.random.permutation(jax.random.key(12), tp)[:4 * pps].reshape(4, pps).astype(jnp.int32)
  cu_q_lens = jnp.array(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
  args = (q, kv_pages, jnp.array(kv_lens, jnp.int32), page_indices, cu_q_lens,
          jnp.array([num_seqs], jnp.int32))
  with numpy_mode():
    got = rpa.ragged_paged_attention(*args, sm_scale=0.1, num_kv_pages_per_block=2,
                                     num_queries_per_block=8, **extra)
  want = _ragged_reference(*[np.asarray(a) for a in args], sm_scale=0.1, **extra)
  n = sum(q_lens[:num_seqs])
  np.testing.assert_allclose(np.asarray(got)[:n], want[:n], rtol=1e-4, atol=1e-4)


def _ragged_reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale,
                      sliding_window=None, soft_cap=None):
  """NumPy port of ``ref_ragged_paged_attention`` (which takes ~13 s un-jitted
  and cannot be jitted): causal attention of each sequence's queries over its
  gathered KV pages (within ``sliding_window`` positions, logits soft-capped
  as ``soft_cap * tanh(logits / soft_cap)``); K and V heads are interleaved
  in ``kv_pages``' head axis."""
  out = np.zeros_like(q)
  nq, nkv = q.shape[1], kv_pages.shape[2] // 2
  for i in range(int(num_seqs[0])):
    q_start, q_end, kv_len = cu_q_lens[i], cu_q_lens[i + 1], kv_lens[i]
    kv = kv_pages[page_indices[i]].reshape(-1, 2 * nkv, q.shape[2])[:kv_len]
    k = np.repeat(kv[:, 0::2], nq // nkv, axis=1)
    v = np.repeat(kv[:, 1::2], nq // nkv, axis=1)
    qs = q[q_start:q_end]
    logits = np.einsum("qhd,khd->hqk", qs, k) * sm_scale
    if soft_cap is not None:
      logits = soft_cap * np.tanh(logits / soft_cap)
    q_pos = kv_len - (q_end - q_start) + np.arange(q_end - q_start)
    visible = np.arange(kv_len)[None, :] <= q_pos[:, None]
    if sliding_window is not None:
      visible &= np.arange(kv_len)[None, :] > q_pos[:, None] - sliding_window
    logits = np.where(visible, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[q_start:q_end] = np.einsum("hqk,khd->qhd", p, v)
  return out


_SPLASH_BLOCKS = sa.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128,
                               block_kv_dkv=128, block_kv_dkv_compute=128, block_q_dq=128,
                               block_kv_dq=128)


@pytest.mark.parametrize("kind", ["mha_causal", "mha_local", "mqa_full", "gqa_numpy_mask"])
def test_splash_attention_fwd(kind):
  H, S, D = 2, 256, 64
  q, k, v = _normal(13, (H, S, D)), _normal(14, (H, S, D)), _normal(15, (H, S, D))
  make, ref_make = sa.make_splash_mha, sa.make_masked_mha_reference
  if kind == "mha_causal":
    masks = [sa.CausalMask((S, S))] * H
  elif kind == "mha_local":
    masks = [sa.LocalMask((S, S), (64, 0), 0)] * H
  elif kind == "mqa_full":
    masks = [sa.FullMask((S, S))] * H
    make, ref_make, k, v = sa.make_splash_mqa, sa.make_masked_mqa_reference, k[0], v[0]
  else:  # GQA: 2 query heads per kv head, one head with a random NumpyMask
    rnd = sa.make_random_mask((S, S), 0.5, seed=0) | np.tri(S, dtype=bool)
    masks = [sa.NumpyMask(rnd), sa.CausalMask((S, S))] * 2
    q = _normal(16, (4, S, D))
  mask = sa.MultiHeadMask(masks)
  kernel = make(mask, block_sizes=_SPLASH_BLOCKS, head_shards=1, q_seq_shards=1)
  with numpy_mode():
    got = kernel(q, k, v)
  want = ref_make(mask)(q, k, v)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_splash_attention_bwd():
  H, S, D = 2, 256, 64
  q, k, v = _normal(17, (H, S, D)), _normal(18, (H, S, D)), _normal(19, (H, S, D))
  mask = sa.MultiHeadMask([sa.CausalMask((S, S))] * H)
  kernel = sa.make_splash_mha(mask, block_sizes=_SPLASH_BLOCKS, head_shards=1, q_seq_shards=1)
  ref = sa.make_masked_mha_reference(mask)
  grads = lambda fn: jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)
  with numpy_mode():
    got = grads(kernel)
  for g, w in zip(got, grads(ref)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-3, atol=1e-3)


_GROUPS = [100, 0, 300, 112]


def test_megablox_gmm():
  lhs, rhs = _normal(20, (512, 256)), _normal(21, (4, 256, 128))
  gs = jnp.array(_GROUPS, jnp.int32)
  with numpy_mode():
    got = gmm_mod.gmm(lhs, rhs, gs, tiling=(128, 128, 128))
  want = np.concatenate([np.asarray(lhs[s:s + n] @ rhs[i]) for i, (s, n) in
                         enumerate(zip(np.cumsum([0] + _GROUPS[:-1]), _GROUPS))])
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-3)


def test_megablox_tgmm():
  lhs, grad = _normal(22, (512, 128)), _normal(23, (512, 128))
  gs = jnp.array(_GROUPS, jnp.int32)
  with numpy_mode():
    got = gmm_mod.tgmm(lhs.T, grad, gs, tiling=(128, 128, 128))
  want = np.stack([np.asarray(lhs[s:s + n].T @ grad[s:s + n]) for s, n in
                   zip(np.cumsum([0] + _GROUPS[:-1]), _GROUPS)])
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-3)


_OFFSET_GROUPS = [0, 200, 0, 184, 0]  # empty groups first, between and last


def test_megablox_gmm_group_offset_and_existing_out():
  """This shard owns groups 2..4 (group_offset=2: rows 200..383); the rows
  of group 1, which it does not own, keep existing_out. Oracle: gmm's own
  interpret=True."""
  lhs, rhs, existing = _normal(24, (384, 128)), _normal(25, (3, 128, 128)), _normal(26, (384, 128))
  gs, offset = jnp.array(_OFFSET_GROUPS, jnp.int32), jnp.array(2, jnp.int32)
  call = lambda **kw: gmm_mod.gmm(lhs, rhs, gs, tiling=(128, 128, 128), group_offset=offset,
                                  existing_out=existing, **kw)
  with numpy_mode():
    got = call()
  np.testing.assert_allclose(np.asarray(got), np.asarray(call(interpret=True)), rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal(np.asarray(got)[:200], np.asarray(existing)[:200])


def test_megablox_gmm_transpose_rhs():
  lhs, rhs = _normal(27, (384, 128)), _normal(28, (5, 128, 128))
  gs = jnp.array(_OFFSET_GROUPS, jnp.int32)
  call = lambda **kw: gmm_mod.gmm(lhs, rhs, gs, tiling=(128, 128, 128), transpose_rhs=True, **kw)
  with numpy_mode():
    got = call()
  np.testing.assert_allclose(np.asarray(got), np.asarray(call(interpret=True)), rtol=1e-5, atol=1e-4)


def test_megablox_ops_gmm_gradients():
  """megablox.ops.gmm's custom VJP (gmm for d lhs, tgmm for d rhs, empty
  groups included) vs autodiff of a per-group jnp reference."""
  ops = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.ops")
  lhs, rhs = _normal(29, (384, 128)), _normal(30, (5, 128, 128))
  sizes = np.array(_OFFSET_GROUPS)
  gs = jnp.array(sizes, jnp.int32)

  def reference(lhs, rhs):
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return jnp.concatenate([lhs[s:s + n] @ rhs[i] for i, (s, n) in enumerate(zip(starts, sizes))])
  loss = lambda f: jax.grad(lambda a, b: (f(a, b) ** 2).sum(), argnums=(0, 1))
  with numpy_mode():
    got = loss(lambda a, b: ops.gmm(a, b, gs, jnp.float32, (128, 128, 128)))(lhs, rhs)
  for g, w in zip(got, loss(reference)(lhs, rhs)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=2e-3)
