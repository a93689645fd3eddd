"""Independent grid points on a thread pool: the multi-core way to take the
grid loop away when blocks are too big to batch (pallas_np.grid.vectorize).

Why it can pay: NumPy releases the GIL inside every ufunc, copy and BLAS
call. When each NumPy call of a kernel is long (tens of microseconds: blocks
of ~10^5 elements, as in a bitonic sort of 128 rows x 1024), two threads on
two cores overlap most of the work. When calls are short, GIL hand-offs make
threads a loss, and GEMMs already use every core through BLAS (numbers in
benchmarks/PERF_LOG.md, design in docs/grid.md). So ``num_threads=None``
(auto) runs threads only for *wide*, GEMM-free kernels; ``num_threads=n``
asks for them whenever legal.

Legal when (all checked, nothing trusted):

* the vectorizer's order-free conditions (``lanes.order_free_reason``);
* no scratch (it carries state from one grid point to the next);
* every primitive is context-free: no DMA, semaphores, PRNG state, prints or
  callbacks (their order or shared state would differ between threads);
* every output block is owned by one *lane* (``lanes.lane_axes``, on
  the index maps evaluated at every grid point, scalar prefetch included).

Each thread walks whole lanes, their grid points in JAX order, so every
output block sees the same sequence of writes as in the sequential loop:
results are identical. If anything raises, the grid runs again sequentially
from fresh buffers, so the error names the first failing grid point exactly
as in sequential mode.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import math
import os
import statistics
import threading

import numpy as np

from pallas_np import debugging, registry
from pallas_np.grid import lanes
from pallas_np.compiler import RunContext

# Auto mode: a kernel is wide when the median eqn result has at least this
# many elements (a float32 ufunc over it takes ~10 us: GIL hand-offs amortised).
_WIDE_ELEMENTS = 1 << 15


def cores() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    return os.cpu_count() or 1


class ThreadPlan:
  """Per KernelPlan: whether (and on how many threads) its grid may run on a
  thread pool; ``reason`` says why not."""

  def __init__(self, kp):
    self.kp = kp
    self.threads = 1
    self._chunks: dict = {}
    self.reason = self._static_reason(kp)
    if self.reason is None:
      requested = kp.params.num_threads
      self.threads = cores() if requested is None else int(requested)
      if self.threads < 2:
        self.reason = "one thread (num_threads=1 or one core)"

  @staticmethod
  def _static_reason(kp):
    requested = kp.params.num_threads
    if requested is not None and int(requested) < 2:
      return "num_threads=1"
    if not kp.several_points:
      return "one grid point"
    reason = lanes.order_free_reason(kp)
    if reason is not None:
      return reason
    if kp.scratch_avals:
      return "the kernel has scratch (state carried across grid points)"
    if kp.params.num_cores > 1:
      return "num_cores > 1 (megacore split)"
    sizes, gemm = [], False
    for eqn in lanes.all_eqns(kp.kernel_jaxpr):
      # Rules that take the run context but keep no state across grid points
      # (grid position, control flow and calls, whose sub-plans are checked
      # too, scoped allocations, no-ops) are registered context_free; any
      # other context rule keeps the grid serial.
      rule = registry.properties(eqn.primitive)
      if rule.needs_ctx and not rule.context_free:
        return f"`{eqn.primitive.name}` depends on grid order or per-core state"
      gemm = gemm or rule.gemm
      sizes.append(max((math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars),
                       default=0))
    if requested is None:
      if gemm:
        return "auto: GEMMs already use every core through BLAS"
      if not sizes or statistics.median(sizes) < _WIDE_ELEMENTS:
        return "auto: NumPy calls too short to gain from threads"
    return None

  def chunks(self, grid, index_ops):
    """Grid points per thread (each a list in grid order), or None when no
    lane structure gives every output block a single owner. Cached per grid
    (lanes.per_grid): warm calls do no analysis."""
    return lanes.per_grid(self._chunks, self.kp, grid, index_ops, self._split)

  def _split(self, grid, index_ops):
    lane_ids = self._lane_ids(grid, index_ops)
    if lane_ids is None:
      return None
    n_lanes = int(lane_ids.max()) + 1
    n = min(self.threads, n_lanes)
    if n < 2:
      return None
    owner = lane_ids * n // n_lanes  # contiguous runs of lanes per thread
    points = list(itertools.product(*map(range, grid)))
    return [[p for p, o in zip(points, owner) if o == t] for t in range(n)]

  def _lane_ids(self, grid, index_ops):
    """Lane id of every grid point (grid order), or None."""
    kp = self.kp
    total = math.prod(grid)
    if total <= 1 or total > lanes.MAX_GRID:
      return None
    ndim = len(grid)
    coords = np.indices(grid, dtype=np.int32).reshape(ndim, -1)
    ctx = RunContext(kp.name, kp.params)
    ctx.num_programs = tuple(np.int32(grid[d]) for d in kp.local_dims)
    out_maps = [m.fn for m in kp.index_maps[kp.num_inputs:]]
    rows = [[] for _ in out_maps]
    try:
      for point in itertools.product(*map(range, grid)):
        ids = tuple(np.int32(i) for i in point)
        ctx.program_ids = tuple(ids[d] for d in kp.local_dims)
        for r, m in zip(rows, out_maps):
          r.append(tuple(int(i) for i in m(ctx, *ids, *index_ops)))
    except Exception:  # the sequential run reports it at its grid point
      return None
    out_block_idx = [list(np.array(r, np.int64).reshape(total, -1).T) for r in rows]
    axes = lanes.lane_axes(grid, coords, out_block_idx, scratch=False)
    if axes is None:
      return None
    return np.ravel_multi_index(tuple(coords[d] for d in axes),
                                tuple(grid[d] for d in axes))


def run(kp, grid, index_ops, buffers, chunks) -> Exception | None:
  """Run ``chunks`` of grid points concurrently (the first in this thread).
  The first chunk's exception if any raised (the caller re-runs the grid
  sequentially), else None."""
  kp.kernel  # noqa: B018 (compile before the threads share it)
  bar = debugging.progress_bar(kp.name, sum(map(len, chunks)), kp.params)
  shared = _SharedProgress(bar) if bar is not None else None
  futures = [_pool().submit(_run_chunk, kp, grid, index_ops, buffers, c,
                            shared and shared.part())
             for c in chunks[1:]]
  try:
    failures = [_run_chunk(kp, grid, index_ops, buffers, chunks[0], shared and shared.part())]
    failures += [f.result() for f in futures]
  finally:
    if bar is not None:
      bar.close()
  return next((e for e in failures if e is not None), None)


def _run_chunk(kp, grid, index_ops, buffers, points, progress) -> Exception | None:
  try:
    with np.errstate(all="ignore"):  # errstate is per thread
      kp.run_grid(grid, index_ops, buffers, [], points=points, progress=progress)
    return None
  except Exception as e:
    return e


class _SharedProgress:
  """One progress bar for all chunks: each chunk's loop ticks its own count,
  the bar shows the sum."""

  def __init__(self, bar):
    self.bar = bar
    self.done = 0
    self.lock = threading.Lock()

  def part(self):
    return _ProgressPart(self)


class _ProgressPart:
  __slots__ = ("shared", "seen")

  def __init__(self, shared):
    self.shared, self.seen = shared, 0

  def tick(self, done):
    s = self.shared
    with s.lock:
      s.done += done - self.seen
      self.seen = done
      s.bar.tick(s.done)


_POOL = None
_POOL_LOCK = threading.Lock()


def _forget_pool():
  # A forked child has none of the parent's threads: an inherited pool
  # would queue work that no thread ever picks up.
  global _POOL, _POOL_LOCK
  _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_forget_pool)


def _pool():
  global _POOL
  if _POOL is None:
    with _POOL_LOCK:
      if _POOL is None:
        # Threads start on demand, up to the most any run asks for.
        _POOL = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="pallas_np")
  return _POOL
