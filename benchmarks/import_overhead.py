"""What ``import pallas_np`` costs code that does not use it: import time, and
a plain jitted call, first and warm, with and without pallas_np imported.

    python benchmarks/import_overhead.py              # 7 rounds of fresh processes
    python benchmarks/import_overhead.py --rounds 15

Each round starts one fresh process per mode, in turn (so machine load hits
all modes alike); the table gives each figure's median over the rounds:
  jax                   ``import jax`` only
  jax + pallas_np       ``import jax; import pallas_np``
  ... after a kernel    as above, then one eager ``interpret="numpy"`` kernel
                        call first: pallas_np's eager-jit hooks are in
                        (whole_program.install_hooks), the cost a program
                        that uses pallas_np pays on its other jitted calls
Bytecode is cached as for an installed package (``PYTHONDONTWRITEBYTECODE``
is dropped and one process imports everything first): otherwise every
process would compile pallas_np's sources, which JAX's installed modules
never pay. Columns: import (s; for the pallas_np modes, ``import jax`` plus
``import pallas_np``), the first call of ``jax.jit(lambda x: x + 1)`` on a (8,)
float32 array (trace, compile, run; ms), and a warm call (µs, the median of
20 batches of 500 calls).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_CHILD = r"""
import json, sys, time
mode = sys.argv[1]
t0 = time.perf_counter()
import jax
t_jax = time.perf_counter() - t0
if mode != "jax":
  import pallas_np  # noqa: F401
t_import = time.perf_counter() - t0
import jax.numpy as jnp
x = jnp.ones((8,), jnp.float32).block_until_ready()
if mode == "kernel":
  from jax.experimental import pallas as pl
  def copy(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                 interpret="numpy")(jnp.ones((8, 128), jnp.float32)).block_until_ready()
f = jax.jit(lambda v: v + 1)
t0 = time.perf_counter()
f(x).block_until_ready()
first = time.perf_counter() - t0
for _ in range(500):
  f(x)
batches = []
for _ in range(20):
  t0 = time.perf_counter()
  for _ in range(500):
    f(x)
  f(x).block_until_ready()
  batches.append((time.perf_counter() - t0) / 501)
batches.sort()
print(json.dumps({"jax": t_jax, "import": t_import, "first": first,
                  "warm": batches[len(batches) // 2]}))
"""

MODES = (("jax", "jax"), ("pallas_np", "jax + pallas_np"), ("kernel", "... after a kernel"))


def run(rounds: int) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("PALLAS_NP_FORCE", None)
  env.pop("PYTHONDONTWRITEBYTECODE", None)
  subprocess.run([sys.executable, "-c", _CHILD, "kernel"], env=env, cwd=ROOT, check=True,
                 capture_output=True)  # writes the bytecode caches
  results = {m: [] for m, _ in MODES}
  for _ in range(rounds):
    for mode, _ in MODES:
      out = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, cwd=ROOT,
                           capture_output=True, text=True, check=True)
      results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
  return results


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=7)
  args = ap.parse_args()
  import jax
  results = run(args.rounds)
  med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
  print(f"JAX {jax.__version__}, Python {sys.version.split()[0]}, {args.rounds} rounds "
        "of fresh processes (medians)")
  print(f"{'mode':<22}{'import s':>10}{'first call ms':>15}{'warm call us':>14}")
  for mode, label in MODES:
    m = med[mode]
    print(f"{label:<22}{m['import']:>10.2f}{m['first'] * 1e3:>15.2f}{m['warm'] * 1e6:>14.2f}")
  ratio = statistics.median(r["import"] / r["jax"] for r in results["pallas_np"])
  print(f"import pallas_np / import jax (same process, median): {ratio:.2f}x")
  base = med["jax"]
  for mode, label in MODES[1:]:
    print(f"{label}: first call {med[mode]['first'] / base['first'] - 1:+.1%}, "
          f"warm call {med[mode]['warm'] / base['warm'] - 1:+.1%} vs jax alone")


if __name__ == "__main__":
  main()
