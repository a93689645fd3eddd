"""Grid vectorization: run many independent grid points in one NumPy pass.

A grid loop costs Python per grid point; with small blocks (one row per
step) that overhead dwarfs the NumPy work. Where grid points are provably
independent, we instead run a *slab* of them at once: every block ref gains a
leading lane axis (lane = one grid point of the batched axes), program_id of
a batched axis becomes an int32 array, and the kernel is compiled a second
time by ``BatchCompiler`` (``pallas_np.batching``) with the batched rules
registered next to each primitive's rule (values carry a leading lane axis
or are shared by all lanes).

When is it safe (the analysis, all of it conservative):

* Every output block is owned by one lane: no two grid points that differ in
  a batched coordinate touch the same output block (checked on the index
  maps evaluated over the whole grid, so scalar-prefetch-driven maps are
  covered). Any grid axis may be batched; the first candidate set that
  passes wins (all axes, then grid prefixes, then single axes).
* Outputs every grid point sees whole (Triton style, no BlockSpec) own no
  block. Without scratch they are batched over every axis anyway and checked
  while the pass runs: ``SharedOutputs`` records, per element, which lane
  touched it, and lanes that meet send the grid back to the loop.
* Scratch persists across grid points. Kernels with scratch batch only a
  grid prefix (lanes consecutive in grid order) and run with lane-private
  scratch, recording every lane's state (scratch and output blocks) after
  its first sequential grid point. A check then re-runs that first point
  only, each lane starting from the previous lane's final scratch: equal
  states prove each lane started from its grid-order state (induction), so
  the pass is the sequential result; otherwise the sequential loop runs.
  ``dimension_semantics`` is thus checked, never trusted.
* The kernel writes no input (aliased inputs are private copies, but shared
  by every grid point), no output has ``Element`` dims (overlapping
  windows), and no debugging option that observes grid order is on.
* Every primitive has a batched rule, or is pure / touches only its own ref
  operands, so it can be run lane by lane inside the pass ("lane loop").
  Anything else (context-dependent TPU/GPU primitives, callbacks, prints)
  raises ``NotBatchable`` and the grid runs sequentially.

Layout: a pass stores its lane-stacked values lanes-first or, for kernels
whose values have short last axes, lanes-last (the lane axis contiguous in
memory; see ``pallas_np.grid.slab_runner``). Same values either way.

This module decides and drives a vectorized run: ``GridVectorizer`` (per
kernel plan: the compiled batched kernel and index maps, the choice of
axes), ``run_vectorized`` (one call's run, with the scratch hand-over check).
The analysis lives in ``pallas_np.grid.lanes``, the passes in
``pallas_np.grid.slab_runner``, the batched rules with their primitives.

Sequential axes stay sequential: each slab of lanes walks the sequential
grid points in JAX order, with its own lane-private scratch. Control flow that
depends on a batched value runs per lane group: ``cond`` splits lanes by
branch (contiguous lane ranges use views, others copy in and out), a
``while`` whose predicate differs per lane keeps iterating the lanes still
active. If anything fails in a vectorized run, the kernel is re-run
sequentially from fresh buffers, so errors name the exact grid point.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from pallas_np import _compat as jc
from pallas_np import debugging
from pallas_np.batching import BatchCompiler, NotBatchable
from pallas_np.compiler import RunContext
from pallas_np.grid.lanes import (
    MAX_GRID, has_gemm, lane_axes, loop_axes, order_free_reason, owned, partly_read_operands,
    per_grid, prefers_lanes_last)
from pallas_np.grid.slab_runner import (
    SlabRunner, block_windows, bytes_per_lane, lane_points, lane_view)
from pallas_np.memory import fill_value

# vectorize=None (auto) batches only grids whose per-grid-point blocks are
# small: there the Python cost per grid point dominates. With bigger blocks
# NumPy is already busy and the batched temporaries only fall out of cache.
# Kernels with scratch also pay the hand-over check (their first sequential
# grid point once more), hence less (_auto_lane_limit); with a single
# sequential point that is a second whole pass: _AUTO_LANE_BYTES_SCRATCH.
_AUTO_LANE_BYTES = 128 << 10      # exclusive
# Lanes last, a batched pass stays ahead of the grid loop with bigger blocks
# (benchmarks/PERF_LOG.md, entry 70).
_AUTO_LANE_BYTES_LANES_LAST = 512 << 10  # exclusive
_AUTO_LANE_BYTES_SCRATCH = 16 << 10
# Auto mode batches at least this many lanes (a 2-lane pass of a fori_loop
# body over ref rows was slower than the loop), and kernels with a matrix
# product at least _AUTO_MIN_GEMM_LANES: their BLAS calls are the same
# batched or not, so a few lanes save only a few grid steps of Python and
# lose the pass's copies and the scratch hand-over check (PERF_LOG).
_AUTO_MIN_LANES = 3
_AUTO_MIN_GEMM_LANES = 8


class GridVectorizer:
  """Per KernelPlan: the static part of the analysis and the compiled
  batched kernels/index maps (built lazily, once)."""

  def __init__(self, kp, compiler_params=None):
    self.kp = kp
    self.reason = None
    self.last_failure = None
    self.candidates: tuple[int, ...] = ()
    self._kernels: dict[Any, Any] = {}
    self._maps: dict[Any, Any] = {}
    self._chosen: dict[Any, Any] = {}
    # id(choice) -> (choice, SlabRunner or why not): see run_vectorized
    self.runners: dict[Any, Any] = {}
    # Static grids whose pass was declined before anything ran for a reason
    # that holds for every call of that grid (Declined.every_call): their
    # runs go straight to the sequential loop.
    self.declined_grids: set = set()
    # Cleared when a pass with shared outputs found lanes that communicate.
    self.shared_outputs_ok = True
    # pass_front.OnePassFront of a one-pass grid's warm calls: None until a
    # run looks for one, False where that run found none.
    self.front = None
    self._lanes_last = None  # prefers_lanes_last(kp), computed once
    self._loop_axes = None  # loop_axes(kp), computed once
    self._partly_read = None  # partly_read_operands(kp), computed once
    self._has_gemm = None  # has_gemm(kp), computed once
    self.last_layout = None  # the last pass's: "lanes-first" or "lanes-last"
    self.last_axes = None  # the grid axes the last pass batched
    params = kp.params
    self.reason = order_free_reason(kp)
    if self.reason is not None:
      return
    self.candidates = tuple(range(len(kp.grid)))
    if not self.candidates:
      self.reason = "no grid"
      return
    if params.vectorize is None:
      # Outputs and scratch are batched whatever the analysis finds: when
      # they alone are too big, skip the (costly, first-call) analysis.
      # (Whole-array outputs may be shared ones, written in place.)
      outs_only = (False,) * kp.num_inputs + tuple(
          bool(kp.scratch_avals) or not geo.whole for geo in kp.blocks[kp.num_inputs:])
      if bytes_per_lane(kp, outs_only) >= _auto_lane_limit(kp, self.lanes_last):
        self.reason = _TOO_BIG

  @property
  def lanes_last(self) -> bool:
    """The layout of this kernel's batched passes (LANES_LAST overrides)."""
    if LANES_LAST is not None:
      return LANES_LAST
    if self._lanes_last is None:
      self._lanes_last = prefers_lanes_last(self.kp)
    return self._lanes_last

  # -- compiled pieces ----------------------------------------------------------
  def index_maps(self, batched_axes):
    key = batched_axes
    hit = self._maps.get(key)
    if hit is None:
      kp = self.kp
      comp = BatchCompiler(kp.params, kp.name + "_index_map", frozenset())
      flags = tuple(d in batched_axes for d in range(len(kp.grid))) + (False,) * kp.num_index
      hit = [comp.compile(bm.index_map_jaxpr, in_batched=flags, first_calls=True)
             for bm in kp.grid_mapping.block_mappings]
      self._maps[key] = hit
    return hit

  def kernel(self, batched_axes, operand_batched, lanes_last=False):
    key = (batched_axes, operand_batched, lanes_last)
    hit = self._kernels.get(key)
    if hit is None:
      kp = self.kp
      local = kp.local_dims
      pid_axes = frozenset(local.index(d) for d in batched_axes if d in local)
      comp = BatchCompiler(kp.params, kp.name, pid_axes, lanes_last=lanes_last)
      flags = ((False,) * kp.num_index + operand_batched
               + (True,) * len(kp.scratch_avals))
      try:
        hit = comp.compile(kp.kernel_jaxpr, in_batched=flags, first_calls=True)
        hit.lane_access_bytes = comp.lane_access_bytes
      except NotBatchable as e:  # remembered: the next call skips the compile
        hit = e
      self._kernels[key] = hit
    if isinstance(hit, NotBatchable):
      raise hit
    return hit

  # -- analysis on a concrete grid -----------------------------------------------
  def choose(self, grid, index_ops):
    """(batched_axes, block indices of every grid point per operand) or None.
    Cached per grid when the index maps depend on nothing else (no scalar
    prefetch)."""
    return per_grid(self._chosen, self.kp, grid, index_ops, self._choose)

  def _choose(self, grid, index_ops):
    total = math.prod(grid)
    if not self.candidates or total <= 1 or total > MAX_GRID:
      return None
    ndim = len(grid)
    coords = np.indices(grid, dtype=np.int32).reshape(ndim, -1)
    maps = self.index_maps(tuple(range(ndim)))
    ctx = RunContext(self.kp.name, self.kp.params)
    ctx.batch_size = total
    block_idx = []
    for m, geo in zip(maps, self.kp.blocks):
      outs = m.fn(ctx, *coords, *index_ops)
      cols = [np.broadcast_to(np.asarray(o, np.int64), (total,)) for o in outs]
      block_idx.append(cols)
    n_in = self.kp.num_inputs
    if self._loop_axes is None:
      self._loop_axes = loop_axes(self.kp)
    axes = lane_axes(grid, coords, block_idx[n_in:], bool(self.kp.scratch_avals),
                     self._loop_axes)
    if axes is not None:
      return axes, block_idx, frozenset()
    if self.kp.scratch_avals or not self.shared_outputs_ok:
      return None
    # Outputs every grid point sees whole (Triton style): batch every axis,
    # each lane with a private copy, checked and merged after the pass.
    axes = tuple(d for d in range(ndim) if grid[d] > 1)
    shared = frozenset(n_in + o for o, cols in enumerate(block_idx[n_in:])
                       if all((c == c[0]).all() for c in cols))
    owned_cols = [cols for o, cols in enumerate(block_idx[n_in:]) if n_in + o not in shared]
    if not shared or not owned(grid, coords, axes, owned_cols):
      return None
    return axes, block_idx, shared



class Declined:
  """``run_vectorized``'s answer when the analysis says no before anything
  ran: the fresh ``prepare()`` it made, untouched, for the sequential loop
  (a warm call of a grid auto mode does not batch prepares once).
  ``every_call``: the answer depends on the grid alone (a static grid, no
  scalar prefetch for the index maps to read, no operand layout consulted),
  so every later call of this grid gets it too."""
  __slots__ = ("prepared", "every_call")

  def __init__(self, prepared, every_call=False):
    self.prepared = prepared
    self.every_call = every_call


def run_vectorized(kp, gv: GridVectorizer, prepare):
  """Run the whole grid vectorized; the output buffers, or ``Declined``
  (nothing ran: fall back to the sequential loop on its buffers) when the
  analysis says no, or None when a checked pass must be redone sequentially.

  ``prepare()`` gives fresh (grid, index_ops, buffers, out_bufs).

  Scratch persists across grid points, so in grid order lane ``l`` starts
  from the scratch lane ``l-1`` left. Kernels (nearly) always re-initialise
  it, so we run with lane-private scratch, then re-run each lane's first
  sequential point starting from the previous lane's final scratch: if every
  lane reaches the same state (scratch, output blocks) as in the pass, each
  lane started from exactly the state it has in grid order (by induction over
  lanes), so the pass is the sequential result (``_run_checked``).
  Otherwise: sequential loop."""
  prepared = prepare()
  grid, index_ops, buffers, out_bufs = prepared
  # (a static grid without scalar prefetch: the choice is the grid's)
  per_grid_only = kp.static_grid is not None and not kp.num_index
  chosen = gv.choose(grid, index_ops)
  if chosen is None:
    return Declined(prepared, per_grid_only)
  # The auto limit may look at the layout of partly read inputs (lane views).
  layout = tuple((b.shape, b.strides) for b in buffers) if gv._partly_read else None
  runner = gv.runners.get(id(chosen))
  if runner is None or runner[0] is not chosen or runner[2:] != (LANES_LAST, layout):
    runner = (chosen, _slab_runner(kp, gv, grid, chosen, buffers), LANES_LAST,
              tuple((b.shape, b.strides) for b in buffers) if gv._partly_read else None)
    if len(gv.runners) >= 16:  # as the choices per grid
      gv.runners.clear()
    gv.runners[id(chosen)] = runner
  if isinstance(runner[1], str):
    gv.last_failure = runner[1]
    return Declined(prepared, per_grid_only and layout is None)
  if runner[1].one_pass():  # one batched call of the kernel: no loops
    one = runner[1]
    gv.last_layout, gv.last_axes = "lanes-first", one.axes
    progress = debugging.progress_bar(kp.name, math.prod(grid), kp.params)
    try:
      one.run_one_pass(index_ops, buffers, progress)
    finally:
      if progress is not None:
        progress.close()
    return out_bufs
  runner = runner[1].per_call()  # per-call state (progress) on a copy; positions shared
  shared = runner.shared
  lanes_last = any(runner.slab_lanes_last(hi - lo) for lo, hi in runner.slabs)
  gv.last_layout = "lanes-last" if lanes_last else "lanes-first"
  gv.last_axes = runner.axes
  checked = runner.n_lanes if kp.scratch_avals else 0  # the hand-over check's points
  runner.progress = debugging.progress_bar(kp.name, math.prod(grid) + checked, kp.params)
  try:
    return _run_checked(kp, gv, runner, prepare, index_ops, buffers, out_bufs)
  except NotBatchable:
    if shared:  # lanes that communicate, or an access the pass cannot see
      gv.shared_outputs_ok = False
      gv._chosen.clear()
      gv.runners.clear()
    raise
  finally:
    if runner.progress is not None:
      runner.progress.close()


def _slab_runner(kp, gv, grid, chosen, buffers):
  """The SlabRunner of a choice of lanes (reused while the choice is: the
  block positions of every slab and step are then computed once), or why
  auto mode does not batch (a string)."""
  axes, block_idx, shared = chosen
  n_in = kp.num_inputs
  maps = gv.index_maps(axes)
  # Operands whose block does not depend on a batched axis are shared; so
  # are outputs every lane sees whole (written in place, SharedOutputs).
  operand_batched = tuple((i not in shared) if i >= n_in else any(m.out_batched)
                          for i, m in enumerate(maps))
  auto = kp.params.vectorize is None
  n_lanes = math.prod(grid[d] for d in axes)
  if auto and n_lanes < _AUTO_MIN_LANES:
    return _TOO_FEW
  if auto and n_lanes < _AUTO_MIN_GEMM_LANES:
    if gv._has_gemm is None:
      gv._has_gemm = has_gemm(kp)
    if gv._has_gemm:
      return _TOO_FEW
  lanes_last = gv.lanes_last and not shared
  limit = _auto_lane_limit(kp, lanes_last, math.prod(grid) // n_lanes)
  weighed = operand_batched
  if auto:
    weighed = _weighed_operands(kp, gv, grid, axes, block_idx, buffers, operand_batched)
  if auto and bytes_per_lane(kp, weighed) >= limit:
    return _TOO_BIG
  plan = gv.kernel(axes, operand_batched, lanes_last)  # may raise NotBatchable
  if auto and bytes_per_lane(kp, weighed) + plan.lane_access_bytes >= limit:
    return _TOO_BIG
  runner = SlabRunner(kp, grid, axes, block_idx, operand_batched, plan, shared,
                      plan.lane_access_bytes, lanes_last)
  if LANES_LAST is not None:  # a forced layout applies to every slab
    runner.lanes_last_min_bytes = 0
  return runner


def _run_checked(kp, gv, runner, prepare, index_ops, buffers, out_bufs):
  if not kp.scratch_avals:
    runner.run(index_ops, buffers, None)
    return out_bufs
  # The hand-over check. A lane's state after its first sequential grid
  # point (scratch and output blocks: inputs are read-only here) determines
  # the rest of its run, so re-running that point alone from the handed
  # scratch is as good a proof as a second whole pass, at 1/n_seq the cost.
  states = _FirstStates(kp, runner)
  finals = runner.run(index_ops, buffers, None, states)
  handed = [np.concatenate([np.full((1, *a.shape), fill_value(a.dtype, kp.params), f.dtype), f[:-1]])
            for a, f in zip(kp.scratch_avals, finals)]
  states.checking = True
  _, check_ops, check_buffers, _ = prepare()  # fresh outputs: the first point's start
  runner.run(check_ops, check_buffers, handed, states, runner.seq_points[:1])
  if states.differ:
    gv.last_failure = "scratch carried from one lane to the next"
    return None
  return out_bufs


class _FirstStates:
  """Every lane's scratch and output blocks right after its first sequential
  grid point: recorded by the pass, then compared (bit for bit) by the
  hand-over check. Slabs touch disjoint lane ranges, so threads may share it."""

  def __init__(self, kp, runner):
    if not all(runner.operand_batched[kp.num_inputs:]):
      raise NotBatchable("an output block shared by the lanes of a kernel with scratch")
    n = runner.n_lanes
    self.scratch = [np.empty((n, *a.shape), np.dtype(jc.physical_dtype(a.dtype)))
                    for a in kp.scratch_avals]
    self.outputs = {
        b: np.empty((n, *[size for kind, size in zip(geo.kinds, geo.sizes) if kind != "squeezed"]),
                    np.dtype(jc.physical_dtype(geo.dtype)))
        for b, geo in enumerate(kp.blocks) if b >= kp.num_inputs}
    self.checking = False
    self.differ = False

  def visit(self, lo, hi, scratch, blocks):
    """``scratch``: the slab's lane-stacked scratch; ``blocks``: output
    operand -> its lanes' blocks (lanes first)."""
    pairs = [*zip(self.scratch, scratch), *((self.outputs[b], v) for b, v in blocks.items())]
    for rec, now in pairs:
      if not self.checking:
        rec[lo:hi] = now
      elif rec[lo:hi].tobytes() != np.ascontiguousarray(now).tobytes():
        self.differ = True


_TOO_BIG = "blocks too big to gain from batching (auto mode)"
_TOO_FEW = "too few lanes to gain from batching (auto mode)"


def _auto_lane_limit(kp, lanes_last=False, n_seq=None):
  """Per-lane bytes below which auto mode batches. With scratch the check
  re-runs the first of ``n_seq`` sequential points: a pass costs 1 + 1/n_seq
  (``None``: not known yet, the most lenient). Paged-attention decode (16
  pages per sequence, ~70 KiB per lane) is faster batched (PERF_LOG)."""
  limit = _AUTO_LANE_BYTES_LANES_LAST if lanes_last else _AUTO_LANE_BYTES
  if not kp.scratch_avals or n_seq is None:
    return limit
  if n_seq < 2:  # the check is a second whole pass
    return _AUTO_LANE_BYTES_SCRATCH
  return limit * n_seq // (n_seq + 1)


def _weighed_operands(kp, gv, grid, axes, block_idx, buffers, operand_batched):
  """The batched operands the auto limit weighs: all but inputs the kernel
  reads only in windows smaller than the block (``partly_read_operands``)
  whose lanes are views of the input (no copy; checked at the first
  sequential grid point): a lane moves only those windows, which the batched
  plan counts as accesses. Causal attention reading 64-row tiles of whole
  K/V blocks batches over (batch, head) that way."""
  if gv._partly_read is None:
    gv._partly_read = partly_read_operands(kp)
  if not gv._partly_read:
    return operand_batched
  flat = lane_points(grid, axes)
  weighed = list(operand_batched)
  for b in gv._partly_read:
    if b < kp.num_inputs and operand_batched[b]:
      cols = [c[flat] for c in block_idx[b]]
      if lane_view(block_windows(buffers[b], kp.blocks[b]), cols) is not None:
        weighed[b] = False
  return tuple(weighed)



LANES_LAST = None  # True/False: force the layout of every batched pass (tests)
