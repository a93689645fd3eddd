"""Float ``dot_general`` in a compiled loop (pallas_np/native/dots.py): the
compiled loop calls NumPy's own BLAS routine for each product, as
``np.matmul`` picks it (sgemm, sgemv either way, sdot, or NumPy's loop for
k == 1), so its bits are the NumPy path's. Each test compares
``native_loops="sync"`` with ``"off"`` bit for bit (and with
interpret=True within float tolerance) and checks that the compiled loop
ran: before float dots were emitted the loop was refused and ran on the
NumPy path."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from pallas_np.native import blas_calls
from tests.native_elig_util import bits as _bits
from tests.native_elig_util import compiled_equals_numpy

needs_blas = pytest.mark.skipif(blas_calls.found() is None,
                                reason="NumPy's BLAS is not an OpenBLAS found here")


def _dots_kernel(x_ref, w_ref, o_ref):
  """Every routine np.matmul picks, in one loop: gemm, vector @ matrix,
  matrix @ vector, row @ column, k == 1 (NumPy's loop), a transposed
  operand and a batched product."""
  def body(i, acc):
    x = x_ref[...] * (1.0 + i.astype(jnp.float32))  # (8, 32)
    w = w_ref[...]  # (32, 16)
    s = jnp.dot(x, w)  # gemm
    r = jnp.dot(x[0:1], w)  # (1, 16): gemv
    c = jnp.dot(x, w[:, 0:1])  # (8, 1): gemv
    d = jnp.dot(x[0:1], w[:, 0:1])  # (1, 1): sdot
    k1 = jnp.dot(x[:, 0:1], w[0:1, :])  # (8, 16): k == 1
    t = lax.dot_general(s, s, (((1,), (1,)), ((), ())))  # s @ s.T: (8, 8)
    bx = x.reshape(2, 4, 32)
    bw = w.reshape(2, 16, 16)
    bt = lax.dot_general(bx[:, :, :16], bw, (((2,), (1,)), ((0,), (0,))))  # (2, 4, 16)
    out = s + r + c + d + k1 + bt.reshape(8, 16) + t[:, :1] * 1e-3
    return acc * 0.5 + out
  o_ref[...] = lax.fori_loop(0, 3, body, jnp.zeros(o_ref.shape, jnp.float32))


def _call_dots(interp):
  return pl.pallas_call(
      _dots_kernel, out_shape=jax.ShapeDtypeStruct((16, 32), jnp.float32), grid=(2, 2),
      in_specs=[pl.BlockSpec((8, 32), lambda i, j: (i, 0)),
                pl.BlockSpec((32, 16), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((8, 16), lambda i, j: (i, j)), interpret=interp)


@needs_blas
def test_float_dots_every_routine_bit_exact():
  rng = np.random.default_rng(1)
  # x's blocks are (8, 32) pieces of a (16, 32) array, w's (32, 16) column
  # blocks of a (32, 32) one: on the NumPy path a block is a strided view
  # (a larger leading dimension), here a contiguous copy.
  x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
  compiled_equals_numpy(_call_dots, x, w, rtol=1e-4)


def _attention_kernel(q_ref, k_ref, v_ref, o_ref, *, block_k):
  """A Triton-style attention row block: the loop over kv blocks holds
  q @ k.T and p @ v (the benchmarks' gpu_attention, without masking)."""
  q = q_ref[...]

  def body(j, carry):
    acc, = carry
    start = pl.multiple_of(j * block_k, block_k)
    k = k_ref[pl.ds(start, block_k), :]
    v = v_ref[pl.ds(start, block_k), :]
    s = jnp.exp(jnp.dot(q, k.T) * 0.125)
    return (acc + jnp.dot(s, v),)
  acc, = lax.fori_loop(0, k_ref.shape[0] // block_k, body,
                       (jnp.zeros(o_ref.shape, jnp.float32),))
  o_ref[...] = acc


@needs_blas
def test_attention_like_loop_bit_exact():
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
             for s in ((32, 64), (128, 64), (128, 64)))

  def make(interp):
    return pl.pallas_call(
        functools.partial(_attention_kernel, block_k=32),
        out_shape=jax.ShapeDtypeStruct((32, 64), jnp.float32), grid=(2,),
        in_specs=[pl.BlockSpec((16, 64), lambda i: (i, 0)),
                  pl.BlockSpec((128, 64), lambda i: (0, 0)),
                  pl.BlockSpec((128, 64), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((16, 64), lambda i: (i, 0)), interpret=interp)
  compiled_equals_numpy(make, q, k, v, rtol=1e-4)


@needs_blas
@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_routine_choice_gives_matmuls_bits(dt):
  """The routine ``blas_calls.routine`` picks, called with the arguments
  the generated code passes (here through ctypes), gives np.matmul's bits
  for every shape class, sizes around OpenBLAS's unrolling and blocking."""
  rng = np.random.default_rng(3)
  fns = blas_calls.ctypes_routines()
  for m in (1, 2, 3, 8, 17):
    for k in (2, 5, 16, 33, 128, 300):
      for n in (1, 2, 7, 64, 65):
        x = rng.standard_normal((m, k)).astype(dt)
        y = rng.standard_normal((k, n)).astype(dt)
        got = np.empty((m, n), dt)
        assert blas_calls.matmul(fns, x, y, got)
        np.testing.assert_array_equal(_bits(got), _bits(np.matmul(x, y)), err_msg=(m, k, n))


def _f64_kernel(x_ref, w_ref, o_ref, s_ref):
  def body(i, carry):
    acc, tot = carry
    x = x_ref[...] * (1.0 + i.astype(jnp.float64))  # (8, 200)
    p = jnp.dot(x, w_ref[...])  # dgemm (8, 16)
    r = jnp.dot(x[0:1], w_ref[...])  # dgemv
    return (acc + p + r + jnp.max(p, axis=0, keepdims=True),
            tot + jnp.sum(x, axis=1) + jnp.sum(x, axis=0)[:8])
  acc, tot = lax.fori_loop(0, 2, body, (jnp.zeros(o_ref.shape, jnp.float64),
                                        jnp.zeros(s_ref.shape, jnp.float64)))
  o_ref[...] = acc
  s_ref[...] = tot


@needs_blas
def test_float64_dots_and_sums_bit_exact():
  """float64: dgemm/dgemv and the pairwise sum over 200 doubles (a split
  block), as the NumPy path."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((8, 200)), jnp.float64)
    w = jnp.asarray(rng.standard_normal((200, 16)), jnp.float64)

    def make(interp):
      return pl.pallas_call(
          _f64_kernel, out_shape=(jax.ShapeDtypeStruct((8, 16), jnp.float64),
                                  jax.ShapeDtypeStruct((8,), jnp.float64)),
          interpret=interp)
    compiled_equals_numpy(make, x, w, rtol=1e-10, atol=1e-10)
