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
"""
from __future__ import annotations

import math

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
  bool_out = out == np.bool_
  lb_, rb_ = in_batched
  lperm = (0, *[d + 1 for d in g.lperm]) if lb_ else g.lperm
  rperm = (0, *[d + 1 for d in g.rperm]) if rb_ else g.rperm
  matmul = blas.matmul_for(Bd * M * K * N)  # the grid loop's choices
  layout = g.layout

  def dot(x, y):
    n = x.shape[0] if lb_ else y.shape[0]
    x = np.transpose(np.asarray(x, dtype=acc), lperm)
    y = np.transpose(np.asarray(y, dtype=acc), rperm)
    x = layout(x.reshape((n, Bd, M, K) if lb_ else (Bd, M, K)))
    y = layout(y.reshape((n, Bd, K, N) if rb_ else (Bd, K, N)))
    r = matmul(x, y)  # (n, Bd, M, N); an unbatched operand broadcasts
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
  ltrivial = lperm == tuple(range(lnd))
  rtrivial = rperm == tuple(range(rnd))
  bool_out = out == np.bool_
  matmul = blas.matmul_for(B * M * K * N)

  def dot(x, y):
    x = np.asarray(x, dtype=acc)
    y = np.asarray(y, dtype=acc)
    if not ltrivial:
      x = np.transpose(x, lperm)
    if not rtrivial:
      y = np.transpose(y, rperm)
    if B == 1:
      r = matmul(layout(x.reshape(M, K)), layout(y.reshape(K, N)))
    else:
      r = matmul(layout(x.reshape(B, M, K)), layout(y.reshape(B, K, N)))
    if bool_out:
      r = r != 0
    return np.asarray(r.reshape(out_shape), dtype=out)

  if B == 1 and lnd == 2 and rnd == 2 and acc == out and not bool_out:
    def dot_out(x, y, out=None):
      """A plain 2-D product, optionally into ``out`` (the ref block it is
      stored to: see the evaluator's ``into_refs``)."""
      x = np.asarray(x, dtype=acc)
      y = np.asarray(y, dtype=acc)
      return matmul(blas_operand(x if ltrivial else x.T),
                    blas_operand(y if rtrivial else y.T), out=out)
    dot.with_out = dot_out
  return dot
