"""Ref accesses of a vectorized pass whose indices differ per lane.

A batched ref rule (``state.refs``, ``state.masked``) indexes the
lane-stacked ref once for every lane when all lanes use the same indices.
When they do not (program_id-based offsets, Triton style), or the ref is one
every lane shares, ``LaneIndexed`` computes every lane's per-element
coordinates and does one NumPy gather/scatter (``Span``: one slice, when the
lanes' elements form one run of a 1-D ref), recording each access in the
pass's ``SharedOutputs``.
"""
from __future__ import annotations

import math

import numpy as np

from pallas_np import _compat as jc
from pallas_np.errors import LaneOutOfBounds, NotBatchable
from pallas_np.shared_outputs import active as shared_outputs
from pallas_np.state.indexing import DimSlice, is_static

class Span:
  """Elements ``lo..hi-1`` of a 1-D ref, lane after lane (``full`` = (lanes,
  per_lane)); ``[a, b)`` is the part inside the ref. A masked-on (or
  unmasked) element outside raises IndexError: the sequential rerun names it."""
  __slots__ = ("lo", "hi", "a", "b", "full", "per_lane", "on", "inner", "on_inner")

  def __init__(self, lo, hi, n, full, on):
    self.lo, self.hi, self.full, self.per_lane, self.on = lo, hi, full, full[1], on
    self.a, self.b = min(max(lo, 0), n), max(min(hi, n), 0)
    self.inner = slice(self.a - lo, max(self.b - lo, self.a - lo))
    if self.b - self.a != hi - lo:
      outside = np.ones(hi - lo, bool)
      outside[self.inner] = False
      if on is None or (on & outside).any():
        raise LaneOutOfBounds("out-of-bounds ref access in a vectorized pass")
    self.on_inner = None if on is None else on[self.inner]

  def gather(self, ref, fill, dtype):
    """Every element, ``fill`` outside the ref, as a new (lanes, per_lane) array."""
    if self.b - self.a == self.hi - self.lo:
      return np.array(ref[self.a:self.b], dtype=dtype).reshape(self.full)
    out = np.full(self.hi - self.lo, fill, dtype=dtype)
    out[self.inner] = ref[self.a:self.b]
    return out.reshape(self.full)

  def scatter(self, ref, val):
    """``ref[lo:hi] = val`` where on and inside."""
    v = np.broadcast_to(np.asarray(val, dtype=ref.dtype), self.full).reshape(-1)[self.inner]
    if self.on_inner is None:
      ref[self.a:self.b] = v
    else:
      np.copyto(ref[self.a:self.b], v, where=self.on_inner)


class LaneIndexed:
  """A lone-indexer access whose indices differ per lane (program_id-based
  offsets, Triton style), on a lane-stacked ref or on one every lane
  shares: per-element coordinates of all lanes, one NumPy gather/scatter."""

  def __init__(self, access, ref_batched, leaf_batched):
    self.access = access
    self.ref_batched = ref_batched
    self.leaf_batched = tuple(leaf_batched)
    self.shape = tuple(access.result_shape)

  @staticmethod
  def make(access, ref_batched, leaf_batched):
    """None unless the access is one indexer with static slice sizes."""
    steps = access.steps
    if len(steps) != 1 or steps[0][0] != "index" or any(
        isinstance(d, DimSlice) and not is_static(d.size) for d in steps[0][1]):
      return None
    return LaneIndexed(access, ref_batched, leaf_batched)

  def coords(self, leaves):
    """Per-element coordinates of every lane (RefAccess.lane_coords)."""
    return self.access.lane_coords(leaves, self.leaf_batched)

  def span(self, ref, coords, lanes, mask):
    """A Span when the lanes' elements are one run ``ref[lo:hi]`` of a 1-D
    ref every lane shares, lane after lane (Triton's ``program_id * BLOCK +
    arange(BLOCK)``): slices then replace gathers and scatters. Else None."""
    if self.ref_batched or ref.ndim != 1 or len(self.shape) != 1:
      return None
    (c,) = coords
    full = (lanes, *self.shape)
    flat = np.broadcast_to(c, full).reshape(-1)
    lo = int(flat[0])
    if flat.size > 1 and (int(flat[-1]) != lo + flat.size - 1 or (np.diff(flat) != 1).any()):
      return None
    on = None if mask is None else np.broadcast_to(np.asarray(mask, bool), full).reshape(-1)
    return Span(lo, lo + flat.size, ref.shape[0], full, on)

  def index(self, ref, coords, lanes, mask):
    """``(index, in_bounds, full)``: ``ref[index]`` broadcasts to ``full`` =
    (lanes, *shape); out-of-bounds coordinates are redirected to 0 and
    ``in_bounds`` (None: all in) says where. A masked-on (or unmasked) lane
    out of bounds raises IndexError: the sequential rerun names it."""
    full = (lanes, *self.shape)
    dims = ref.shape[1:] if self.ref_batched else ref.shape
    in_bounds = None
    safe = []
    for c, n in zip(coords, dims):
      if c.size and (c.min() < 0 or c.max() >= n):
        ok = (c >= 0) & (c < n)
        in_bounds = ok if in_bounds is None else in_bounds & ok
        c = np.where(ok, c, 0)
      safe.append(c)
    if self.ref_batched:
      safe.insert(0, np.arange(lanes).reshape((lanes,) + (1,) * len(self.shape)))
    if in_bounds is not None:
      in_bounds = np.broadcast_to(in_bounds, full)
      bad = ~in_bounds if mask is None else np.broadcast_to(mask, full) & ~in_bounds
      if bad.any():
        raise LaneOutOfBounds("out-of-bounds ref access in a vectorized pass")
    return tuple(safe), in_bounds, full

  @staticmethod
  def active(index, full, on):
    """``index`` restricted to the elements where ``on`` (None: all)."""
    if on is None:
      return tuple(np.broadcast_to(c, full).ravel() for c in index)
    on = np.broadcast_to(on, full)
    return tuple(np.broadcast_to(c, full)[on] for c in index)


def lanes_of(args, flags):
  return next(a.shape[0] for a, f in zip(args, flags) if f)


def lane_index(idx):
  return (slice(None), *idx) if isinstance(idx, tuple) else (slice(None), Ellipsis)


def dyn_flags(access, leaf_batched):
  return tuple(leaf_batched[p] for p in access.dynamic_positions)


def tracked(ref):
  """The SharedOutputs recording writes to ``ref``, a ref every lane shares
  (only a shared output may be written that way)."""
  shared = shared_outputs()
  if shared is None or shared.region(ref) is None:
    raise NotBatchable("write to a ref shared by all lanes")
  return shared


def count_lane_bytes(bc, lane_acc, dtype):
  """Per-lane bytes a lane-indexed access moves: the auto mode weighs them
  like block bytes (a Triton kernel's blocks are such accesses)."""
  bc.lane_access_bytes += math.prod(lane_acc.shape) * np.dtype(jc.physical_dtype(dtype)).itemsize


def masked_on(mask, in_bounds):
  """Elements a masked access really touches (None: all)."""
  if mask is None:
    return in_bounds
  mask = np.asarray(mask, bool)
  return mask if in_bounds is None else mask & in_bounds



def trailing_slices(index, full):
  """``index`` (coordinate arrays broadcastable to ``full``) with its
  trailing arrays that are plain ranges along their own result axis, the
  same for every lane (``k_ref[pl.ds(start_of_lane, 128), :]``'s columns),
  as slices: NumPy then copies runs instead of gathering element by element
  (a Triton decode kernel's K tile). The same elements in the same order
  once broadcast to ``full``; unchanged when in doubt."""
  nres = len(full)
  cut = len(index)
  slices = []
  while cut > 0:
    c = index[cut - 1]
    axis = nres - len(slices) - 1
    if (axis < 1 or c.ndim != nres or c.shape[axis] not in (1, full[axis])
        or any(n != 1 for a, n in enumerate(c.shape) if a != axis)):
      break
    v = c.reshape(-1)
    if v.size > 1:
      step = int(v[1] - v[0])
      if step <= 0 or (np.diff(v) != step).any():
        break
      slices.append(slice(int(v[0]), int(v[-1]) + 1, step))
    else:
      slices.append(slice(int(v[0]), int(v[0]) + 1))
    cut -= 1
  if not slices:
    return index
  keep = nres - len(slices)  # result axes the remaining arrays index
  rest = []
  for c in index[:cut]:
    if any(n != 1 for n in c.shape[keep:]):
      return index
    rest.append(c.reshape(c.shape[:keep]))
  return (*rest, *reversed(slices))
