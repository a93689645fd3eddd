"""Pallas kernels for the benchmark suite (and anyone who wants realistic
kernels to try): each ``case_*`` returns a ``Case`` whose ``make(interpret)``
builds the call for one ``interpret=`` value.

``interpret`` may be ``"numpy"``/an ``InterpretParams`` (then the call goes
through ``pallas_np.pallas_call``: eager, no XLA compile), ``True`` or a
``pltpu.InterpretParams()`` (``pl.pallas_call``, which JAX jits).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np.params import is_numpy_mode


@dataclasses.dataclass
class Case:
  name: str
  make: Callable[[Any], Callable]
  args: tuple
  reference: Callable | None = None  # NumPy/jnp reference of the result
  tol: float = 1e-4


def pallas_call(kernel, out_shape, *, interpret, **kw):
  if is_numpy_mode(interpret):
    return pallas_np.pallas_call(kernel, out_shape, interpret=interpret, **kw)
  return pl.pallas_call(kernel, out_shape, interpret=interpret, **kw)


def _normal(key, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(key), shape, dtype)


# -- quickstart --------------------------------------------------------------------
def add_vectors_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] + y_ref[...]


def case_add(n=8):
  x = jnp.arange(float(n))
  y = jnp.arange(float(n))
  make = lambda interp: pallas_call(
      add_vectors_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interp)
  return Case(f"add {n}", make, (x, y), lambda x, y: x + y)


def matmul_kernel(x_ref, y_ref, z_ref, *, activation=None):
  z = x_ref[...] @ y_ref[...]
  z_ref[...] = activation(z) if activation else z


def case_matmul(n=1024, activation=None, label="matmul"):
  x, y = _normal(0, (n, n)), _normal(1, (n, n))

  def make(interp):
    return pallas_call(
        functools.partial(matmul_kernel, activation=activation),
        jax.ShapeDtypeStruct((n, n), x.dtype), grid=(2, 2),
        in_specs=[pl.BlockSpec((n // 2, n), lambda i, j: (i, 0)),
                  pl.BlockSpec((n, n // 2), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((n // 2, n // 2), lambda i, j: (i, j)),
        interpret=interp)
  ref = (lambda x, y: activation(x @ y)) if activation else (lambda x, y: x @ y)
  return Case(f"{label} {n}", make, (x, y), ref, tol=1e-2)


def case_fused_matmul(n=512):
  return case_matmul(n, jax.nn.relu, "matmul+relu")


# -- bitonic sort: the kernel of benchmarks/bitonic_sort.py ------------------------
from benchmarks.bitonic_sort import bitonic_kernel  # noqa: E402


def case_bitonic(rows=1024, n=256, rows_per_block=1):
  x = _normal(2, (rows, n))

  def make(interp):
    return pallas_call(
        bitonic_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(rows // rows_per_block,),
        in_specs=[pl.BlockSpec((rows_per_block, n), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((rows_per_block, n), lambda i: (i, 0)),
        interpret=interp)
  return Case(f"bitonic {rows}x{n} /{rows_per_block}", make, (x,),
              lambda x: jnp.sort(x, axis=-1), tol=0)


# -- row-wise normalisations ----------------------------------------------------------
def softmax_kernel(x_ref, o_ref):
  x = x_ref[...]
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  o_ref[...] = e / jnp.sum(e, axis=-1, keepdims=True)


def case_softmax(rows=1024, n=512, block=8):
  x = _normal(3, (rows, n))

  def make(interp):
    return pallas_call(
        softmax_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(rows // block,),
        in_specs=[pl.BlockSpec((block, n), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((block, n), lambda i: (i, 0)), interpret=interp)
  return Case(f"softmax {rows}x{n} /{block}", make, (x,),
              lambda x: jax.nn.softmax(x, axis=-1), tol=1e-5)


def layer_norm_kernel(x_ref, w_ref, b_ref, o_ref, *, eps=1e-5):
  x = x_ref[...]
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  o_ref[...] = (x - mean) * lax.rsqrt(var + eps) * w_ref[...] + b_ref[...]


def case_layer_norm(rows=1024, n=256, block=16):
  x = _normal(4, (rows, n))
  w = _normal(5, (1, n))
  b = _normal(6, (1, n))

  def make(interp):
    return pallas_call(
        layer_norm_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(rows // block,),
        in_specs=[pl.BlockSpec((block, n), lambda i: (i, 0)),
                  pl.BlockSpec((1, n), lambda i: (0, 0)),
                  pl.BlockSpec((1, n), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((block, n), lambda i: (i, 0)), interpret=interp)

  def ref(x, w, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / jnp.sqrt(v + 1e-5) * w + b
  return Case(f"layer_norm {rows}x{n} /{block}", make, (x, w, b), ref)


# -- attention ---------------------------------------------------------------------
def _attention_ref(q, k, v, causal=False):
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
  if causal:
    n = q.shape[2]
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
  return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def flash_fwd_kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, scale):
  """TPU style: the kv axis is the innermost ("arbitrary") grid axis; running
  max/sum/accumulator live in VMEM scratch."""
  kv = pl.program_id(3)

  @pl.when(kv == 0)
  def _():
    m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)

  q = q_ref[...]
  k = k_ref[...]
  s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
  m_prev = m_ref[...]
  m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
  p = jnp.exp(s - m_new)
  alpha = jnp.exp(m_prev - m_new)
  l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=-1, keepdims=True)
  acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v_ref[...],
                                                preferred_element_type=jnp.float32)
  m_ref[...] = m_new

  @pl.when(kv == pl.num_programs(3) - 1)
  def _():
    o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def case_flash_attention(b=2, h=4, s=512, d=64, bq=128, bk=128):
  q, k, v = _normal(7, (b, h, s, d)), _normal(8, (b, h, s, d)), _normal(9, (b, h, s, d))

  def make(interp):
    spec_q = pl.BlockSpec((None, None, bq, d), lambda b, h, i, j: (b, h, i, 0))
    spec_kv = pl.BlockSpec((None, None, bk, d), lambda b, h, i, j: (b, h, j, 0))
    return pallas_call(
        functools.partial(flash_fwd_kernel, scale=1.0 / math.sqrt(d)),
        jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(b, h, s // bq, s // bk),
        in_specs=[spec_q, spec_kv, spec_kv], out_specs=spec_q,
        scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                        pltpu.VMEM((bq, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interp)
  return Case(f"flash_attention b{b} h{h} s{s} d{d}", make, (q, k, v), _attention_ref)


def paged_decode_kernel(lengths_ref, pages_ref, q_ref, k_ref, v_ref, o_ref,
                        m_ref, l_ref, acc_ref, *, page_size, scale):
  """One query token per sequence; grid (batch, page): each step attends to
  one KV page picked through the page table (scalar prefetch)."""
  b, p = pl.program_id(0), pl.program_id(1)

  @pl.when(p == 0)
  def _():
    m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)

  length = lengths_ref[b]

  @pl.when(p * page_size < length)
  def _():
    q = q_ref[...]                      # (heads, d)
    k = k_ref[...]                      # (heads, page, d)
    s = jnp.einsum("hd,hpd->hp", q, k) * scale
    pos = p * page_size + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(pos < length, s, -jnp.inf)
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
    e = jnp.exp(s - m_new)
    alpha = jnp.exp(m_prev - m_new)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(e, axis=-1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.einsum("hp,hpd->hd", e, v_ref[...])
    m_ref[...] = m_new

  @pl.when(p == pl.num_programs(1) - 1)
  def _():
    o_ref[...] = acc_ref[...] / l_ref[...]


def case_paged_attention(batch=16, heads=8, d=64, page_size=16, pages_per_seq=16,
                         total_pages=512):
  q = _normal(10, (batch, heads, d))
  k_pages = _normal(11, (heads, total_pages, page_size, d))
  v_pages = _normal(12, (heads, total_pages, page_size, d))
  rng = np.random.default_rng(0)
  page_table = jnp.asarray(rng.permutation(total_pages)[:batch * pages_per_seq]
                           .reshape(batch, pages_per_seq), jnp.int32)
  lengths = jnp.asarray(rng.integers(1, pages_per_seq * page_size + 1, batch), jnp.int32)

  def make(interp):
    kv_spec = pl.BlockSpec((heads, None, page_size, d),
                           lambda b, p, lens, pt: (0, pt[b, p], 0, 0))
    return pallas_call(
        functools.partial(paged_decode_kernel, page_size=page_size,
                          scale=1.0 / math.sqrt(d)),
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(batch, pages_per_seq),
            in_specs=[pl.BlockSpec((None, heads, d), lambda b, p, lens, pt: (b, 0, 0)),
                      kv_spec, kv_spec],
            out_specs=pl.BlockSpec((None, heads, d), lambda b, p, lens, pt: (b, 0, 0)),
            scratch_shapes=[pltpu.VMEM((heads, 1), jnp.float32),
                            pltpu.VMEM((heads, 1), jnp.float32),
                            pltpu.VMEM((heads, d), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interp)

  def ref(lengths, page_table, q, k_pages, v_pages):
    k = k_pages[:, page_table].reshape(heads, batch, -1, d).transpose(1, 0, 2, 3)
    v = v_pages[:, page_table].reshape(heads, batch, -1, d).transpose(1, 0, 2, 3)
    s = jnp.einsum("bhd,bhtd->bht", q, k) / math.sqrt(d)
    mask = jnp.arange(k.shape[2])[None, None, :] < lengths[:, None, None]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("bht,bhtd->bhd", p, v)
  return Case(f"paged_attention b{batch} h{heads} p{pages_per_seq}x{page_size}", make,
              (lengths, page_table, q, k_pages, v_pages), ref)


def gpu_attention_kernel(q_ref, k_ref, v_ref, o_ref, *, block_k, scale, causal):
  """GPU (Triton) style: grid over (batch, head, q block); the kernel loops
  over kv blocks itself, with a trip count that depends on program_id when
  causal."""
  block_q, d = q_ref.shape
  seq = k_ref.shape[0]
  qi = pl.program_id(2)
  q = q_ref[...] * scale

  def body(j, carry):
    m, l, acc = carry
    start = pl.multiple_of(j * block_k, block_k)
    k = k_ref[pl.ds(start, block_k), :]
    v = v_ref[pl.ds(start, block_k), :]
    s = jnp.dot(q, k.T)
    if causal:
      rows = qi * block_q + lax.broadcasted_iota(jnp.int32, s.shape, 0)
      cols = start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
      s = jnp.where(cols <= rows, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None])
    alpha = jnp.exp(m - m_new)
    return m_new, alpha * l + jnp.sum(p, axis=1), alpha[:, None] * acc + jnp.dot(p, v)

  upper = (qi + 1) * block_q // block_k if causal else seq // block_k
  init = (jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32),
          jnp.zeros((block_q, d), jnp.float32))
  m, l, acc = lax.fori_loop(0, upper, body, init)
  o_ref[...] = acc / l[:, None]


def case_gpu_attention(b=2, h=4, s=512, d=64, bq=64, bk=64, causal=True):
  q, k, v = _normal(13, (b, h, s, d)), _normal(14, (b, h, s, d)), _normal(15, (b, h, s, d))

  def make(interp):
    return pallas_call(
        functools.partial(gpu_attention_kernel, block_k=bk, scale=1.0 / math.sqrt(d),
                          causal=causal),
        jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(b, h, s // bq),
        in_specs=[pl.BlockSpec((None, None, bq, d), lambda b, h, i: (b, h, i, 0)),
                  pl.BlockSpec((None, None, s, d), lambda b, h, i: (b, h, 0, 0)),
                  pl.BlockSpec((None, None, s, d), lambda b, h, i: (b, h, 0, 0))],
        out_specs=pl.BlockSpec((None, None, bq, d), lambda b, h, i: (b, h, i, 0)),
        interpret=interp)
  return Case(f"gpu_attention b{b} h{h} s{s} d{d}{' causal' if causal else ''}", make,
              (q, k, v), functools.partial(_attention_ref, causal=causal))


# -- JAX's GPU (Triton-path) ops, jax.experimental.pallas.ops.gpu ------------------------
# These take ``interpret=`` themselves and jit internally, so every mode (numpy
# included) runs under jit; in numpy mode that eagerly called jit runs whole in
# the NumPy evaluator (InterpretParams.whole_program), as pallas_np.jit would.
def _gpu_op_case(label, op, args, reference, tol=1e-4, grad=False):
  def flat(fn):
    if not grad:
      return fn
    g = jax.grad(lambda *a: (fn(*a) * jnp.cos(a[0])).sum(), argnums=tuple(range(len(args))))
    return lambda *a: jnp.concatenate([x.ravel() for x in g(*a)])

  def make(interp):
    return jax.jit(flat(lambda *a: op(*a, interpret=interp)))
  return Case(label, make, args, flat(reference), tol=tol)


def case_gpu_ops_mha(s=512, causal=True, grad=False):
  from jax.experimental.pallas.ops.gpu import attention
  b, h, d = 1, 2, 64
  q, k, v = _normal(20, (b, s, h, d)), _normal(21, (b, s, h, d)), _normal(22, (b, s, h, d))
  blocks = attention.BlockSizes(block_q=64, block_k=64, block_q_dkv=64, block_kv_dkv=64,
                                block_q_dq=64, block_kv_dq=64)
  op = lambda q, k, v, interpret: attention.mha(q, k, v, None, causal=causal,
                                                block_sizes=blocks, interpret=interpret)
  ref = lambda q, k, v: attention.mha_reference(q, k, v, None, causal=causal)
  return _gpu_op_case(f"ops.gpu mha {'bwd' if grad else 'fwd'} s{s}", op, (q, k, v), ref,
                      grad=grad)


def case_gpu_ops_norm(which="layer_norm", rows=256, n=1000, grad=False):
  from jax.experimental.pallas.ops.gpu import layer_norm, rms_norm
  mod = {"layer_norm": layer_norm, "rms_norm": rms_norm}[which]
  x, w, b = _normal(23, (4, rows // 4, n)), _normal(24, (n,)), _normal(25, (n,))
  op = lambda x, w, b, interpret: getattr(mod, which)(x, w, b, interpret=interpret)
  ref = getattr(mod, f"{which}_reference")
  return _gpu_op_case(f"ops.gpu {which} {'bwd' if grad else 'fwd'} {rows}x{n}", op,
                      (x, w, b), ref, grad=grad)


def case_gpu_ops_softmax(rows=256, n=1000):
  from jax.experimental.pallas.ops.gpu import softmax
  x = _normal(26, (4, rows // 4, n))
  return _gpu_op_case(f"ops.gpu softmax {rows}x{n}", softmax.softmax, (x,),
                      lambda x: jax.nn.softmax(x, axis=-1), tol=1e-5)


def case_gpu_ops_decode(kind="gqa", s=2048):
  from jax.experimental.pallas.ops.gpu import decode_attention
  b, nq, d, kvh = 2, 16, 64, 2
  q = _normal(27, (b, nq, d))
  kv_shape = (b, s, d) if kind == "mqa" else (b, s, kvh, d)
  k, v = _normal(28, kv_shape), _normal(29, kv_shape)
  op = lambda q, k, v, interpret: getattr(decode_attention, kind)(
      q, k, v, block_k=128, k_splits=4, interpret=interpret)
  return _gpu_op_case(f"ops.gpu decode {kind} s{s}", op, (q, k, v),
                      getattr(decode_attention, f"{kind}_reference"))


def case_gpu_ops_paged(s=2048, page=16):
  from jax.experimental.pallas.ops.gpu import paged_attention
  b, nq, d, kvh = 2, 16, 64, 2
  pps = s // page
  q = _normal(30, (b, nq, d))
  k_pages, v_pages = _normal(31, (kvh, b * pps, page, d)), _normal(32, (kvh, b * pps, page, d))
  tables = jax.random.permutation(jax.random.key(33), b * pps).reshape(b, pps).astype(jnp.int32)
  lengths = jnp.array([s - 100, s], jnp.int32)
  op = lambda q, kp, vp, t, l, interpret: paged_attention.paged_attention(
      q, kp, vp, t, l, pages_per_compute_block=4, k_splits=4, interpret=interpret)

  def ref(q, kp, vp, t, l):
    unpage = lambda p: p[:, t].reshape(kvh, b, pps * page, d).transpose(1, 2, 0, 3)
    return paged_attention.paged_attention_reference(q, unpage(kp), unpage(vp), l)
  return _gpu_op_case(f"ops.gpu paged_attention s{s}", op,
                      (q, k_pages, v_pages, tables, lengths), ref)


GPU_OP_CASES = {
    "gpu_ops_mha_fwd": case_gpu_ops_mha,
    "gpu_ops_mha_bwd": functools.partial(case_gpu_ops_mha, grad=True),
    "gpu_ops_layer_norm_fwd": case_gpu_ops_norm,
    "gpu_ops_layer_norm_bwd": functools.partial(case_gpu_ops_norm, grad=True),
    "gpu_ops_rms_norm_fwd": functools.partial(case_gpu_ops_norm, "rms_norm"),
    "gpu_ops_rms_norm_bwd": functools.partial(case_gpu_ops_norm, "rms_norm", grad=True),
    "gpu_ops_softmax": case_gpu_ops_softmax,
    "gpu_ops_decode_mqa": functools.partial(case_gpu_ops_decode, "mqa"),
    "gpu_ops_decode_gqa": case_gpu_ops_decode,
    "gpu_ops_paged_attention": case_gpu_ops_paged,
}


def all_cases(quick=False):
  """The suite, as zero-argument builders (cases build their inputs lazily)."""
  cases = {
      "add": case_add,
      "matmul": case_matmul,
      "matmul_relu": case_fused_matmul,
      "bitonic_1024x256_r1": functools.partial(case_bitonic, 1024, 256, 1),
      "bitonic_1024x256_r64": functools.partial(case_bitonic, 1024, 256, 64),
      "bitonic_256x1024_r8": functools.partial(case_bitonic, 256, 1024, 8),
      "bitonic_8x128_r8": functools.partial(case_bitonic, 8, 128, 8),
      "softmax": case_softmax,
      "layer_norm": case_layer_norm,
      "flash_attention": case_flash_attention,
      "paged_attention": case_paged_attention,
      "gpu_attention": case_gpu_attention,
      **GPU_OP_CASES,
  }
  if quick:
    keep = ("add", "matmul_relu", "bitonic_8x128_r8", "softmax")
    cases = {k: v for k, v in cases.items() if k in keep}
  return cases
