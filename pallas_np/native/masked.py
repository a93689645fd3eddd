"""Masked (Triton-style) loads and stores in a compiled loop: the
``masked_load``/``masked_swap`` primitives (``pl.load``/``pl.store`` with
``mask=``, ``other=``), with the NumPy rules' values and errors
(``state/masked.py``).

One indexer of slices (static size), ints and integer arrays (NumPy's
advanced indexing: an array index, alone or with ints, gathers and
scatters element by element). Each lane (element of the access) has its
coordinates; a lane pointing outside the ref reads the ``uninitialized``
fill and is never written, and is an error only when it is masked on
(``IndexError``: the NumPy rule's own message, ``masked_lane_error``, for
the first such lane in C order; under ``bounds_check="clamp"`` it is
not). Masked-off lanes load ``other`` where it is given, the ref's
contents (or the fill) where not. A store first checks every lane (the
NumPy rule raises before it writes), then writes the masked-on lanes in
C order; an array-indexed store with every lane in bounds writes every
lane, the masked-off ones with the value read before (as the NumPy rule's
``view[idx] = where(mask, val, old)``: with repeated indices the last lane
wins). Without a mask, accesses of slices and ints only: a lane out of
bounds raises the plain access error (``RefAccess.resolve``).
"""
from __future__ import annotations

import math

import numpy as np

from pallas_np import _compat as jc
from pallas_np.native.codegen import MAX_LEAVES, Refused, Val, dtype_of, np_name, register
from pallas_np.native.shapes import linear, row_strides
from pallas_np.state import indexing
from pallas_np.state.indexing import RefAccess
from pallas_np.state.masked import masked_lane_error


class _Pos:
  """An invar position in the unflattened ``args_tree``."""
  __slots__ = ("i",)

  def __init__(self, i):
    self.i = i


def _split(eqn):
  parts = jc.tree_unflatten(eqn.params["args_tree"], [_Pos(i) for i in range(len(eqn.invars))])
  return [p.i if isinstance(p, _Pos) else p for p in parts]


class MaskedLaneSite:
  """A bounds-check site (``tier``'s ``sites``) of a masked access: the
  status array holds the failing lane and its coordinates, and
  ``resolve`` raises the NumPy rule's error for them."""

  def __init__(self, ndim_out: int):
    self.ndim_out = ndim_out
    self.num_dynamic = 0  # set once the ref's rank is known

  def resolve(self, ref, values):
    lane, where = values[:self.ndim_out], values[self.ndim_out:]
    raise masked_lane_error(lane, where, ref.shape)


def _broadcast_at(v: Val, shape, js) -> str:
  """Element ``js`` (of ``shape``) of ``v`` broadcast NumPy-style."""
  if v.kind == "s":
    return v.name
  off = len(shape) - len(v.shape)
  if off < 0 or any(n not in (1, shape[off + d]) for d, n in enumerate(v.shape)):
    raise Refused("masked access operand shapes")
  st = row_strides(v.shape)
  return f"{v.name}[{linear((js[off + d], st[d] if n != 1 else 0) for d, n in enumerate(v.shape))}]"


def _int_layout(dims, int_shape):
  """(first result axis of the integer block, result axis of each slice
  dim): NumPy's placement of advanced indices (``indexing``'s rule)."""
  is_int = [not isinstance(d, indexing.DimSlice) for d in dims]
  int_dims = [i for i, x in enumerate(is_int) if x]
  contiguous = all(b - a == 1 for a, b in zip(int_dims, int_dims[1:]))
  int_at = sum(1 for i in range(int_dims[0]) if not is_int[i]) if int_dims and contiguous else 0
  axes, seen = [], 0
  for i, d in enumerate(dims):
    if is_int[i]:
      axes.append(None)
      continue
    axes.append(seen + (len(int_shape) if int_dims and (not contiguous or i > int_dims[0]) else 0))
    seen += 1
  return int_at, axes


class _Lanes:
  """The per-lane coordinates of one access (see the module doc)."""

  def __init__(self, gen, eqn, ref: Val, tree, atoms, vals, clamp=False):
    if ref.kind != "r":
      raise Refused("a masked access of a value that is not a ref")
    self.access = RefAccess(tree, list(atoms), ref.shape, clamp=clamp, ref_dtype=ref.dtype)
    self.checked: dict = {}  # ref axis -> its checked start/index, or "clamp" (array_access)
    steps = self.access.steps
    if len(steps) != 1 or steps[0][0] != "index":
      raise Refused("ref transforms")
    dyn = [v for a, v in zip(atoms, vals) if not isinstance(a, jc.Literal)]
    if len(dyn) != self.access.num_dynamic:
      raise Refused("ref indices")
    self.dims, self.dyn, self.ref = steps[0][1], dyn, ref
    self.shape = tuple(int(n) for n in self.access.result_shape)
    arrays = []
    for d in self.dims:
      if isinstance(d, indexing.DimSlice):
        if not indexing.is_static(d.size):
          raise Refused("dynamic slice size")
      elif isinstance(d, indexing.DimArray):
        if indexing.is_static(d.value) or dyn[d.value.k].kind != "a":
          raise Refused("a static or scalar array index")
        arrays.append(dyn[d.value.k].shape)
      elif not indexing.is_static(d.value) and dyn[d.value.k].kind != "s":
        raise Refused("array ref index")
    self.has_arrays = bool(arrays)
    self.int_shape = tuple(np.broadcast_shapes(*arrays)) if arrays else ()
    self.int_at, self.axes = _int_layout(self.dims, self.int_shape)

  def coords(self, gen, js) -> list[str]:
    """The coordinate of lane ``js`` along each ref axis (int64 locals)."""
    out = []
    for ref_axis, (d, axis) in enumerate(zip(self.dims, self.axes)):
      fixed = self.checked.get(ref_axis)
      if isinstance(d, indexing.DimSlice):
        start = (fixed if fixed is not None else str(int(d.start)) if indexing.is_static(d.start)
                 else f"np.int64({self.dyn[d.start.k].name})")
        expr = f"{start} + {int(d.stride)} * {js[axis]}"
      elif isinstance(d, indexing.DimArray):
        block = js[self.int_at:self.int_at + len(self.int_shape)]
        expr = f"np.int64({_broadcast_at(self.dyn[d.value.k], self.int_shape, block)})"
        if fixed == "clamp":  # (bounds.check_array: the axis size added to a negative index)
          e = gen.scalar(expr, np.dtype(np.int64)).name
          n = self.ref.shape[ref_axis]
          expr = f"min(max({e} + {n} if {e} < 0 else {e}, 0), {n - 1})"
      else:
        expr = (fixed if fixed is not None else str(int(d.value)) if indexing.is_static(d.value)
                else f"np.int64({self.dyn[d.value.k].name})")
      out.append(gen.scalar(expr, np.dtype(np.int64)).name)
    return out

  def in_bounds(self, cs) -> str:
    return " and ".join(f"0 <= {c} < {n}" for c, n in zip(cs, self.ref.shape)) or "True"

  def fail(self, gen, eqn, js, cs, masked: bool) -> None:
    """Record the failing lane for the error ``tier`` raises, and raise."""
    if masked:
      site = MaskedLaneSite(len(self.shape))
      site.num_dynamic = len(self.shape) + len(cs)
      values = list(js) + list(cs)
    else:
      site, values = self.access, [v.name for v in self.dyn]
      if any(v.kind != "s" for v in self.dyn):
        raise Refused("an unmasked access with array indices")
    if len(values) > MAX_LEAVES:
      raise Refused("a masked access of too many dimensions")
    gen.sites.append((eqn, site, gen.ref_positions[self.ref.name],
                      tuple(e for e in gen.stack if e is not None)))
    gen.emit(f"_st[0] = {len(gen.sites)}")
    for k, v in enumerate(values):
      gen.emit(f"_st[{k + 1}] = np.int64({v})")
    gen.emit("raise IndexError('pallas_np native loop: out-of-bounds masked access')")


def _fill(gen, dt):
  """What a lane outside the ref reads (``memory.fill_value`` under the
  kernel's ``InterpretParams.uninitialized``)."""
  value = np.zeros((), dt) if gen.uninitialized == "zero" else jc.uninitialized_value_np(dt)
  return gen.constant(value, dt).name


def _flat(js, shape) -> str:
  return linear(zip(js, row_strides(shape)))


def _ref_lanes(gen, eqn, ins, ref_pos, transforms):
  """(the ref, its ``_Lanes``) of a masked access whose indexers are
  ``transforms`` (the eqn's operands marked by ``_Pos``)."""
  atoms, tree = jc.jax.tree_util.tree_flatten(transforms, is_leaf=lambda x: isinstance(x, _Pos))
  pos = [p.i for p in atoms]
  ref = ins[ref_pos]
  return ref, _Lanes(gen, eqn, ref, tree, [eqn.invars[p] for p in pos], [ins[p] for p in pos])


@register("masked_load")
def _masked_load(gen, eqn, ins):
  ref_pos, transforms, mask_pos, other_pos = _split(eqn)
  ref, lanes = _ref_lanes(gen, eqn, ins, ref_pos, transforms)
  dt = dtype_of(eqn.outvars[0].aval)
  if dt != ref.dtype or tuple(eqn.outvars[0].aval.shape) != lanes.shape:
    raise Refused("masked load dtype or shape")
  mask = None if mask_pos is None else ins[mask_pos]
  other = None if other_pos is None else ins[other_pos]
  if mask is None and lanes.has_arrays:
    raise Refused("an unmasked access with array indices")
  fill = _fill(gen, dt)
  shape = lanes.shape
  out = gen.array(shape, dt) if shape else None
  js = gen.nest(shape)
  cs = lanes.coords(gen, js)
  on = None if mask is None else _broadcast_at(mask, shape, js)
  v = gen.fresh("e")
  with gen.block(f"if {lanes.in_bounds(cs)}:"):
    gen.emit(f"{v} = {lane_ref(ref, cs)}")
  with gen.block("else:"):
    _check(gen, eqn, lanes, js, cs, on)
    gen.emit(f"{v} = {fill}")
  if other is not None and on is not None:
    gen.emit(f"{v} = {v} if {on} else {np_name(dt)}({_broadcast_at(other, shape, js)})")
  if out is not None:
    gen.emit(f"{out.name}[{_flat(js, shape)}] = {v}")
  gen.close(shape)
  return [out if out is not None else Val(v, (), dt, "s")]


def _check(gen, eqn, lanes, js, cs, on) -> None:
  """A lane outside the ref: without a mask always an error (the NumPy
  rule's access is never clamped), with one when masked on, unless
  ``bounds_check="clamp"``."""
  if on is None:
    lanes.fail(gen, eqn, js, cs, masked=False)
  elif not gen.clamp:
    with gen.block(f"if {on}:"):
      lanes.fail(gen, eqn, js, cs, masked=True)


def lane_ref(ref: Val, cs) -> str:
  return f"{ref.name}[{', '.join(cs)}]" if cs else f"{ref.name}[()]"


@register("masked_swap")
def _masked_swap(gen, eqn, ins):
  ref_pos, transforms, val_pos, mask_pos = _split(eqn)
  ref, lanes = _ref_lanes(gen, eqn, ins, ref_pos, transforms)
  shape = lanes.shape
  val, mask = ins[val_pos], (None if mask_pos is None else ins[mask_pos])
  if mask is None and lanes.has_arrays:
    raise Refused("an unmasked access with array indices")
  if val.kind == "r" or val.dtype != ref.dtype:
    raise Refused("masked store value")
  dt = ref.dtype
  c = np_name(dt)
  gen.written.add(gen.ref_positions[ref.name])
  want_old = not isinstance(eqn.outvars[0], jc.DropVar) and bool(gen.consumers.get(eqn.outvars[0]))
  fill = _fill(gen, dt)
  any_out = gen.fresh("oob")
  gen.emit(f"{any_out} = False")
  # 1. every lane checked (and the old values read) before anything is written
  old = gen.array(shape, dt) if (want_old or lanes.has_arrays) and shape else None
  js = gen.nest(shape)
  cs = lanes.coords(gen, js)
  on = None if mask is None else _broadcast_at(mask, shape, js)
  with gen.block(f"if not ({lanes.in_bounds(cs)}):"):
    gen.emit(f"{any_out} = True")
    _check(gen, eqn, lanes, js, cs, on)
  if old is not None:
    with gen.block(f"if {lanes.in_bounds(cs)}:"):
      gen.emit(f"{old.name}[{_flat(js, shape)}] = {lane_ref(ref, cs)}")
    with gen.block("else:"):
      gen.emit(f"{old.name}[{_flat(js, shape)}] = {fill}")
  gen.close(shape)
  # 2. the writes
  js = gen.nest(shape)
  cs = lanes.coords(gen, js)
  on = None if mask is None else _broadcast_at(mask, shape, js)
  src = f"{c}({_broadcast_at(val, shape, js)})"
  write_all = f"(not {any_out})" if lanes.has_arrays else "False"
  with gen.block(f"if {lanes.in_bounds(cs)}:"):
    if on is None:
      gen.emit(f"{lane_ref(ref, cs)} = {src}")
    else:
      with gen.block(f"if {on}:"):
        gen.emit(f"{lane_ref(ref, cs)} = {src}")
      if old is not None:
        with gen.block(f"elif {write_all}:"):  # (NumPy's where(mask, val, old) into a copy)
          gen.emit(f"{lane_ref(ref, cs)} = {old.name}[{_flat(js, shape)}]")
  gen.close(shape)
  if not want_old:
    return [None]
  if old is None:  # a 0-d access
    raise Refused("a 0-d masked swap whose old value is read")
  res = gen.array(shape, dt)
  js = gen.nest(shape)
  i = _flat(js, shape)
  src = f"{c}({_broadcast_at(val, shape, js)})"
  sel = f"{old.name}[{i}]" if on is None else f"({old.name}[{i}] if {_broadcast_at(mask, shape, js)} else {src})"
  gen.emit(f"{res.name}[{i}] = {sel}")
  gen.close(shape)
  return [res]


class GatherSite:
  """A bounds-check site of an array-indexed ``get``: the status array
  holds each scalar index, and each index array's (min, max) — all
  ``bounds.check_array`` looks at —, and ``resolve`` re-runs the NumPy
  rule's checks on them, raising its error."""

  def __init__(self, access, kinds):
    self.access, self.kinds = access, kinds
    self.num_dynamic = sum(2 if k == "a" else 1 for k in kinds)

  def resolve(self, ref, values):
    leaves, it = [], iter(values)
    for k in self.kinds:
      leaves.append(np.array([next(it), next(it)], np.int64) if k == "a" else next(it))
    return self.access.resolve(ref, leaves)


def array_access(gen, eqn, ref: Val, atoms, vals):
  """``get`` through an indexer holding integer arrays (a gather), for
  ``refs``: (element expression builder ``at(js)``, the accessed shape).
  The NumPy rule checks each axis in order (``RefAccess.resolve``): a
  slice start or an int, then an index array's min and max; out of range
  it raises, or under ``bounds_check="clamp"`` clamps (an array element
  by element)."""
  lanes = _Lanes(gen, eqn, ref, eqn.params["tree"], atoms, vals, clamp=gen.clamp)
  dyn = lanes.dyn
  kinds = ["a" if v.kind == "a" else "s" for v in dyn]
  site = GatherSite(lanes.access, kinds)
  if site.num_dynamic > MAX_LEAVES:
    raise Refused("ref indices")
  bounds: dict = {}  # array leaf -> (min, max) locals, once checked

  def fail():
    gen.sites.append((eqn, site, gen.ref_positions[ref.name],
                      tuple(e for e in gen.stack if e is not None)))
    gen.emit(f"_st[0] = {len(gen.sites)}")
    values = []
    for k, v in enumerate(dyn):
      values += list(bounds.get(k, ("0", "0"))) if v.kind == "a" else [v.name]
    for j, v in enumerate(values):
      gen.emit(f"_st[{j + 1}] = np.int64({v})")
    gen.emit("raise IndexError('pallas_np native loop: out-of-bounds ref access')")

  def scalar_index(k, last, n, axis):
    i = gen.scalar(f"np.int64({dyn[k].name})", np.dtype(np.int64)).name
    if gen.clamp:
      gen.emit(f"{i} = min(max({i} + {n} if {i} < 0 else {i}, 0), {last})")
    else:
      with gen.block(f"if {i} < 0 or {i} > {last}:"):
        fail()
    lanes.checked[axis] = i

  for axis, (d, n) in enumerate(zip(lanes.dims, ref.shape)):
    if isinstance(d, indexing.DimSlice):
      size, stride = int(d.size), int(d.stride)
      extent = (size - 1) * stride + 1
      if size <= 0 or extent > n:
        raise Refused("slice larger than the axis")
      if indexing.is_static(d.start):
        if not 0 <= int(d.start) <= n - extent:
          raise Refused("static index out of range")
      else:
        scalar_index(d.start.k, n - extent, n, axis)
    elif isinstance(d, indexing.DimArray):
      v = dyn[d.value.k]
      if gen.clamp:
        lanes.checked[axis] = "clamp"
        continue
      if not v.size:
        continue
      lo, hi, q = gen.fresh("lo"), gen.fresh("hi"), gen.fresh("q")
      gen.emit(f"{lo} = np.int64({v.name}[0])")
      gen.emit(f"{hi} = {lo}")
      with gen.block(f"for {q} in range({v.size}):"):
        gen.emit(f"{lo} = min({lo}, np.int64({v.name}[{q}]))")
        gen.emit(f"{hi} = max({hi}, np.int64({v.name}[{q}]))")
      bounds[d.value.k] = (lo, hi)
      with gen.block(f"if {lo} < 0 or {hi} >= {n}:"):
        fail()
    elif indexing.is_static(d.value):
      if not 0 <= int(d.value) < n:
        raise Refused("static index out of range")
    else:
      scalar_index(d.value.k, n - 1, n, axis)

  def at(js):
    return lane_ref(ref, lanes.coords(gen, js))
  return at, lanes.shape


def result_is_c(eqn) -> bool:
  """Whether the NumPy rule of ``eqn`` (a ``get`` or ``masked_load``) returns
  a row-major array (``reductions.numpy_layout``): basic indexing (a view,
  or its copy), or advanced indices leading the indexer — NumPy lays a
  result with advanced indices after a slice out with those axes outermost
  in memory (``x[:, idx]`` is not C-contiguous)."""
  if eqn.primitive.name == "get":
    tree, atoms = eqn.params["tree"], list(eqn.invars[1:])
  else:
    ref_pos, transforms = _split(eqn)[:2]
    leaves, tree = jc.jax.tree_util.tree_flatten(transforms, is_leaf=lambda x: isinstance(x, _Pos))
    atoms = [eqn.invars[p.i] for p in leaves]
  ref_aval = eqn.invars[0].aval
  try:
    access = RefAccess(tree, atoms, ref_aval.inner_aval.shape, clamp=False)
  except Exception:  # noqa: BLE001 - any indexer this cannot read: unknown
    return False
  for _, dims in ((s[0], s[1]) for s in access.steps):
    if not any(isinstance(d, indexing.DimArray) for d in dims):
      continue
    flags = [not isinstance(d, indexing.DimSlice) for d in dims]
    if flags != sorted(flags, reverse=True):  # (advanced..., slices...)
      return False
  return True
