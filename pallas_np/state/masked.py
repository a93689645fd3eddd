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
from pallas_np import batching, races, registry
from pallas_np.errors import NotBatchable
from pallas_np.memory import fill_value
from pallas_np.shared_outputs import active as shared_outputs
from pallas_np.state.indexing import DimArray, DimSlice, RefAccess, static_atoms
from pallas_np.state.lane_access import (
    LaneIndexed, count_lane_bytes, lane_index, lanes_of, masked_on, tracked)


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
      raise masked_lane_error(lane, where, view.shape)
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


def masked_lane_error(lane, where, shape) -> IndexError:
  """The error of a masked access whose masked-on ``lane`` points at
  ``where``, outside a ref of ``shape`` (also raised by the native tier's
  compiled masked accesses, ``native/masked.py``)."""
  return IndexError(
      f"out-of-bounds masked ref access: lane {tuple(lane)} is masked on but "
      f"points at index {tuple(where)} of a ref of shape {tuple(shape)}. "
      "Only masked-off lanes may point out of bounds. interpret=True would "
      "silently read padding / drop the write; pass "
      "InterpretParams(bounds_check='clamp') to do the same.")


# -- batched rules: one NumPy index of the lane-stacked ref ---------------------------
def _access_for_lanes(info, in_batched):
  """``(operand positions, access, fancy, lane_indexed)``. ``access`` is set
  when every lane indexes its own ref block with the same indices (the loop
  counters and column vectors Triton-style kernels use), so that one index
  of the lane-stacked ref does all lanes; ``fancy``: an integer-array index
  (NumPy then gives a copy, not a view). Otherwise ``lane_indexed`` (a
  LaneIndexed) when the indices differ per lane (program_id offsets) or the
  ref is shared by all lanes; both None: run lane by lane."""
  positions = split_args(info)
  ref_pos, transforms_pos = positions[:2]
  acc = MaskedAccess(info, ref_pos, transforms_pos)
  if acc.note is not None:
    return positions, None, False, None
  leaf_b = tuple(in_batched[p] for p in acc.dyn_positions)
  if not in_batched[ref_pos] or any(leaf_b):
    return positions, acc, False, LaneIndexed.make(acc.access, in_batched[ref_pos], leaf_b)
  steps = acc.access.steps
  if len(steps) > 1 or (steps and steps[0][0] != "index"):
    return positions, None, False, None
  dims = steps[0][1] if steps else ()
  adv = [i for i, d in enumerate(dims) if not isinstance(d, DimSlice)]
  fancy = any(isinstance(dims[i], DimArray) for i in adv)
  if fancy and adv[-1] - adv[0] != len(adv) - 1:
    # NumPy would move split integer indices before the lanes.
    return positions, acc, False, LaneIndexed.make(acc.access, True, leaf_b)
  return positions, acc, fancy, None


def _lane_ref_args(args, ref_pos):
  """``args`` with the ref replaced by lane 0's block (same shape for all)."""
  args = list(args)
  args[ref_pos] = args[ref_pos][0]
  return args


def _load_batched(bc, rule, info, in_batched):
  if info.compiler.params.oob_reads == "fill":  # (each lane may read past the ref)
    return batching.lane_loop(rule, info, in_batched)
  (ref_pos, _, mask_pos, other_pos), acc, _, lane_acc = _access_for_lanes(
      info, in_batched)
  dtype = np.dtype(jc.physical_dtype(info.out_aval.dtype))
  if lane_acc is not None:
    flags = tuple(in_batched)
    ref_b = in_batched[ref_pos]
    count_lane_bytes(bc, lane_acc, dtype)

    def load_lanes(*args):
      ref = args[ref_pos]
      mask = None if mask_pos is None else args[mask_pos]
      coords, lanes = lane_acc.coords(acc.leaves(args)), lanes_of(args, flags)
      span = None if ref_b else lane_acc.span(ref, coords, lanes, mask)
      if span is not None:
        shared = shared_outputs()
        if shared is not None:
          shared.access_span(ref, span, "read")
        val = span.gather(ref, acc.fill, dtype)
        if mask is not None and other_pos is not None:
          val = np.where(mask, val, args[other_pos])
        return np.ascontiguousarray(np.broadcast_to(val, span.full), dtype=dtype)
      index, in_bounds, full = lane_acc.index(ref, coords, lanes, mask)
      shared = None if ref_b else shared_outputs()
      if shared is not None:
        shared.access(ref, index, full, masked_on(mask, in_bounds), "read")
      val = ref[index]
      if in_bounds is not None:
        val = np.where(in_bounds, val, acc.fill)
      if mask is not None and other_pos is not None:
        val = np.where(mask, val, args[other_pos])
      return np.ascontiguousarray(np.broadcast_to(val, full), dtype=dtype)
    return load_lanes, False, (True,)
  if acc is None:
    return batching.lane_loop(rule, info, in_batched)

  def load(*args):
    ref = args[ref_pos]
    hit = acc.resolve(args)
    if hit is not None:
      bidx = lane_index(hit[1])
      # C order: NumPy lays ``a[:, idx]`` out lanes-inner, and a later
      # reduction would then add in another order than the sequential run.
      val = np.array(ref[bidx], dtype=dtype, order="C")
    elif mask_pos is None:
      raise IndexError("out-of-bounds masked load")  # the sequential rerun names it
    else:
      _, safe, in_bounds, mask = acc.lanes(_lane_ref_args(args, ref_pos), args[mask_pos])
      bidx = (slice(None), *safe)
      if not ref[0].size:
        val = np.full((ref.shape[0], *acc.shape), acc.fill, dtype=dtype)
      else:
        val = np.where(in_bounds, ref[bidx], acc.fill).astype(dtype, copy=False)
    if mask_pos is not None and other_pos is not None:
      val = np.where(args[mask_pos], val, args[other_pos]).astype(dtype, copy=False)
    return np.ascontiguousarray(val)
  return load, False, (True,)


@registry.register(jc.pallas_primitives.load_p, batch=_load_batched)
def _masked_load(e):
  ref_pos, transforms_pos, mask_pos, other_pos = split_args(e)
  acc = MaskedAccess(e, ref_pos, transforms_pos)
  dtype = np.dtype(jc.physical_dtype(e.out_aval.dtype))

  select = mask_pos is not None and other_pos is not None
  # oob_reads="fill": lanes past the ref read the fill, masked on or not
  # (state/past_end.py); masked-off lanes then take ``other``.
  reads_past = e.compiler.params.oob_reads == "fill"

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
    elif mask_pos is None and not reads_past:
      acc.access.resolve(args[ref_pos], acc.leaves(args))  # raises IndexError
      raise AssertionError("unreachable")
    else:
      view, safe, in_bounds, mask = acc.lanes(
          args, np.False_ if reads_past or mask_pos is None else args[mask_pos])
      if reads_past:  # (what the race detector sees read: the masked-on lanes)
        mask = np.True_ if mask_pos is None else np.asarray(args[mask_pos], bool)
      if acc.note is not None:
        acc.note(view, safe, "read", mask & in_bounds)
      val = acc.gather(view, safe, in_bounds)
    if select:
      val = np.where(args[mask_pos], val, args[other_pos]).astype(dtype, copy=False)
    return val
  return load


def _swap_batched(bc, rule, info, in_batched):
  (ref_pos, _, val_pos, mask_pos), acc, fancy, lane_acc = _access_for_lanes(
      info, in_batched)
  ref_b = in_batched[ref_pos]
  if not ref_b and lane_acc is None:
    raise NotBatchable("write to a ref shared by all lanes")
  want_old = info.outvars_used[0]
  kind = "readwrite" if want_old else "write"
  if lane_acc is not None:
    flags = tuple(in_batched)
    count_lane_bytes(bc, lane_acc, info.in_avals[val_pos].dtype)

    def swap_lanes(*args):
      ref, val = args[ref_pos], args[val_pos]
      mask = None if mask_pos is None else args[mask_pos]
      coords, lanes = lane_acc.coords(acc.leaves(args)), lanes_of(args, flags)
      span = None if ref_b else lane_acc.span(ref, coords, lanes, mask)
      if span is not None:
        tracked(ref).access_span(ref, span, kind)
        old = span.gather(ref, acc.fill, ref.dtype) if want_old else None
        span.scatter(ref, val)
        if old is None:
          return None
        if mask is not None:
          old = np.where(mask, old, val)
        return np.ascontiguousarray(np.broadcast_to(old, span.full), dtype=ref.dtype)
      index, in_bounds, full = lane_acc.index(ref, coords, lanes, mask)
      on = masked_on(mask, in_bounds)
      if not ref_b:  # a shared output: no two lanes may meet (checked first)
        tracked(ref).access(ref, index, full, on, kind)
      old = None
      if want_old:
        old = np.broadcast_to(ref[index], full)
        if in_bounds is not None:
          old = np.where(in_bounds, old, acc.fill)
      active = LaneIndexed.active(index, full, on)
      val = np.broadcast_to(np.asarray(val, dtype=ref.dtype), full)
      ref[active] = val.ravel() if on is None else val[np.broadcast_to(on, full)]
      if old is None:
        return None
      old = np.broadcast_to(old, full)
      if mask is not None:
        old = np.where(mask, old, val)
      return np.ascontiguousarray(old, dtype=ref.dtype)
    return swap_lanes, False, (True,)
  if acc is None:
    return batching.lane_loop(rule, info, in_batched)

  def swap(*args):
    ref, val = args[ref_pos], args[val_pos]
    hit = acc.resolve(args)
    if hit is not None:
      bidx = lane_index(hit[1])
      if mask_pos is None:
        old = np.array(ref[bidx], order="C") if want_old else None
        ref[bidx] = val
        return old
      mask = args[mask_pos]
      region = ref[bidx]
      old = np.array(region, order="C") if want_old or fancy else None
      if fancy:
        ref[bidx] = np.where(mask, val, old)
      else:
        np.copyto(region, np.broadcast_to(val, region.shape),
                  where=np.broadcast_to(mask, region.shape))
      if not want_old:
        return None
      return np.ascontiguousarray(np.where(mask, old, val).astype(old.dtype, copy=False))
    if mask_pos is None:
      raise IndexError("out-of-bounds masked store")  # the sequential rerun names it
    _, safe, in_bounds, mask = acc.lanes(_lane_ref_args(args, ref_pos), args[mask_pos])
    lanes = ref.shape[0]
    full = (lanes, *acc.shape)
    old = None
    if want_old:
      old = np.where(in_bounds, ref[(slice(None), *safe)], acc.fill).astype(ref.dtype, copy=False)
    active = np.broadcast_to(mask & in_bounds, full)
    lane = np.arange(lanes).reshape((lanes,) + (1,) * len(acc.shape))
    index = tuple(np.broadcast_to(c, full)[active] for c in (lane, *safe))
    ref[index] = np.broadcast_to(np.asarray(val, dtype=ref.dtype), full)[active]
    return None if old is None else np.ascontiguousarray(np.where(mask, old, val))
  return swap, False, (True,)


@registry.register(jc.pallas_primitives.swap_p, batch=_swap_batched)
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
