"""Ref reads and writes in a compiled loop: ``get``, ``swap``, ``addupdate``
through one indexer of static ints/slices and dynamic scalar indices or
``pl.ds`` starts (static sizes); a ``get`` also through integer index
arrays (a gather: ``masked.array_access``).

Bounds checks stay: a dynamic index out of range (``bounds_check="raise"``)
stores the check site and the dynamic index values in the status array
``_st`` and raises; ``tier`` then raises the NumPy rule's own error by
resolving the same ``RefAccess`` with those values. ``"clamp"`` clamps as
the NumPy rule does (a negative index gets the axis size added first).
"""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np.native import dots, masked, shapes
from pallas_np.native.codegen import MAX_LEAVES, Refused, Val, dtype_of, np_name, register
from pallas_np.state import indexing
from pallas_np.state.indexing import RefAccess


def _dyn_k(v):
  """The dynamic leaf number of an index part (None if static)."""
  return None if indexing.is_static(v) else v.k


def _access(gen, eqn, ref: Val, idx_atoms, idx_vals):
  """(the element expression builder ``at(js)``, the accessed shape):
  emits the checks of the dynamic indices."""
  if ref.kind != "r":
    raise Refused("indexing a value that is not a ref")
  access = RefAccess(eqn.params["tree"], list(idx_atoms), ref.shape, clamp=gen.clamp,
                     ref_dtype=ref.dtype)
  if len(access.steps) > 1 or (access.steps and access.steps[0][0] != "index"):
    raise Refused("ref transforms")
  dyn = [v for a, v in zip(idx_atoms, idx_vals) if not isinstance(a, jc.Literal)]
  if len(dyn) != access.num_dynamic or len(dyn) > MAX_LEAVES:
    raise Refused("ref indices")
  if access.steps and any(isinstance(d, indexing.DimArray) for d in access.steps[0][1]):
    if eqn.primitive.name != "get":  # (repeated indices: NumPy's fancy-index writes)
      raise Refused("a store through array ref indices")
    return masked.array_access(gen, eqn, ref, list(idx_atoms), list(idx_vals))
  if any(v.kind != "s" for v in dyn):
    raise Refused("array ref indices")
  if not access.steps:
    whole = lambda js: f"{ref.name}[{', '.join(js)}]" if js else f"{ref.name}[()]"
    whole.parts = [("slice", "0", 1)] * len(ref.shape)  # (dots.ref_operand)
    return whole, ref.shape
  dims = access.steps[0][1]
  site = len(gen.sites) + 1
  gen.sites.append((eqn, access, gen.ref_positions[ref.name],
                    tuple(e for e in gen.stack if e is not None)))
  parts, shape = [], []  # parts: ("int", expr) | ("slice", start expr, stride)
  for axis, (d, n) in enumerate(zip(dims, ref.shape)):
    if isinstance(d, indexing.DimSlice):
      if not indexing.is_static(d.size):
        raise Refused("dynamic slice size")
      size, stride = int(d.size), int(d.stride)
      extent = (size - 1) * stride + 1
      if size <= 0 or extent > n:
        raise Refused("slice larger than the axis")
      last = n - extent
      k = _dyn_k(d.start)
      if k is None:
        if not 0 <= int(d.start) <= last:
          raise Refused("static index out of range")
        start = str(int(d.start))
      else:
        start = _checked(gen, dyn, k, last, n, site)
      parts.append(("slice", start, stride))
      shape.append(size)
    else:
      k = _dyn_k(d.value)
      if k is None:
        if not 0 <= int(d.value) < n:
          raise Refused("static index out of range")
        parts.append(("int", str(int(d.value))))
      else:
        parts.append(("int", _checked(gen, dyn, k, n - 1, n, site)))

  def at(js):
    it = iter(js)
    idx = [p[1] if p[0] == "int" else f"{p[1]} + {next(it)} * {p[2]}" for p in parts]
    return f"{ref.name}[{', '.join(idx)}]" if idx else f"{ref.name}[()]"
  at.parts = parts  # (a dot's operand read in place: dots.ref_operand)
  return at, tuple(shape)


def _checked(gen, dyn, k, last, n, site) -> str:
  """A checked (or clamped) dynamic index/start: in range when in [0, last]."""
  i = gen.scalar(f"np.int64({dyn[k].name})", np.dtype(np.int64)).name
  if gen.clamp:  # (adds the axis size to a negative index first, as JAX does)
    gen.emit(f"{i} = min(max({i} + {n} if {i} < 0 else {i}, 0), {last})")
    return i
  with gen.block(f"if {i} < 0 or {i} > {last}:"):
    gen.emit(f"_st[0] = {site}")
    for j, v in enumerate(dyn):
      gen.emit(f"_st[{j + 1}] = np.int64({v.name})")
    gen.emit("raise IndexError('pallas_np native loop: out-of-bounds ref access')")
  return i


def _flat(js, shape) -> str:
  terms, acc = [], 1
  for j, n in reversed(list(zip(js, shape))):
    terms.append(f"{j} * {acc}" if acc != 1 else j)
    acc *= n
  return " + ".join(reversed(terms)) if terms else "0"


def _read(gen, at, shape, dt) -> Val:
  if not shape:
    return gen.scalar(at([]), dt)
  out = gen.array(shape, dt)
  js = gen.nest(shape)
  gen.emit(f"{out.name}[{_flat(js, shape)}] = {at(js)}")
  gen.close(shape)
  return out


def _write(gen, at, shape, ref: Val, val: Val, combine=None) -> None:
  if val.shape != tuple(shape) or val.kind == "r":
    raise Refused("stored value shape")
  gen.written.add(gen.ref_positions[ref.name])
  if gen.store(at, shape, ref.name, val, combine):  # (in an elementwise loop: loop_fusion)
    return
  js = gen.nest(shape)
  src = val.at(_flat(js, shape)) if shape else val.name
  if combine is not None:
    src = combine(at(js), src)
  gen.emit(f"{at(js)} = {src}")
  gen.close(shape)


@register("get")
def _get(gen, eqn, ins):
  at, shape = _access(gen, eqn, ins[0], eqn.invars[1:], ins[1:])
  if shape != tuple(eqn.outvars[0].aval.shape):
    raise Refused("get shape")
  dt = dtype_of(eqn.outvars[0].aval)
  view = dots.ref_operand(gen, eqn, ins[0], at, shape, dt, getattr(at, "parts", None))
  if view is None:  # (read in place by elementwise loops, else copied)
    view = shapes.ref_in_place(gen, eqn, ins[0].name, at, shape, dt)
  return [view if view is not None else _read(gen, at, shape, dt)]


@register("swap")
def _swap(gen, eqn, ins):
  at, shape = _access(gen, eqn, ins[0], eqn.invars[2:], ins[2:])
  old = None
  if not isinstance(eqn.outvars[0], jc.DropVar) and gen.consumers.get(eqn.outvars[0]):
    old = _read(gen, at, shape, ins[0].dtype)
  _write(gen, at, shape, ins[0], ins[1])
  return [old]


@register("addupdate")
def _addupdate(gen, eqn, ins):
  at, shape = _access(gen, eqn, ins[0], eqn.invars[2:], ins[2:])
  dt = ins[0].dtype
  if dt == np.bool_:
    raise Refused("bool addupdate")
  c = np_name(dt)
  _write(gen, at, shape, ins[0], ins[1], lambda a, b: f"{c}({a} + {b})")
  return []
