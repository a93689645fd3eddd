"""Integer dot_general through a float BLAS GEMM (primitives/dot.py,
``exact_int_gemm``): bit-identical to XLA's integer accumulation, wrap-around
included, on both sides of the float32/float64 thresholds."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from pallas_np import blas
from pallas_np.primitives.dot import exact_int_gemm
from tests.helpers import assert_identical

_rng = np.random.default_rng(33)
F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
I8, U8, I16, I32 = (np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.int32))
SEQ = pallas_np.InterpretParams(vectorize=False, check_avals=True)
VEC = pallas_np.InterpretParams(vectorize=True, check_avals=True)




def _run(x, y, pref, out_dtype=None, interpret=SEQ, grid_rows=None):
  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = lax.dot_general(x_ref[...], y_ref[...], (((1,), (0,)), ((), ())),
                                 preferred_element_type=pref)
  if out_dtype is None:
    out_dtype = jax.eval_shape(
        lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                     preferred_element_type=pref), x, y).dtype
  shape = (x.shape[0], y.shape[1])
  kw = {}
  if grid_rows:
    kw = dict(grid=(shape[0] // grid_rows,),
              in_specs=[pl.BlockSpec((grid_rows, x.shape[1]), lambda i: (i, 0)),
                        pl.BlockSpec(y.shape, lambda i: (0, 0))],
              out_specs=pl.BlockSpec((grid_rows, shape[1]), lambda i: (i, 0)))
  entry = pl.pallas_call if interpret is True else pallas_np.pallas_call
  return entry(kernel, jax.ShapeDtypeStruct(shape, out_dtype), interpret=interpret, **kw)(x, y)


def _ints(shape, dtype, fill=None):
  dtype = np.dtype(dtype)
  if fill is not None:
    return jnp.full(shape, fill, dtype)
  info = ml_dtypes.iinfo(dtype) if dtype.kind == "V" else np.iinfo(dtype)
  return jnp.asarray(_rng.integers(int(info.min), int(info.max) + 1, size=shape).astype(dtype))


def test_exact_int_gemm_picks_the_narrowest_exact_float():
  assert exact_int_gemm(I8, I8, I32, 1024) == (F32, False)  # 1024 * 2^14 = 2^24
  assert exact_int_gemm(I8, I8, I32, 1025) == (F64, False)
  assert exact_int_gemm(I8, I8, I32, 1 << 17) == (F64, True)  # may reach 2^31
  assert exact_int_gemm(U8, U8, I32, 258) == (F32, False)
  assert exact_int_gemm(U8, U8, I32, 259) == (F64, False)
  assert exact_int_gemm(I8, I8, I8, 4) == (F32, True)  # int8 accumulation wraps
  assert exact_int_gemm(I16, I16, I32, 1 << 23) == (F64, True)
  assert exact_int_gemm(I16, I16, I32, (1 << 23) + 1) is None  # past 2^53
  int4 = np.dtype(ml_dtypes.int4)
  assert exact_int_gemm(int4, int4, I32, 4096) == (F32, False)
  assert exact_int_gemm(I32, I32, I32, 2) is None  # int32 products are not exact
  assert exact_int_gemm(I8, I8, F32, 8) is None  # float accumulation: the float path
  assert exact_int_gemm(np.dtype(np.bool_), np.dtype(np.bool_), I32, 8) is None


CASES = [
    # (lhs dtype, rhs dtype, preferred, M, K, N, fill)
    ("int8", "int8", jnp.int32, 16, 256, 24, None),
    ("int8", "int8", jnp.int32, 8, 1024, 16, -128),  # float32, the sum is 2^24 exactly
    ("int8", "int8", jnp.int32, 8, 1025, 16, -128),  # just past: float64
    ("int8", "int8", jnp.int32, 8, 1025, 16, None),
    ("int8", "int8", jnp.int32, 2, 1 << 17, 8, -128),  # 2^31: wraps to -2^31
    ("int8", "int8", jnp.int32, 2, (1 << 17) - 1, 8, -128),  # 2^31 - 2^14 fits
    ("uint8", "uint8", jnp.int32, 8, 258, 16, 255),
    ("uint8", "uint8", jnp.int32, 8, 300, 16, None),
    ("int8", "uint8", jnp.int32, 8, 128, 16, None),
    ("int8", "int8", None, 8, 64, 16, None),  # int8 accumulation wraps
    ("int8", "int8", jnp.int16, 8, 512, 16, -128),
    ("int8", "int8", jnp.uint32, 8, 64, 16, None),  # negative sums wrap mod 2^32
    ("int8", "int8", jnp.float32, 8, 64, 16, None),  # float accumulation (not this path)
    ("int16", "int16", jnp.int32, 8, 64, 16, -32768),  # 2^36 wraps
    ("int16", "int16", jnp.int32, 8, 64, 16, None),
    ("int8", "bfloat16", jnp.float32, 8, 64, 16, None),  # mixed: a float dot
]


@pytest.mark.parametrize("lhs,rhs,pref,M,K,N,fill", CASES)
def test_int_dot_matches_interpret_true(lhs, rhs, pref, M, K, N, fill):
  def operand(shape, dtype):
    if dtype == "bfloat16":
      return jnp.asarray(_rng.standard_normal(shape).astype(ml_dtypes.bfloat16))
    return _ints(shape, dtype, fill)
  x, y = operand((M, K), lhs), operand((K, N), rhs)
  want = _run(x, y, pref, interpret=True)
  got = _run(x, y, pref)
  if np.dtype(want.dtype).kind == "f":  # a float GEMM: BLAS and XLA round differently
    assert got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-3)
  else:
    assert_identical(got, want)


@pytest.mark.parametrize("fill", [None, -128])
def test_int_dot_vectorized_grid_matches(fill):
  """The batched rule (one matmul over the grid's lanes) takes the same path."""
  x, y = _ints((64, 1100), np.int8, fill), _ints((1100, 16), np.int8, fill)
  want = _run(x, y, jnp.int32, interpret=True, grid_rows=8)
  assert_identical(_run(x, y, jnp.int32, interpret=VEC, grid_rows=8), want)
  assert_identical(_run(x, y, jnp.int32, interpret=SEQ, grid_rows=8), want)


@pytest.mark.parametrize("interp", [SEQ, VEC])
def test_int8_dot_runs_a_float_gemm(monkeypatch, interp):
  """No integer matmul reaches NumPy (its integer matmul is a naive loop)."""
  seen = []
  real = blas.matmul_for

  def spy(macs):
    mm = real(macs)

    def matmul(x, y, out=None):
      seen.append((x.dtype, y.dtype))
      return mm(x, y, out=out)
    return matmul
  monkeypatch.setattr(blas, "matmul_for", spy)
  x, y = _ints((32, 96), np.int8), _ints((96, 8), np.int8)
  got = _run(x, y, jnp.int32, interpret=interp, grid_rows=8)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x, np.int64) @ np.asarray(y, np.int64))
  assert seen and all(d == (F32, F32) for d in seen), seen


CHUNKED_CASES = [
    # (lhs, rhs, preferred, M, K, N, fill): every one long enough to be summed in K-chunks
    ("int8", "int8", jnp.int32, 32, 300, 24, None),  # two full chunks and a remainder
    ("int8", "int8", jnp.int32, 16, 1024, 8, -128),  # float32: the whole sum is 2^24
    ("int8", "int8", jnp.int32, 16, 1100, 8, -128),  # float64
    ("int8", "int8", None, 16, 300, 8, None),  # int8 accumulation wraps
    ("int8", "int8", None, 16, 300, 8, -128),
    ("uint8", "uint8", jnp.int32, 16, 258, 8, 255),
    ("int16", "int16", jnp.int32, 16, 300, 8, -32768),  # 300 * 2^30 wraps mod 2^32
    ("int8", "int8", jnp.uint32, 16, 260, 8, None),  # negative sums wrap mod 2^32
]


@pytest.mark.parametrize("lhs,rhs,pref,M,K,N,fill", CHUNKED_CASES)
def test_long_int_dot_summed_in_k_chunks_keeps_the_bits(monkeypatch, lhs, rhs, pref, M, K, N,
                                                          fill):
  """An exact integer GEMM of 16+ rows and K > 128 is summed over 128-wide
  K-chunks (dot.chunked_int_gemm: OpenBLAS is 2-4x faster on them): the
  same exact sums, wrap-around included, as XLA and as one int64 product."""
  from pallas_np.primitives import dot as dot_mod
  widths = []
  real = blas.matmul_for

  def spy(macs):
    mm = real(macs)

    def matmul(x, y, out=None):
      widths.append(x.shape[-1])
      return mm(x, y, out=out)
    return matmul
  monkeypatch.setattr(blas, "matmul_for", spy)
  pallas_np.clear_caches()  # (plans pick their matmul when they are built)
  x, y = _ints((M, K), lhs, fill), _ints((K, N), rhs, fill)
  want = _run(x, y, pref, interpret=True)
  got = _run(x, y, pref)
  assert_identical(got, want)
  exact = np.asarray(x, np.int64) @ np.asarray(y, np.int64)
  np.testing.assert_array_equal(np.asarray(got), exact.astype(want.dtype))
  step = dot_mod.INT_GEMM_K_CHUNK
  assert widths == [step] * (K // step) + ([K % step] if K % step else []), widths


def test_chunked_int_gemm_equals_one_gemm_and_declines_small_shapes():
  from pallas_np.primitives.dot import INT_GEMM_MIN_ROWS, chunked_int_gemm
  x = _rng.integers(-128, 128, (INT_GEMM_MIN_ROWS, 520)).astype(np.float32)
  y = _rng.integers(-128, 128, (520, 40)).astype(np.float32)
  chunked = chunked_int_gemm(np.matmul, *x.shape, y.shape[1], F32)
  assert_identical(chunked(x, y), x @ y)
  assert chunked_int_gemm(np.matmul, INT_GEMM_MIN_ROWS - 1, 520, 40, F32) is None
  assert chunked_int_gemm(np.matmul, 64, 128, 40, F32) is None
