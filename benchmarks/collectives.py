"""Multi-device collective kernels on host devices: numpy mode vs TPU
interpret mode (``pltpu.InterpretParams()``), cold and warm.

    python benchmarks/collectives.py                   # 4 and 8 devices, every kernel
    python benchmarks/collectives.py --devices 4 --kernels all_reduce --warm 5

Kernels (tests/collective_kernels.py, the shapes of tests/multi_device_kernels.py):
the tutorial's right permute, the ring all-reduce, reduce-scatter and the
all-gather collective matmul, each under ``jax.jit(jax.shard_map(...))`` over
``--xla_force_host_platform_device_count=N`` devices. Every (devices,
kernel, mode) runs in a fresh process: *cold* is the first call (tracing,
lowering, XLA compile, running; imports excluded), *warm* the median of the
next ``--warm`` calls. Results are checked against the jax.lax collective.
Target: warm numpy >= 10x faster than TPU interpret mode.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNELS = ("right_permute", "all_reduce", "reduce_scatter", "all_gather_matmul")
MODES = ("numpy", "tpu")


def worker(kernel: str, mode: str, warm: int, rows: int) -> dict:
  import jax
  import numpy as np
  from jax.experimental.pallas import tpu as pltpu

  sys.path.insert(0, str(ROOT))
  from tests import collective_kernels as ck
  from tests import multi_device_kernels as mdk

  n = jax.device_count()
  interpret = "numpy" if mode == "numpy" else pltpu.InterpretParams()
  x = mdk.int_data((n * rows, 128), 0)
  if kernel == "right_permute":
    f = mdk.shmap(lambda v: mdk.right_permute(v, interpret=interpret))
    ref = mdk.shmap(lambda v: jax.lax.ppermute(v, "x", [(i, (i + 1) % n) for i in range(n)]))
    args = (x,)
  elif kernel == "all_reduce":
    f = mdk.shmap(lambda v: ck.all_reduce(v, n, interpret))
    ref = mdk.shmap(lambda v: jax.lax.psum(v, "x"))
    args = (x,)
  elif kernel == "reduce_scatter":
    f = mdk.shmap(lambda v: ck.reduce_scatter(v, n, interpret))
    ref = mdk.shmap(lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True))
    args = (mdk.int_data((n * n * rows, 128), 1),)
  else:
    # y stays at 128 x 128: with a larger replicated operand TPU interpret
    # mode's io_callback hangs on host devices (docs/tpu.md).
    f = mdk.shmap(lambda v, w: ck.all_gather_matmul(v, w, n, interpret),
                  in_specs=(mdk.P("x"), mdk.P(None)), out_specs=mdk.P("x"))
    ref = mdk.shmap(lambda v, w: jax.lax.all_gather(v, "x", tiled=True) @ w,
                    in_specs=(mdk.P("x"), mdk.P(None)), out_specs=mdk.P("x"))
    args = (x, mdk.int_data((128, 128), 2))
  t0 = time.perf_counter()
  out = jax.block_until_ready(f(*args))
  cold = time.perf_counter() - t0
  times = []
  for _ in range(warm):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  ok = bool(np.array_equal(np.asarray(out), np.asarray(ref(*args))))
  return {"cold": cold, "warm": statistics.median(times), "ok": ok}


def run_one(devices: int, kernel: str, mode: str, warm: int, rows: int) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  cmd = [sys.executable, __file__, "--worker", kernel, mode, str(warm), str(rows)]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
  if proc.returncode:
    return {"error": proc.stderr[-500:]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--worker":
    print(json.dumps(worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))
    return
  ap = argparse.ArgumentParser()
  ap.add_argument("--devices", default="4,8")
  ap.add_argument("--kernels", default=",".join(KERNELS))
  ap.add_argument("--warm", type=int, default=5)
  ap.add_argument("--rows", type=int, default=8, help="rows of 128 lanes per device shard")
  a = ap.parse_args()
  print(f"| devices | kernel | numpy cold s | tpu cold s | cold ratio | numpy warm ms | "
        f"tpu warm ms | warm ratio | ok |")
  print("|---|---|---|---|---|---|---|---|---|")
  for devices in map(int, a.devices.split(",")):
    for kernel in a.kernels.split(","):
      r = {m: run_one(devices, kernel, m, a.warm, a.rows) for m in MODES}
      if any("error" in v for v in r.values()):
        print(f"| {devices} | {kernel} | error: {[v.get('error') for v in r.values()]} |")
        continue
      nb, tp = r["numpy"], r["tpu"]
      print(f"| {devices} | {kernel} | {nb['cold']:.2f} | {tp['cold']:.2f} | "
            f"{tp['cold'] / nb['cold']:.1f}x | {nb['warm'] * 1e3:.2f} | {tp['warm'] * 1e3:.1f} | "
            f"{tp['warm'] / nb['warm']:.0f}x | {nb['ok'] and tp['ok']} |", flush=True)


if __name__ == "__main__":
  main()
