"""Compiled kernel bodies (pallas_np/native/bodies.py) as a user meets them
with the native cache warm, against ``native_loops="off"`` and
interpret=True, their calls interleaved in one process (on a loaded machine
the only comparison finer than the load's swings between processes).

    python benchmarks/native_bodies_ab.py                    # the non-loop small kernels
    python benchmarks/native_bodies_ab.py --kernels layer_norm_block --seconds 6

Per kernel: an untimed process builds the kernel's body (``native_loops=
"sync"``) into a fresh cache directory, as a first run of a test suite
would; a second process then makes the kernel three ways (the tier,
"background", which finds the body by its pre-key at the first call; off;
interpret=True), makes each one's first call, and calls them in turn (the
order rotating) for ``--seconds``. Reported: mean ms per call over the
first ~1.5 s and the median of the last 50 calls per mode, each with its
ratio to interpret=True, and the body counters (``bodies.stats()``).
Never run as a timed test (CPU-bound, seconds per kernel).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BODY_KERNELS = ("copy_8x128", "elementwise_ragged", "gather_prefetch", "softmax_bf16",
                "int8_matmul", "quant_matmul", "w8_bf16", "layer_norm_block", "matmul_acc")
WINDOW = 1.5


def child(kernel: str, mode: str, seconds: float) -> dict:
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
  import jax
  jax.config.update("jax_platforms", "cpu")
  import pallas_np
  from benchmarks import small_kernels
  from pallas_np.native import bodies
  case = small_kernels.all_cases()[kernel]()
  args = jax.block_until_ready(case.args)
  if mode == "fill":
    fn = case.make(pallas_np.InterpretParams(native_loops="sync"))
    for _ in range(pallas_np.native.HOT_RUNS + 1):
      jax.block_until_ready(fn(*args))
    pallas_np.native.wait(900)
    return {"bodies": bodies.stats()}
  fns = {"tier": case.make(pallas_np.InterpretParams(native_loops="background")),
         "off": case.make(pallas_np.InterpretParams(native_loops="off")),
         "interpret": case.make(True)}
  times = {m: [] for m in fns}
  for m, fn in fns.items():
    jax.block_until_ready(fn(*args))
  order = list(fns.items())
  start = time.perf_counter()
  k = 0
  while time.perf_counter() - start < seconds:
    for m, fn in order[k % 3:] + order[:k % 3]:
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[m].append((t0 - start, time.perf_counter() - t0))
    k += 1
  return {"times": times, "bodies": bodies.stats()}


def run(kernel: str, mode: str, seconds: float, cache: str) -> dict:
  env = dict(os.environ, PALLAS_NP_PROGRESS="0", JAX_PLATFORMS="cpu",
             PALLAS_NP_NATIVE_CACHE=cache)
  out = subprocess.run([sys.executable, __file__, "--child", kernel, mode, str(seconds)],
                       env=env, capture_output=True, text=True, cwd=ROOT, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--kernels", default=",".join(BODY_KERNELS))
  ap.add_argument("--seconds", type=float, default=4.0)
  ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.child:
    print(json.dumps(child(a.child[0], a.child[1], float(a.child[2]))))
    return
  ratios = {"tier": [], "off": []}
  for kernel in a.kernels.split(","):
    cache = tempfile.mkdtemp(prefix="pallas_np-bodies-bench-")
    try:
      fill = run(kernel, "fill", a.seconds, cache)
      r = run(kernel, "ab", a.seconds, cache)
    finally:
      shutil.rmtree(cache, ignore_errors=True)
    stats = {}
    for m, ts in r["times"].items():
      window = [dt for t, dt in ts if t < WINDOW]
      stats[m] = (statistics.fmean(window), statistics.median(dt for _, dt in ts[-50:]))
    base = stats["interpret"]
    for m in ratios:
      ratios[m].append(stats[m][0] / base[0])
    print(f"{kernel}: " + " | ".join(
        f"{m} {w * 1e3:.3f} ms ({w / base[0]:.2f}x), post {p * 1e3:.3f} ({p / base[1]:.2f}x)"
        for m, (w, p) in stats.items())
        + f" | built {fill['bodies']['compiled']}, warm run: {r['bodies']}", flush=True)
  for m, rs in ratios.items():
    geo = statistics.geometric_mean(rs)
    print(f"geomean first {WINDOW} s, {m} / interpret=True: {geo:.2f} (worst {max(rs):.2f})")


if __name__ == "__main__":
  main()
