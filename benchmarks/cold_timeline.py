"""A fresh process's first calls of one kernel with an empty native cache,
and the native tier's events among them (issue 41, target (a) with an
empty cache): when lite's compile process starts and is ready, when the
build is submitted, its source generated, built, and at which call the
compiled loop first runs. With the cache warm (a second run on the same
``PALLAS_NP_NATIVE_CACHE``): the pre-key lookup, BLAS's one-off checks,
a kernel body's probe and its verdict.

    PALLAS_NP_NATIVE_CACHE=$(mktemp -d) python benchmarks/cold_timeline.py cumsum_fori
    python benchmarks/cold_timeline.py bitonic_fori --mode off
    PALLAS_NP_NATIVE_CACHE=$(mktemp -d) python benchmarks/cold_timeline.py while_collatz --assume-idle

``--buckets K``: also the caller's wall and thread-CPU ms a call, per K
calls (wall above CPU: the caller waited, for the GIL or a core).
``--assume-idle``: the scheduler is told a core is idle whatever the load
average says (``scheduler.weight``), so that a machine loaded by other
work measures the path a quiet machine takes (the load-aware rules
otherwise fall back to building later). Prints one summary line (the call
at which the compiled loop first ran, ``land@``; the mean ms a call over
the first 20 and 100 calls and over the window: 1000 calls or 1.5 s of
calls) and the events, in ms after the first call ended. Never a test.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("kernel")
  ap.add_argument("--mode", default="background", choices=("background", "off"))
  ap.add_argument("--calls", type=int, default=1000)
  ap.add_argument("--assume-idle", action="store_true")
  ap.add_argument("--buckets", type=int, default=0)
  a = ap.parse_args(argv)
  sys.path.insert(0, ROOT)
  import jax
  jax.config.update("jax_platforms", "cpu")
  import pallas_np
  from benchmarks import small_kernels
  from pallas_np.native import blas_calls, bodies, scheduler, tier
  if a.assume_idle:
    scheduler.weight = lambda: scheduler.COMPILE_WEIGHT
  events, call = [], [0]

  def wrap(owner, attr, name):
    inner = getattr(owner, attr)

    def timed(*args, **kwargs):
      events.append((name + " >", call[0], time.perf_counter()))
      try:
        return inner(*args, **kwargs)
      finally:
        events.append((name + " <", call[0], time.perf_counter()))
    setattr(owner, attr, timed)
  wrap(scheduler.Compiler, "_start", "process start (to its ready line)")
  wrap(scheduler.Compiler, "build", "build in the compile process")
  wrap(tier.NativeLoop, "_generate", "source generation")
  wrap(scheduler, "submit_build", "build due: its caller part")
  wrap(tier.NativeLoop, "arrived", "compile process's reply in (tier thread)")
  wrap(tier.NativeLoop, "land", "landed: loaded and swapped in (caller)")
  wrap(scheduler, "prestart", "compile process asked for")
  wrap(tier.NativeLoop, "_prelookup", "pre-key lookup (first run)")
  wrap(blas_calls, "found", "BLAS found and checked (once)")
  wrap(bodies.BodyPlan, "_swapped", "body swapped in")
  wrap(bodies.BodyPlan, "decide", "body probe decided")
  case = small_kernels.all_cases()[a.kernel]()
  args = jax.block_until_ready(case.args)
  fn = case.make(pallas_np.InterpretParams(native_loops=a.mode))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  end_first = time.perf_counter()
  times, cpus, natives = [], [], []
  while len(times) < a.calls and sum(times) < 1.5:
    call[0] += 1
    t, c = time.perf_counter(), time.thread_time()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
    cpus.append(time.thread_time() - c)
    natives.append(pallas_np.native.stats()["native_calls"])
  land = next((k for k, n in enumerate(natives) if n), None)
  mean = lambda xs: 1e3 * sum(xs) / max(len(xs), 1)  # noqa: E731
  print(f"{a.kernel} {a.mode} land@{land} first {1e3 * (end_first - t0):.0f} ms, "
        f"{len(times)} calls: mean {mean(times):.3f} ms, N=20 {mean(times[:20]):.3f}, "
        f"N=100 {mean(times[:100]):.3f}")
  if a.buckets:
    k = a.buckets
    print("  wall/CPU ms a call per", k, "calls:", " ".join(
        f"{mean(times[i:i + k]):.3f}/{mean(cpus[i:i + k]):.3f}" for i in range(0, len(times), k)))
  for name, k, t in events:
    print(f"  {1e3 * (t - end_first):8.1f} ms  call {k:4d}  {name}")


if __name__ == "__main__":
  main()
