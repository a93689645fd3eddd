"""What a user sees of the native tier: a fresh process calling one kernel in
a loop, timed call by call from its first call (issue 41).

    python benchmarks/user_view.py                        # every kernel of small_kernels.py
    python benchmarks/user_view.py --kernels loops        # its loop kernels only
    python benchmarks/user_view.py --kernels bitonic_fori --calls 1000 --seconds 20
    python benchmarks/user_view.py --interleaved --kernels loops   # tier vs off, one process
    python benchmarks/user_view.py --repeats 5 --kernels all      # medians of 5 rounds of processes
    python benchmarks/user_view.py --repeats 3 --aa               # and an A/A noise floor
    python benchmarks/user_view.py --kernels lib:tpu_flash_fwd    # a library kernel
                                                  # (benchmarks/native_library.py's cases)

For each kernel, one fresh process per mode runs the kernel's first call
(trace + compile + run, reported apart) and then calls it until it made
``--calls`` calls or ran ``--seconds``. Modes: ``tier`` (interpret="numpy",
``native_loops="background"``, the default) with no library of the
kernel in the native cache (a first run; one cache directory for the
whole benchmark, so pycc's C helpers are built once) and again with the
cache filled (a second process: a re-run test suite), ``off`` (``native_loops="off"``) and
``interpret`` (``interpret=True``); right before the warm run, a process
that is not timed builds the kernel's loops into the warm run's cache as a
user's first process does, probes included (``fill``), so the warm run is a
second process after the builds however busy the machine was. Reported per mode: the mean call time
over the first N calls after the first (N = 20, 100, 1000), over the calls
made in the first ~1.5 s, and the median of the last 20 calls (the state
after the switch), each as a ratio to interpret=True's. The totals: the
geometric mean over the kernels of the first ~1.5 s's ratio per mode and
the worst kernel, the first calls' geometric mean (interpret=True's first
call / the tier's), and at which N the tier (cold and warm cache) was
slower than ``off``. With ``--repeats R`` every mode's process runs R
times (each round: the modes one after another, in an order rotated round
by round, ``rotated``; a tier_cold with a cache of its own that holds no
library of the kernel),
and each figure is the median over the rounds, with the spread of the
per-round tier/off ratios beside "slower than off": one process against
another moves ±20-30% on this kind of VM where the two run the same Python
(a kernel the tier never compiles), so a verdict from one round of each is
noise. ``--aa`` runs a second ``off`` process each round (``off_aa``):
its per-round ratio to ``off`` is what two processes running the same
Python differ by on this machine, and a kernel's tier counts as "slower
beyond noise" at N only where the median tier/off exceeds 1 by more than
the largest A/A deviation of its rounds. With ``--repeats 5`` or more, a
sign test too: "slower by the sign test" at N where the tier was slower
than ``off`` in so many of the rounds that a tier no slower would be so
rarely (one-sided, p < 0.05): a cost of a few percent the tier always
adds shows there, below the A/A noise; over many (kernel, cache, N) tests
some pass by chance (the total says how many are expected), and a kernel
the tier wrapped nothing of is marked (the same code as ``off``). Nothing
waits for a compile (``native.wait`` is never called in a timed process):
this is the user's view.
Never run as a timed test (CPU-bound, seconds per kernel).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NS = (20, 100, 1000)
WINDOW = 1.5  # seconds of calls after the first: "the first ~1.5 s"
LOOP_KERNELS = ("cumsum_fori", "bitonic_fori", "while_collatz")
MODES = ("tier_cold", "tier_warm", "off", "interpret")


def _case(kernel: str):
  """The kernel's case (``make(interpret)``, ``args``): one of
  small_kernels.py's, or ``lib:NAME``, native_library.py's case NAME
  (library kernels with loops)."""
  import types
  if kernel.startswith("lib:"):
    from benchmarks import native_library
    make, args = native_library.CASES[kernel[len("lib:"):]]()
    return types.SimpleNamespace(make=make, args=args)
  from benchmarks import small_kernels
  return small_kernels.all_cases()[kernel]()


def child(kernel: str, mode: str, calls: int, seconds: float) -> dict:
  """Runs in the fresh process: the first call, then the timed calls."""
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
  import jax
  jax.config.update("jax_platforms", "cpu")
  import pallas_np
  case = _case(kernel)
  args = jax.block_until_ready(case.args)
  if mode == "fill":  # (not timed: the kernel's loops built now, waited for)
    return fill(case, args)
  if mode == "ab":  # tier (cold) and off interleaved call by call in one process
    return interleaved(case, args, calls, seconds)
  if mode == "interpret":
    fn = case.make(True)
  else:
    fn = case.make(pallas_np.InterpretParams(
        native_loops="off" if mode in ("off", "off_aa") else "background"))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first = time.perf_counter() - t0
  times = []
  start = time.perf_counter()
  while len(times) < calls and time.perf_counter() - start < seconds:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  stats = pallas_np.native.stats()
  # (loops and bodies the tier wrapped: none, and the tier ran the same code as off)
  stats["tier_loops"] = sum(issubclass(type(o), pallas_np.native.tier.NativeLoop)
                            for o in gc.get_objects())
  if mode == "tier_cold":  # (after the timing: the build it started ends before the next process)
    pallas_np.native.wait(600)
  return {"first": first, "times": times, "native": stats}


def fill(case, args) -> dict:
  """A first process, untimed, that leaves the cache as a user's first
  process that ran long enough leaves it: the kernel's loops and bodies
  built in background mode with the cost rule's prices zeroed (due at
  ``HOT_RUNS``), a lite refusal's numba build too, and each kernel body's
  probe run and its verdict recorded (``tier_records``; a ``"sync"``
  build records none, and its warm process then probed: PERF_LOG 164)."""
  import jax
  import pallas_np
  from pallas_np.native import bodies, cost_rule, scheduler
  for name in ("LOOKUP_PRICE", "SETUP_PRICE", "PRESTART_PRICE"):
    setattr(cost_rule, name, 0.0)
  for name in ("COMPILE_WEIGHT", "CALLER_PRICE", "NEIGHBOUR_SHARE"):
    setattr(scheduler, name, 0.0)
  fn = case.make(pallas_np.InterpretParams(native_loops="background"))
  for _ in range(6):  # (priced, built, landed, probed; a lite refusal's numba build)
    for _ in range(2 * bodies.PROBE_CALLS + bodies.SAMPLE_STEPS * cost_rule.HOT_RUNS):
      jax.block_until_ready(fn(*args))
    pallas_np.native.wait(900)
  return {"first": 0.0, "times": [], "native": pallas_np.native.stats()}


def interleaved(case, args, calls, seconds) -> dict:
  """The tier and ``off`` in one process, their calls alternating (which
  goes first alternates too): a machine whose load swings between two
  processes' runs hits both alike. Returns each one's first call and
  timed calls."""
  import jax
  import pallas_np
  fns = {m: case.make(pallas_np.InterpretParams(native_loops=m)) for m in ("background", "off")}
  out = {}
  for m, fn in fns.items():
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    out[m] = {"first": time.perf_counter() - t0, "times": []}
  order = list(fns.items())
  start = time.perf_counter()
  k = 0
  while k < calls and time.perf_counter() - start < seconds:
    for m, fn in (order if k % 2 == 0 else order[::-1]):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      out[m]["times"].append(time.perf_counter() - t0)
    k += 1
  stats = pallas_np.native.stats()
  for m in out:
    out[m]["native"] = stats
  return out


def start_child(kernel, mode, calls, seconds, cache_dir):
  env = dict(os.environ, PALLAS_NP_PROGRESS="0", JAX_PLATFORMS="cpu",
             PALLAS_NP_NATIVE_CACHE=cache_dir)
  return subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), "--child", kernel, mode, str(calls),
       str(seconds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
      cwd=ROOT)


def finish_child(proc, what) -> dict:
  out, err = proc.communicate(timeout=1800)
  if proc.returncode:
    raise RuntimeError(f"{what} failed:\n{err[-3000:]}")
  return json.loads(out.strip().splitlines()[-1])


def run_modes(kernel, calls, seconds, cache_dir, cold_cache, groups) -> dict:
  """Each group of modes in ``groups`` runs at the same time (one process
  each): a load that changes while the benchmark runs hits both alike.
  ``tier_cold`` runs with ``cold_cache`` (no library of the kernel in it),
  every other mode with ``cache_dir``."""
  res = {}
  for group in groups:
    procs = {m: start_child(kernel, m, calls, seconds, cold_cache if m == "tier_cold" else cache_dir)
             for m in group}
    for m, p in procs.items():
      out = finish_child(p, f"{kernel}/{m}")
      if m != "fill":
        res[m] = summary(out)
  return res


def _fresh_cache(cache_dir) -> str:
  """A cache directory of its own under ``cache_dir`` (no library of the
  kernel in it: a first process again), pycc's C helpers copied in."""
  cache = tempfile.mkdtemp(prefix="pallas_np-native-round-", dir=cache_dir)
  for tag in os.listdir(cache_dir):  # (one directory per Python/CPU/numba: its mixins)
    mix = os.path.join(cache_dir, tag, "mixins")
    if os.path.isdir(mix):
      shutil.copytree(mix, os.path.join(cache, tag, "mixins"))
  return cache


def rotated(timed, r) -> list:
  """Round ``r``'s groups: the timed modes one after another, their order
  rotated by ``r`` so that no mode holds the same place in every round (in
  a fixed order, kernels the tier wrapped nothing of, the same code in
  both, ran 2-10% slower in ``tier_cold``'s place than in ``off``'s in 5
  of 5 rounds: PERF_LOG 163), with the untimed ``fill`` right before
  ``tier_warm``."""
  k = r % len(timed)
  groups = []
  for m in timed[k:] + timed[:k]:
    groups += [("fill",), (m,)] if m == "tier_warm" else [(m,)]
  return groups


def run_rounds(kernel, calls, seconds, cache_dir, groups, repeats) -> tuple[dict, list]:
  """``run_modes`` ``repeats`` times, round r's modes in the order
  ``groups(r)``; every round's tier_cold runs with a cache of its own
  (``_fresh_cache``), and round r > 0 runs fill and tier_warm with one too.
  Returns each mode's summary with every figure the median over the
  rounds, and the rounds' own summaries."""
  rounds = []
  for r in range(repeats):
    cache = _fresh_cache(cache_dir) if r else cache_dir
    rounds.append(run_modes(kernel, calls, seconds, cache, _fresh_cache(cache_dir), groups(r)))
  if repeats == 1:
    return rounds[0], rounds
  out = {}
  for m in rounds[0]:
    out[m] = dict(rounds[0][m])
    for key, v in rounds[0][m].items():
      if isinstance(v, float) and all(rd[m].get(key) is not None for rd in rounds):
        out[m][key] = statistics.median(rd[m][key] for rd in rounds)
  return out, rounds


def summary(r) -> dict:
  t = r["times"]
  s = {f"n{n}": statistics.fmean(t[:n]) if len(t) >= n else None for n in NS}
  acc, k = 0.0, 0
  while k < len(t) and acc < WINDOW:
    acc += t[k]
    k += 1
  s["window"] = statistics.fmean(t[:k]) if k else None
  s["window_calls"] = k
  s["post"] = statistics.median(t[-20:]) if t else None
  s["median"] = statistics.median(t) if t else None
  s["first"] = r["first"]
  s["calls"] = len(t)
  n = r["native"]
  s["native"] = f"{n['compiled']} compiled ({n['disk_hits']} from disk), {n['native_calls']} calls"
  s["tier_loops"] = n.get("tier_loops")
  return s


def fmt(v, base):
  if v is None or base is None:
    return "—"
  return f"{v * 1e3:.2f} ({v / base:.2f}×)"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--kernels", default="all",
                  help="comma-separated names, 'all' (default) or 'loops'")
  ap.add_argument("--calls", type=int, default=1000)
  ap.add_argument("--seconds", type=float, default=30.0, help="cap per process")
  ap.add_argument("--side-by-side", action="store_true",
                  help="run tier (cold) beside off, then tier (warm) beside interpret=True, "
                       "at the same time (a loaded machine: both meet the same load)")
  ap.add_argument("--interleaved", action="store_true",
                  help="only the tier (no library of the kernel on disk) against off, in one "
                       "process per kernel, calls alternating: where the tier costs a caller more")
  ap.add_argument("--repeats", type=int, default=1,
                  help="rounds of every mode's process, alternating; figures are medians")
  ap.add_argument("--aa", action="store_true",
                  help="a second off process per round: the A/A noise floor of tier/off")
  ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.child:
    kernel, mode, calls, seconds = a.child
    print(json.dumps(child(kernel, mode, int(calls), float(seconds))))
    return
  if a.interleaved:
    return run_interleaved(kernel_names(a.kernels), a.calls, a.seconds)
  rows = []
  # One cache directory for the run: pycc's C helpers (built once per
  # machine, ~10 s) are paid by the first kernel's cold run only; each
  # kernel's loops are new to it.
  cache = tempfile.mkdtemp(prefix="pallas_np-native-bench-")
  try:
    for kernel in kernel_names(a.kernels):
      aa = [("off_aa",)] if a.aa else []
      if a.side_by_side:
        fixed = [("tier_cold", "off"), ("fill",), ("tier_warm", "interpret")] + aa
        groups = lambda r, fixed=fixed: fixed  # noqa: E731
      else:
        timed = [*MODES] + [m for (m,) in aa]
        groups = lambda r, timed=timed: rotated(timed, r)  # noqa: E731
      res, rounds = run_rounds(kernel, a.calls, a.seconds, cache, groups, a.repeats)
      report_kernel(kernel, res)
      rows.append((kernel, res, rounds))
  finally:
    shutil.rmtree(cache, ignore_errors=True)
  totals(rows)


def run_interleaved(kernels, calls, seconds):
  cache = tempfile.mkdtemp(prefix="pallas_np-native-bench-")
  worse = {}
  try:
    for kernel in kernels:
      r = finish_child(start_child(kernel, "ab", calls, seconds, cache), f"{kernel}/ab")
      s = {m: summary(v) for m, v in r.items()}
      tier, off = s["background"], s["off"]
      print(f"{kernel}: tier / off, mean ms per call over the first N, interleaved: " + " | ".join(
          f"N={n} {tier[f'n{n}'] * 1e3:.3f} / {off[f'n{n}'] * 1e3:.3f} "
          f"({tier[f'n{n}'] / off[f'n{n}']:.3f})" for n in NS if tier[f"n{n}"])
          + f" | median {tier['median'] * 1e3:.3f} / {off['median'] * 1e3:.3f} "
          f"({tier['median'] / off['median']:.3f}) | native {tier['native']}", flush=True)
      worse[kernel] = [n for n in NS if tier[f"n{n}"] and tier[f"n{n}"] > off[f"n{n}"]]
  finally:
    shutil.rmtree(cache, ignore_errors=True)
  for kernel, ns in worse.items():
    print(f"{kernel}: tier slower than off at N = {ns or 'none'}")


def kernel_names(spec: str) -> list:
  if spec == "loops":
    return list(LOOP_KERNELS)
  if spec == "all":
    if ROOT not in sys.path:
      sys.path.insert(0, ROOT)
    from benchmarks import small_kernels  # (imports JAX: only in the parent, only here)
    return list(small_kernels.all_cases())
  return [k.strip() for k in spec.split(",")]


def report_kernel(kernel, res):
  base = res["interpret"]
  print(f"\n{kernel}: ms per call (ratio to interpret=True)")
  for m in MODES:
    s = res[m]
    print(f"  {m:10s} first {s['first'] * 1e3:8.0f} ms | " + " | ".join(
        f"N={n} {fmt(s[f'n{n}'], base[f'n{n}'])}" for n in NS)
        + f" | first {WINDOW} s ({s['window_calls']} calls) {fmt(s['window'], base['window'])}"
        + f" | post {fmt(s['post'], base['post'])} | native {s['native']}", flush=True)


def geomean(xs) -> float:
  return math.exp(statistics.fmean(map(math.log, xs)))


def totals(rows):
  for m in ("tier_cold", "tier_warm", "off"):
    ws = {k: r[m]["window"] / r["interpret"]["window"] for k, r, _ in rows}
    worst = max(ws, key=ws.get)
    print(f"geomean first {WINDOW} s, {m}: {geomean(ws.values()):.2f} over {len(ws)} kernels "
          f"(worst {worst} {ws[worst]:.2f}; above 5: {[k for k, v in ws.items() if v > 5] or 'none'})")
  tests = found = 0
  first = [r["interpret"]["first"] / r["tier_cold"]["first"] for _, r, _ in rows]
  print(f"first calls, interpret=True / tier (cold): geomean {geomean(first):.1f}x faster")
  for kernel, r, rounds in rows:  # (issue 41's target (b): at no N slower than off, either cache)
    for m, what in (("tier_cold", "cold"), ("tier_warm", "warm")):
      worse = [n for n in NS if r[m][f"n{n}"] and r["off"][f"n{n}"]
               and r[m][f"n{n}"] > r["off"][f"n{n}"]]
      spread = ""
      if len(rounds) > 1:  # (each round's tier/off: how far one round moves)
        spread = "; tier/off per round " + ", ".join(
            f"N={n} " + "/".join(f"{rd[m][f'n{n}'] / rd['off'][f'n{n}']:.2f}" for rd in rounds)
            for n in NS if all(rd[m][f"n{n}"] and rd["off"][f"n{n}"] for rd in rounds))
      print(f"{kernel}: tier ({what} cache) slower than off at N = {worse or 'none'}{spread}")
      if "off_aa" in r and len(rounds) > 1:
        print(f"{kernel}: tier ({what} cache) slower beyond noise at N = "
              f"{beyond_noise(r, rounds, m) or 'none'}")
      if len(rounds) >= SIGN_ROUNDS:
        hits = sign_test(rounds, m)
        tests += sum(all(rd[m][f"n{n}"] and rd["off"][f"n{n}"] for rd in rounds) for n in NS)
        found += len(hits)
        idle = " (the tier wrapped no loop or body: the same code as off)" if hits and not any(
            rd[m].get("tier_loops") for rd in rounds) else ""
        print(f"{kernel}: tier ({what} cache) slower by the sign test at N = {hits or 'none'}{idle}")
  if tests:  # (each test at p < P_SLOWER: some hit by chance where the tier costs nothing)
    print(f"sign test: {found} of {tests} (kernel, cache, N) at p < {P_SLOWER}; "
          f"~{tests * P_SLOWER:.1f} expected by chance alone were the tier never slower")


SIGN_ROUNDS = 5  # (the fewest rounds whose sign test can reach P_SLOWER: 5 of 5, p = 1/32)
P_SLOWER = 0.05


def sign_test(rounds, m) -> list:
  """The N at which the tier was slower than ``off`` in so many rounds
  that a tier no slower (each round's tier/off as likely above 1 as
  below) would have been so rarely (one-sided binomial sign test, p <
  P_SLOWER): a small cost the tier always adds shows here however noisy
  each round is, where ``beyond_noise`` asks for more than the A/A noise.
  Each with the rounds slower, the p-value and the rounds' median
  tier/off."""
  out = []
  for n in NS:
    key = f"n{n}"
    if not all(rd[m][key] and rd["off"][key] for rd in rounds):
      continue
    ratios = [rd[m][key] / rd["off"][key] for rd in rounds]
    k, r = sum(x > 1 for x in ratios), len(ratios)
    p = sum(math.comb(r, i) for i in range(k, r + 1)) / 2 ** r
    if p < P_SLOWER:
      out.append(f"{n} ({k} of {r} rounds, p={p:.3f}, median {statistics.median(ratios):.3f})")
  return out


def beyond_noise(r, rounds, m) -> list:
  """The N at which the median tier/off exceeds 1 by more than the largest
  deviation from 1 of the rounds' off_aa/off (two processes of the same
  Python), with that bound beside each."""
  out = []
  for n in NS:
    key = f"n{n}"
    if not all(rd[m][key] and rd["off"][key] and rd["off_aa"][key] for rd in rounds):
      continue
    ratio = statistics.median(rd[m][key] / rd["off"][key] for rd in rounds)
    noise = max(abs(rd["off_aa"][key] / rd["off"][key] - 1) for rd in rounds)
    if ratio - 1 > noise:
      out.append(f"{n} ({ratio:.2f} > 1+{noise:.2f})")
  return out


if __name__ == "__main__":
  main()
