"""How close each float primitive is to XLA on CPU, in one place.

Two kinds of claims, both re-measured against ``jax.jit`` on the machine the
tests run on (tests/test_conformance.py), never read from a table written
elsewhere:

- ``BIT_EXACT[prim]``: bit-exact by construction on every CPU, in float32,
  bf16 and f16: the rule follows XLA's own expansion op for op (with its FMAs,
  ``primitives/xla_math.py``), calls the C library function XLA calls
  (``primitives/libm.py``), or is a correctly rounded IEEE operation. None of
  them uses a NumPy ufunc whose float32 result depends on the CPU's SIMD code
  path. (XLA itself compiles for the host: these follow its code for CPUs
  with FMA, every x86-64 since 2013 and every ARMv8.)
- ``ULP[prim][dtype]``: the rest, where XLA has its own approximation that
  the rule does not reproduce (the C library's double function rounded once,
  or SciPy's scalar C code: neither depends on the CPU's SIMD path): the largest
  difference in units in the last place over the sample ``measure`` draws
  (10^6 points of ``DOMAINS[prim]``, seed 0), the max over the JAX versions
  CI tests. This bound is a property of XLA's approximation, not of the
  machine.

Results that XLA flushes (denormals of float32, and of bf16, whose math runs
in float32) compare as zero; NaN matches NaN. ``python -m
pallas_np.conformance [N]`` re-measures everything. Primitives not listed
(integer ops, comparisons, data movement, max/min, rounding, conversions) are
bit-exact and tested so elsewhere (tests/test_signed_zeros.py, the fuzzer).
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

# name: (low, high) for unary; ((low, high), (low, high)) for binary.
DOMAINS = {
    "exp": (-90, 90), "exp2": (-120, 120), "log": (0, 1e6), "log1p": (-1, 100),
    "expm1": (-20, 20), "tanh": (-12, 12), "logistic": (-40, 40), "sin": (-100, 100),
    "cos": (-100, 100), "tan": (-10, 10), "erf": (-5, 5), "erfc": (-5, 12),
    "erf_inv": (-1, 1), "lgamma": (-30, 60), "digamma": (-30, 60), "sqrt": (0, 1e6),
    "rsqrt": (0, 1e6), "cbrt": (-1e6, 1e6), "asin": (-1, 1), "acos": (-1, 1),
    "atan": (-100, 100), "log2": (0, 1e4), "sinh": (-80, 80), "cosh": (-80, 80), "asinh": (-1e4, 1e4),
    "acosh": (1, 1e4), "atanh": (-1, 1), "bessel_i0e": (-50, 50), "bessel_i1e": (-50, 50),
    "atan2": ((-10, 10), (-10, 10)), "pow": ((0, 10), (-10, 10)),
    "igamma": ((0.1, 20), (0, 30)), "igammac": ((0.1, 20), (0, 30)),
    "div": ((-10, 10), (-10, 10)), "rem": ((-10, 10), (-10, 10)),
}

# primitive -> how the rule gets XLA's bits (see the module docstring).
_FORMULA, _LIBM, _IEEE = "XLA's formula", "C library call, as XLA", "IEEE correctly rounded"
BIT_EXACT: dict[str, str] = {
    "exp": _FORMULA, "exp2": _FORMULA, "log": _FORMULA, "log2": _FORMULA, "log1p": _FORMULA,
    "erf_inv": _FORMULA, "cosh": _FORMULA, "tanh": _FORMULA, "logistic": _FORMULA,
    "asin": _FORMULA, "acos": _FORMULA,
    "sin": _LIBM, "cos": _LIBM, "tan": _LIBM, "cbrt": _LIBM, "atan2": _LIBM,
    "pow": _LIBM, "sqrt": _IEEE, "div": _IEEE, "rem": _IEEE,
}

# XLA and JAX change their formulas between versions: exp (so exp2, cosh,
# logistic) has two generations in XLA (JAX 0.10's and 0.12's) and asin two
# lowerings in JAX; the rules follow the installed one, told apart by a probe
# (xla_math.exp_generation, xla_math.asin_expands_to_atan2), so these are
# bit-exact on both.

# Measured with ``python -m pallas_np.conformance 1000000``; the max over the
# JAX versions CI tests (0.10.2 and 0.12.0.1: XLA's atan changed in between).
ULP: dict[str, dict[str, int]] = {}


def _register(table: str):
  for line in table.strip().splitlines():
    name, *vals = line.split()
    ULP[name] = dict(zip(("float32", "bfloat16", "float16"), map(int, vals)))


# primitive   float32  bfloat16  float16
# (atan: the C library's atanf, as jitted XLA calls it; inside a larger
# fused program XLA may call atan2f(x, 1) instead, and JAX 0.12's XLA has its
# own formula: within these bounds)
_register("""
atan                 3         0         1
expm1                5         0         2
erf                  5         0         1
erfc                66         0         0
lgamma          525186     13568        12
digamma         270104         1         3
rsqrt                2         0         0
sinh                24         0         1
asinh                2         1         1
acosh                4         2         2
atanh                3         1         1
bessel_i0e           5         0         0
bessel_i1e          10         0         1
igamma             206         1         1
igammac            259         1         1
""")


def bound(name: str, dtype_name: str) -> int:
  """The claimed max ulp of ``name`` in ``dtype_name`` (0: bit-exact)."""
  return 0 if name in BIT_EXACT else ULP[name][dtype_name]


def _ordered(a):
  bits = a.dtype.itemsize * 8
  u = a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).astype(np.int64)
  mag = u & ((1 << (bits - 1)) - 1)
  return np.where(u >> (bits - 1) == 1, -mag, mag)


def ulp_diff(got, want):
  """Per element |got - want| in ulps; NaN vs NaN is 0, NaN vs number huge."""
  got, want = np.asarray(got), np.asarray(want)
  tiny = np.finfo(np.float32).tiny if got.dtype.itemsize != 2 or got.dtype.name == "bfloat16" else 0

  def flush(a):
    return np.where(np.abs(a.astype(np.float32)) < tiny, np.zeros((), a.dtype), a).astype(a.dtype)
  got, want = flush(got), flush(want)
  gn, wn = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
  d = np.abs(_ordered(got) - _ordered(want))
  return np.where(gn & wn, 0, np.where(gn ^ wn, 1 << 40, d))


def _sample(lo, hi, n, dt, rng):
  if lo > 0 and hi / lo > 1e3 or lo == 0 and hi > 1e3:
    x = np.exp(rng.uniform(np.log(max(lo, 1e-6)), np.log(hi), n))
  else:
    x = rng.uniform(lo, hi, n)
  return x.astype(np.float32).astype(dt)


def function(name: str):
  """The lax (or jnp) function measured as ``name``."""
  return getattr(lax, name, None) or getattr(jnp, name)  # log2: a lax primitive from JAX 0.11


def measure(name: str, dtype, n: int = 1_000_000, seed: int = 0) -> int:
  """Max ulp difference of ``lax.<name>`` between numpy mode and XLA."""
  return measure_dtypes(name, (dtype,), n, seed)[np.dtype(dtype).name]


def measure_dtypes(name: str, dtypes, n: int = 1_000_000, seed: int = 0) -> dict[str, int]:
  """``measure`` for several dtypes (dtype name -> max ulp), with one XLA
  compile for all of them (XLA's expansions of igamma, lgamma, ... take
  seconds to compile; one program of three costs less than three)."""
  f = function(name)
  dom = DOMAINS[name]
  doms = dom if isinstance(dom[0], tuple) else (dom,)
  per_dtype = []
  for dtype in dtypes:
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    per_dtype.append((dt, [_sample(lo, hi, n, dt, rng) for lo, hi in doms]))

  def kernel(*refs):
    refs[-1][...] = f(*[r[...] for r in refs[:-1]])
  got = [pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), dt),
                        interpret="numpy")(*args) for dt, args in per_dtype]
  want = jax.jit(lambda groups: [f(*args) for args in groups])([args for _, args in per_dtype])
  return {dt.name: int(ulp_diff(np.asarray(g), np.asarray(w)).max())
          for (dt, _), g, w in zip(per_dtype, got, want)}


def describe(name: str) -> str | None:
  """'bit-exact (...)' or 'float32 <= 3 ulp, ...' for the coverage report."""
  if name in BIT_EXACT:
    return f"bit-exact (float32, bf16, f16; {BIT_EXACT[name]})"
  row = ULP.get(name)
  if row is None:
    return None
  return ", ".join("bit-exact" + f" {k}" if v == 0 else f"{k} <= {v} ulp" for k, v in row.items())


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  n = int(argv[0]) if argv else 1_000_000
  names = argv[1].split(",") if len(argv) > 1 else list(DOMAINS)
  print(f"# primitive   float32  bfloat16  float16   (max ulp vs XLA CPU, {n} samples)")
  for name in names:
    vals = list(measure_dtypes(name, (np.float32, ml_dtypes.bfloat16, np.float16), n).values())
    print(f"{name:12s}" + "".join(f"{v:>10d}" for v in vals), flush=True)


if __name__ == "__main__":
  main()
