"""The per-call floor of small sequential grids: a warm call of a static
grid that runs as the plain grid loop goes from its operands to the loop's
steps without the layers that chose that loop.

``GridRun.run`` asks, on every call of such a grid, whether to batch it
(``_run_vectorized``: the vectorizer declined this grid for good, answered
from ``GridVectorizer.declined_grids``), whether to use threads (the thread
plan's fixed ``reason``, or no chunks for this grid), whether a race
detector runs, then ``KernelPlan.run_grid`` rebuilds its context, the
constant blocks' views, the grid's steps lookup and the progress bar: in
situ ~15-25 µs a call (PERF_LOG ``[floor]``: cumsum_fori 135.5 → 121.1 µs,
int8_matmul 598.8 → 579.1). ``LoopFront`` holds those answers, found after a
sequential run that took that path, and runs what the full path would run:
the same buffers (``KernelPlan.prepare``'s recipe), the same scratch
allocators, the same steps (``KernelPlan._grid_schedule``: the block
indices that change per point), the kernel's current ``fn``, the DMA
check, the same error at the same grid point (``kernel_error``), the
progress bar, the padding cut (``BufferSetup.results``). Each call checks
that the vectorizer still declines the grid (a cleared
``declined_grids`` sends the call back to the full path, which decides
again); nothing else it holds can change for a plan (its params, grid,
blocks and thread plan are fixed).

Not built for: dynamic grids or scalar prefetch (the steps depend on
values), race detection, ``explain`` or a race record (each run
registers), a trace callback, a fast path that failed in the run.
"""
from __future__ import annotations

from pallas_np import debugging
from pallas_np.compiler import RunContext
from pallas_np.errors import KernelError
from pallas_np.state import dma


class LoopFront:
  """``GridRun.run`` of a warm sequential grid (see the module doc):
  ``__call__(kp, args)`` returns the outputs, or None where the full path
  must run the call."""
  __slots__ = ("gv", "grid", "schedule", "views", "num_programs", "total", "n_args")

  def __init__(self, kp, gv, schedule):
    self.gv = gv
    self.grid = kp.static_grid
    self.schedule = schedule
    # Per block: None (dynamic: the first step sets it), True (the whole
    # buffer) or the index of its one block (a constant index map).
    self.views = tuple(True if geo.whole else
                       (geo.zero_block_index(kp.clamp) if geo.trivial_index_map else None)
                       for geo in kp.blocks)
    self.num_programs = tuple(kp._num_programs[1])  # noqa: SLF001 - set by the run for this grid
    self.total = len(schedule)
    self.n_args = kp.num_inputs

  @classmethod
  def of(cls, kp):
    """The front of ``kp``'s last run where it was the sequential loop of a
    static grid with no per-call question left open, else None."""
    grid, params = kp.static_grid, kp.params
    if (grid is None or kp.num_index or params.detect_races or params.explain is not None
        or params.race_policy == "record" or params.trace is not None
        or kp._num_programs[0] != grid):  # noqa: SLF001
      return None
    gv = kp.vectorizer
    if params.vectorize is False or not kp.several_points:
      gv = None  # (never batched: nothing to check per call)
    elif gv is None or (gv.reason is None and grid not in gv.declined_grids):
      return None
    elif gv.reason is not None:
      gv = None
    threads = kp.thread_plan()
    if threads.reason is None and threads.chunks(grid, []) is not None:
      return None
    dynamic = [b for b, geo in enumerate(kp.blocks) if not geo.whole and not geo.trivial_index_map]
    schedule = kp._grid_schedule(grid, dynamic)  # noqa: SLF001
    if schedule is None:
      return None
    return cls(kp, gv, schedule)

  def __call__(self, kp, args):
    gv = self.gv
    if gv is not None and self.grid not in gv.declined_grids:
      return None
    if len(args) != self.n_args:
      return None  # (the full path's assertion)
    _grid, _index_ops, buffers, out_bufs = kp.prepare(args)
    scratch = kp.fresh_scratch()
    ctx = RunContext(kp.name, kp.params)
    ctx.device = None
    ctx.num_programs = self.num_programs
    kernel = kp.kernel.fn
    views = [buf if v is True else (None if v is None else buf[v])
             for v, buf in zip(self.views, buffers)]
    progress = debugging.progress_bar(kp.name, self.total, kp.params) if self.total > 1 else None
    point = ()
    try:
      for step, (point, program_ids, changes) in enumerate(self.schedule):
        ctx.grid_point = point
        ctx.program_ids = program_ids
        for b, idx in changes:
          views[b] = buffers[b][idx]
        kernel(ctx, *views, *scratch)
        if progress is not None:
          progress.tick(step + 1)
      if ctx.rules is not None:
        dma.check_finished(ctx, buffers)
    except KernelError:
      raise
    except Exception as e:
      raise kp.kernel_error(e, point) from e
    finally:
      if progress is not None:
        progress.close()
    kp.last_mode = "sequential"
    return kp.setup.results(out_bufs)
