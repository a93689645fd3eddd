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

A ref block read only by a dot (``ref_operand``, called by ``refs``'s
``get``) is not copied: the dot reads the ref itself. The NumPy rule's
``get`` is a view of the ref, which ``primitives/dot.blas_operand`` hands
to BLAS with its row stride where its rows are unit-stride (else a C copy):
so here, the same pointer and leading dimension (the same call), or the
same copy; a block the dot needs transposed is gathered from the ref
straight into the C-order buffer the NumPy rule's copy makes (one pass
instead of two). Only where no eqn between the ``get`` and the dot can
write a ref (the value is read at the dot, not at the ``get``).
"""
from __future__ import annotations

import math

import numpy as np

from pallas_np import _compat as jc
from pallas_np import blas
from pallas_np.native import blas_calls
from pallas_np.native.codegen import Refused, Val, dtype_of, is_narrow, np_name, register
from pallas_np.native.shapes import gather, linear, row_strides
from pallas_np.primitives.dot import exact_int_gemm


def _geometry(eqn, x, y):
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lf = [d for d in range(len(x.shape)) if d not in lc and d not in lb]
  rf = [d for d in range(len(y.shape)) if d not in rc and d not in rb]
  out_shape = tuple(eqn.outvars[0].aval.shape)
  outer = ([x.shape[d] for d in lb] + [x.shape[d] for d in lf] + [y.shape[d] for d in rf])
  if tuple(outer) != out_shape:
    raise Refused("dot_general output layout")
  return (lc, rc), (lb, rb), lf, rf, out_shape, outer


class RefView(Val):
  """A ref block (``get``) that only a dot reads, not copied (kind "v"):
  ``at_(js)`` is its element at loop variables ``js``; ``parts`` the
  indexer's ("int", expr) / ("slice", start expr, stride) per ref axis
  (None once transposed: never read in place, as the NumPy rule copies a
  transposed view); ``order`` (None: the block's own) the block axis each
  axis of a transposed view is."""
  __slots__ = ("ref", "at_", "parts", "order", "block_parts")

  def transposed(self, gen, perm) -> "RefView":
    """``transpose`` of this block (``shapes``'s emitter): still a view."""
    v = RefView(gen.fresh("view"), [self.shape[d] for d in perm], self.dtype, "v")
    where = {d: i for i, d in enumerate(perm)}
    v.ref, v.parts = self.ref, None
    v.block_parts = self.parts if self.order is None else self.block_parts
    v.at_ = lambda js, at=self.at_: at([js[where[d]] for d in range(len(perm))])
    order = self.order or tuple(range(len(perm)))
    v.order = tuple(order[d] for d in perm)
    return v


def _sole_reader(gen, var):
  readers = gen.consumers.get(var, [])
  return readers[0][0] if len(readers) == 1 else None


def ref_operand(gen, eqn, ref: Val, at, shape, dt, parts):
  """A ``RefView`` for ``get`` eqn ``eqn`` (ref block ``at``/``parts`` of
  ``shape``) when its value's one reader is a float ``dot_general`` of the
  same jaxpr, directly or through one ``transpose``, and no eqn between the
  ``get`` and the dot can write a ref; else None."""
  out = eqn.outvars[0]
  if parts is None or len(shape) != 2 or dt.kind != "f":
    return None
  reader = _sole_reader(gen, out)
  if reader is not None and reader.primitive.name == "transpose":
    reader = _sole_reader(gen, reader.outvars[0])
  if reader is None or reader.primitive.name != "dot_general":
    return None
  if any(str(a.aval.dtype) != str(out.aval.dtype) for a in reader.invars):
    return None
  for jaxpr in gen.scanned.values():
    eqns = jaxpr.eqns
    k = next((i for i, e in enumerate(eqns) if e is eqn), None)
    if k is None:
      continue
    end = next((i for i, e in enumerate(eqns) if e is reader), None)
    if end is None or end < k:
      return None
    for e in eqns[k + 1:end]:
      if any(True for _ in jc.eqn_subjaxprs(e)) or (
          e.primitive.name != "get"
          and any(isinstance(getattr(a, "aval", None), jc.AbstractRef) for a in e.invars)):
        return None
    v = RefView(gen.fresh("view"), shape, dt, "v")
    v.ref, v.at_, v.parts, v.order = ref, at, tuple(parts), None
    v.block_parts = v.parts
    return v
  return None


def _copied(gen, v: Val) -> Val:
  """``v`` as a flat array (a ``RefView`` gathered from its ref)."""
  if isinstance(v, RefView):
    if v.order is not None:
      return _gathered(gen, v, range(len(v.shape)), v.dtype)
    return gather(gen, v.shape, v.dtype, v.at_)
  return v


_TILE = 8  # (the transposed gather's tile: 8 float32 rows of 32 bytes)


def _gathered(gen, v: "RefView", perm, dt) -> Val:
  """The C-order copy of ``v`` transposed by ``perm``, in ``dt``: a 2-D
  transpose in 8 x 8 tiles (each read row by row; the strided writes stay
  within 8 cache lines: flash attention's 128 x 128 K block ~2.5x faster),
  else its loops in the ref block's own axis order (a K block read down
  its columns for ``q @ k.T`` cost GQA decode ~0.2 ms a call, PERF_LOG).
  The same elements, so the same bits, whatever the order."""
  order = v.order or tuple(range(len(v.shape)))
  base = [0] * len(order)
  for i, b in enumerate(order):
    base[b] = v.shape[i]
  shape = [v.shape[d] for d in perm]
  out = gen.array(shape, dt)
  tiled = (len(base) == 2 and [order[d] for d in perm] != [0, 1]  # (a transpose)
           and all(n % _TILE == 0 for n in base))
  if tiled:  # (a transpose in 8 x 8 tiles: rows and columns both within a few cache lines)
    outer = gen.nest([n // _TILE for n in base])
    inner = gen.nest([_TILE, _TILE])
    js = [f"({o} * {_TILE} + {i})" for o, i in zip(outer, inner)]
  else:
    js = gen.nest(base)  # (one loop per block axis, outermost first)
  dst = row_strides(shape)
  gen.emit(f"{out.name}[{linear((js[order[d]], dst[k]) for k, d in enumerate(perm))}] = "
           f"{np_name(dt)}({v.at_([js[b] for b in order])})")
  if tiled:
    gen.close(base)
  gen.close(base)
  return out


@register("dot_general")
def _dot_general(gen, eqn, ins):
  x, y = ins
  out_dt = dtype_of(eqn.outvars[0].aval)
  if any(v.kind not in "av" for v in (x, y)):
    raise Refused("dot_general of a scalar or ref")
  pref = eqn.params.get("preferred_element_type")
  if pref is not None and np.dtype(pref) != out_dt:
    raise Refused("dot_general accumulating in another dtype")
  if out_dt.kind in "iu" and x.dtype.kind in "iu" and y.dtype.kind in "iu":
    return [_exact_int_gemm(gen, eqn, x, y, out_dt)
            or _int_dot(gen, eqn, _copied(gen, x), _copied(gen, y), out_dt)]
  if all(is_narrow(a.aval) for a in eqn.invars):
    if out_dt != np.float32 or is_narrow(eqn.outvars[0].aval):
      raise Refused("a bfloat16 dot_general to another dtype than float32")
    return [_float_dot(gen, eqn, x, y, np.dtype(np.float64), out_dt)]
  if out_dt.kind == "f" and x.dtype == y.dtype == out_dt:
    return [_float_dot(gen, eqn, x, y, out_dt)]
  raise Refused("a bool or mixed-dtype dot_general")


def _exact_int_gemm(gen, eqn, x, y, out_dt):
  """An integer dot whose float GEMM is exact (``dot.exact_int_gemm``:
  every product and partial sum an integer the float holds), through the
  float routine the NumPy rule calls: the operands converted to the float,
  the exact sums narrowed through int64 (wrapping as XLA's accumulator).
  The same bits as ``_int_dot`` in any summation order, at BLAS's speed
  (the scalar int64 loop was ~10x slower than the NumPy rule's GEMM: an
  int8 kernel body lost to its plan). None where no such float exists or
  BLAS cannot take it (the loop, then)."""
  K = math.prod(x.shape[d] for d in eqn.params["dimension_numbers"][0][0])
  exact = exact_int_gemm(x.dtype, y.dtype, out_dt, K)
  if exact is None:
    return None
  if _blas_refusal(eqn, x, y) is not None:
    return None
  sums = _blas_dot(gen, eqn, x, y, exact[0])
  out = gen.array(sums.shape, out_dt)
  gen.elementwise(out, lambda a: f"{np_name(out_dt)}(np.int64({a}))", [sums])
  return out


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
    return _copied(gen, v)
  shape = [v.shape[d] for d in perm]
  if isinstance(v, RefView):  # (one pass: the ref straight into the C-order copy)
    return _gathered(gen, v, perm, dt)
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


def _sizes(eqn, x, y):
  """(B, M, K, N) of the dot as the NumPy rule's stacked matmul."""
  (lc, rc), (lb, rb), lf, rf, out_shape, _ = _geometry(eqn, x, y)
  return (math.prod(x.shape[d] for d in lb), math.prod(x.shape[d] for d in lf),
          math.prod(x.shape[d] for d in lc), math.prod(y.shape[d] for d in rf))


def _blas_refusal(eqn, x, y) -> str | None:
  """Why ``_blas_dot`` refuses this dot, or None."""
  B, M, K, N = _sizes(eqn, x, y)
  if 0 in (B, M, K, N):
    return "an empty dot_general"
  if B * M * K * N >= blas.MULTITHREAD_MACS:
    return "a dot_general big enough for every BLAS thread"
  if blas_calls.routine(M, K, N) != "noblas" and blas_calls.found() is None:
    return "a float dot_general where NumPy's BLAS is not found (its summation order)"
  return None


def _blas_dot(gen, eqn, x, y, dt):
  why = _blas_refusal(eqn, x, y)
  if why is not None:
    raise Refused(why)
  (lc, rc), (lb, rb), lf, rf, out_shape, _ = _geometry(eqn, x, y)
  B, M, K, N = _sizes(eqn, x, y)
  kind = blas_calls.routine(M, K, N)
  p = "s" if dt == np.float32 else "d"
  c = np_name(dt)
  xperm, yperm = (*lb, *lf, *lc), (*rb, *rc, *rf)
  direct = kind == "gemm" and B == 1 and blas_calls.found() is not None
  ok = _transposed_word(len(gen.transposed))  # (this site's word, if it takes one)
  xd = (_direct(gen, x, xperm, dt, M, K) or _in_place(gen, x, xperm, dt, M, K, ok)
        or _value_transposed(gen, x, xperm, dt, M, K, ok)) if direct else None
  yd = (_direct(gen, y, yperm, dt, K, N) or _in_place(gen, y, yperm, dt, K, N, ok)
        or _value_transposed(gen, y, yperm, dt, K, N, ok)) if direct else None
  ta_may, tb_may = (d is not None and d[2] != blas_calls.NO_TRANS for d in (xd, yd))
  if ta_may or tb_may:  # (the loop's status array gets the shape's answer: blas_calls.status)
    key = blas_calls.transposed_key(dt, M, K, N, ta_may, tb_may)
    gen.transposed.append(key)
    blas_calls.transposed_ok(key)  # (checked now, where the loop is built, not at its first call)
  xs = None if xd else _stacked(gen, x, xperm, dt)
  ys = None if yd else _stacked(gen, y, yperm, dt)
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
  name = p + ("gemm" if kind == "gemm" else "gemv" if kind.startswith("gemv") else "dot")
  fp = _routine_address(gen, name, found[1])
  isz = dt.itemsize
  po = gen.fresh("po")
  R, C, NT, T = (blas_calls.ROW_MAJOR, blas_calls.COL_MAJOR, blas_calls.NO_TRANS,
                 blas_calls.TRANS)
  px, lda, ta = xd or (gen.scalar(f"np.int64({xs.name}.ctypes.data)", np.dtype(np.int64)).name,
                       K, NT)
  py, ldb, tb = yd or (gen.scalar(f"np.int64({ys.name}.ctypes.data)", np.dtype(np.int64)).name,
                       N, NT)
  gen.emit(f"{po} = np.int64({out.name}.ctypes.data)")
  one, zero = f"{c}(1.0)", f"{c}(0.0)"
  with gen.block(f"for _b in range({B}):"):
    a = f"{px} + _b * {M * K * isz}"
    b = f"{py} + _b * {K * N * isz}"
    o = f"{po} + _b * {M * N * isz}"
    if kind == "gemm":
      gen.emit(f"_cblas_{name}({fp}, {R}, {ta}, {tb}, {M}, {N}, {K}, {one}, {a}, {lda}, "
               f"{b}, {ldb}, {zero}, {o}, {N})")
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


def _direct(gen, v: Val, perm, dt, rows: int, cols: int):
  """(pointer local, leading-dimension local) of a ``RefView`` that BLAS
  reads in place as a (rows, cols) operand, or None. As ``blas_operand``
  on the NumPy path's view: its own rows (unit-stride elements, a row
  stride that is a whole number of elements, at least ``cols``), else a C
  copy (here, at run time, into a buffer of this dot)."""
  if (not isinstance(v, RefView) or v.parts is None or tuple(perm) != (0, 1)
      or dt != v.dtype or (v.shape[0], v.shape[1]) != (rows, cols)):
    return None
  axes = [(ax, p) for ax, p in enumerate(v.parts) if p[0] == "slice"]
  if len(axes) != 2:
    return None
  (ra, rp), (ca, cp) = axes
  r, isz = v.ref.name, dt.itemsize
  offset = " + ".join(f"np.int64({p[1]}) * {r}.strides[{ax}]" for ax, p in enumerate(v.parts))
  ptr = gen.scalar(f"np.int64({r}.ctypes.data) + {offset or '0'}", np.dtype(np.int64)).name
  rs = gen.scalar(f"np.int64({r}.strides[{ra}]) * {rp[2]}", np.dtype(np.int64)).name
  cs = gen.scalar(f"np.int64({r}.strides[{ca}]) * {cp[2]}", np.dtype(np.int64)).name
  ld = gen.fresh("ld")
  with gen.block(f"if {cs} == {isz} and {rs} % {isz} == 0 and {rs} >= {cols * isz}:"):
    gen.emit(f"{ld} = {rs} // {isz}")
  with gen.block("else:"):  # (NumPy's ascontiguousarray of the view)
    c = gather(gen, v.shape, dt, v.at_)
    gen.emit(f"{ptr} = np.int64({c.name}.ctypes.data)")
    gen.emit(f"{ld} = np.int64({cols})")
  return ptr, ld, blas_calls.NO_TRANS


def _transposed_word(j: int) -> str:
  """The test of the status array's word of the loop's ``j``-th dot site
  reading an operand ``TRANS``: 1 where ?gemm so called gives the copy's
  bits for that site's shape in this process (``blas_calls.transposed_ok``
  of its key, ``gen.transposed[j]``, filled in by ``blas_calls.status``
  from the keys recorded with the loop); absent: the copy."""
  slot = blas_calls.TRANSPOSED + j
  return f"_st.shape[0] > {slot} and _st[{slot}] == 1"


def _value_transposed(gen, v: Val, perm, dt, rows: int, cols: int, ok: str):
  """As ``_in_place`` for an eqn's 2-D value (C order, its rows ``rows``
  long) that the dot needs transposed (paged attention's ``k.T`` of its
  rounded K block): ?gemm reads it ``TRANS`` where the status array says
  so, else the NumPy rule's C-order copy is made."""
  if (v.kind != "a" or isinstance(v, RefView) or len(v.shape) != 2 or tuple(perm) != (1, 0)
      or dt != v.dtype or (v.shape[1], v.shape[0]) != (rows, cols)):
    return None
  ptr, ld, trans = gen.fresh("pt"), gen.fresh("ld"), gen.fresh("tr")
  with gen.block(f"if {ok}:"):
    gen.emit(f"{ptr} = np.int64({v.name}.ctypes.data)")
    gen.emit(f"{ld} = np.int64({rows})")
    gen.emit(f"{trans} = {blas_calls.TRANS}")
  with gen.block("else:"):  # (the NumPy rule's C-order copy)
    _from_copy(gen, _stacked(gen, v, perm, dt), ptr, ld, trans, cols)
  return ptr, ld, trans


def _in_place(gen, v: Val, perm, dt, rows: int, cols: int, ok: str):
  """(pointer local, leading-dimension local, transpose local) of a
  ``RefView`` that the dot needs transposed (``q @ k.T``'s K block), or
  None. The NumPy rule copies it transposed into C order and calls ?gemm
  with ``NO_TRANS``; here, where the block's own rows are unit-stride and
  the status array says so (``ok``, the site's word: ?gemm reading an
  operand ``TRANS`` in place gives the copy's bits for this shape in this
  process, ``_transposed_word``), ?gemm
  reads the ref block in place with ``TRANS``: no gather (flash
  attention's 128 x 128 K block: ~20 us of its step). Else the copy, as
  before (``_gathered``)."""
  if (not isinstance(v, RefView) or v.block_parts is None or len(v.shape) != 2
      or dt != v.dtype):
    return None
  order = v.order or (0, 1)
  if [order[d] for d in perm] != [1, 0]:
    return None
  axes = [(ax, p) for ax, p in enumerate(v.block_parts) if p[0] == "slice"]
  if len(axes) != 2:
    return None
  (ra, rp), (ca, cp) = axes  # the block's own rows (the operand's columns) and columns
  r, isz = v.ref.name, dt.itemsize
  offset = " + ".join(f"np.int64({p[1]}) * {r}.strides[{ax}]"
                      for ax, p in enumerate(v.block_parts))
  ptr = gen.scalar(f"np.int64({r}.ctypes.data) + {offset or '0'}", np.dtype(np.int64)).name
  rs = gen.scalar(f"np.int64({r}.strides[{ra}]) * {rp[2]}", np.dtype(np.int64)).name
  cs = gen.scalar(f"np.int64({r}.strides[{ca}]) * {cp[2]}", np.dtype(np.int64)).name
  ld, trans = gen.fresh("ld"), gen.fresh("tr")
  with gen.block(f"if {ok} and {cs} == {isz} and "
                 f"{rs} % {isz} == 0 and {rs} >= {rows * isz}:"):
    gen.emit(f"{ld} = {rs} // {isz}")
    gen.emit(f"{trans} = {blas_calls.TRANS}")
  with gen.block("else:"):  # (the NumPy rule's C-order copy)
    _from_copy(gen, _gathered(gen, v, perm, dt), ptr, ld, trans, cols)
  return ptr, ld, trans


def _from_copy(gen, c: Val, ptr: str, ld: str, trans: str, cols: int) -> None:
  """The generated lines that point ?gemm at ``c``, a C-order copy of the
  transposed operand (``cols`` wide), read ``NO_TRANS``: the fallback of
  ``_value_transposed`` and ``_in_place`` where reading in place is not
  known to give the copy's bits."""
  gen.emit(f"{ptr} = np.int64({c.name}.ctypes.data)")
  gen.emit(f"{ld} = np.int64({cols})")
  gen.emit(f"{trans} = {blas_calls.NO_TRANS}")
