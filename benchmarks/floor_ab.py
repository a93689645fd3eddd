"""Warm numpy-mode calls of the small-kernel suite, this checkout against
another one (a baseline), processes alternating: on a loaded machine the
load drifts between two back-to-back runs by more than most per-call
changes, so each round runs the baseline's process, then this checkout's,
then (for the ratio) interpret=True's, and the medians of the rounds are
reported.

    python benchmarks/floor_ab.py --baseline /path/to/base/checkout
    python benchmarks/floor_ab.py --baseline DIR --kernels copy_8x128,int8_matmul --rounds 5

Numpy mode runs with ``native_loops="off"`` (the NumPy path: what the
per-call floor and the NumPy rules cost). Each process calls each kernel
for ``--seconds`` after three warm-up calls and prints its median.
Never run as a timed test (CPU-bound, minutes).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NON_LOOP = ("copy_8x128,elementwise_ragged,gather_prefetch,softmax_bf16,int8_matmul,"
            "quant_matmul,w8_bf16,layer_norm_block,matmul_acc")


def child(kernels, mode, seconds):
  """In a fresh process whose cwd is the checkout to time: one median (µs)
  per kernel, printed as ``name median``."""
  sys.path.insert(0, os.getcwd())
  import jax
  jax.config.update("jax_platforms", "cpu")
  import pallas_np
  from benchmarks import small_kernels
  for name in kernels.split(","):
    case = small_kernels.all_cases()[name]()
    args = jax.block_until_ready(case.args)
    fn = case.make(pallas_np.InterpretParams(native_loops="off") if mode == "numpy" else True)
    for _ in range(3):
      jax.block_until_ready(fn(*args))
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - t0)
    print(name, statistics.median(times) * 1e6, flush=True)


def run(checkout, kernels, mode, seconds) -> dict:
  out = subprocess.run(
      [sys.executable, os.path.abspath(__file__), "--child", kernels, mode, str(seconds)],
      cwd=checkout, capture_output=True, text=True, check=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu", PALLAS_NP_PROGRESS="0"))
  return {line.split()[0]: float(line.split()[1]) for line in out.stdout.splitlines()
          if len(line.split()) == 2}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--baseline", help="the other checkout's root")
  ap.add_argument("--kernels", default=NON_LOOP)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--seconds", type=float, default=1.5)
  ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.child:
    return child(a.child[0], a.child[1], float(a.child[2]))
  runs = {"base": [], "this": [], "interpret": []}
  for _ in range(a.rounds):
    runs["base"].append(run(a.baseline, a.kernels, "numpy", a.seconds))
    runs["this"].append(run(ROOT, a.kernels, "numpy", a.seconds))
    runs["interpret"].append(run(ROOT, a.kernels, "interpret", a.seconds))
  print("| kernel | base µs | this µs | this/base | interpret=True µs | base ratio | this ratio |")
  print("|---|---|---|---|---|---|---|")
  ratios = {"base": [], "this": []}
  for k in a.kernels.split(","):
    med = {m: statistics.median(r[k] for r in rs) for m, rs in runs.items()}
    for m in ratios:
      ratios[m].append(med[m] / med["interpret"])
    print(f"| {k} | {med['base']:.0f} | {med['this']:.0f} | {med['this'] / med['base']:.2f} | "
          f"{med['interpret']:.0f} | {ratios['base'][-1]:.2f} | {ratios['this'][-1]:.2f} |")
  for m, rs in ratios.items():
    print(f"geomean ratio to interpret=True, {m}: "
          f"{math.exp(sum(map(math.log, rs)) / len(rs)):.2f}")


if __name__ == "__main__":
  main()
