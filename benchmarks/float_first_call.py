"""A fresh process's first call of a float kernel (softmax, sin, exp) in numpy mode, and the
warm call after it: what the compiled float loops (primitives/libm.py) cost the first time, with
their on-disk object cache cold (an empty cache directory), warm (a second process) and off.

    python benchmarks/float_first_call.py [REPEATS]

Each measurement runs in its own process (`python -c`), from the current directory (run it from
the checkout to measure); the cache lives in a temporary directory (XDG_CACHE_HOME), never
the user's. Prints the median over REPEATS (default 3) processes, in ms: the first call's wall
time and its CPU time (the process's, all threads: steadier on a shared machine), and the best of
7 warm calls.
"""
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import time, numpy as np, jax, jax.numpy as jnp
from jax.experimental import pallas as pl
import pallas_np
x = np.random.default_rng(0).uniform(-3, 3, (512, 1024)).astype(np.float32)
f = {"softmax": lambda a: jax.nn.softmax(a, axis=-1), "sin": jnp.sin, "exp": jnp.exp}[KERNEL]
def k(a_ref, o_ref):
  o_ref[...] = f(a_ref[...])
call = pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret="numpy")
t, c = time.perf_counter(), time.process_time()
np.asarray(call(x))
first, first_cpu = time.perf_counter() - t, time.process_time() - c
warm = []
for _ in range(7):
  t = time.perf_counter(); np.asarray(call(x)); warm.append(time.perf_counter() - t)
print(first * 1e3, min(warm) * 1e3, first_cpu * 1e3)
"""


def run(kernel, env):
  out = subprocess.run([sys.executable, "-c", CHILD.replace("KERNEL", repr(kernel))],
                       env=env, capture_output=True, text=True, check=True).stdout.split()
  return float(out[0]), float(out[1]), float(out[2])


def main():
  repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
  base = dict(os.environ, PYTHONPATH=os.getcwd())
  print(f"{'kernel':8s} {'cache':6s} {'first ms':>9s} {'first cpu ms':>13s} {'warm ms':>8s}")
  for kernel in ("softmax", "sin", "exp"):
    rows = {"cold": [], "warm": [], "off": []}
    for _ in range(repeats):
      with tempfile.TemporaryDirectory() as d:
        env = dict(base, XDG_CACHE_HOME=d)
        rows["cold"].append(run(kernel, env))
        rows["warm"].append(run(kernel, env))
      rows["off"].append(run(kernel, dict(base, PALLAS_NP_LIBM_CACHE="0")))
    for name, vals in rows.items():
      first = statistics.median(v[0] for v in vals)
      warm = statistics.median(v[1] for v in vals)
      cpu = statistics.median(v[2] for v in vals)
      print(f"{kernel:8s} {name:6s} {first:9.1f} {cpu:13.1f} {warm:8.2f}", flush=True)


if __name__ == "__main__":
  main()
