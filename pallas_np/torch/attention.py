"""Built-in kernels as torch ops: JAX's TPU flash attention and paged
attention, run by the NumPy interpreter.

Registered with ``torch.library`` as ``torch.ops.pallas_np.flash_attention``,
``torch.ops.pallas_np.flash_attention_backward`` and
``torch.ops.pallas_np.paged_attention``: opaque custom ops with fake (meta)
implementations, so ``torch.compile`` graphs keep them as single nodes.
Flash attention's autograd formula is the JAX kernel's own backward
(its ``custom_vjp``), obtained with ``jax.vjp``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import torch
from jax.experimental.pallas.ops.tpu import flash_attention as _fa
from jax.experimental.pallas.ops.tpu import paged_attention as _pa

from pallas_np.torch.kernels import TorchNumpyRunner

Tensor = torch.Tensor

# BlockSizes fields in order; the op takes them as an int list.
_BLOCK_FIELDS = ("block_q", "block_k_major", "block_k", "block_b",
                 "block_q_major_dkv", "block_k_major_dkv", "block_k_dkv", "block_q_dkv",
                 "block_k_major_dq", "block_k_dq", "block_q_dq")


def _default_block_sizes(q_len: int, kv_len: int) -> list[int]:
  """torch_xla's choice: JAX's 128 defaults, capped at the sequence lengths."""
  bq, bk = min(128, q_len), min(128, kv_len)
  return [bq, bk, bk, 1, bq, bk, bk, bq, bk, bk, bq]


def _block_sizes(values: Sequence[int]) -> _fa.BlockSizes:
  return _fa.BlockSizes(**dict(zip(_BLOCK_FIELDS, (int(v) for v in values))))


def _segments(q_segment_ids, kv_segment_ids):
  if q_segment_ids is None and kv_segment_ids is None:
    return None
  if q_segment_ids is None or kv_segment_ids is None:
    raise ValueError("flash_attention: pass both q_segment_ids and kv_segment_ids, or neither")
  return _fa.SegmentIds(q_segment_ids, kv_segment_ids)


def _jax_flash_attention(q, k, v, ab, q_seg, kv_seg, *, causal, sm_scale, block_sizes):
  return _fa.flash_attention(q, k, v, ab, _segments(q_seg, kv_seg), causal=causal,
                             sm_scale=sm_scale, block_sizes=_block_sizes(block_sizes))


def _jax_flash_attention_bwd(do, q, k, v, ab, q_seg, kv_seg, *, causal, sm_scale,
                             block_sizes):
  segments = _segments(q_seg, kv_seg)
  sizes = _block_sizes(block_sizes)

  def f(q, k, v, ab):
    return _fa.flash_attention(q, k, v, ab, segments, causal=causal, sm_scale=sm_scale,
                               block_sizes=sizes)
  if ab is None:
    _, vjp = jax.vjp(lambda q, k, v: f(q, k, v, None), q, k, v)
    dq, dk, dv = vjp(do)
    dab = jnp.zeros((0,), q.dtype)
  else:
    _, vjp = jax.vjp(f, q, k, v, ab)
    dq, dk, dv, dab = vjp(do)
  return dq, dk, dv, dab


_fa_fwd = TorchNumpyRunner(_jax_flash_attention)
_fa_bwd = TorchNumpyRunner(_jax_flash_attention_bwd)


def _match(out: Tensor, like: Tensor) -> Tensor:
  # JAX runs without x64: float64 inputs are computed in float32.
  return out if out.dtype == like.dtype else out.to(like.dtype)


@torch.library.custom_op("pallas_np::flash_attention", mutates_args=())
def _flash_attention_op(q: Tensor, k: Tensor, v: Tensor, ab: Optional[Tensor],
                        q_segment_ids: Optional[Tensor], kv_segment_ids: Optional[Tensor],
                        causal: bool, sm_scale: float, block_sizes: Sequence[int]) -> Tensor:
  out = _fa_fwd((q, k, v, ab, q_segment_ids, kv_segment_ids),
                dict(causal=causal, sm_scale=sm_scale, block_sizes=tuple(block_sizes)))
  return _match(out, q)


@_flash_attention_op.register_fake
def _(q, k, v, ab, q_segment_ids, kv_segment_ids, causal, sm_scale, block_sizes):
  return q.new_empty(q.shape)


@torch.library.custom_op("pallas_np::flash_attention_backward", mutates_args=())
def _flash_attention_bwd_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor,
                            ab: Optional[Tensor], q_segment_ids: Optional[Tensor],
                            kv_segment_ids: Optional[Tensor], causal: bool, sm_scale: float,
                            block_sizes: Sequence[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
  """(dq, dk, dv, dab); dab is empty when there is no bias."""
  dq, dk, dv, dab = _fa_bwd(
      (grad_out, q, k, v, ab, q_segment_ids, kv_segment_ids),
      dict(causal=causal, sm_scale=sm_scale, block_sizes=tuple(block_sizes)))
  return _match(dq, q), _match(dk, k), _match(dv, v), _match(dab, ab if ab is not None else q)


@_flash_attention_bwd_op.register_fake
def _(grad_out, q, k, v, ab, q_segment_ids, kv_segment_ids, causal, sm_scale, block_sizes):
  dab = ab.new_empty(ab.shape) if ab is not None else q.new_empty((0,))
  return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dab


def _fa_setup_context(ctx, inputs, output):
  q, k, v, ab, q_seg, kv_seg, causal, sm_scale, block_sizes = inputs
  ctx.save_for_backward(q, k, v, ab, q_seg, kv_seg)
  ctx.static = (causal, sm_scale, list(block_sizes))


def _fa_backward(ctx, grad_out):
  q, k, v, ab, q_seg, kv_seg = ctx.saved_tensors
  causal, sm_scale, block_sizes = ctx.static
  dq, dk, dv, dab = torch.ops.pallas_np.flash_attention_backward(
      grad_out.contiguous(), q, k, v, ab, q_seg, kv_seg, causal, sm_scale, block_sizes)
  return dq, dk, dv, (dab if ab is not None else None), None, None, None, None, None


torch.library.register_autograd("pallas_np::flash_attention", _fa_backward,
                                setup_context=_fa_setup_context)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                    q_segment_ids: Tensor | None = None, kv_segment_ids: Tensor | None = None,
                    sm_scale: float = 1.0, *, ab: Tensor | None = None,
                    block_sizes: _fa.BlockSizes | Sequence[int] | None = None,
                    partition_spec=None, mesh=None) -> Tensor:
  """torch_xla's ``flash_attention`` on CPU tensors: JAX's TPU flash attention
  kernel in numpy mode, differentiable (the kernel's own backward).

  q: [batch, heads, q_len, head_dim]; k, v: [batch, heads, kv_len, head_dim];
  segment ids: [batch, q_len] / [batch, kv_len]; ab: additive bias
  [batch, heads, q_len, kv_len]. Block sizes default to 128 capped at the
  sequence lengths (kv_len must be a multiple of the kv block).
  """
  if partition_spec is not None or mesh is not None:
    raise NotImplementedError(
        "pallas_np.torch.flash_attention: SPMD partition_spec/mesh are not supported on CPU")
  if block_sizes is None:
    sizes = _default_block_sizes(q.shape[2], k.shape[2])
  elif isinstance(block_sizes, _fa.BlockSizes):
    sizes = [getattr(block_sizes, f) for f in _BLOCK_FIELDS]
    if any(s is None for s in sizes):
      defaults = _default_block_sizes(q.shape[2], k.shape[2])
      sizes = [d if s is None else s for s, d in zip(sizes, defaults)]
  else:
    sizes = list(block_sizes)
  as_i32 = lambda t: None if t is None else t.to(torch.int32)
  return torch.ops.pallas_np.flash_attention(
      q, k, v, ab, as_i32(q_segment_ids), as_i32(kv_segment_ids), bool(causal),
      float(sm_scale), [int(s) for s in sizes])


def _jax_paged_attention(q, k_pages, v_pages, lengths, page_indices, *,
                         pages_per_compute_block, megacore_mode, attn_logits_soft_cap):
  return _pa.paged_attention(q, k_pages, v_pages, lengths, page_indices,
                             pages_per_compute_block=pages_per_compute_block,
                             megacore_mode=megacore_mode,
                             attn_logits_soft_cap=attn_logits_soft_cap)


_pa_run = TorchNumpyRunner(_jax_paged_attention)


@torch.library.custom_op("pallas_np::paged_attention", mutates_args=())
def _paged_attention_op(q: Tensor, k_pages: Tensor, v_pages: Tensor, lengths: Tensor,
                        page_indices: Tensor, pages_per_compute_block: int,
                        megacore_mode: Optional[str] = None,
                        attn_logits_soft_cap: Optional[float] = None) -> Tensor:
  out = _pa_run((q, k_pages, v_pages, lengths, page_indices),
                dict(pages_per_compute_block=pages_per_compute_block,
                     megacore_mode=megacore_mode, attn_logits_soft_cap=attn_logits_soft_cap))
  return _match(out, q)


@_paged_attention_op.register_fake
def _(q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block,
      megacore_mode=None, attn_logits_soft_cap=None):
  return q.new_empty(q.shape)


def paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, lengths: Tensor,
                    page_indices: Tensor, pages_per_compute_block: int,
                    megacore_mode: str | None = None,
                    attn_logits_soft_cap: float | None = None) -> Tensor:
  """torch_xla's ``paged_attention``: JAX's TPU paged (grouped-query) attention
  kernel in numpy mode. No autograd (the JAX kernel has no backward).

  q: [batch, q_heads, head_dim]; k_pages, v_pages: [kv_heads, total_pages,
  page_size, head_dim]; lengths: [batch] ints; page_indices: [batch,
  pages_per_sequence] ints.
  """
  return torch.ops.pallas_np.paged_attention(
      q, k_pages, v_pages, lengths.to(torch.int32), page_indices.to(torch.int32),
      int(pages_per_compute_block), megacore_mode,
      None if attn_logits_soft_cap is None else float(attn_logits_soft_cap))
