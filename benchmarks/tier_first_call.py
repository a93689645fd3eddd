"""What the native tier adds to a kernel's first call: the first call of a
small kernel (benchmarks/small_kernels.py) in a fresh process with the
tier (``native_loops="background"``) and with ``"off"``, the two
alternating process by process (issue 41: first calls, "never slower").

    python benchmarks/tier_first_call.py                          # every kernel, empty cache
    python benchmarks/tier_first_call.py --kernels w8_bf16,cumsum_fori --rounds 5
    python benchmarks/tier_first_call.py --cache populated        # another kernel's library on disk
    python benchmarks/tier_first_call.py --cache warm             # this kernel's library on disk

``--cache``: ``empty`` (a new cache directory each process: a first run
on a new machine), ``populated`` (a cache holding another kernel's
library: a user who ran pallas_np before, so a loop's pre-key is computed
and looked up), ``warm`` (the kernel's own loops built first: a re-run test
suite; its first call loads them). Reported per kernel: each process's
first call (ms, trace + plan + run), the median per mode and tier - off.
Never run as a timed test.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(kernel: str, mode: str) -> None:
  """The fresh process: one first call, timed."""
  sys.path.insert(0, ROOT)
  import jax
  jax.config.update("jax_platforms", "cpu")
  import pallas_np
  from benchmarks import small_kernels
  case = small_kernels.all_cases()[kernel]()
  args = jax.block_until_ready(case.args)
  fn = case.make(pallas_np.InterpretParams(native_loops=mode))
  if mode == "sync":  # (not timed: the kernel's loops built into the cache)
    for _ in range(pallas_np.native.HOT_RUNS + 1):
      jax.block_until_ready(fn(*args))
    pallas_np.native.wait(900)
    return
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  print(f"{(time.perf_counter() - t0) * 1e3:.3f}")


def run(kernel, mode, cache) -> float | None:
  env = dict(os.environ, PALLAS_NP_PROGRESS="0", JAX_PLATFORMS="cpu", PALLAS_NP_NATIVE_CACHE=cache)
  out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kernel, mode],
                       capture_output=True, text=True, env=env, cwd=ROOT, check=True).stdout
  return float(out.strip().splitlines()[-1]) if mode != "sync" else None


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--kernels", default="all")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--cache", choices=("empty", "populated", "warm"), default="empty")
  ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.child:
    return child(*a.child)
  if a.kernels == "all":
    sys.path.insert(0, ROOT)
    from benchmarks import small_kernels
    kernels = list(small_kernels.all_cases())
  else:
    kernels = [k.strip() for k in a.kernels.split(",")]
  root = tempfile.mkdtemp(prefix="pallas_np-first-call-")
  try:
    for kernel in kernels:
      shared = os.path.join(root, kernel)
      if a.cache == "populated":  # (another kernel's library: the cache is not empty)
        run("cumsum_fori" if kernel != "cumsum_fori" else "while_collatz", "sync", shared)
      elif a.cache == "warm":
        run(kernel, "sync", shared)
      times = {"off": [], "background": []}
      for r in range(a.rounds):
        for mode in (("off", "background") if r % 2 == 0 else ("background", "off")):
          cache = tempfile.mkdtemp(dir=root) if a.cache == "empty" else shared
          times[mode].append(run(kernel, mode, cache))
          if a.cache == "empty":
            shutil.rmtree(cache, ignore_errors=True)
      med = {m: statistics.median(v) for m, v in times.items()}
      print(f"{kernel} ({a.cache} cache): first call ms, off " +
            " ".join(f"{v:.1f}" for v in times["off"]) + " | tier " +
            " ".join(f"{v:.1f}" for v in times["background"]) +
            f" | medians {med['off']:.1f} / {med['background']:.1f} "
            f"(tier - off {med['background'] - med['off']:+.1f} ms)", flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
