"""Integer ``dot_general`` in a compiled loop through an exact float GEMM
(pallas_np/native/dots.py, ``_exact_int_gemm``): where every product and
partial sum is an integer the float holds (``primitives/dot.exact_int_gemm``),
the compiled loop converts the operands and calls NumPy's BLAS routine, as
the NumPy rule does, and narrows the exact sums through int64 (wrapping
like XLA's accumulator). Each test checks the generated source calls BLAS
(the feature: before it, a scalar int64 loop ran, ~10x slower than the
NumPy rule) and that the compiled loop equals the NumPy path and
interpret=True bit for bit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from pallas_np.native import blas_calls
from tests.native_elig_util import compiled_equals_numpy, loop_source_of

needs_blas = pytest.mark.skipif(blas_calls.found() is None,
                                reason="NumPy's BLAS is not an OpenBLAS found here")


def _make(x, y, acc_dt, steps=3):
  def kernel(x_ref, y_ref, o_ref):
    def body(i, acc):
      p = lax.dot_general(x_ref[...], y_ref[...], (((1,), (0,)), ((), ())),
                          preferred_element_type=acc_dt)
      return acc + p * (i + 1).astype(acc_dt)
    o_ref[...] = lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, acc_dt))

  def make(interp):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]),
                                                                 acc_dt), interpret=interp)
  return make


def _ints(rng, dt, shape, extreme=False):
  info = np.iinfo(dt)
  if extreme:  # (every product at the dtype's largest magnitude: sums that wrap)
    return np.where(rng.random(shape) < 0.5, info.min, info.max).astype(dt)
  return rng.integers(info.min, int(info.max) + 1, shape).astype(dt)


CASES = {
    # int8 -> int32, K = 256: |sum| <= 2^22, float32 exact (sgemm)
    "int8 K=256": (np.int8, np.int8, jnp.int32, (64, 256), (256, 64), False, "_cblas_sgemm"),
    # uint8 -> uint32 (an unsigned accumulator: narrowed through int64)
    "uint8": (np.uint8, np.uint8, jnp.uint32, (16, 128), (128, 32), False, "_cblas_sgemm"),
    # int16 extremes -> int32, K = 64: sums up to 2^36 (float64, dgemm) wrap mod 2^32
    "int16 wrapping": (np.int16, np.int16, jnp.int32, (16, 64), (64, 16), True, "_cblas_dgemm"),
    # one row: vector @ matrix (gemv), as np.matmul picks it
    "int8 row": (np.int8, np.int8, jnp.int32, (1, 128), (128, 32), False, "_cblas_sgemv"),
}


@needs_blas
@pytest.mark.parametrize("case", list(CASES))
def test_int_dot_through_exact_float_gemm(case):
  xdt, ydt, acc, xs, ys, extreme, routine = CASES[case]
  rng = np.random.default_rng(3)
  x = jnp.asarray(_ints(rng, xdt, xs, extreme))
  y = jnp.asarray(_ints(rng, ydt, ys, extreme))
  make = _make(x, y, acc)
  assert routine in loop_source_of(make, x, y)
  got = compiled_equals_numpy(make, x, y)
  want = (np.asarray(x, np.int64) @ np.asarray(y, np.int64)) * 6  # (1 + 2 + 3)
  np.testing.assert_array_equal(np.asarray(got), want.astype(np.dtype(acc)))


def test_int_dot_beyond_float64_stays_an_integer_loop():
  """int32 operands: no float holds every sum (``exact_int_gemm`` is None),
  so the compiled loop sums in int64 itself, with the same wrapped bits."""
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.integers(-2**31, 2**31, (8, 16), dtype=np.int64).astype(np.int32))
  y = jnp.asarray(rng.integers(-2**31, 2**31, (16, 8), dtype=np.int64).astype(np.int32))
  make = _make(x, y, jnp.int32)
  assert "_cblas_" not in loop_source_of(make, x, y)
  compiled_equals_numpy(make, x, y)
