"""Recording one kernel run for ``pallas_np.explain``.

The recorder stands where the race detector stands (``races.for_run`` hands
it out when ``InterpretParams.explain`` is set): the grid loop calls
``begin`` with each grid point's block indices, the ref rules and DMAs call
``access`` with the elements they touch. Nothing here runs unless explain is
on: plans compiled without it have no reporting hooks.
"""
from __future__ import annotations

import threading

import numpy as np

from pallas_np.races import byte_offsets


class TrackedBuffer:
  """What a run did to each element of one buffer (flat, padded layout)."""
  __slots__ = ("name", "start", "end", "itemsize", "shape", "scratch",
               "first_step", "last_step", "visits", "read", "written")

  def __init__(self, name: str, arr: np.ndarray, scratch: bool):
    self.name = name
    self.start = arr.__array_interface__["data"][0]
    self.end = self.start + arr.nbytes
    self.itemsize = arr.itemsize
    self.shape = arr.shape
    self.scratch = scratch
    size = arr.size
    self.first_step = np.full(size, -1, np.int64)  # first grid step touching it
    self.last_step = np.full(size, -1, np.int64)   # to count each step once
    self.visits = np.zeros(size, np.int64)         # grid steps touching it
    self.read = np.zeros(size, bool)
    self.written = np.zeros(size, bool)


class RunRecorder:
  """Block indices per grid step and element accesses of one kernel run."""

  def __init__(self, plan, grid, buffers: list, scratch: list):
    self.plan = plan
    self.grid = tuple(int(g) for g in grid)
    self.num_steps = int(np.prod(self.grid, dtype=np.int64)) if self.grid else 1
    _unshare(buffers)
    self.buffers: list[TrackedBuffer] = []
    for geo, buf in zip(plan.blocks, buffers):
      self.buffers.append(TrackedBuffer(str(geo.origin), np.asarray(buf), False))
    for i, buf in enumerate(scratch):
      self.track(f"scratch_operands[{i}]", buf, scratch=True)
    ndims = [len(geo.sizes) for geo in plan.blocks]
    # block_indices[b][step]: operand b's block index at that step (-1: not run)
    self.block_indices = [np.full((self.num_steps, n), -1, np.int64) for n in ndims]
    self.ran = np.zeros(self.num_steps, bool)
    self.reads = None   # (steps, buffers) elements read / written per step,
    self.writes = None  # allocated once every buffer is tracked
    self.step = 0

  def track(self, name: str, arr, *, scratch: bool = False):
    if isinstance(arr, np.ndarray) and arr.size:
      self.buffers.append(TrackedBuffer(name, arr, scratch))

  def _counters(self):
    if self.reads is None or self.reads.shape[1] != len(self.buffers):
      shape = (self.num_steps, len(self.buffers))
      old_r, old_w = self.reads, self.writes
      self.reads, self.writes = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
      if old_r is not None:
        self.reads[:, :old_r.shape[1]] = old_r
        self.writes[:, :old_w.shape[1]] = old_w

  def begin(self, step: int, point, block_indices=()):
    """Enter grid point ``point``; ``block_indices[b]``: operand b's block
    index (None: constant index map, i.e. block 0)."""
    linear = 0
    for c, n in zip(point, self.grid):
      linear = linear * n + int(c)
    self.step = linear
    self.ran[linear] = True
    for b, rows in enumerate(self.block_indices):
      bidx = block_indices[b] if b < len(block_indices) else None
      rows[linear] = 0 if bidx is None else [int(i) for i in bidx]

  def access(self, view, index, kind: str, mask=None):
    """Record the elements ``view[index]`` touches (``mask``: only those)."""
    if not isinstance(view, np.ndarray) or view.size == 0:
      return
    ptr = view.__array_interface__["data"][0]
    buf_pos = next((k for k, b in enumerate(self.buffers) if b.start <= ptr < b.end), None)
    if buf_pos is None:  # run_scoped / private memory
      return
    buf = self.buffers[buf_pos]
    elems = ((ptr - buf.start) + byte_offsets(view)) // buf.itemsize
    if index is not Ellipsis:
      elems = elems[index]
    elems = np.asarray(elems)
    if mask is not None:
      elems = elems[np.broadcast_to(np.asarray(mask, bool), elems.shape)]
    elems = elems.ravel()
    if elems.size == 0:
      return
    step = self.step
    fresh = elems[buf.last_step[elems] != step]
    buf.visits[fresh] += 1  # repeated indices count once: one visit per step
    buf.last_step[elems] = step
    unseen = elems[buf.first_step[elems] < 0]
    buf.first_step[unseen] = step
    self._counters()
    if kind in ("read", "readwrite"):
      buf.read[elems] = True
      self.reads[step, buf_pos] += elems.size
    if kind in ("write", "readwrite"):
      buf.written[elems] = True
      self.writes[step, buf_pos] += elems.size


def _unshare(buffers: list):
  """An array passed as two operands is one buffer: give the later operand a
  read-only copy, so each access names its own operand (explain runs only)."""
  for i, buf in enumerate(buffers):
    if not isinstance(buf, np.ndarray) or buf.flags.writeable:
      continue
    if any(isinstance(o, np.ndarray) and np.may_share_memory(buf, o) for o in buffers[:i]):
      copy = np.array(buf)
      copy.flags.writeable = False
      buffers[i] = copy


class ExplainSession:
  """The sink ``InterpretParams(explain=...)`` carries: collects one
  recorder per kernel run while open. Compared by identity (params are a
  cache key), so each explain() call compiles its own plans."""

  def __init__(self, first_run_only: bool = False):
    self.first_run_only = first_run_only
    self.runs: list[RunRecorder] = []
    self._seen_plans: set = set()
    self._lock = threading.Lock()
    self.open = True

  def __repr__(self):
    return f"<pallas_np explain session, {len(self.runs)} runs>"

  def start_run(self, plan, grid, buffers, scratch):
    with self._lock:
      if not self.open or (self.first_run_only and id(plan) in self._seen_plans):
        return None
      self._seen_plans.add(id(plan))
      rec = RunRecorder(plan, grid, buffers, scratch)
      self.runs.append(rec)
      return rec

  def close(self) -> list[RunRecorder]:
    with self._lock:
      self.open = False
      runs, self.runs = self.runs, []
      return runs
