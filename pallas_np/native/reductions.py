"""``reduce_sum``, ``reduce_max``, ``reduce_min`` in a compiled loop, float
ones included, with the NumPy rules' bits (``primitives/reductions.py``);
integer and bool ones are ``shapes.int_reduction``.

A float sum's bits depend on NumPy's order, and NumPy's order on the
operand's memory layout on the NumPy path: ``np.add.reduce`` starts from
0.0 and adds, along an axis that is innermost in memory, NumPy's pairwise
sum (blocks of at most 128 elements, each summed with 8 interleaved
accumulators, halves split at multiples of 8: ``pairwise``), and across
axes that are outer in memory one slice after another. So a sum is
emitted only where that layout is known statically (``numpy_layout``:
the operand is made, within the loop, by an eqn whose NumPy rule returns a
row-major array — an elementwise op, a dot, a read of a ref, a slice,
a reshape) and the reduced axes (size-1 axes aside) are either trailing
(pairwise over their elements; several trailing axes only when the operand
is contiguous, where NumPy coalesces them) or leading (in order, one
slice after another). Any other operand or pattern is refused. A sum of
one element is that element (the NumPy rule's, after XLA).

A float max/min is the same number in any order: the NumPy rule's
``np.maximum.reduce`` with XLA's signed zeros (-0.0 < +0.0) and NaN
propagation. Which NaN, when several of different sign or payload meet, is
the first one here (the value is NaN either way, as with additions:
docs/native.md).
"""
from __future__ import annotations

import math

import numpy as np

from pallas_np import _compat as jc
from pallas_np.compiler import INLINE_CALLS
from pallas_np.native import elementwise, masked, shapes, transcendental
from pallas_np.native.codegen import Refused, Val, inline_callee, np_name, register

PW_BLOCK = 128  # NumPy's PW_BLOCKSIZE
# Primitives whose NumPy rule returns a fresh C-contiguous array.
_FRESH = frozenset({"dot_general", "concatenate"})
# Primitives whose NumPy rule allocates its result in its (first)
# operand's memory order (a ufunc's reduce, ``np.array(x)``): C where that
# operand is row-major or broadcast.
_KEEP_ORDER = frozenset({"reduce_sum", "reduce_max", "reduce_min", "dynamic_update_slice"})
_VIEWS = frozenset({"slice", "dynamic_slice"})  # basic-indexing views
_RESHAPES = frozenset({"reshape", "squeeze", "expand_dims"})


def numpy_layout(gen, var, val: Val | None = None):
  """The layout of ``var``'s array on the NumPy path, as far as it is
  known here: "C" (C-contiguous), "R" (a row-major view: positive strides,
  decreasing), "B" (a broadcast view: stride 0 along broadcast axes, the
  others decreasing), or None (unknown: a loop carry, an operand from
  outside the loop, a transpose, a cond's result...)."""
  if isinstance(var, jc.Literal) or (val is not None and val.glob):
    return "C"
  memo = gen.layouts
  if var in memo:
    return memo[var]
  memo[var] = None  # (bounds the recursion)
  eqn = gen.producers.get(var)
  layout = None
  if eqn is None and var in gen.aliases:  # an inlined call's parameter
    layout = numpy_layout(gen, gen.aliases[var])
  elif eqn is not None:
    name = eqn.primitive.name
    if name in _FRESH:
      layout = "C"
    elif name == "get":  # a ref block read: a view of a row-major buffer (or a gather)
      layout = "R" if masked.result_is_c(eqn) else None
    elif name == "masked_load":  # a copy, or a where(): C
      layout = "C" if masked.result_is_c(eqn) else None
    elif name in _KEEP_ORDER:
      x = eqn.invars[0]
      if _orderless(x) or _orderless(var) or numpy_layout(gen, x) in ("C", "R", "B"):
        layout = "C"
    elif name == "iota":  # np.broadcast_to of an arange
      layout = "B"
    elif name == "tile":  # np.tile: repeated (C), or a copy in the operand's order
      reps = tuple(int(r) for r in eqn.params["reps"])
      inner = numpy_layout(gen, eqn.invars[0])
      layout = "C" if any(r != 1 for r in reps) or inner in ("C", "R") else None
    elif name in _VIEWS or name in _RESHAPES:
      inner = numpy_layout(gen, eqn.invars[0])
      layout = ("R" if name in _VIEWS else inner) if inner in ("C", "R") else None
    elif name == "broadcast_in_dim":
      x = eqn.invars[0]
      same = math.prod(x.aval.shape) == math.prod(eqn.outvars[0].aval.shape)
      if same:
        layout = numpy_layout(gen, x)
      elif _orderless(x) or numpy_layout(gen, x) in ("C", "R", "B"):
        layout = "B"
    elif (name in elementwise.SCALAR or name in transcendental.FORMULAS
          or name in transcendental.EXPANDED):
      # A ufunc allocates its result in its operands' memory order: C
      # where they are row-major or broadcast (zero strides order nothing,
      # nor does an operand with one axis, whatever its stride's sign).
      kinds = [numpy_layout(gen, a) for a in eqn.invars if not _orderless(a)]
      layout = "C" if all(k in ("C", "R", "B") for k in kinds) else None
    elif name in INLINE_CALLS:  # (its callee's result, emitted inline)
      jaxpr, _ = inline_callee(eqn)
      layout = numpy_layout(gen, jaxpr.outvars[list(eqn.outvars).index(var)])
  memo[var] = layout
  return layout


def _orderless(atom) -> bool:
  """At most one axis longer than 1: no memory order among its axes."""
  return sum(n != 1 for n in atom.aval.shape) <= 1


def _pairwise(c: str, leaf: str, arr: str, base: str, lo: int, n: int) -> str:
  """NumPy's pairwise sum of ``arr[base + lo : base + lo + n]`` as one
  expression: the halves split as ``pairwise_sum`` splits them."""
  if n <= PW_BLOCK:
    return f"{leaf}({arr}, {base} + {lo}, {n})"
  n2 = n // 2
  n2 -= n2 % 8
  return (f"{c}({_pairwise(c, leaf, arr, base, lo, n2)} + "
          f"{_pairwise(c, leaf, arr, base, lo + n2, n - n2)})")


def _leaf_source(dt) -> str:
  """NumPy's ``pairwise_sum`` for n <= 128 (``loops_utils.h.src``): fewer
  than 8 elements added to -0.0 in order; else 8 accumulators over the
  multiple-of-8 part, combined ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), then
  the rest in order."""
  c = np_name(dt)
  r = [f"r{k}" for k in range(8)]
  lines = [f"@_njit", f"def _pw_leaf_{dt.name}(a, off, n):",
           "    if n < 8:", f"        res = {c}(-0.0)", "        for i in range(n):",
           f"            res = {c}(res + a[off + i])", "        return res"]
  lines += [f"    {v} = a[off + {k}]" for k, v in enumerate(r)]
  lines += ["    i = 8", "    m = n - (n % 8)", "    while i < m:"]
  lines += [f"        {v} = {c}({v} + a[off + i + {k}])" for k, v in enumerate(r)]
  lines += ["        i += 8",
            f"    res = {c}({c}({c}(r0 + r1) + {c}(r2 + r3)) + {c}({c}(r4 + r5) + {c}(r6 + r7)))",
            "    while i < n:", f"        res = {c}(res + a[off + i])", "        i += 1",
            "    return res", ""]
  return "\n".join(lines) + "\n"


def _pattern(shape, axes):
  """("trailing" | "leading", kept elements, reduced elements, number of
  reduced axes) of a reduction, size-1 axes dropped; None otherwise."""
  dims = [(n, d in axes) for d, n in enumerate(shape) if n != 1]
  red = [r for _, r in dims]
  kept = math.prod(n for n, r in dims if not r)
  size = math.prod(n for n, r in dims if r)
  nred = sum(red)
  if red == sorted(red):  # kept..., reduced...
    return "trailing", kept, size, nred
  if red == sorted(red, reverse=True):  # reduced..., kept...
    return "leading", kept, size, nred
  return None


def _float_sum(gen, eqn, x: Val):
  axes = tuple(sorted(int(a) for a in eqn.params["axes"]))
  out_shape = tuple(eqn.outvars[0].aval.shape)
  dt = x.dtype
  c = np_name(dt)
  if x.kind == "s" or math.prod(x.shape[a] for a in axes) == 1:
    return shapes.retarget(gen, x, out_shape)  # (one element: itself, its sign kept)
  if x.kind != "a":
    raise Refused("a float sum of a ref")
  pattern = _pattern(x.shape, axes)
  layout = numpy_layout(gen, eqn.invars[0], x)
  if pattern is None or layout not in ("C", "R"):
    raise Refused("a float sum whose NumPy summation order is not known here "
                  f"(operand layout {layout}, axes {axes} of {x.shape})")
  how, kept, size, nred = pattern
  if how == "trailing" and nred > 1 and layout != "C":
    raise Refused("a float sum over several axes of a strided view")
  acc = gen.fresh("acc")
  o = gen.fresh("o")
  out = gen.array(out_shape, dt) if out_shape else None
  with gen.block(f"for {o} in range({kept}):"):
    if how == "trailing":
      leaf = f"_pw_leaf_{dt.name}"
      gen.headers.setdefault("njit", "from numba import njit as _njit\n")
      gen.headers.setdefault(leaf, _leaf_source(dt))
      gen.emit(f"{acc} = {c}({c}(0.0) + {_pairwise(c, leaf, x.name, f'{o} * {size}', 0, size)})")
    else:
      r = gen.fresh("r")
      gen.emit(f"{acc} = {c}(0.0)")
      with gen.block(f"for {r} in range({size}):"):
        gen.emit(f"{acc} = {c}({acc} + {x.name}[{r} * {kept} + {o}])")
    if out is not None:
      gen.emit(f"{out.name}[{o}] = {acc}")
  return out if out is not None else Val(acc, (), dt, "s")


# Float dtype -> (its same-size signed integer, the mask of its magnitude
# bits, the bits of +inf): ``_float_extremum``'s order keys.
_KEYS = {np.dtype(np.float32): ("np.int32", 31, 0x7FFFFFFF, 0x7F800000),
         np.dtype(np.float64): ("np.int64", 63, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000)}


def _float_extremum(gen, eqn, x: Val, is_max: bool):
  """max/min over ``axes``: NaN if any element is NaN (the first one),
  else the extremum with -0.0 < +0.0; ±inf for no elements.

  Computed on order keys: a float's bits as a signed integer, its
  magnitude bits flipped where negative (``b ^ ((b >> 31) & 0x7FFFFFFF)``),
  order as the floats do, -0.0 below +0.0, and equal keys are equal bits:
  the integer max/min of the keys is the float extremum, bit for bit, and
  a loop of integer max/min compiles to vector code (the branchy float
  comparison did not: 30 µs of flash attention's 200 µs outside its GEMMs
  a grid point, PERF_LOG). A NaN shows in the largest magnitude bits
  (above +inf's): for such an output the elements are scanned again in
  order, as before, for the first NaN."""
  axes = tuple(sorted(int(a) for a in eqn.params["axes"]))
  out_shape = tuple(eqn.outvars[0].aval.shape)
  dt = x.dtype
  c = np_name(dt)
  if x.kind == "s":
    return x
  if x.kind != "a":
    raise Refused("a float reduction of a ref")
  it, top, mask, inf_bits = _KEYS[dt]
  kept_axes = [d for d in range(len(x.shape)) if d not in axes]
  in_strides = shapes.row_strides(x.shape)
  out = gen.array(out_shape, dt) if out_shape else None
  bits = gen.fresh("u")
  gen.emit(f"{bits} = {x.name}.view({it})")
  one = gen.array((1,), dt)  # (a key turned back into its float)
  one_bits = gen.fresh("u")
  gen.emit(f"{one_bits} = {one.name}.view({it})")
  ko = gen.nest([x.shape[d] for d in kept_axes])
  acc, v, key, mag, b = (gen.fresh("acc"), gen.fresh("e"), gen.fresh("key"), gen.fresh("mag"),
                         gen.fresh("b"))
  # (the key of -inf / +inf: every other key is above / below it but a NaN's)
  first = ((inf_bits - mask - 1) ^ mask) if is_max else inf_bits

  def key_of(e):
    return f"{it}({e} ^ {it}({it}({e} >> {it}({top})) & {it}({mask})))"
  gen.emit(f"{key} = {it}({first})")
  gen.emit(f"{mag} = {it}(0)")
  kr = gen.nest([x.shape[d] for d in axes])
  idx = shapes.linear([(j, in_strides[d]) for j, d in zip(ko, kept_axes)]
                      + [(j, in_strides[d]) for j, d in zip(kr, axes)])
  gen.emit(f"{b} = {bits}[{idx}]")
  gen.emit(f"{v} = {key_of(b)}")
  with gen.block(f"if {v} {'>' if is_max else '<'} {key}:"):
    gen.emit(f"{key} = {v}")
  gen.emit(f"{v} = {it}({b} & {it}({mask}))")
  with gen.block(f"if {v} > {mag}:"):
    gen.emit(f"{mag} = {v}")
  gen.close(axes)
  with gen.block(f"if {mag} > {it}({inf_bits}):"):  # a NaN: the first one, in order
    gen.emit(f"{acc} = {c}({'-' if is_max else ''}np.inf)")
    kr = gen.nest([x.shape[d] for d in axes])
    idx = shapes.linear([(j, in_strides[d]) for j, d in zip(ko, kept_axes)]
                        + [(j, in_strides[d]) for j, d in zip(kr, axes)])
    e = gen.fresh("e")
    gen.emit(f"{e} = {x.name}[{idx}]")
    with gen.block(f"if {acc} == {acc} and {e} != {e}:"):
      gen.emit(f"{acc} = {e}")
    gen.close(axes)
  with gen.block("else:"):  # (an infinity's key, or a finite float's, back to its bits)
    gen.emit(f"{one_bits}[0] = {key_of(key)}")
    gen.emit(f"{acc} = {one.name}[0]")
  if out is not None:
    gen.emit(f"{out.name}[{shapes.linear(zip(ko, shapes.row_strides(out_shape)))}] = {acc}")
  gen.close(kept_axes)
  return out if out is not None else Val(acc, (), dt, "s")


def _reduction(kind):
  int_emit = shapes.int_reduction(kind)

  def emit(gen, eqn, ins):
    x = ins[0]
    if x.dtype.kind != "f":
      return int_emit(gen, eqn, ins)
    if x.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
      raise Refused(f"a {x.dtype} reduction")
    if kind == "sum":
      return [_float_sum(gen, eqn, x)]
    return [_float_extremum(gen, eqn, x, kind == "max")]
  return emit


for _k in ("sum", "max", "min"):
  register(f"reduce_{_k}")(_reduction(_k))
