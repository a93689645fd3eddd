"""Where a first (cold) call's time goes, phase by phase, over fresh processes.

    python benchmarks/first_call_phases.py bitonic_1024x256_r1 softmax --repeats 5

Each repeat is a fresh process that wraps pallas_np's phases (plan emit,
Python's compile(), the line runner's construction, grid runs, allocation,
the hand-off to JAX, ...) with timers, makes one call of the suite kernel and
reports *exclusive* times in ms (a phase's time minus the wrapped phases
inside it). ``trace+misc`` is the eager call minus everything wrapped: JAX's
trace, mostly. Medians over the repeats; the machine's noise applies (see
docs/performance.md, Measuring).

    python benchmarks/first_call_phases.py add softmax --repeats 5 --clock cpu --against /tmp/old

``--clock cpu`` times with the process's CPU time instead of the wall clock
(a first call is one busy thread: on a machine other work loads, CPU time
moves far less than wall time). ``--against DIR`` runs every repeat twice,
alternately with this checkout's pallas_np and with the one in DIR (another
checkout, e.g. ``git worktree add``/``git archive`` of the commit to compare
with), and prints both medians and their ratio: an A/B in the same session.
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
    ("pallas_np.grid.run_strategies", "allocate", "allocate"),
    ("pallas_np.grid.buffers", "BufferSetup.buffers", "buffers"),
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


def child(kernel, clock_name="wall"):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("PALLAS_NP_PROGRESS", "0")
  root = os.environ.get("FIRST_CALL_ROOT", ROOT)
  sys.path.insert(0, root)
  clock = time.process_time if clock_name == "cpu" else time.perf_counter
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
      t0 = clock()
      try:
        return orig(*args, **kwargs)
      finally:
        spent = clock() - t0
        inner = stack.pop()
        times[label] = times.get(label, 0.0) + spent - inner
        stack[-1] += spent
    setattr(owner, name, timed)

  for module, path, label in PHASES:
    owner = importlib.import_module(module)
    *parents, name = path.split(".")
    for p in parents:
      owner = getattr(owner, p, None)
    if owner is not None and hasattr(owner, name):  # (an older checkout may lack it)
      wrap(owner, name, label)
  case = kernels.all_cases()[kernel]()
  args = jax.block_until_ready(case.args)
  fn = case.make(pallas_np.InterpretParams())
  times.clear()
  stack[:] = [0.0]
  t0 = clock()
  jax.block_until_ready(fn(*args))
  total = clock() - t0
  out = {k: v * 1e3 for k, v in times.items()}
  out["unwrapped"] = (total - stack[0]) * 1e3
  out["first call"] = total * 1e3
  print(json.dumps(out))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("kernels", nargs="+", help="suite kernel names (benchmarks/kernels.py)")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                  help="wall clock, or the process's CPU time (robust to other load)")
  ap.add_argument("--against", metavar="DIR",
                  help="another checkout: alternate repeats with it, print both first calls")
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  opts = ap.parse_args()
  if opts.child:
    child(opts.kernels[0], opts.clock)
    return

  def one(kernel, root):
    env = dict(os.environ, FIRST_CALL_ROOT=root)
    proc = subprocess.run([sys.executable, __file__, "--child", "--clock", opts.clock, kernel],
                          capture_output=True, text=True, env=env, cwd=root)
    if proc.returncode:
      sys.exit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])

  if opts.against:
    other = os.path.abspath(opts.against)
    ratios = []
    for kernel in opts.kernels:
      mine, theirs = [], []
      for _ in range(opts.repeats):
        theirs.append(one(kernel, other)["first call"])
        mine.append(one(kernel, ROOT)["first call"])
      a, b = statistics.median(theirs), statistics.median(mine)
      ratios.append(a / b)
      print(f"{kernel}: first call ({opts.clock} ms, median of {opts.repeats}) "
            f"{other} {a:.2f} -> this checkout {b:.2f} ({a / b:.2f}x)", flush=True)
    print(f"geomean {statistics.geometric_mean(ratios):.3f}x over {len(ratios)} kernels")
    return
  for kernel in opts.kernels:
    runs = [one(kernel, ROOT) for _ in range(opts.repeats)]
    labels = sorted(set().union(*runs), key=lambda k: -statistics.median(r.get(k, 0.0) for r in runs))
    cells = [f"{k} {statistics.median(r.get(k, 0.0) for r in runs):.2f}" for k in labels]
    print(f"{kernel}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
  main()
