"""The kernel benchmark suite: interpret="numpy" vs interpret=True vs
pltpu.InterpretParams(), cold and warm, written to benchmarks/RESULTS.md.

    python benchmarks/suite.py                 # everything (~10 min on 2 cores)
    python benchmarks/suite.py --quick         # four small kernels
    python benchmarks/suite.py --repeats 3     # cold/warm medians of 3 fresh processes
    python benchmarks/suite.py --kernels bitonic_1024x256_r1,softmax --modes numpy,interpret
    python benchmarks/suite.py --plot          # ... and chart it: benchmarks/results.png
    python benchmarks/suite.py --plot-only     # chart the existing RESULTS.md, run nothing

Every (kernel, mode) runs in a fresh process: *cold* is its first call
(tracing, compiling, running; imports excluded), *warm* the median of the
following calls. numpy mode calls ``pallas_np.pallas_call`` (eager: no XLA
compilation at all); the others call ``pl.pallas_call`` (which JAX jits).
Each result is checked against the kernel's reference.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MODES = {
    "numpy": "interpret=\"numpy\" (pallas_np.pallas_call, vectorize=auto)",
    "numpy_seq": "interpret=InterpretParams(vectorize=False)",
    "interpret": "interpret=True",
    "tpu": "interpret=pltpu.InterpretParams()",
    "trace": "JAX's trace of the call alone, as numpy mode's first call has it made "
             "(`f.trace(*args)` of the jitted function it traces: the `pl.pallas_call` of "
             "`pallas_np.pallas_call`, whose kernel body is traced with its jit calls inlined "
             "where `inline_jit` allows, or the jitted op), the part of numpy mode's first call "
             "before it interprets anything; interpret=True's own trace (the kernel through jit) "
             "costs more",
}
DEFAULT_MODES = ("numpy", "interpret", "tpu")
# benchmarks/small_kernels.py's section of RESULTS.md, kept when this
# script rewrites its own table.
SMALL_KERNELS_START = "<!-- small-kernels: written by benchmarks/small_kernels.py -->"
SMALL_KERNELS_END = "<!-- /small-kernels -->"


def split_section(text):
  """(``text`` without the small-kernels section, that section or '')."""
  start, end = text.find(SMALL_KERNELS_START), text.find(SMALL_KERNELS_END)
  if start < 0 or end < start:
    return text, ""
  end += len(SMALL_KERNELS_END)
  return text[:start].rstrip("\n") + "\n" + text[end:].lstrip("\n"), text[start:end]


def _interpret_value(mode):
  import pallas_np
  from jax.experimental.pallas import tpu as pltpu
  return {"numpy": pallas_np.InterpretParams(),
          "numpy_seq": pallas_np.InterpretParams(vectorize=False),
          "interpret": True,
          "tpu": pltpu.InterpretParams()}[mode]


def child(kernel, mode, warm_budget, max_reps):
  """Measure one (kernel, mode) in this (fresh) process; print JSON."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("PALLAS_NP_PROGRESS", "0")
  sys.path.insert(0, ROOT)
  import jax
  import numpy as np
  from benchmarks import kernels
  case = kernels.all_cases()[kernel]()
  args = jax.block_until_ready(case.args)
  if mode == "trace":  # the floor of any first call: no warm calls, no result
    from pallas_np import _compat
    fn = case.make(_interpret_value("numpy"))
    fn = getattr(fn, "jax_callable", fn)  # pallas_np.pallas_call's wrapper: the JAX call
    t0 = time.perf_counter()
    _compat.jit_trace(fn, args)
    print(json.dumps({"name": case.name, "cold": time.perf_counter() - t0, "warm": None,
                      "reps": 0, "err": None, "tol": case.tol, "grid_mode": None}))
    return
  fn = case.make(_interpret_value(mode))
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  cold = time.perf_counter() - t0
  times = []
  start = time.perf_counter()
  while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < warm_budget):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
    if time.perf_counter() - start > 4 * warm_budget:
      break
  err = None
  if case.reference is not None:
    want = np.asarray(case.reference(*args), np.float64)
    got = np.asarray(out, np.float64)
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
  mode_used = None
  if mode.startswith("numpy"):
    from pallas_np import api
    plans = [entry[1] for entry in api._plan_cache.values()]
    mode_used = plans[-1].last_mode if plans else None
  print(json.dumps({"name": case.name, "cold": cold, "warm": float(np.median(times)),
                    "reps": len(times), "err": err, "tol": case.tol,
                    "grid_mode": mode_used}))


def run_child(kernel, mode, timeout, warm_budget, max_reps):
  cmd = [sys.executable, os.path.abspath(__file__), "--child", kernel, mode,
         "--warm-budget", str(warm_budget), "--max-reps", str(max_reps)]
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
  except subprocess.TimeoutExpired:
    return {"error": f"timeout ({timeout}s)"}
  for line in reversed(p.stdout.splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  lines = (p.stderr or p.stdout).strip().splitlines()
  errors = [l for l in lines if ("Error" in l or "Exception" in l) and not l.startswith(" ")
            and not l.startswith("For simplicity")]
  return {"error": (errors or lines or ["no output"])[-1][:200]}


def geomean(xs):
  xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
  return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def machine():
  cpu = platform.processor() or ""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  import jax
  import numpy as np
  load = os.getloadavg() if hasattr(os, "getloadavg") else None
  return (f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores; "
          f"Python {platform.python_version()}, JAX {jax.__version__}, NumPy {np.__version__}"
          + (f"; load average {load[0]:.1f} at start" if load else ""))


def fmt_ms(r):
  if r is None:
    return "-"
  if "error" in r:
    return "n/a"
  return f"{r['cold'] * 1e3:.0f}", f"{r['warm'] * 1e3:.2f}"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--child", nargs=2, metavar=("KERNEL", "MODE"), help=argparse.SUPPRESS)
  ap.add_argument("--quick", action="store_true", help="four small kernels")
  ap.add_argument("--kernels", help="comma-separated kernel names (see benchmarks/kernels.py)")
  ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                  help=f"comma-separated, from {', '.join(MODES)}")
  ap.add_argument("--warm-budget", type=float, default=2.0, help="seconds of warm calls")
  ap.add_argument("--max-reps", type=int, default=50)
  ap.add_argument("--timeout", type=float, default=300, help="seconds per (kernel, mode)")
  ap.add_argument("--repeats", type=int, default=1,
                  help="fresh processes per (kernel, mode), medians reported; interleaved "
                  "across modes so a slow spell of the machine hits every mode (TPU "
                  "interpret mode, whose cold time no target uses, runs once)")
  ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
  ap.add_argument("--plot", action="store_true",
                  help="also chart the results (results.png next to --out, shown in it)")
  ap.add_argument("--plot-only", action="store_true",
                  help="chart the existing --out file and run nothing")
  args = ap.parse_args(argv)
  if args.child:
    child(*args.child, args.warm_budget, args.max_reps)
    return
  if args.plot_only:
    plot_results(args.out)
    return

  sys.path.insert(0, ROOT)
  from benchmarks import kernels
  names = list(kernels.all_cases(args.quick))
  if args.kernels:
    names = [n.strip() for n in args.kernels.split(",")]
  modes = [m.strip() for m in args.modes.split(",")]
  info = machine()
  print(info, flush=True)
  results = {}
  for name in names:
    runs = {mode: [] for mode in modes}
    for rep in range(max(1, args.repeats)):
      for mode in modes:
        if rep and (mode == "tpu" or "error" in runs[mode][0]):
          continue
        r = run_child(name, mode, args.timeout, args.warm_budget, args.max_reps)
        runs[mode].append(r)
        shown = (f"cold {r['cold'] * 1e3:9.1f} ms"
                 + (f"  warm {r['warm'] * 1e3:9.2f} ms" if r["warm"] is not None else "")
                 + (f"  [{r['grid_mode']}]" if r.get("grid_mode") else "")
                 if "error" not in r else r["error"])
        print(f"{name:24s} {mode:10s} {shown}", flush=True)
    for mode in modes:
      results[(name, mode)] = _median_run(runs[mode])
  write_results(args, names, modes, results, info)
  if args.plot:
    plot_results(args.out)


def plot_results(results_md: str) -> None:
  sys.path.insert(0, ROOT)
  from benchmarks import plot_results as pr
  png = pr.plot(results_md, os.path.join(os.path.dirname(os.path.abspath(results_md)),
                                         "results.png"))
  pr.link_in_results(results_md, png)
  print(f"wrote {png}")


def _median_run(runs):
  """One cell from several fresh processes: median cold and warm, the rest
  (check, grid mode) from the first; an error if any run failed."""
  bad = [r for r in runs if "error" in r]
  if bad:
    return bad[0]
  out = dict(runs[0])
  out["cold"] = statistics.median(r["cold"] for r in runs)
  out["warm"] = (statistics.median(r["warm"] for r in runs)
                 if runs[0]["warm"] is not None else None)
  out["err"] = max((r["err"] for r in runs if r.get("err") is not None), default=None)
  out["runs"] = len(runs)
  return out


def write_results(args, names, modes, results, info):
  def get(name, mode):
    r = results.get((name, mode))
    return r if r is not None and "error" not in r else None

  lines = ["# Benchmark results", "",
           f"Machine: {info}.", "",
           f"Command: `{' '.join(['python benchmarks/suite.py', *sys.argv[1:]])}` "
           f"({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC).", "",
           "Modes: " + "; ".join(f"**{m}** = {MODES[m]}" for m in modes) + ".", "",
           "*cold* = first call in a fresh process (trace + compile + run; imports "
           "excluded), *warm* = median of later calls. Times in ms."
           + (f" Each numpy/interpret cell is the median of {args.repeats} fresh processes "
              "(modes interleaved); TPU interpret mode ran once."
              if args.repeats > 1 else ""), ""]
  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
  if load > (os.cpu_count() or 1):
    lines += [f"**Noisy run**: the machine was shared (load average {load:.1f} at the end on "
              f"{os.cpu_count()} cores), so single timings can be off by several times "
              "(multi-threaded code, OpenBLAS and XLA alike, suffers most); compare ratios "
              "across reruns before trusting one.", ""]
  warm_modes = [m for m in modes if m != "trace"]
  head = ["kernel"] + [f"{m} cold" for m in modes] + [f"{m} warm" for m in warm_modes]
  ratio_cols = []
  if "numpy" in modes and "interpret" in modes:
    ratio_cols += ["warm numpy/interpret", "cold interpret/numpy"]
  if "trace" in modes and "interpret" in modes:
    ratio_cols += ["cold floor interpret/trace"]
  if "trace" in modes and "numpy" in modes:
    ratio_cols += ["numpy cold - trace"]
  if "numpy" in modes and "tpu" in modes:
    ratio_cols += ["warm tpu/numpy"]
  head += ratio_cols + ["check"]
  lines.append("| " + " | ".join(head) + " |")
  lines.append("|" + "---|" * len(head))
  warm_ratios, cold_ratios, tpu_ratios, floor_ratios = {}, {}, {}, {}
  errors = {}
  for name in names:
    label = next((r["name"] for m in modes if (r := get(name, m))), name)
    row = [f"{label} (`{name}`)"]
    for key in ("cold", "warm"):
      for m in (modes if key == "cold" else warm_modes):
        r = results.get((name, m))
        if r is None or "error" in r:
          if r and key == "cold":
            errors.setdefault(r["error"], []).append(f"{name}/{m}")
          row.append("error" if r else "-")
        else:
          row.append(f"{r[key] * 1e3:.1f}" if key == "cold" else f"{r[key] * 1e3:.2f}")
    n, i, t = get(name, "numpy"), get(name, "interpret"), get(name, "tpu")
    if "warm numpy/interpret" in ratio_cols:
      w = n["warm"] / i["warm"] if n and i else None
      c = i["cold"] / n["cold"] if n and i else None
      row += [f"{w:.2f}" if w else "-", f"{c:.1f}" if c else "-"]
      if w:
        warm_ratios[name] = w
      if c:
        cold_ratios[name] = c
    tr = get(name, "trace")
    if "cold floor interpret/trace" in ratio_cols:
      f = i["cold"] / tr["cold"] if i and tr else None
      row.append(f"{f:.1f}" if f else "-")
      if f:
        floor_ratios[name] = f
    if "numpy cold - trace" in ratio_cols:
      o = (n["cold"] - tr["cold"]) * 1e3 if n and tr else None
      row.append(f"{o:.1f}" if o is not None else "-")
    if "warm tpu/numpy" in ratio_cols:
      r = t["warm"] / n["warm"] if n and t else None
      row.append(f"{r:.1f}" if r else "-")
      if r:
        tpu_ratios[name] = r
    checks = []
    for m in modes:
      r = get(name, m)
      if r and r.get("err") is not None:
        ok = r["err"] <= max(r["tol"], 0) + (1e-6 if r["tol"] else 0)
        checks.append("ok" if ok else f"{m} err {r['err']:.1e}")
    grid_mode = (get(name, "numpy") or {}).get("grid_mode")
    row.append(", ".join(sorted(set(checks))) + (f" ({grid_mode} grid)" if grid_mode else ""))
    lines.append("| " + " | ".join(row) + " |")
  lines.append("")
  if errors:
    lines.append("Errors (first line of the exception): " + "; ".join(
        f"{', '.join(where)}: `{msg}`" for msg, where in errors.items()) + ".")
    lines.append("")

  def summary(label, keep):
    w = [v for k, v in warm_ratios.items() if keep(k)]
    c = [v for k, v in cold_ratios.items() if keep(k)]
    t = [v for k, v in tpu_ratios.items() if keep(k)]
    f = [v for k, v in floor_ratios.items() if keep(k)]
    if f:
      lines.append(f"- {label}: cold floor (interpret=True's first call / the trace alone, the "
                   f"ratio numpy mode would reach if it added nothing to its trace): geometric "
                   f"mean **{geomean(f):.1f}** ({len(f)} kernels).")
    if w:
      lines.append(f"- {label}: warm geometric mean numpy / interpret=True **{geomean(w):.2f}** "
                   f"(target <= 1.0), cold geometric mean interpret=True / numpy "
                   f"**{geomean(c):.1f}** (target >= 20)"
                   + (f", warm pltpu.InterpretParams() / numpy **{geomean(t):.1f}**" if t else "")
                   + f" ({len(w)} kernels).")

  core = lambda k: not k.startswith("gpu_ops_")
  summary("Suite kernels", core)
  if any(not core(k) for k in warm_ratios):
    summary("With JAX's GPU ops (`gpu_ops_*`)", lambda k: True)
  b = "bitonic_1024x256_r1"
  n, i = get(b, "numpy"), get(b, "interpret")
  if n and i:
    lines.append(f"- Bitonic 1024x256, one row per grid step, warm: numpy {n['warm'] * 1e3:.1f} ms "
                 f"vs interpret=True {i['warm'] * 1e3:.1f} ms "
                 f"({'faster' if n['warm'] < i['warm'] else 'slower'}).")
  lines.append("")
  kept = ""  # benchmarks/small_kernels.py's section survives a rewrite
  if os.path.exists(args.out):
    _, kept = split_section(open(args.out).read())
  with open(args.out, "w") as f:
    f.write("\n".join(lines) + ("\n" + kept + "\n" if kept else ""))
  print("\n".join(lines[-6:]))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
