"""XLA's float formulas and C library calls (pallas_np/primitives/xla_math.py,
libm.py): the FMA emulation is a true FMA, the bits do not change when
NumPy's SIMD dispatch is switched off (another CPU, simulated), and a
division by a constant is XLA's multiplication by the reciprocal."""
import fractions
import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_np import conformance
from pallas_np.primitives import xla_math
from tests.helpers import concurrently

F32 = np.float32


def _round_f32(q: fractions.Fraction):
  """The float32 nearest to the exact ``q``, ties to even (the reference)."""
  f = F32(float(q))
  cands = [np.nextafter(f, F32(-np.inf)), f, np.nextafter(f, F32(np.inf))]
  dist = [abs(fractions.Fraction(float(c)) - q) for c in cands]
  best = min(dist)
  ties = [c for c, d in zip(cands, dist) if d == best]
  return min(ties, key=lambda c: int(np.asarray(c).view(np.uint32)) & 1)


def test_fma_is_correctly_rounded():
  # Double rounding's trap: a*b + c = 1 + 2^-24 + 2^-70 rounds to the float32
  # midpoint 1 + 2^-24 in float64 (then to 1.0, even); the true FMA gives
  # 1 + 2^-23.
  a, b, c = F32(-(1 + 2.0 ** -23) * 2.0 ** -24), F32(1 - 2.0 ** -23), F32(1 + 2.0 ** -23)
  naive = (np.float64(a) * np.float64(b) + np.float64(c)).astype(F32)
  assert naive == F32(1.0)
  assert xla_math.fma_f32(a, b, c) == F32(1 + 2.0 ** -23)
  rng = np.random.default_rng(3)
  a = rng.standard_normal(3000).astype(F32)
  b = (rng.standard_normal(3000) * 2.0 ** rng.integers(-30, 30, 3000)).astype(F32)
  c = rng.standard_normal(3000).astype(F32)
  got = xla_math.fma_f32(a, b, c)
  want = [_round_f32(fractions.Fraction(float(x)) * fractions.Fraction(float(y))
                     + fractions.Fraction(float(z))) for x, y, z in zip(a, b, c)]
  np.testing.assert_array_equal(got, np.array(want, F32))


_SIMULATED = r"""
import json, sys
import numpy as np, ml_dtypes, jax
from jax.experimental import pallas as pl
import pallas_np
from pallas_np import conformance
out = {}
for name in sorted(conformance.DOMAINS):
  for dt in (np.float32, ml_dtypes.bfloat16, np.float16):
    rng = np.random.default_rng(2)
    dom = conformance.DOMAINS[name]
    doms = dom if isinstance(dom[0], tuple) else (dom,)
    args = [conformance._sample(lo, hi, 4096, dt, rng) for lo, hi in doms]
    f = conformance.function(name)
    def kernel(*refs):
      refs[-1][...] = f(*[r[...] for r in refs[:-1]])
    r = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4096,), dt), interpret="numpy")(*args)
    out[name + "/" + np.dtype(dt).name] = np.asarray(r).view(np.uint16 if np.dtype(dt).itemsize == 2 else np.uint32).tolist()
x = np.random.default_rng(2).uniform(-100, 100, 4096).astype(np.float32)
out["np.sin"] = np.sin(x).view(np.uint32).tolist()
json.dump(out, sys.stdout)
"""


def _run(env_extra):
  env = dict(os.environ, **env_extra)
  env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
  r = subprocess.run([sys.executable, "-c", _SIMULATED], env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout)


def test_bits_do_not_depend_on_numpys_simd_dispatch():
  """Every float primitive of pallas_np.conformance (bit-exact or not)
  gives the same bits with NumPy's dispatched SIMD code paths switched off (NPY_DISABLE_CPU_FEATURES: another CPU, as
  far as NumPy can tell), while NumPy's own float32 sin changes."""
  from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
  found = [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]
  if not found:
    pytest.skip("this CPU has no dispatched SIMD features to switch off")
  here, other = concurrently(lambda: _run({}),
                             lambda: _run({"NPY_DISABLE_CPU_FEATURES": " ".join(found)}))
  changed = [k for k in here if k != "np.sin" and here[k] != other[k]]
  assert not changed, changed
  assert here["np.sin"] != other["np.sin"], "the simulation switched nothing off"


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("divisor", [3.0, 10.0, 255.0, 0.1, -7.0, 0.0, np.inf])
def test_division_by_a_constant_is_xlas(divisor, dtype):
  """XLA computes x / c as x * (1 / c): NumPy's true division differed on
  ~15-70% of elements in float32 and float16 before."""
  x = np.random.default_rng(0).uniform(-100, 100, 4096).astype(F32).astype(dtype)
  x[:4] = np.array([0.0, -0.0, np.inf, np.nan], F32).astype(dtype)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] / divisor

  def call(interpret):
    return np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                     interpret=interpret)(x))
  d = conformance.ulp_diff(call("numpy"), call(True))
  assert d.max() == 0, (int((d > 0).sum()), x[np.argmax(d)])


def test_native_loop_division_by_a_constant():
  """The native tier's compiled loop divides by a constant as XLA does
  (x * (1/c)), bit for bit with the NumPy path and interpret=True; its sign
  keeps either zero."""
  import jax.numpy as jnp
  from jax import lax

  import pallas_np
  from pallas_np import native

  def kernel(x_ref, o_ref):
    def body(i, x):
      o_ref[0] = x / 3.0
      o_ref[1] = jnp.sign(x)
      o_ref[2] = x / np.float32(0.1)
      return x * 1.5
    lax.fori_loop(0, 2, body, x_ref[...])

  x = np.random.default_rng(1).uniform(-100, 100, (8, 128)).astype(F32)
  x[0, :4] = [0.0, -0.0, np.inf, np.nan]

  def call(interpret):
    return np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((3, 8, 128), F32),
                                     interpret=interpret)(x))
  before = native.stats()["native_calls"]
  got = call(pallas_np.InterpretParams(native_loops="sync"))
  assert native.stats()["native_calls"] > before, "the compiled loop did not run"
  for other in (call(pallas_np.InterpretParams(native_loops="off")), call(True)):
    d = conformance.ulp_diff(got, other)
    assert d.max() == 0, int((d > 0).sum())
  assert np.signbit(got[1, 0, 1]) and got[1, 0, 1] == 0
