"""Cost of the loop watchdog (InterpretParams.loop_watchdog_s): warm
per-call time of while-loop kernels with the watchdog off (the default) and
on. Run it from two checkouts to compare "off" with the code before the
watchdog existed:

    PYTHONPATH=. python benchmarks/watchdog_cost.py
"""
from __future__ import annotations

import inspect
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

import pallas_np  # noqa: E402
from benchmarks.small_kernels import collatz_kernel  # noqa: E402


def scalar_loop_kernel(x_ref, o_ref):
  """A scalar while loop of 2,000 short iterations (per-iteration overhead)."""
  def body(c):
    i, acc = c
    return i + 1, acc + x_ref[0, i % 128]
  o_ref[0, 0] = lax.while_loop(lambda c: c[0] < 2000, body, (0, jnp.float32(0)))[1]


def bench(kernel, x, out, params, reps=15):
  f = pl.pallas_call(kernel, out_shape=out, interpret=params)
  jax.block_until_ready(f(x))
  jax.block_until_ready(f(x))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(f(x))
    times.append(time.perf_counter() - t)
  return statistics.median(times) * 1e3


def main():
  has_field = "loop_watchdog_s" in inspect.signature(pallas_np.InterpretParams).parameters
  rng = np.random.default_rng(0)
  cases = {
      "collatz (2,128) int32": (collatz_kernel, jnp.asarray(rng.integers(1, 60, (2, 128)),
                                                            jnp.int32)),
      "scalar while x2000": (scalar_loop_kernel, jnp.ones((8, 128), jnp.float32)),
  }
  for name, (kernel, x) in cases.items():
    out = jax.ShapeDtypeStruct((2, 128) if x.shape == (2, 128) else (8, 128), x.dtype)
    row = [f"{name}: off {bench(kernel, x, out, pallas_np.InterpretParams()):.3f} ms"]
    row.append(f"off, native_loops=off {bench(kernel, x, out, pallas_np.InterpretParams(native_loops='off')):.3f} ms")
    if has_field:
      on = pallas_np.InterpretParams(loop_watchdog_s=120.0)
      row.append(f"on {bench(kernel, x, out, on):.3f} ms")
    print("; ".join(row), flush=True)


if __name__ == "__main__":
  main()
