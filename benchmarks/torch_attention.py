"""pallas_np.torch: JAX's TPU flash attention on torch CPU tensors.

    python benchmarks/torch_attention.py [--quick]

Times ``pallas_np.torch.flash_attention`` (numpy mode; forward, and forward
plus backward through torch autograd) against the same JAX kernel under JAX's
own TPU interpret mode (``pltpu.force_tpu_interpret_mode``, forward only),
and the per-call overhead of ``make_kernel_from_pallas`` on a tiny kernel.
Steady-state numbers are the best of a few runs after a warm-up call.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PALLAS_NP_PROGRESS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.experimental.pallas.ops.tpu import flash_attention as fa  # noqa: E402

import pallas_np  # noqa: E402,F401
import pallas_np.torch as pt  # noqa: E402


def best(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="smaller problem, fewer repeats")
  args = parser.parse_args()
  shape = (1, 2, 256, 64) if args.quick else (1, 4, 512, 64)
  repeats = 2 if args.quick else 3
  torch.manual_seed(0)
  q, k, v = [torch.randn(shape) for _ in range(3)]
  print(f"flash attention, causal, q/k/v {tuple(shape)} float32")

  start = time.perf_counter()
  out = pt.flash_attention(q, k, v, causal=True)
  print(f"  pallas_np.torch forward, first call (traces):   {time.perf_counter() - start:8.3f} s")
  fwd = best(lambda: pt.flash_attention(q, k, v, causal=True), repeats)
  print(f"  pallas_np.torch forward, steady:                {fwd:8.3f} s")

  qg, kg, vg = [t.clone().requires_grad_() for t in (q, k, v)]

  def fwd_bwd():
    pt.flash_attention(qg, kg, vg, causal=True).sum().backward()
  fwd_bwd()
  print(f"  pallas_np.torch forward+backward, steady:       {best(fwd_bwd, repeats):8.3f} s")

  jq, jk, jv = [jnp.asarray(t.numpy()) for t in (q, k, v)]
  with pltpu.force_tpu_interpret_mode():
    jitted = jax.jit(lambda q, k, v: fa.flash_attention(q, k, v, causal=True))
    start = time.perf_counter()
    ref = jitted(jq, jk, jv).block_until_ready()
    print(f"  JAX TPU interpret mode forward, first call:     {time.perf_counter() - start:8.3f} s")
    jax_fwd = best(lambda: jitted(jq, jk, jv).block_until_ready(), repeats)
    print(f"  JAX TPU interpret mode forward, steady:         {jax_fwd:8.3f} s")
  print(f"  max |pallas_np - JAX interpret| = {np.abs(out.numpy() - np.asarray(ref)).max():.2e}; "
        f"steady forward speed-up {jax_fwd / fwd:.1f}x")

  @jax.jit
  def add(x, y):
    def kernel(x_ref, y_ref, o_ref):
      o_ref[...] = x_ref[...] + y_ref[...]
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)

  add_kernel = pt.make_kernel_from_pallas(add, lambda x, y: [(x.shape, x.dtype)])
  x = torch.randn(8)
  add_kernel(x, x)
  overhead = best(lambda: add_kernel(x, x), 200)
  print(f"make_kernel_from_pallas call on 8 floats (overhead): {overhead * 1e6:.0f} us")


if __name__ == "__main__":
  main()
