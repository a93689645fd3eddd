"""Wall time of JAX's GPU (Triton-path) Pallas ops on CPU:
``interpret="numpy"`` vs ``interpret=True``.

    PYTHONPATH=. python benchmarks/gpu_kernels.py [--quick] [name ...]

For each op: *first* = first call (tracing + XLA compile + run), *steady* =
median of repeated calls of the jitted function. Numbers are printed as a
table; the ratio column is interpret=True time / numpy time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import (attention, decode_attention, layer_norm,
                                             paged_attention, rms_norm, softmax)

import pallas_np  # noqa: F401  (installs interpret="numpy")


def _cases(quick: bool):
  keys = jax.random.split(jax.random.key(0), 12)
  s = 128 if quick else 512
  b, h, d = 1, 2, 64
  q, k, v = (jax.random.normal(keys[i], (b, s, h, d)) for i in range(3))
  blocks = attention.BlockSizes(block_q=64, block_k=64, block_q_dkv=64, block_kv_dkv=64,
                                block_q_dq=64, block_kv_dq=64)
  x = jax.random.normal(keys[3], (4, 64 if quick else 256, 1000))
  w = jax.random.normal(keys[4], (1000,))
  bias = jax.random.normal(keys[5], (1000,))
  bd, nq, sk, dd, kvh = 2, 16, (512 if quick else 2048), 64, 2
  qd = jax.random.normal(keys[6], (bd, nq, dd))
  kd = jax.random.normal(keys[7], (bd, sk, dd))
  vd = jax.random.normal(keys[8], (bd, sk, dd))
  kg = jax.random.normal(keys[7], (bd, sk, kvh, dd))
  vg = jax.random.normal(keys[8], (bd, sk, kvh, dd))
  page, pps = 16, sk // 16
  kp = jax.random.normal(keys[9], (kvh, bd * pps, page, dd))
  vp = jax.random.normal(keys[10], (kvh, bd * pps, page, dd))
  tables = jax.random.permutation(keys[11], bd * pps).reshape(bd, pps).astype(jnp.int32)
  lengths = jnp.array([sk - 100, sk], jnp.int32)

  def mha_bwd(interp):
    f = lambda q, k, v: attention.mha(q, k, v, None, causal=True, block_sizes=blocks,
                                      interpret=interp).sum()
    return jax.jit(jax.grad(f, argnums=(0, 1, 2))), (q, k, v)

  def norm_bwd(mod, fn):
    def make(interp):
      f = lambda x, w, b: getattr(mod, fn)(x, w, b, interpret=interp).sum()
      return jax.jit(jax.grad(f, argnums=(0, 1, 2))), (x, w, bias)
    return make

  return {
      "mha_fwd_causal": lambda i: (jax.jit(lambda q, k, v: attention.mha(
          q, k, v, None, causal=True, block_sizes=blocks, interpret=i)), (q, k, v)),
      "mha_bwd_causal": mha_bwd,
      "layer_norm_fwd": lambda i: (jax.jit(lambda x, w, b: layer_norm.layer_norm(
          x, w, b, interpret=i)), (x, w, bias)),
      "layer_norm_bwd": norm_bwd(layer_norm, "layer_norm"),
      "rms_norm_fwd": lambda i: (jax.jit(lambda x, w, b: rms_norm.rms_norm(
          x, w, b, interpret=i)), (x, w, bias)),
      "rms_norm_bwd": norm_bwd(rms_norm, "rms_norm"),
      "softmax": lambda i: (jax.jit(lambda x: softmax.softmax(x, interpret=i)), (x,)),
      "decode_mqa": lambda i: (jax.jit(lambda q, k, v: decode_attention.mqa(
          q, k, v, block_k=128, k_splits=4, interpret=i)), (qd, kd, vd)),
      "decode_gqa": lambda i: (jax.jit(lambda q, k, v: decode_attention.gqa(
          q, k, v, block_k=128, k_splits=4, interpret=i)), (qd, kg, vg)),
      "paged_attention": lambda i: (jax.jit(lambda q, kp, vp, t, l: paged_attention.paged_attention(
          q, kp, vp, t, l, pages_per_compute_block=4, k_splits=4, interpret=i)),
          (qd, kp, vp, tables, lengths)),
  }


def _time(make, interp, repeats):
  fn, args = make(interp)
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return first, statistics.median(times), out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("names", nargs="*")
  ap.add_argument("--quick", action="store_true", help="small shapes")
  ap.add_argument("--repeats", type=int, default=3)
  a = ap.parse_args()
  cases = _cases(a.quick)
  names = a.names or list(cases)
  print(f"{'kernel':18s} {'numpy first':>11s} {'True first':>11s} {'ratio':>6s}   "
        f"{'numpy steady':>12s} {'True steady':>11s} {'ratio':>6s}   max|diff|")
  for name in names:
    nf, ns, nout = _time(cases[name], "numpy", a.repeats)
    tf, ts, tout = _time(cases[name], True, a.repeats)
    diff = max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree_util.tree_leaves(nout), jax.tree_util.tree_leaves(tout)))
    print(f"{name:18s} {nf:10.3f}s {tf:10.3f}s {tf / nf:6.1f}x   "
          f"{ns:11.4f}s {ts:10.4f}s {ts / ns:6.1f}x   {diff:.1e}", flush=True)


if __name__ == "__main__":
  main()
