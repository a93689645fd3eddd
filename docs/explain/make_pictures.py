"""Render the pallas_np.explain pictures of docs/explain/ (and print each
kernel's summary): ``python docs/explain/make_pictures.py [OUTDIR]``."""
from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import pallas_np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


# 1. JAX's Pallas quickstart: a (2, 2) grid of matmul blocks.
def matmul_kernel(x_ref, y_ref, z_ref):
  z_ref[...] = x_ref[...] @ y_ref[...]


def quickstart_matmul(x, y):
  return pl.pallas_call(
      matmul_kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), x.dtype),
      grid=(2, 2),
      in_specs=[pl.BlockSpec((x.shape[0] // 2, x.shape[1]), lambda i, j: (i, 0)),
                pl.BlockSpec((y.shape[0], y.shape[1] // 2), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((x.shape[0] // 2, y.shape[1] // 2), lambda i, j: (i, j)),
      interpret=True)(x, y)


# 2. Ragged edge blocks: (100, 70) in (32, 32) blocks.
def scale_kernel(x_ref, o_ref):
  o_ref[...] = 2 * x_ref[...]


def ragged(x):
  spec = pl.BlockSpec((32, 32), lambda i, j: (i, j))
  return pl.pallas_call(scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(pl.cdiv(x.shape[0], 32), pl.cdiv(x.shape[1], 32)),
                        in_specs=[spec], out_specs=spec)(x)


# 3. A reduction revisiting its output: k axis last, output block fixed along k.
def acc_matmul_kernel(x_ref, y_ref, o_ref, acc_ref):
  @pl.when(pl.program_id(2) == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)
  acc_ref[...] += x_ref[...] @ y_ref[...]

  @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
  def _():
    o_ref[...] = acc_ref[...]


def accumulating_matmul(x, y, bm=32, bk=32, bn=32):
  m, k = x.shape
  n = y.shape[1]
  return pl.pallas_call(
      acc_matmul_kernel, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
      grid=(m // bm, n // bn, k // bk),
      in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
      scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")))(x, y)


# 4a. Causal attention, hand-written: pl.when skips kv blocks above the
# diagonal, so their (mapped) blocks are never read.
def causal_kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, block):
  qi, ki = pl.program_id(0), pl.program_id(1)

  @pl.when(ki == 0)
  def _():
    m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(ki <= qi)  # blocks above the diagonal see nothing: skipped
  def _():
    s = q_ref[...] @ k_ref[...].T
    rows = qi * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
    cols = ki * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(cols <= rows, s, -jnp.inf)
    m_new = jnp.maximum(m_ref[...], s.max(axis=1, keepdims=True))
    p = jnp.exp(s - m_new)
    scale = jnp.exp(m_ref[...] - m_new)
    l_ref[...] = scale * l_ref[...] + p.sum(axis=1, keepdims=True)
    acc_ref[...] = scale * acc_ref[...] + p @ v_ref[...]
    m_ref[...] = m_new

  @pl.when(ki == pl.num_programs(1) - 1)
  def _():
    o_ref[...] = acc_ref[...] / l_ref[...]


def causal_attention(q, k, v, block=16):
  s, d = q.shape
  n = s // block
  return pl.pallas_call(
      functools.partial(causal_kernel, block=block),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(n, n),
      in_specs=[pl.BlockSpec((block, d), lambda i, j: (i, 0)),
                pl.BlockSpec((block, d), lambda i, j: (j, 0)),
                pl.BlockSpec((block, d), lambda i, j: (j, 0))],
      out_specs=pl.BlockSpec((block, d), lambda i, j: (i, 0)),
      scratch_shapes=[pltpu.VMEM((block, 1), jnp.float32), pltpu.VMEM((block, 1), jnp.float32),
                      pltpu.VMEM((block, d), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")))(q, k, v)


# 4b. JAX's TPU flash attention, causal: its index maps clamp skipped kv
# blocks to the last useful one instead of fetching them.
def library_flash(q, k, v):
  from jax.experimental.pallas.ops.tpu import flash_attention as fa
  bs = fa.BlockSizes(block_q=128, block_k_major=128, block_k=128, block_b=1,
                     block_q_major_dkv=128, block_k_major_dkv=128, block_k_dkv=128,
                     block_q_dkv=128, block_k_major_dq=128, block_k_dq=128, block_q_dq=128)
  return fa.flash_attention(q, k, v, causal=True, block_sizes=bs)


# 5. Manual DMAs: the input stays in HBM (memory_space=ANY); each step copies
# its rows into VMEM scratch itself.
def dma_kernel(x_hbm, o_ref, buf, sem, *, rows):
  i = pl.program_id(0)
  copy = pltpu.make_async_copy(x_hbm.at[pl.ds(i * rows, rows)], buf, sem)
  copy.start()
  copy.wait()
  o_ref[...] = buf[...] + 1


def manual_dma(x, rows=8):
  return pl.pallas_call(
      functools.partial(dma_kernel, rows=rows),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // rows,),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0)),
      scratch_shapes=[pltpu.VMEM((rows, x.shape[1]), x.dtype), pltpu.SemaphoreType.DMA])(x)


# 6. A bug: the output index map ignores j, so half the output is never written.
def wrong_index_map(x):
  return pl.pallas_call(
      scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2, 2),
      in_specs=[pl.BlockSpec((16, 16), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((16, 16), lambda i, j: (i, 0)))(x)


def cases():
  r = lambda seed, shape: jax.random.normal(jax.random.key(seed), shape, jnp.float32)
  return [
      ("quickstart_matmul", quickstart_matmul, (r(0, (64, 32)), r(1, (32, 64))), {}),
      ("ragged_edges", ragged, (r(2, (100, 70)),), {}),
      ("accumulator", accumulating_matmul, (r(3, (64, 96)), r(4, (96, 64))), {}),
      ("causal_attention", causal_attention, (r(5, (64, 32)), r(6, (64, 32)), r(7, (64, 32))),
       {}),
      ("flash_attention_causal", library_flash,
       tuple(r(8 + i, (1, 2, 512, 64)) for i in range(3)), {"color": "visits"}),
      ("manual_dma", manual_dma, (r(11, (32, 128)),), {}),
      ("wrong_index_map", wrong_index_map, (r(12, (32, 32)),), {}),
  ]


def main(outdir=HERE):
  os.makedirs(outdir, exist_ok=True)
  for name, fn, args, options in cases():
    explanation = pallas_np.explain(fn, *args)
    print(explanation, end="\n\n")
    for k in explanation:
      k.save(os.path.join(outdir, f"{name}.png"), **options)


if __name__ == "__main__":
  main(*sys.argv[1:])
