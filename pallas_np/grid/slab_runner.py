"""The slab runner: a vectorized grid's passes over the block buffers.

The lanes (grid points of the batched axes) are cut into slabs that fit
``_SLAB_BYTES`` of blocks; each slab walks the sequential grid points in grid
order, with the lanes' blocks gathered into one lane-stacked array per
operand (a view where the lanes' blocks are adjacent, ``lane_view``; else a
copy written back) and lane-private scratch, and calls the batched kernel
plan once per sequential point. Slabs may run on threads
(``num_threads``), except with shared outputs.

Layout: a pass stores its lane-stacked values lanes-first or, for kernels
whose values have short last axes, lanes-last (the lane axis contiguous in
memory, ``pallas_np.grid.lanes.prefers_lanes_last``): the runner copies the lanes' blocks
and scratch into that layout and the output blocks back. Same values either
way.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import math

import numpy as np

from pallas_np import _compat as jc
from pallas_np.compiler import RunContext
from pallas_np.memory import fill_value, lanes_last_empty
from pallas_np.shared_outputs import SharedOutputs, tracking

_SLAB_BYTES = 8 << 20        # block bytes per vectorized pass
_MAX_LANES = 1 << 14
_LANES_LAST_MIN_LANES = 8
# Slabs with fewer block bytes than this keep the plain layout too: the
# copies into and out of the lanes-last layout cost more than the short
# strided runs they save (a 12-lane pass of 32x32 blocks: 350 vs 450 us).
_LANES_LAST_MIN_BYTES = 256 << 10


def lane_points(grid, axes, lane_coords=None):
  """Flat grid index of every lane (in lane order) at the first sequential
  grid point; ``lane_coords``: the lanes' coordinates on ``axes``."""
  if lane_coords is None:
    lane_coords = np.indices(tuple(grid[d] for d in axes)).reshape(len(axes), -1)
  return sum(lane_coords[k].astype(np.int64) * math.prod(grid[d + 1:])
             for k, d in enumerate(axes))


def bytes_per_lane(kp, operand_batched):
  """Bytes of the blocks and scratch one lane owns."""
  n = sum(int(np.prod(geo.sizes)) * np.dtype(jc.physical_dtype(geo.dtype)).itemsize
          for geo, b in zip(kp.blocks, operand_batched) if b)
  return n + sum(int(np.prod(a.shape)) * np.dtype(jc.physical_dtype(a.dtype)).itemsize
                 for a in kp.scratch_avals)


class SlabRunner:
  """Walks the lanes slab by slab, each slab through every sequential grid
  point in order."""

  def __init__(self, kp, grid, axes, block_idx, operand_batched, kernel, shared=frozenset(),
               access_bytes=0, lanes_last=False):
    self.kp, self.grid, self.axes = kp, grid, axes
    self.lanes_last = lanes_last
    self.shared = shared  # operands whose one block every lane shares (SharedOutputs)
    self.block_idx = block_idx
    self.operand_batched = operand_batched
    self.kernel = kernel  # the batched kernel's Plan (its ``fn`` is read per slab)
    blocks = kp.blocks
    self.seq_axes = tuple(d for d in range(len(grid)) if d not in axes)
    lane_shape = tuple(grid[d] for d in axes)
    self.n_lanes = math.prod(lane_shape)
    lane_bytes = bytes_per_lane(kp, operand_batched) + access_bytes
    self.lane_bytes = lane_bytes
    self.lanes_last_min_bytes = _LANES_LAST_MIN_BYTES  # (0 where a test forces the layout)
    per_slab = max(1, min(_MAX_LANES, _SLAB_BYTES // max(lane_bytes, 1)))
    # Auto (None) keeps batched slabs on one thread: no reliable gain (GUIDE).
    self.threads = max(1, int(kp.params.num_threads or 1))
    if shared:  # slabs run in grid order, each seeing the ones before it
      self.threads = 1
    if self.threads > 1:
      per_slab = min(per_slab, -(-self.n_lanes // self.threads))
    self.slabs = [(s, min(s + per_slab, self.n_lanes)) for s in range(0, self.n_lanes, per_slab)]
    self.lane_coords = np.indices(lane_shape, dtype=np.int32).reshape(len(axes), -1)
    self.lane_flat = lane_points(grid, axes, self.lane_coords)
    self.num_programs = tuple(np.int32(grid[d]) for d in kp.local_dims)
    self.seq_points = list(itertools.product(*[range(grid[d]) for d in self.seq_axes]))
    self.grid_strides = [math.prod(grid[d + 1:]) for d in range(len(grid))]
    self.progress = None
    self.done = 0
    self._one_pass = None  # one_pass(), on the first run
    # (slab lo, hi, sequential point) -> _block_positions: shared by the
    # copies run_vectorized makes per call
    self._positions = {}
    # (slab, step, operand, window layout) -> _merged_view_recipe
    self._recipes = {}

  def run(self, index_ops, buffers, scratch_init, first_states=None, seq_points=None):
    """Walks every slab through ``seq_points`` (default: all sequential grid
    points); returns the final scratch of every lane. ``first_states``
    (_FirstStates) sees each slab's state after its first point."""
    kp = self.kp
    windows = [block_windows(buf, geo) for buf, geo in zip(buffers, kp.blocks)]
    finals = [np.empty((self.n_lanes, *a.shape), np.dtype(jc.physical_dtype(a.dtype)))
              for a in kp.scratch_avals]
    if seq_points is None:
      seq_points = self.seq_points
    args = (index_ops, windows, scratch_init, finals, first_states, seq_points)
    if self.threads > 1 and len(self.slabs) > 1:
      with concurrent.futures.ThreadPoolExecutor(self.threads) as pool:
        futures = [pool.submit(self._slab, lo, hi, *args) for lo, hi in self.slabs]
        for f in futures:
          f.result()
    else:
      for lo, hi in self.slabs:
        self._slab(lo, hi, *args)
    return finals

  def _slab(self, lo, hi, index_ops, windows, scratch_init, finals, first_states, seq_points):
    kp = self.kp
    params = kp.params
    blocks = kp.blocks
    grid, axes, local = self.grid, self.axes, kp.local_dims
    operand_batched = self.operand_batched
    n_in = kp.num_inputs
    n_ops = len(windows)
    pos_limits = [w.shape[:len(geo.kinds)] for w, geo in zip(windows, blocks)]
    n = hi - lo
    ctx = RunContext(kp.name, params)
    ctx.num_programs = self.num_programs
    ctx.batch_size = n
    ctx.grid_point = None
    ids = [None] * len(grid)
    for k, d in enumerate(axes):
      ids[d] = self.lane_coords[k, lo:hi]
    lane_flat = self.lane_flat[lo:hi]
    lanes_last = self.slab_lanes_last(n)
    if scratch_init is None:
      scratch = [lane_full(n, a.shape, fill_value(a.dtype, params),
                            np.dtype(jc.physical_dtype(a.dtype)), lanes_last)
                 for a in kp.scratch_avals]
    else:
      scratch = [lanes_last_copy(s[lo:hi]) if lanes_last else np.array(s[lo:hi])
                 for s in scratch_init]
    shared_last = [None] * n_ops
    shared_view = [None] * n_ops
    kernel = self.kernel.fn  # (read per slab: a Plan compiles itself after its first calls)
    if self.shared:
      assert len(self.seq_points) == 1, "shared outputs batch every grid axis"
      return self._shared_slab(n, ctx, ids, lane_flat, index_ops, windows, pos_limits)
    for step, point in enumerate(seq_points):
      for d, v in zip(self.seq_axes, point):
        ids[d] = np.int32(v)
      ctx.program_ids = tuple(ids[d] for d in local)
      positions = self._positions.get((lo, hi, point))
      if positions is None:
        positions = self._block_positions(lane_flat, point, pos_limits)
        self._positions[lo, hi, point] = positions
      views = [None] * n_ops
      step_cols = [None] * n_ops
      writeback = []
      relaid = []  # (block view, its lanes-last copy the kernel writes)
      for b in range(n_ops):
        cols, index = positions[b]
        step_cols[b] = cols
        if not operand_batched[b]:
          key = index
          if key != shared_last[b]:
            shared_last[b] = key
            shared_view[b] = windows[b][key] if key else windows[b]
          views[b] = shared_view[b]
          continue
        if index is not None:  # the lanes' blocks are a view: one basic index
          view, copied = windows[b][index], False
        else:
          view, copied = self._gather(lo, hi, point, b, windows[b], cols)
        views[b] = view
        if copied and b >= n_in:
          writeback.append((b, cols, view))
        if lanes_last:
          views[b] = lanes_last_copy(view)
          if b >= n_in:
            relaid.append((view, views[b]))
          else:
            views[b].flags.writeable = False  # read-only, as the input block
      kernel(ctx, *index_ops, *views, *scratch)
      for view, copy in relaid:
        np.copyto(view, copy)
      for b, cols, view in writeback:
        self._scatter(lo, hi, point, b, windows[b], cols, view)
      if step == 0 and first_states is not None:
        first_states.visit(lo, hi, scratch, {b: gather(windows[b], step_cols[b])[0]
                                             for b in range(n_in, n_ops)})
      if self.progress is not None:
        self.done += n
        self.progress.tick(self.done)
    for f, s in zip(finals, scratch):
      f[lo:hi] = s


  def one_pass(self) -> bool:
    """Whether a run is one batched call of the kernel: one slab, one
    sequential grid point, no scratch, no shared outputs, lanes first
    (``run_one_pass`` then does what ``run`` would, without its loops)."""
    one = self._one_pass
    if one is None:  # (decided on the first run: the layout limit may be set after __init__)
      one = self._one_pass = (
          len(self.slabs) == 1 and len(self.seq_points) == 1 and not self.shared
          and not self.kp.scratch_avals and not self.slab_lanes_last(self.n_lanes))
    return one

  def run_one_pass(self, index_ops, buffers, progress):
    """``run`` of a ``one_pass`` runner, ``progress`` ticked at the end
    (the per-call floor of small vectorized grids)."""
    kp = self.kp
    windows = [block_windows(buf, geo) for buf, geo in zip(buffers, kp.blocks)]
    lo, hi = self.slabs[0]
    point = self.seq_points[0]
    positions = self._positions.get((lo, hi, point))
    if positions is None:
      pos_limits = [w.shape[:len(geo.kinds)] for w, geo in zip(windows, kp.blocks)]
      positions = self._block_positions(self.lane_flat[lo:hi], point, pos_limits)
      self._positions[lo, hi, point] = positions
    views, writeback = [], []
    for b, (cols, index) in enumerate(positions):
      window = windows[b]
      if not self.operand_batched[b]:
        views.append(window[index] if index else window)
      elif index is not None:  # the lanes' blocks are a view: one basic index
        views.append(window[index])
      else:
        view, copied = self._gather(lo, hi, point, b, window, cols)
        if copied and b >= kp.num_inputs:
          writeback.append((b, cols, view))
        views.append(view)
    ctx = RunContext(kp.name, kp.params)
    ctx.num_programs = self.num_programs
    ctx.batch_size = hi - lo
    ctx.grid_point = None
    ids = [None] * len(self.grid)
    for k, d in enumerate(self.axes):
      ids[d] = self.lane_coords[k, lo:hi]
    for d, v in zip(self.seq_axes, point):
      ids[d] = np.int32(v)
    ctx.program_ids = tuple(ids[d] for d in kp.local_dims)
    self.kernel.fn(ctx, *index_ops, *views)
    for b, cols, view in writeback:
      self._scatter(lo, hi, point, b, windows[b], cols, view)
    if progress is not None:
      progress.tick(hi - lo)

  def per_call(self) -> SlabRunner:
    """A shallow copy for one call's state (progress, lanes done); the
    positions and recipes stay shared. ``copy.copy`` costs ~4 µs."""
    runner = object.__new__(type(self))
    runner.__dict__.update(self.__dict__)
    return runner

  def slab_lanes_last(self, n) -> bool:
    """Whether a slab of ``n`` lanes is laid out lanes-last."""
    return (self.lanes_last and n >= _LANES_LAST_MIN_LANES
            and n * self.lane_bytes >= self.lanes_last_min_bytes)

  def _gather(self, lo, hi, point, b, window, cols):
    """``gather(window, cols)``, with how it cuts the lanes' blocks (a view
    of merged block dims, or a copy) decided once per slab, step, operand
    and window layout (``_merged_view_recipe``)."""
    key = (lo, hi, point, b, window.shape, window.strides)
    recipe = self._recipes.get(key)
    if recipe is None:
      recipe = self._recipes[key] = (_merged_view_recipe(window, cols)
                                     or _Box.of(window, cols))
    if recipe is False:
      return window[tuple(cols)], True
    if type(recipe) is _Box:  # a copy, through reshape: cheaper than the gather
      return window[recipe.index].reshape(recipe.lanes_shape), True
    run_index, shape, start, n = recipe
    return window[run_index].reshape(shape)[start:start + n], False

  def _scatter(self, lo, hi, point, b, window, cols, view):
    """Write back the lanes' blocks ``_gather`` copied."""
    recipe = self._recipes.get((lo, hi, point, b, window.shape, window.strides))
    if type(recipe) is _Box:
      window[recipe.index] = view.reshape(recipe.box_shape)
    else:
      window[tuple(cols)] = view

  def _block_positions(self, lane_flat, point, pos_limits):
    """Per operand at sequential grid ``point``: the lanes' block positions
    (checked) and the basic index that cuts their blocks as one view (the
    shared block's position for unbatched operands; None where the lanes'
    blocks need a gather or a layout-dependent view). Depends only on the
    choice of lanes, so it is computed once per slab and step."""
    flat = lane_flat
    for d, v in zip(self.seq_axes, point):
      flat = flat + v * self.grid_strides[d]
    out = []
    for b, geo in enumerate(self.kp.blocks):
      cols = [c[flat] for c in self.block_idx[b]]
      cols = check_positions(cols, pos_limits[b], self.kp.clamp, geo)
      if not self.operand_batched[b]:
        out.append((cols, tuple(int(c[0]) for c in cols)))
      else:
        out.append((cols, lane_view_index(cols)))
    return out

  def _shared_slab(self, n, ctx, ids, flat, index_ops, windows, pos_limits):
    """One slab of a pass with shared outputs, written in place while a
    SharedOutputs records who touched what (fresh for every slab)."""
    kp = self.kp
    blocks = kp.blocks
    for d in self.seq_axes:
      ids[d] = np.int32(0)
    ctx.program_ids = tuple(ids[d] for d in kp.local_dims)
    shared = SharedOutputs(n)
    views, writeback = [], []
    for b in range(len(windows)):
      cols = [c[flat] for c in self.block_idx[b]]
      cols = check_positions(cols, pos_limits[b], kp.clamp, blocks[b])
      if not self.operand_batched[b]:
        key = tuple(int(c[0]) for c in cols)
        view = windows[b][key] if key else windows[b]
        if b in self.shared:
          shared.add(view)
        views.append(view)
        continue
      view, copied = gather(windows[b], cols)
      if copied and b >= kp.num_inputs:
        writeback.append((b, cols, view))
      views.append(view)
    tracking.shared = shared
    try:
      self.kernel.fn(ctx, *index_ops, *views)
    finally:
      tracking.shared = None
    for b, cols, view in writeback:
      windows[b][tuple(cols)] = view
    if self.progress is not None:
      self.done += n
      self.progress.tick(self.done)


def block_windows(buf, geo):
  """View of ``buf`` indexed by block position: W[i0, i1, ...] is the block.
  Its layout is computed once per buffer layout; a C-contiguous buffer is
  viewed through ``np.ndarray`` (a fifth of ``as_strided``'s cost: the
  per-call floor of vectorized grids)."""
  key = (buf.shape, buf.strides)
  layout = geo.window_layouts.get(key)
  if layout is None:
    layout = _window_layout(buf, geo)
    if len(geo.window_layouts) >= 16:
      geo.window_layouts.clear()
    geo.window_layouts[key] = layout
  shape, strides = layout
  if buf.flags.c_contiguous and buf.size:
    return np.ndarray(shape, buf.dtype, buf, 0, strides)
  return np.lib.stride_tricks.as_strided(buf, shape=shape, strides=strides,
                                         writeable=buf.flags.writeable)


def _window_layout(buf, geo):
  """(shape, strides) of ``block_windows``' view of ``buf``."""
  pos_shape, strides = [], []
  blk_shape, blk_strides = [], []
  for d, (kind, b) in enumerate(zip(geo.kinds, geo.sizes)):
    mult = b if kind == "blocked" else 1
    n = geo.padded_shape[d]
    pos_shape.append((n - b) // mult + 1 if n >= b else 0)
    strides.append(buf.strides[d] * mult)
    if kind != "squeezed":
      blk_shape.append(b)
      blk_strides.append(buf.strides[d])
  return (*pos_shape, *blk_shape), (*strides, *blk_strides)


def lanes_last_copy(x):
  out = lanes_last_empty(x.shape[0], x.shape[1:], x.dtype)
  np.copyto(out, x)
  return out


def lane_full(n, shape, fill, dtype, lanes_last):
  if not lanes_last:
    return np.full((n, *shape), fill, dtype)
  out = lanes_last_empty(n, tuple(shape), dtype)
  out[...] = fill
  return out


def check_positions(cols, limits, clamp, geo):
  out = []
  for d, (c, lim) in enumerate(zip(cols, limits)):
    if c.size and (c.min() < 0 or c.max() >= lim):
      if not clamp:
        raise IndexError(f"block index out of bounds on dimension {d} of {geo.origin}")
      c = np.clip(c, 0, lim - 1)
    out.append(c)
  return out


def gather(window, cols):
  """The lanes' blocks as one array with a leading lane axis: a view when
  possible (``lane_view``); else a copy (written back after the step for
  outputs)."""
  view = lane_view(window, cols)
  if view is not None:
    return view, False
  return window[tuple(cols)], True


class _Box:
  """Lanes whose blocks are every block of a box of block positions, in C
  order (a ragged 2-D grid's lanes): ``window[index]`` reshaped to
  ``lanes_shape`` is the gather ``window[tuple(cols)]``, and writing
  ``view.reshape(box_shape)`` back to ``window[index]`` its scatter, both
  plain strided copies."""
  __slots__ = ("index", "lanes_shape", "box_shape")

  @classmethod
  def of(cls, window, cols):
    """The box of ``cols``, or False."""
    k, n = len(cols), len(cols[0])
    lows = [int(c.min()) for c in cols] if n else []
    extents = [int(c.max()) + 1 - low for c, low in zip(cols, lows)]
    if not n or math.prod(extents) != n:
      return False
    enumeration = np.indices(extents).reshape(k, -1)
    if not all((c - low == e).all() for c, low, e in zip(cols, lows, enumeration)):
      return False
    box = cls()
    box.index = tuple(slice(low, low + e) for low, e in zip(lows, extents))
    box.lanes_shape = (n, *window.shape[k:])
    box.box_shape = (*extents, *window.shape[k:])
    return box


def _merged_view_recipe(window, cols):
  """How ``lane_view`` cuts the lanes' blocks when they walk several block
  dims: ``(run_index, shape, start, n)`` such that
  ``window[run_index].reshape(shape)[start:start + n]`` is its view (a
  reshape that merges stride-compatible axes never copies; checked here
  against ``lane_view``'s own result), or False where the blocks need a
  gather."""
  view = lane_view(window, cols)
  if view is None:
    return False
  n = len(cols[0])
  varying = [d for d, c in enumerate(cols) if not (c == c[0]).all()]
  lo, hi = varying[0], varying[-1] + 1
  extents = window.shape[lo:hi]
  start = int(np.ravel_multi_index(tuple(int(c[0]) for c in cols[lo:hi]), extents))
  run_index = tuple(slice(None) if lo <= k < hi else int(cols[k][0]) for k in range(len(cols)))
  run = window[run_index]
  shape = (math.prod(extents), *run.shape[hi - lo:])
  mine = run.reshape(shape)[start:start + n]
  same = (mine.shape == view.shape and mine.strides == view.strides
          and mine.__array_interface__["data"][0] == view.__array_interface__["data"][0]
          and mine.flags.writeable == view.flags.writeable)
  return (run_index, shape, start, n) if same else False


def lane_view_index(cols):
  """The basic index of the lanes' blocks in a window when one block
  coordinate steps by one from lane to lane and the others are fixed (the
  first case of ``lane_view``); else None."""
  n = len(cols[0])
  varying = [d for d, c in enumerate(cols) if not (c == c[0]).all()]
  if len(varying) > 1:
    return None
  d = varying[0] if varying else 0
  c = cols[d]
  start = int(c[0])
  if not varying and n == 1 or varying and int(c[-1]) - start == n - 1 and (
      n < 3 or (np.diff(c) == 1).all()):
    return tuple(slice(start, start + n) if k == d else int(cols[k][0])
                 for k in range(len(cols)))
  return None


def lane_view(window, cols):
  """The lanes' blocks as a view of ``window``, or None: when one block
  coordinate steps by one from lane to lane and the others are fixed, or
  when the lanes walk consecutive block positions of several adjacent dims
  in C order (lanes over (batch, head) of a (B, H, ...) operand) whose
  windows merge into one axis without a copy."""
  n = len(cols[0])
  varying = [d for d, c in enumerate(cols) if not (c == c[0]).all()]
  if len(varying) <= 1:
    idx = lane_view_index(cols)
    return None if idx is None else window[idx]
  lo, hi = varying[0], varying[-1] + 1
  extents = window.shape[lo:hi]
  flat = np.ravel_multi_index(tuple(cols[lo:hi]), extents)
  start = int(flat[0])
  if int(flat[-1]) - start != n - 1 or not (np.diff(flat) == 1).all():
    return None
  run = window[tuple(slice(None) if lo <= k < hi else int(cols[k][0])
                     for k in range(len(cols)))]
  merged = hi - lo  # the first ``merged`` axes of ``run`` fold into one
  if any(run.strides[k] != run.strides[k + 1] * run.shape[k + 1] for k in range(merged - 1)):
    return None
  return np.lib.stride_tricks.as_strided(
      run, (math.prod(extents), *run.shape[merged:]),
      (run.strides[merged - 1], *run.strides[merged:]))[start:start + n]
