"""``dot_general`` in a compiled loop, with the NumPy rule's bits
(``primitives/dot.py``).

Integer dots: each output element the sum of its products in int64,
narrowed to the result dtype. XLA accumulates in the result's width,
wrapping mod 2^bits; the NumPy rule's matmul (in the accumulator dtype, or
an exact float GEMM narrowed through int64) gives the same residue,
whatever the order.

Float dots (float32 x float32 -> float32, float64 likewise): the NumPy rule
lays the operands out as C-contiguous (batch, m, k) and (batch, k, n)
stacks and calls ``np.matmul``, which hands each product to NumPy's BLAS —
sgemm, sgemv or sdot by shape, or its own loop when k == 1
(``blas_calls.routine``). Here the operands are laid out the same way and
the same routines are called, through their addresses in this process
(``blas_calls``), with the arguments NumPy passes: the same kernel, the
same summation order, the same bits. (A sub-block of a wider ref reaches
BLAS with a larger leading dimension on the NumPy path; BLAS packs its
panels, so the order does not change — the differential tests cover both.)
bfloat16 x bfloat16 -> float32 (held in float32: ``narrow``): the NumPy
rule multiplies them in float64 (every product exact, one rounding to
float32 at the end, as the MXU; ``primitives/dot.py``), so here too: the
operands are laid out in float64, the float64 routine NumPy picks is
called, and each result is rounded to float32. One bfloat16 and one
float32 operand are a float32 product there, and here.
Refused: f16 operands (not held natively), other mixed dtypes, an
accumulation in another dtype, products big enough for the NumPy rule to
wake BLAS's threads (``blas.MULTITHREAD_MACS``), and every float dot where
NumPy's BLAS is not found or fails its self-check.
"""
from __future__ import annotations

import math

import numpy as np

from pallas_np import blas
from pallas_np.native import blas_calls
from pallas_np.native.codegen import Refused, Val, dtype_of, is_narrow, np_name, register
from pallas_np.native.shapes import gather, linear, row_strides


def _geometry(eqn, x, y):
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lf = [d for d in range(len(x.shape)) if d not in lc and d not in lb]
  rf = [d for d in range(len(y.shape)) if d not in rc and d not in rb]
  out_shape = tuple(eqn.outvars[0].aval.shape)
  outer = ([x.shape[d] for d in lb] + [x.shape[d] for d in lf] + [y.shape[d] for d in rf])
  if tuple(outer) != out_shape:
    raise Refused("dot_general output layout")
  return (lc, rc), (lb, rb), lf, rf, out_shape, outer


@register("dot_general")
def _dot_general(gen, eqn, ins):
  x, y = ins
  out_dt = dtype_of(eqn.outvars[0].aval)
  if any(v.kind != "a" for v in (x, y)):
    raise Refused("dot_general of a scalar or ref")
  pref = eqn.params.get("preferred_element_type")
  if pref is not None and np.dtype(pref) != out_dt:
    raise Refused("dot_general accumulating in another dtype")
  if out_dt.kind in "iu" and x.dtype.kind in "iu" and y.dtype.kind in "iu":
    return [_int_dot(gen, eqn, x, y, out_dt)]
  if all(is_narrow(a.aval) for a in eqn.invars):
    if out_dt != np.float32 or is_narrow(eqn.outvars[0].aval):
      raise Refused("a bfloat16 dot_general to another dtype than float32")
    return [_float_dot(gen, eqn, x, y, np.dtype(np.float64), out_dt)]
  if out_dt.kind == "f" and x.dtype == y.dtype == out_dt:
    return [_float_dot(gen, eqn, x, y, out_dt)]
  raise Refused("a bool or mixed-dtype dot_general")


def _int_dot(gen, eqn, x, y, out_dt):
  (lc, rc), (lb, rb), lf, rf, out_shape, outer = _geometry(eqn, x, y)
  out = gen.array(out_shape, out_dt)
  ov = gen.nest(outer)
  bv, mv, nv = ov[:len(lb)], ov[len(lb):len(lb) + len(lf)], ov[len(lb) + len(lf):]
  acc = gen.fresh("acc")
  gen.emit(f"{acc} = np.int64(0)")
  kv = gen.nest([x.shape[d] for d in lc])
  xvar = {**dict(zip(lb, bv)), **dict(zip(lf, mv)), **dict(zip(lc, kv))}
  yvar = {**dict(zip(rb, bv)), **dict(zip(rf, nv)), **dict(zip(rc, kv))}
  xs, ys = row_strides(x.shape), row_strides(y.shape)
  xi = linear((xvar[d], xs[d]) for d in range(len(x.shape)))
  yi = linear((yvar[d], ys[d]) for d in range(len(y.shape)))
  gen.emit(f"{acc} = {acc} + np.int64({x.name}[{xi}]) * np.int64({y.name}[{yi}])")
  gen.close(lc)
  gen.emit(f"{out.name}[{linear(zip(ov, row_strides(out_shape)))}] = {np_name(out_dt)}({acc})")
  gen.close(outer)
  return out


def _stacked(gen, v: Val, perm, dt=None) -> Val:
  """``v`` transposed by ``perm`` (flat, C order) and converted to ``dt``
  (exactly: a wider float): ``v`` itself when neither changes it."""
  dt = v.dtype if dt is None else dt
  if tuple(perm) == tuple(range(len(v.shape))) and dt == v.dtype:
    return v
  shape = [v.shape[d] for d in perm]
  src = row_strides(v.shape)
  return gather(gen, shape, dt, lambda js: f"{np_name(dt)}({v.name}[" + linear(
      (j, src[d]) for j, d in zip(js, perm)) + "])")


def _routine_address(gen, name: str, bits: int) -> str:
  """The local holding ``name``'s address (read once, at the entry, from
  the status array ``blas_calls.status`` fills)."""
  gen.headers.setdefault("cblas", blas_calls.header(blas_calls.header_bits()))
  local = f"_fp_{name}"
  if local not in gen.headers:
    gen.headers[local] = ""
    need = blas_calls.SLOT + len(blas_calls.NAMES)
    slot = blas_calls.SLOT + blas_calls.NAMES.index(name)
    gen.prologue.append(f"    if _st.shape[0] < {need} or _st[{slot}] == 0: "
                        "raise RuntimeError('pallas_np native loop: no BLAS addresses')")
    gen.prologue.append(f"    {local} = _st[{slot}]")
  return local


def _float_dot(gen, eqn, x, y, dt, result=None):
  """The product in ``dt`` (the operands converted to it), its elements
  rounded to ``result`` where given."""
  out = _blas_dot(gen, eqn, x, y, dt)
  if result is None:
    return out
  rounded = gen.array(out.shape, result)
  gen.elementwise(rounded, lambda a: f"{np_name(result)}({a})", [out])
  return rounded


def _blas_dot(gen, eqn, x, y, dt):
  (lc, rc), (lb, rb), lf, rf, out_shape, _ = _geometry(eqn, x, y)
  B = math.prod(x.shape[d] for d in lb)
  M = math.prod(x.shape[d] for d in lf)
  K = math.prod(x.shape[d] for d in lc)
  N = math.prod(y.shape[d] for d in rf)
  if 0 in (B, M, K, N):
    raise Refused("an empty dot_general")
  if B * M * K * N >= blas.MULTITHREAD_MACS:
    raise Refused("a dot_general big enough for every BLAS thread")
  kind = blas_calls.routine(M, K, N)
  p = "s" if dt == np.float32 else "d"
  c = np_name(dt)
  xs = _stacked(gen, x, (*lb, *lf, *lc), dt)
  ys = _stacked(gen, y, (*rb, *rc, *rf), dt)
  out = gen.array(out_shape, dt)
  if kind == "noblas":  # NumPy's own loop: 0 + each product in order
    with gen.block(f"for _b in range({B}):"):
      with gen.block(f"for _m in range({M}):"):
        with gen.block(f"for _n in range({N}):"):
          acc = gen.fresh("acc")
          gen.emit(f"{acc} = {c}(0.0)")
          with gen.block(f"for _k in range({K}):"):
            gen.emit(f"{acc} = {c}({acc} + {c}({xs.name}[_b * {M * K} + _m * {K} + _k]"
                     f" * {ys.name}[_b * {K * N} + _k * {N} + _n]))")
          gen.emit(f"{out.name}[_b * {M * N} + _m * {N} + _n] = {acc}")
    return out
  found = blas_calls.found()
  if found is None:
    raise Refused("a float dot_general where NumPy's BLAS is not found (its summation order)")
  name = p + ("gemm" if kind == "gemm" else "gemv" if kind.startswith("gemv") else "dot")
  fp = _routine_address(gen, name, found[1])
  isz = dt.itemsize
  px, py, po = gen.fresh("px"), gen.fresh("py"), gen.fresh("po")
  gen.emit(f"{px} = np.int64({xs.name}.ctypes.data)")
  gen.emit(f"{py} = np.int64({ys.name}.ctypes.data)")
  gen.emit(f"{po} = np.int64({out.name}.ctypes.data)")
  one, zero = f"{c}(1.0)", f"{c}(0.0)"
  R, C, NT, T = (blas_calls.ROW_MAJOR, blas_calls.COL_MAJOR, blas_calls.NO_TRANS,
                 blas_calls.TRANS)
  with gen.block(f"for _b in range({B}):"):
    a = f"{px} + _b * {M * K * isz}"
    b = f"{py} + _b * {K * N * isz}"
    o = f"{po} + _b * {M * N * isz}"
    if kind == "gemm":
      gen.emit(f"_cblas_{name}({fp}, {R}, {NT}, {NT}, {M}, {N}, {K}, {one}, {a}, {K}, "
               f"{b}, {N}, {zero}, {o}, {N})")
    elif kind == "gemv_row":  # vector @ matrix
      gen.emit(f"_cblas_{name}({fp}, {R}, {T}, {K}, {N}, {one}, {b}, {N}, {a}, 1, {zero}, "
               f"{o}, 1)")
    elif kind == "gemv_col":  # matrix @ vector
      gen.emit(f"_cblas_{name}({fp}, {C}, {T}, {K}, {M}, {one}, {a}, {K}, {b}, 1, {zero}, "
               f"{o}, 1)")
    else:  # row @ column: NumPy sums ?dot's result into a double from 0.0
      r = gen.fresh("r")
      gen.emit(f"{r} = _cblas_{name}({fp}, {K}, {a}, 1, {b}, 1)")
      gen.emit(f"{out.name}[_b] = {c}(np.float64(0.0) + np.float64({r}))")
  return out
