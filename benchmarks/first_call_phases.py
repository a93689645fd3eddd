"""Where a first (cold) call's time goes, phase by phase, over fresh processes.

    python benchmarks/first_call_phases.py bitonic_1024x256_r1 softmax --repeats 5

Each repeat is a fresh process that wraps pallas_np's phases (plan emit,
Python's compile(), the line runner's construction, grid runs, allocation,
the hand-off to JAX, ...) with timers, makes one call of the suite kernel and
reports *exclusive* times in ms (a phase's time minus the wrapped phases
inside it). ``trace+misc`` is the eager call minus everything wrapped: JAX's
trace, mostly. Medians over the repeats; the machine's noise applies (see
docs/performance.md, Measuring).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (module, attribute path, label)
PHASES = [
    ("pallas_np.api", "eager_numpy_call", "trace+misc"),
    ("pallas_np.api", "EagerPlan.__init__", "eager plan"),
    ("pallas_np.api", "EagerPlan.run", "eager run"),
    ("pallas_np.grid.kernel_plan", "KernelPlan.__init__", "kernel plan"),
    ("pallas_np.grid.kernel_plan", "KernelPlan._prepare", "prepare"),
    ("pallas_np.grid.kernel_plan", "allocate", "allocate"),
    ("pallas_np.grid.blocks", "allocate", "allocate"),
    ("pallas_np.grid.kernel_plan", "KernelPlan.run_grid", "grid loop"),
    ("pallas_np.compiler.compiler", "Compiler._codegen", "emit"),
    ("pallas_np.compiler.compiler", "Compiler.compile", "compile (other)"),
    ("pallas_np.compiler.plan", "function_code", "compile()"),
    ("pallas_np.compiler.plan", "_line_runner", "line runner"),
    ("pallas_np.grid.vectorize", "GridVectorizer.__init__", "vectorizer"),
    ("pallas_np.grid.vectorize", "GridVectorizer.choose", "choose"),
    ("pallas_np.grid.vectorize", "run_vectorized", "vectorized run"),
    ("pallas_np.grid.vectorize", "_run_checked", "slabs"),
    ("pallas_np.grid.threads", "ThreadPlan.__init__", "thread plan"),
    ("pallas_np._compat", "np_to_jax", "to jax"),
]


def child(kernel):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("PALLAS_NP_PROGRESS", "0")
  sys.path.insert(0, ROOT)
  import importlib
  import jax
  import pallas_np
  from benchmarks import kernels
  times: dict[str, float] = {}
  stack = [0.0]

  def wrap(owner, name, label):
    orig = getattr(owner, name)

    def timed(*args, **kwargs):
      stack.append(0.0)
      t0 = time.perf_counter()
      try:
        return orig(*args, **kwargs)
      finally:
        spent = time.perf_counter() - t0
        inner = stack.pop()
        times[label] = times.get(label, 0.0) + spent - inner
        stack[-1] += spent
    setattr(owner, name, timed)

  for module, path, label in PHASES:
    owner = importlib.import_module(module)
    *parents, name = path.split(".")
    for p in parents:
      owner = getattr(owner, p)
    wrap(owner, name, label)
  case = kernels.all_cases()[kernel]()
  args = jax.block_until_ready(case.args)
  fn = case.make(pallas_np.InterpretParams())
  times.clear()
  stack[:] = [0.0]
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  total = time.perf_counter() - t0
  out = {k: v * 1e3 for k, v in times.items()}
  out["unwrapped"] = (total - stack[0]) * 1e3
  out["first call"] = total * 1e3
  print(json.dumps(out))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("kernels", nargs="+", help="suite kernel names (benchmarks/kernels.py)")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  opts = ap.parse_args()
  if opts.child:
    child(opts.kernels[0])
    return
  for kernel in opts.kernels:
    runs = []
    for _ in range(opts.repeats):
      proc = subprocess.run([sys.executable, __file__, "--child", kernel],
                            capture_output=True, text=True)
      if proc.returncode:
        sys.exit(proc.stderr)
      runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    labels = sorted(set().union(*runs), key=lambda k: -statistics.median(r.get(k, 0.0) for r in runs))
    cells = [f"{k} {statistics.median(r.get(k, 0.0) for r in runs):.2f}" for k in labels]
    print(f"{kernel}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
  main()
