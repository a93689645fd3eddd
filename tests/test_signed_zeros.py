"""Signed zeros bit for bit against XLA (``jax.jit`` on the CPU): every pair
of special values (no denormals: XLA's CPU backend flushes those, numpy mode
does not, docs/limits.md) through the ops where NumPy's zero sign differs
from XLA's. Each case failed before its fix (sign, round away from zero and
so float floor_divide, clamp, float16 nextafter)."""
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 0.25, -0.25, 1.5, -1.5, 2.5, -2.5, 0.49999997,
           -0.49999997, 3.0, -3.0, 7.0, -7.0, 1e-3, -1e-3, 100.0, -100.0, 1e30, -1e30, 6e4, -6e4,
           np.inf, -np.inf, np.nan]
DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]


def raw_bits(a):
  """The bit pattern; every NaN as -1 (payloads aside, docs/coverage.md)."""
  a = np.asarray(a)
  u = a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).astype(np.int64)
  return np.where(np.isnan(a.astype(np.float32)), -1, u)


def pairs(dt):
  with np.errstate(over="ignore"):
    v = np.array(SPECIAL, np.float32).astype(dt)
  a, b = zip(*itertools.product(v, v))
  return np.array(a, dt), np.array(b, dt)


def assert_bits_like_xla(f, *args):
  def kernel(*refs):
    refs[-1][...] = f(*[r[...] for r in refs[:-1]])
  out = jax.eval_shape(f, *args)
  got = np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
                                  interpret="numpy")(*args))
  want = np.asarray(jax.jit(f)(*args))
  bad = raw_bits(got) != raw_bits(want)
  assert not bad.any(), [(tuple(a[i] for a in args), got[i], want[i])
                         for i in np.argwhere(bad).ravel()[:6]]


OPS = {
    "sign": (1, jnp.sign),
    "round_away": (1, lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO)),
    "round_even": (1, lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)),
    "floor_divide": (2, jnp.floor_divide),
    "remainder": (2, jnp.remainder),
    "clamp_lo_x_hi": (2, lambda a, b: lax.clamp(jnp.minimum(a, b), b, jnp.maximum(a, b))),
    "clamp_x_zero": (2, lambda a, b: lax.clamp(a, b, jnp.zeros_like(a))),
    "clamp_neg_zero": (2, lambda a, b: lax.clamp(a, b, jnp.full_like(a, -0.0))),
    "nextafter": (2, jnp.nextafter),
    "max": (2, lax.max), "min": (2, lax.min),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", sorted(OPS))
def test_special_values_bit_exact(name, dtype):
  nargs, f = OPS[name]
  x, y = pairs(dtype)
  if nargs == 1:
    with np.errstate(over="ignore"):
      x = np.array(SPECIAL, np.float32).astype(dtype)
    assert_bits_like_xla(f, x)
  else:
    assert_bits_like_xla(f, x, y)


def test_clamp_scalar_bounds_negative_zero():
  x = np.array([-0.0, 0.0, -1.0, 1.0, np.nan], np.float32)
  assert_bits_like_xla(lambda v: lax.clamp(np.float32(-0.0), v, np.float32(0.0)), x)
  assert_bits_like_xla(lambda v: lax.clamp(np.float32(0.0), v, np.float32(0.0)), x)
