"""The compiled float32 loops (pallas_np/primitives/libm.py, the formulas of
xla_math.py) against ``jax.jit`` on this CPU over a dense sweep of float32
bit patterns: every 4093rd pattern of all 2^32 (both signs, every
exponent), every denormal exponent range, ±0, ±inf, NaN. The loops run
with denormals flushed as XLA's code does, so the raw bits must match (NaN
matches NaN); the functions that combine a loop with NumPy steps
(logistic, cosh, asin, acos, exp2) are compared with denormal results read
as zero, as conformance.ulp_diff does (docs/limits.md)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from pallas_np import conformance


def _sweep():
  bits = np.arange(0, 1 << 32, 4093, dtype=np.uint64).astype(np.uint32)
  tiny = np.arange(0, 1 << 23, 997, dtype=np.uint32)  # denormals and zero
  x = np.concatenate([bits, tiny, tiny | np.uint32(1 << 31)]).view(np.float32)
  return np.concatenate([x, np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0])])


X = _sweep()
Y = np.roll(X, 12345)  # the second operand of binary functions: every kind against every kind

LOOPS = {"exp": jnp.exp, "log": jnp.log, "tanh": jnp.tanh, "sin": jnp.sin, "cos": jnp.cos,
         "tan": jnp.tan, "cbrt": jnp.cbrt, "atan2": jnp.arctan2, "pow": lax.pow}
COMBINED = {"logistic": lax.logistic, "cosh": jnp.cosh, "asin": jnp.arcsin, "acos": jnp.arccos,
            "exp2": jnp.exp2}


def _both(f, nargs):
  args = (X, Y)[:nargs]

  def kernel(*refs):
    refs[-1][...] = f(*[r[...] for r in refs[:-1]])
  got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(X.shape, np.float32),
                       interpret="numpy")(*args)
  return np.asarray(got), np.asarray(jax.jit(f)(*args))


def _nargs(name):
  return 2 if name in ("atan2", "pow") else 1


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_loop_bits_match_xla(name):
  got, want = _both(LOOPS[name], _nargs(name))
  same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
  bad = np.flatnonzero(~same)
  assert bad.size == 0, (name, bad.size, X[bad[:5]], got[bad[:5]], want[bad[:5]])


@pytest.mark.parametrize("name", sorted(COMBINED))
def test_combined_match_xla(name):
  got, want = _both(COMBINED[name], _nargs(name))
  d = conformance.ulp_diff(got, want)
  assert d.max() == 0, (name, int(d.max()), X[np.argmax(d)])


def test_exp_probe_bits_are_the_loops():
  # xla_math.exp_generation compares XLA's exp of its probe inputs with
  # these constants instead of compiling both loops: they must be the loops'.
  from pallas_np.primitives import xla_math
  for name, loop in (("split", xla_math._exp_split), ("clamped", xla_math._exp_clamped)):
    got = loop(xla_math._EXP_PROBE).view(np.uint32)
    np.testing.assert_array_equal(got, xla_math._EXP_PROBE_BITS[name])
  assert xla_math.exp_generation() in xla_math._EXP_PROBE_BITS


def test_the_callers_float_mode_is_restored():
  # The loops set MXCSR's FTZ/DAZ for themselves only: NumPy's arithmetic
  # after them still produces and reads denormals.
  from pallas_np.primitives import libm
  tiny = np.float32(2.0 ** -140)  # a denormal, exactly
  libm.call("xla_logf", np.float32([tiny, 2.0]))
  libm.call("sinf", np.float32([tiny, 2.0]))
  assert tiny * np.float32(2) == np.float32(2.0 ** -139)  # not flushed
  assert np.float32(2.0 ** -126) * np.float32(0.5) == np.float32(2.0 ** -127) != 0


def test_out_overlapping_an_operand():
  from pallas_np.primitives import xla_math
  base = np.linspace(-5, 5, 4099, dtype=np.float32)
  want = xla_math.exp_f32(base.copy())
  same = base.copy()
  xla_math.exp_f32(same, out=same)  # out is the operand: in place
  np.testing.assert_array_equal(same.view(np.uint32), want.view(np.uint32))
  shifted = base.copy()
  buf = np.concatenate([shifted, np.zeros(3, np.float32)])
  # out starts 3 elements past the operand's start: a partial overlap
  xla_math.exp_f32(buf[:-3], out=buf[3:])
  np.testing.assert_array_equal(buf[3:].view(np.uint32), want.view(np.uint32))
