"""Masked (Triton-style) ref accesses: ``pltriton.load``/``store`` with a
``mask`` (the ``masked_load``/``masked_swap`` primitives) and the machinery
``atomics.py`` shares.

On the GPU a masked access is a tensor of pointers plus a predicate: lanes
whose mask is off are never dereferenced, so they may point anywhere, e.g.
``pl.ds(i * BLOCK, BLOCK)`` running past the end of the array with
``mask = idx < n``. Here an access first tries the ordinary bounds-checked
view (the common, in-bounds case costs nothing extra); only if that raises do
we fall back to per-element coordinates, check that every *masked-on* lane is
in bounds (``IndexError`` otherwise, as for any other access) and gather or
scatter just those lanes.

Values of masked-off lanes, mirroring ``interpret=True``: a load gives
``other`` when given, otherwise the array's contents where the lane is in
bounds and the "uninitialized" fill (NaN, int min, ...) where it is not; a
swap returns the stored value there.
"""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import races, registry
from pallas_np.state.indexing import RefAccess, static_atoms


class _Pos:
  """Placeholder leaf: position of an eqn invar. Not an int on purpose: a
  ``Slice`` treats int starts as static and would swallow it."""
  __slots__ = ("i",)

  def __init__(self, i):
    self.i = i


def split_args(e: registry.EqnInfo):
  """Unflatten an ``args_tree`` param into invar positions (or None)."""
  tree = e.params["args_tree"]
  parts = jc.tree_unflatten(tree, [_Pos(i) for i in range(len(e.eqn.invars))])
  return [p.i if isinstance(p, _Pos) else p for p in parts]


class MaskedAccess:
  """One masked access, compiled: ``ref_pos`` and ``transforms_pos`` are what
  ``split_args`` returned for the ref and its transforms."""

  def __init__(self, e: registry.EqnInfo, ref_pos, transforms_pos):
    leaves, tree = jc.jax.tree_util.tree_flatten(
        transforms_pos, is_leaf=lambda x: isinstance(x, _Pos))
    idx_positions = [p.i for p in leaves]
    ref_aval = e.in_avals[ref_pos]
    # Never clamp here: clamping would shift a slice that overruns the end and
    # move masked-on lanes. Out-of-bounds lanes are handled below instead.
    self.access = RefAccess.shared(tree, static_atoms(e.folded, [e.eqn.invars[p] for p in idx_positions]),
                                   ref_aval.shape, ref_dtype=ref_aval.dtype, clamp=False)
    self.ref_pos = ref_pos
    self.dyn_positions = [idx_positions[p] for p in self.access.dynamic_positions]
    self.clamp = e.compiler.params.bounds_check == "clamp"
    self.shape = tuple(self.access.result_shape)
    from pallas_np.grid import fill_value
    self.fill = fill_value(ref_aval.dtype, e.compiler.params)
    # races.note(view, index, kind, mask) when detection/explain is on, else None.
    self.note = races.note if e.compiler.params.records_accesses else None

  def leaves(self, args):
    return [args[p] for p in self.dyn_positions]

  def resolve(self, args):
    """``(view, idx)`` when every lane is in bounds, else None."""
    try:
      return self.access.resolve(args[self.ref_pos], self.leaves(args))
    except IndexError:
      return None

  def lanes(self, args, mask):
    """Slow path: ``(view, safe, in_bounds, mask)``: ``safe`` are per-axis
    index arrays (broadcastable to the access' shape) with out-of-bounds
    lanes redirected to 0, ``in_bounds`` which lanes point inside the ref.
    Raises if a masked-on lane points outside, unless bounds_check='clamp'."""
    got = self.access.unchecked_coords(args[self.ref_pos], self.leaves(args))
    if got is None:  # an earlier transform is out of bounds: re-raise it
      self.access.resolve(args[self.ref_pos], self.leaves(args))
      raise AssertionError("unreachable")
    view, coords = got
    in_bounds = np.True_  # broadcastable to the access' shape
    safe = []
    for c, n in zip(coords, view.shape):
      if c.size and 0 <= c.min() and c.max() < n:
        safe.append(c)
        continue
      ok = (c >= 0) & (c < n)
      in_bounds = in_bounds & ok
      safe.append(np.where(ok, c, 0))
    in_bounds = np.broadcast_to(in_bounds, self.shape)
    mask = np.asarray(mask, dtype=bool)
    bad = mask & ~in_bounds
    if not self.clamp and bad.any():
      lane = tuple(int(i) for i in np.argwhere(bad)[0])
      where = tuple(int(np.broadcast_to(c, self.shape)[lane]) for c in coords)
      raise IndexError(
          f"out-of-bounds masked ref access: lane {lane} is masked on but "
          f"points at index {where} of a ref of shape {tuple(view.shape)}. "
          "Only masked-off lanes may point out of bounds. interpret=True would "
          "silently read padding / drop the write; pass "
          "InterpretParams(bounds_check='clamp') to do the same.")
    return view, tuple(safe), in_bounds, mask

  def gather(self, view, safe, in_bounds):
    """Every lane's current value; the fill where it points outside."""
    if not view.size:
      return np.full(self.shape, self.fill, dtype=view.dtype)
    return np.where(in_bounds, view[safe], self.fill).astype(view.dtype, copy=False)

  def scatter(self, view, safe, in_bounds, mask, val):
    """``view[lane] = val[lane]`` for masked-on, in-bounds lanes."""
    active = mask & in_bounds  # full shape
    index = tuple(np.broadcast_to(c, self.shape)[active] for c in safe)
    view[index] = np.broadcast_to(val, self.shape)[active]


@registry.register(jc.pallas_primitives.load_p)
def _masked_load(e):
  ref_pos, transforms_pos, mask_pos, other_pos = split_args(e)
  acc = MaskedAccess(e, ref_pos, transforms_pos)
  dtype = np.dtype(jc.physical_dtype(e.out_aval.dtype))

  select = mask_pos is not None and other_pos is not None

  def load(*args):
    hit = acc.resolve(args)
    if hit is not None:
      view, idx = hit
      if acc.note is not None:
        acc.note(view, idx, "read", None if mask_pos is None else args[mask_pos])
      if select:
        mask = args[mask_pos]
        if mask.all() if isinstance(mask, np.ndarray) else np.all(mask):
          return np.array(view[idx], dtype=dtype)  # every lane on (interior blocks)
        return np.where(mask, view[idx], args[other_pos]).astype(dtype, copy=False)
      val = np.array(view[idx], dtype=dtype)
    elif mask_pos is None:
      acc.access.resolve(args[ref_pos], acc.leaves(args))  # raises IndexError
      raise AssertionError("unreachable")
    else:
      view, safe, in_bounds, mask = acc.lanes(args, args[mask_pos])
      if acc.note is not None:
        acc.note(view, safe, "read", mask & in_bounds)
      val = acc.gather(view, safe, in_bounds)
    if select:
      val = np.where(args[mask_pos], val, args[other_pos]).astype(dtype, copy=False)
    return val
  return load


@registry.register(jc.pallas_primitives.swap_p)
def _masked_swap(e):
  ref_pos, transforms_pos, val_pos, mask_pos = split_args(e)
  acc = MaskedAccess(e, ref_pos, transforms_pos)
  want_old = e.outvars_used[0]

  def swap(*args):
    val = args[val_pos]
    hit = acc.resolve(args)
    kind = "readwrite" if want_old else "write"
    if hit is not None:
      view, idx = hit
      if acc.note is not None:
        acc.note(view, idx, kind, None if mask_pos is None else args[mask_pos])
      if mask_pos is None:
        old = np.array(view[idx]) if want_old else None
        view[idx] = val
        return old
      mask = args[mask_pos]
      region = view[idx]
      is_view = isinstance(region, np.ndarray) and np.shares_memory(region, view)
      old = np.array(region) if want_old or not is_view else None
      if is_view:
        np.copyto(region, np.broadcast_to(val, region.shape),
                  where=np.broadcast_to(mask, region.shape))
      else:  # integer-array index: NumPy handed us a copy
        view[idx] = np.where(mask, val, old)
      if not want_old:
        return None
      return np.where(mask, old, val).astype(old.dtype, copy=False)
    if mask_pos is None:
      acc.access.resolve(args[ref_pos], acc.leaves(args))  # raises IndexError
      raise AssertionError("unreachable")
    view, safe, in_bounds, mask = acc.lanes(args, args[mask_pos])
    if acc.note is not None:
      acc.note(view, safe, kind, mask & in_bounds)
    old = acc.gather(view, safe, in_bounds) if want_old else None
    val = np.asarray(val, dtype=view.dtype)
    acc.scatter(view, safe, in_bounds, mask, val)
    return None if old is None else np.where(mask, old, val)
  return swap
