"""Outputs every lane of a vectorized pass shares, and who touched what.

A Triton-style kernel writes whole-array outputs at program_id-dependent
offsets: its lanes cannot own blocks. The slab runner keeps such an output
one buffer that the lanes write in place, and every batched ref rule records
each access in the pass's ``SharedOutputs`` (``active()``), which refuses
the pass the moment two lanes meet on an element.
"""
from __future__ import annotations

import threading

import numpy as np

from pallas_np.errors import NotBatchable


class SharedOutputs:
  """Outputs every lane of a pass sees whole (Triton-style whole-array
  outputs written at program_id-dependent offsets). They stay one unbatched
  buffer that the lanes write in place, and every access through a batched
  rule records, per element, which lane wrote it and which lane(s) read it.
  Lanes of a pass then provably commute -- and the pass equals grid order
  -- when no element is written by two lanes or written by one lane and
  read by another; the first access that breaks this raises NotBatchable
  (the grid loop reruns from fresh buffers). Anything that would touch a
  tracked buffer unseen (a lane loop running the unbatched rule, an eqn
  every lane runs as one, a view of it) raises NotBatchable too. Slabs run
  one after another, each with fresh records: a later slab seeing what an
  earlier one wrote is grid order."""

  def __init__(self, lanes: int):
    self.regions = []  # (base, start, end, state)
    self.lane_ids = np.arange(lanes, dtype=np.int64)  # a lane group narrows it (LaneGroup.run)

  # Per element: -1 untouched, -2 read by several lanes (none wrote it), or
  # 4 * lane + (1 if read) + (2 if written) for the one lane that touched it.
  def add(self, base: np.ndarray):
    start = base.__array_interface__["data"][0]
    self.regions.append((base, start, start + base.nbytes, np.full(base.size, -1, np.int64)))

  def region(self, ref):
    if not isinstance(ref, np.ndarray):
      return None
    ptr = ref.__array_interface__["data"][0]
    for r in self.regions:
      if r[1] <= ptr < r[2]:
        if ref is not r[0]:
          raise NotBatchable("a shared output accessed through a view")
        return r
    return None

  def refuse(self, args, why):
    for a in args:
      if self.region(a) is not None:
        raise NotBatchable(f"a shared output is touched by {why}")

  def access(self, ref, coords, full, on, kind):
    """Record the elements ``ref[coords]`` (broadcast to ``full`` = (lanes,
    *shape), where ``on``) each lane touches; ``kind``: read/write/readwrite."""
    region = self.region(ref)
    if region is None:
      return
    base, _, _, state = region
    lane = self.lane_ids.reshape((-1,) + (1,) * (len(full) - 1))
    if on is None:
      pick = lambda c: np.broadcast_to(c, full).ravel()
    else:
      on = np.broadcast_to(on, full)
      pick = lambda c: np.broadcast_to(c, full)[on]
    me = pick(lane * 4)
    if base.ndim == 1:
      elems = pick(coords[0])
    elif base.ndim:
      elems = np.ravel_multi_index(tuple(pick(c) for c in coords), base.shape)
    else:
      elems = np.zeros(me.shape, np.intp)
    s = state[elems]
    other = (s >= 0) & ((s & ~3) != me)
    if kind == "read":
      if (other & ((s & 2) != 0)).any():
        raise NotBatchable("a lane read a shared output element another lane wrote")
      new = np.where(s == -1, me + 1, np.where(other | (s == -2), -2, s | 1))
    else:
      if (other | (s == -2)).any():
        raise NotBatchable("a lane wrote a shared output element another lane touched")
      new = me + 3
    state[elems] = new
    clash = state[elems] != new  # one op, several lanes on one element
    if clash.any():
      if kind != "read":
        raise NotBatchable("two lanes write one shared output element")
      state[elems[clash]] = -2

  def access_span(self, ref, span, kind):
    """``access`` for a Span (``state.lane_access``) of a 1-D ref: slices instead of gathers (each
    element at most once, so no same-op clash)."""
    region = self.region(ref)
    if region is None or span.a >= span.b:
      return
    state = region[3]
    me = np.repeat(self.lane_ids * 4, span.per_lane)[span.inner]
    s = state[span.a:span.b]
    other = (s >= 0) & ((s & ~3) != me)
    if kind == "read":
      bad = other & ((s & 2) != 0)
      new = np.where(s == -1, me + 1, np.where(other | (s == -2), -2, s | 1))
    else:
      bad = other | (s == -2)
      new = me + 3
    on = span.on_inner
    if on is not None:
      bad &= on
      new = np.where(on, new, s)
    if bad.any():
      raise NotBatchable("lanes meet on a shared output element")
    state[span.a:span.b] = new


tracking = threading.local()  # .shared: this thread's pass's SharedOutputs


def active():
  """The active SharedOutputs of this thread's pass, or None."""
  return getattr(tracking, "shared", None)

