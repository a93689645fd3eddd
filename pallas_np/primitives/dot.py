"""dot_general as one batched matmul.

Operands are transposed to (batch, free, contract) / (batch, contract, free),
reshaped to 3-D and multiplied with ``np.matmul`` (BLAS for floats). The
permutations and reshapes are worked out once at compile time. Inputs are
cast to the accumulation dtype first: ``preferred_element_type`` when given
(int8 x int8 -> int32 accumulates in int32), float32 for bf16/f16/fp8
operands, so the only rounding to a low precision type happens at the end, as
on the MXU / tensor cores. opt_einsum would pick the same BLAS call for these
shapes; a reshape + matmul plan is cheaper per call than an einsum dispatch.

Operands reach BLAS in one layout, whatever they were (``blas_operand``),
and the batched rule (below, next to the sequential one) makes, lane by lane, exactly the call
the grid loop makes: that is what keeps a vectorized grid bitwise equal to
the sequential one, since BLAS rounds differently with the routine NumPy
picks for a layout (gemv_t vs gemv_n, a strided dot) and with a GEMM's row
count.

Small-integer products (int8/uint8/int4/int16 operands, integer
accumulation) go through a float GEMM when it is provably exact
(``exact_int_gemm``): NumPy's integer matmul is a naive loop, 10-100x slower
than BLAS, and has no int8 GEMM. Since such a float GEMM is exact in any
summation order, a long contraction is summed in K-chunks
(``chunked_int_gemm``): NumPy's OpenBLAS sgemm runs 2-4x slower per multiply
on K of 256 and more than on 128-wide panels (PERF_LOG [floor]).
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from jax import lax

from pallas_np import blas, registry
from pallas_np.dtypes import np_dtype, is_low_precision_float


def _acc_dtype(lhs_dt, rhs_dt, pref):
  if pref is not None:
    pref = np_dtype(pref)
    if is_low_precision_float(pref):
      return np.dtype(np.float32), pref
    return pref, pref
  out = np.result_type(lhs_dt, rhs_dt) if lhs_dt != rhs_dt else lhs_dt
  if is_low_precision_float(out):
    return np.dtype(np.float32), out
  if out == np.bool_:
    return np.dtype(np.int32), out
  return out, out


# Largest |sum of K products| a float GEMM adds up exactly, whatever the
# order: every partial sum is an integer of at most this size (all such
# integers are floats).
_F32_EXACT = 1 << 24
_F64_EXACT = 1 << 53


def _int_magnitude(dt):
  """max |x| over integer dtype ``dt`` (int4 etc. via ml_dtypes), or None
  for non-integer dtypes."""
  if dt.kind in "iu":
    info = np.iinfo(dt)
  elif dt.name in ("int4", "uint4", "int2", "uint2"):
    info = ml_dtypes.iinfo(dt)
  else:
    return None
  return max(-int(info.min), int(info.max))


def exact_int_gemm(lhs_dt, rhs_dt, acc, K):
  """(float dtype, wrap) to compute an integer dot_general through BLAS,
  or None. Exact: every product and partial sum is an integer of at most
  2^24 (float32) / 2^53 (float64), so the float GEMM returns the exact
  sum in any summation order; the integer accumulation XLA does wraps mod
  2^bits, and so does narrowing the exact sum through int64 (``wrap``:
  needed when the sum may not fit ``acc``)."""
  if acc.kind not in "iu" or acc.itemsize > 8:
    return None
  a, b = _int_magnitude(lhs_dt), _int_magnitude(rhs_dt)
  if a is None or b is None or lhs_dt.itemsize > 2 or rhs_dt.itemsize > 2:
    return None
  bound = max(K, 1) * a * b
  if bound <= _F32_EXACT:
    f = np.dtype(np.float32)
  elif bound <= _F64_EXACT:
    f = np.dtype(np.float64)
  else:
    return None
  info = np.iinfo(acc)
  return f, bound > info.max or (acc.kind == "u")


# Exact integer GEMMs (exact_int_gemm) of at least INT_GEMM_MIN_ROWS rows sum
# K in chunks of INT_GEMM_K_CHUNK products: measured per call on NumPy's
# OpenBLAS (docs/performance.md#constants), 2-4x faster from K = 256 for
# 16+ rows; fewer rows take BLAS's small-matrix path, faster unchunked.
INT_GEMM_K_CHUNK = 128
INT_GEMM_MIN_ROWS = 16


def chunked_int_gemm(matmul, M, K, N, compute):
  """``matmul(x, y)`` for 2-D (M, K) x (K, N) operands of an exact
  integer GEMM as a sum over K-chunks (the same exact sums, so the same
  bits: every partial sum is an integer within the float's exact range),
  or None where one GEMM is the faster call."""
  if M < INT_GEMM_MIN_ROWS or K <= INT_GEMM_K_CHUNK:
    return None
  step = INT_GEMM_K_CHUNK
  bounds = [(s, min(s + step, K)) for s in range(0, K, step)]

  def chunked(x, y):
    r = matmul(x[:, :step], y[:step])
    part = np.empty((M, N), compute)
    for s, e in bounds[1:]:
      r += matmul(x[:, s:e], y[s:e], out=part)
    return r
  return chunked


def _to_int(r, acc, wrap):
  """The exact float sums ``r`` as ``acc`` integers, wrapping like XLA."""
  if wrap:
    r = r.astype(np.int64)
  return r.astype(acc)


def blas_operand(a):
  """``a`` (2-D, or a stack of matrices) laid out as BLAS gets every
  operand: rows of unit stride, a one-column operand contiguous. A block
  of a wider array keeps its row stride (it changes no rounding, and the
  copy would cost a memory pass); a transposed or strided view is copied
  to C order."""
  item = a.itemsize
  rows, cols = a.strides[-2:]
  if a.shape[-1] == 1:
    ok = rows == item or a.shape[-2] == 1
  else:
    ok = cols == item and rows % item == 0 and rows >= a.shape[-1] * item
  return a if ok else np.ascontiguousarray(a)


class DotGeometry:
  """dot_general as (batch, free, contract) x (batch, contract, free): the
  permutations, the 3-D sizes and the dtypes, worked out once per eqn (shared
  with the batched rule)."""

  def __init__(self, e):
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    lhs_aval, rhs_aval = e.in_avals
    lnd, rnd = len(lhs_aval.shape), len(rhs_aval.shape)
    lf = [d for d in range(lnd) if d not in lc and d not in lb]
    rf = [d for d in range(rnd) if d not in rc and d not in rb]
    self.lperm = (*lb, *lf, *lc)
    self.rperm = (*rb, *rc, *rf)
    ls, rs = lhs_aval.shape, rhs_aval.shape
    self.B = math.prod(ls[d] for d in lb)
    self.M = math.prod(ls[d] for d in lf)
    self.K = math.prod(ls[d] for d in lc)
    self.N = math.prod(rs[d] for d in rf)
    self.out_shape = tuple(e.out_aval.shape)
    self.acc, _ = _acc_dtype(np_dtype(lhs_aval.dtype), np_dtype(rhs_aval.dtype),
                             e.params.get("preferred_element_type"))
    self.out = np_dtype(e.out_aval.dtype)
    # Integer products through a float GEMM where exact (None: as acc).
    self.int_gemm = exact_int_gemm(np_dtype(lhs_aval.dtype), np_dtype(rhs_aval.dtype),
                                   self.acc, self.K)
    self.compute = self.int_gemm[0] if self.int_gemm else self.acc
    # Narrow floats (bf16, f16, fp8) into float32: every product is exact
    # in float64 and so, in practice, is their sum: one rounding to float32
    # at the end gives each element the same bits whatever the GEMM's shape,
    # as an MXU / tensor core does (its result per element does not depend
    # on how the kernel tiles M and N; BLAS's float32 GEMM rounds an element
    # differently with the shape: tokamax splash attention's qk_diag_skip
    # tests compare a split matmul with the whole one bit for bit).
    if self.acc == np.float32 and all(
        is_low_precision_float(d) for d in (np_dtype(lhs_aval.dtype), np_dtype(rhs_aval.dtype))):
      self.compute = np.dtype(np.float64)
    self.lnd, self.rnd = lnd, rnd
    # How the grid loop lays out each product's operands (the batched rule
    # must match it): 2-D products take blas_operand; NumPy's batched matmul
    # only uses BLAS for contiguous operands.
    self.layout = blas_operand if self.B == 1 else np.ascontiguousarray


def _dot_general_batched(bc, rule, info, in_batched):
  """One ``np.matmul`` over every lane whose per-lane products are the very
  BLAS calls the grid loop makes (the same shapes, operand layouts and
  thread count). Folding the lanes into the lhs rows (one big GEMM)
  is faster, but BLAS rounds a GEMM's rows differently with the row count
  (measured: most elements of a 64-lane 1x32 @ 32x16 product moved by an
  ulp on an AVX2 EPYC), and vectorized grids must stay bitwise equal to
  the sequential ones."""
  g = DotGeometry(info)
  Bd, M, K, N = g.B, g.M, g.K, g.N
  out_shape, acc, out = g.out_shape, g.acc, g.out
  compute, int_gemm = g.compute, g.int_gemm
  bool_out = out == np.bool_
  lb_, rb_ = in_batched
  lperm = (0, *[d + 1 for d in g.lperm]) if lb_ else g.lperm
  rperm = (0, *[d + 1 for d in g.rperm]) if rb_ else g.rperm
  matmul = blas.matmul_for(Bd * M * K * N)  # the grid loop's choices
  layout = g.layout

  def dot(x, y):
    n = x.shape[0] if lb_ else y.shape[0]
    x = np.transpose(np.asarray(x, dtype=compute), lperm)
    y = np.transpose(np.asarray(y, dtype=compute), rperm)
    x = layout(x.reshape((n, Bd, M, K) if lb_ else (Bd, M, K)))
    y = layout(y.reshape((n, Bd, K, N) if rb_ else (Bd, K, N)))
    r = matmul(x, y)  # (n, Bd, M, N); an unbatched operand broadcasts
    if int_gemm:
      r = _to_int(r, acc, int_gemm[1])
    if bool_out:
      r = r != 0
    return np.asarray(r.reshape((n, *out_shape)), dtype=out)
  return dot, False, (True,)


@registry.register(lax.dot_general_p, batch=_dot_general_batched, gemm=True)
def _dot_general(e):
  g = DotGeometry(e)
  lperm, rperm, B, M, K, N = g.lperm, g.rperm, g.B, g.M, g.K, g.N
  out_shape, acc, out = g.out_shape, g.acc, g.out
  lnd, rnd, layout = g.lnd, g.rnd, g.layout
  compute, int_gemm = g.compute, g.int_gemm
  ltrivial = lperm == tuple(range(lnd))
  rtrivial = rperm == tuple(range(rnd))
  bool_out = out == np.bool_
  matmul = blas.matmul_for(B * M * K * N)
  if int_gemm and B == 1:  # (operands: 2-D, rows of unit stride: blas_operand)
    matmul = chunked_int_gemm(matmul, M, K, N, compute) or matmul

  def dot(x, y):
    x = np.asarray(x, dtype=compute)
    y = np.asarray(y, dtype=compute)
    if not ltrivial:
      x = np.transpose(x, lperm)
    if not rtrivial:
      y = np.transpose(y, rperm)
    if B == 1:
      r = matmul(layout(x.reshape(M, K)), layout(y.reshape(K, N)))
    else:
      r = matmul(layout(x.reshape(B, M, K)), layout(y.reshape(B, K, N)))
    if int_gemm:
      r = _to_int(r, acc, int_gemm[1])
    if bool_out:
      r = r != 0
    return np.asarray(r.reshape(out_shape), dtype=out)

  if B == 1 and lnd == 2 and rnd == 2 and acc == out and not bool_out and not int_gemm and compute == acc:
    def dot_out(x, y, out=None):
      """A plain 2-D product, optionally into ``out`` (the ref block it is
      stored to: see the evaluator's ``into_refs``)."""
      x = np.asarray(x, dtype=acc)
      y = np.asarray(y, dtype=acc)
      return matmul(blas_operand(x if ltrivial else x.T),
                    blas_operand(y if rtrivial else y.T), out=out)
    dot.with_out = dot_out
  return dot
