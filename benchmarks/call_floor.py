"""The per-call floor: what one warm call of a one-block (8, 128) copy kernel
costs, numpy mode vs interpret=True, eager and under ``jax.jit``, and the
floors around it that pallas_np does not own (issue 33).

    python benchmarks/call_floor.py            # 3000 interleaved rounds
    python benchmarks/call_floor.py --rounds 500

Rows (median of interleaved warm calls, µs, one process):
  numpy eager / jit        pallas_np.pallas_call(...)(x), jax.jit of it
  interpret eager / jit    pl.pallas_call(..., interpret=True)
  numpy jit, no whole_program
                           InterpretParams(whole_program=False): XLA runs the
                           program, the kernel through one io_callback
  empty io_callback jit    jax.jit of an io_callback returning its operand:
                           XLA's host-callback floor
  jit dispatch floor       jax.jit of the numpy kernel with pallas_np's eager
                           jit hooks answering at once (outputs made in
                           advance): JAX's own Python dispatch of an eager jit
                           call that misses its C++ cache, which every
                           whole-program call does, plus pallas_np's program
                           memo (``_compat.install_jit_params_memo``)
  jit, JAX's own dispatch  the same with JAX's ``_infer_params`` answering at
                           once too: what is JAX's alone (the C++ cache miss,
                           ``cache_miss``, ``block_until_ready``)
  hand-off                 ``batched_device_put`` of a fresh (8, 128) buffer
                           as kernel outputs are handed to JAX, and
                           ``block_until_ready``: JAX's part of every call
  jnp x*2+1 jit            a jitted two-op XLA program, for scale
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

import pallas_np  # noqa: E402
from pallas_np import _compat as jc  # noqa: E402


def copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def callables(x):
  sds = jax.ShapeDtypeStruct(x.shape, x.dtype)
  numpy = pallas_np.pallas_call(copy_kernel, sds, interpret=pallas_np.InterpretParams())
  interp = pl.pallas_call(copy_kernel, sds, interpret=True)
  no_whole = pl.pallas_call(copy_kernel, sds,
                            interpret=pallas_np.InterpretParams(whole_program=False))
  empty = jax.jit(lambda v: jax.experimental.io_callback(lambda a: a, sds, v, ordered=False))
  return {"numpy eager": numpy, "interpret eager": interp, "numpy jit": jax.jit(numpy),
          "interpret jit": jax.jit(interp), "numpy jit, no whole_program": jax.jit(no_whole),
          "empty io_callback jit": empty, "jnp x*2+1 jit": jax.jit(lambda v: v * 2 + 1)}


def medians(fns, x, rounds):
  for f in fns.values():
    jax.block_until_ready(f(x))
  times = {k: [] for k in fns}
  for _ in range(rounds):
    for k, f in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(x))
      times[k].append(time.perf_counter() - t0)
  return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def dispatch_floor(x, rounds):
  """The numpy jit call with the eager-jit hook answering at once."""
  fns = callables(x)
  fns = {"numpy jit": fns["numpy jit"], "interpret jit": fns["interpret jit"]}
  jax.block_until_ready(fns["numpy jit"](x))
  answer = [jc.np_to_jax(np.asarray(x))]

  def at_once(jax_impl, *args, jaxpr, **params):
    return list(answer), None, None, []
  # In front of pallas_np's hooks until the process ends: measured last.
  jc.install_jit_call_hook(at_once)
  jc.install_jit_run_hook(lambda params, args_flat: list(answer))
  floor = medians(fns, x, rounds)["numpy jit"]
  # JAX's _infer_params answered at once as well (the traced program of
  # this call, found once): a benchmark-only patch, never undone.
  p, _ = jc.jax_pjit._infer_params(fns["numpy jit"]._fun, fns["numpy jit"]._jit_info, (x,), {})
  jc.jax_pjit._infer_params = lambda fun, ji, args, kwargs: (p, [*p.consts, *args])
  return floor, medians(fns, x, rounds)["numpy jit"]


def hand_off(x, rounds):
  """A fresh kernel-output-like buffer handed to JAX (the putter the
  one-point kernels use), then block_until_ready."""
  put = jc.exact_array_putter(x.shape, x.dtype)
  template = np.asarray(x).copy()
  return medians({"hand-off": lambda v: put([template.copy()])}, x, rounds)["hand-off"]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=3000)
  args = ap.parse_args(argv)
  if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")
  os.environ.setdefault("PALLAS_NP_PROGRESS", "0")
  x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32))
  result = medians(callables(x), x, args.rounds)
  result["hand-off"] = hand_off(x, args.rounds)
  result["jit dispatch floor"], result["jit, JAX's own dispatch"] = dispatch_floor(x, args.rounds)
  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
  print(f"jax {jax.__version__}, python {sys.version.split()[0]}, load {load:.1f}, "
        f"{args.rounds} rounds")
  for k, v in result.items():
    print(f"{k:30s} {v:8.1f} us")


if __name__ == "__main__":
  main()
