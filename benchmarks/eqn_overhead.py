"""Per-eqn overhead of a compiled plan beyond the NumPy call itself.

    python benchmarks/eqn_overhead.py

Builds a kernel of N dependent elementwise eqns on a tiny block, times one
evaluation of its compiled plan, and subtracts the time the same NumPy calls
take when written by hand in a Python loop. What is left is what the
interpreter adds per eqn (the generated ``vK = fJ(vI, k0)`` line, wrappers
of the rules).
"""
from __future__ import annotations

import os
import sys
import timeit

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_np  # noqa: E402
from pallas_np import api  # noqa: E402

N = 200


def kernel(x_ref, o_ref):
  x = x_ref[...]
  for i in range(N // 2):
    x = x * 1.0001
    x = x + 0.5
  o_ref[...] = x


def main():
  for shape in [(8,), (8, 128)]:
    x = jnp.ones(shape, jnp.float32)
    pallas_np.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(shape, jnp.float32))(x)
    plan = [e[1] for e in api._plan_cache.values()][-1]
    kern = plan.kernel
    n_eqns = kern.num_eqns
    ctx = api.RunContext("k", plan.params)
    xin = np.ones(shape, np.float32)
    out = np.empty(shape, np.float32)
    reps = 200
    t_plan = min(timeit.repeat(lambda: kern.fn(ctx, xin, out), number=reps, repeat=5)) / reps
    a, b = np.float32(1.0001), np.float32(0.5)

    def by_hand():
      v = xin.copy()
      for _ in range(N // 2):
        v = np.multiply(v, a)
        v = np.add(v, b)
      out[...] = v
    t_hand = min(timeit.repeat(by_hand, number=reps, repeat=5)) / reps
    print(f"block {shape}: plan {t_plan * 1e6:.0f} us for {n_eqns} eqns = "
          f"{t_plan / n_eqns * 1e6:.2f} us/eqn; the same NumPy calls by hand "
          f"{t_hand / n_eqns * 1e6:.2f} us/eqn; overhead "
          f"{(t_plan - t_hand) / n_eqns * 1e6:.2f} us/eqn")


if __name__ == "__main__":
  main()
