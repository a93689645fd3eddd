"""The one grid executor: runs a compiled kernel over its grid, the way
``interpret=True`` does, but with NumPy arrays mutated in place.

Data flow for one ``pallas_call``::

    params (jaxpr, GridMapping) --KernelPlan()--> plan: compiled kernel,
        compiled index maps, block geometry, buffers to allocate
    plan.run(*operands) --> pad operands whose shape is not a multiple of the
        block, allocate outputs/scratch, then for each grid point (JAX order,
        last axis fastest): evaluate index maps, take block *views* of the
        (padded) arrays, call the kernel plan on them --> slice padding off.

Semantics mirrored from ``jax._src.pallas.hlo_interpreter``: edge blocks read
padding filled with the "uninitialized" value and their writes to padding are
dropped; outputs start uninitialized unless aliased to an input; scratch
persists across grid steps; input refs the kernel writes to are private
copies. An aliased input whose ref is the HBM buffer itself (memory space
ANY/HBM/GMEM, or any block of a GPU kernel) and its output are *one* buffer,
as on the hardware and in JAX's TPU interpret mode (``shared_aliases``).
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from pallas_np import _compat as jc
from pallas_np import blas, debugging, devices, fp_state, memory, races, registry
from pallas_np.compiler import Compiler, RunContext, failing_eqns, new_run
from pallas_np.errors import UnsupportedError, KernelError, check_fallback, kernel_error_class
from pallas_np.grid import lanes, threads, vectorize
from pallas_np.grid.blocks import BlockGeometry, index_map_origin
from pallas_np.grid.buffers import BufferSetup
from pallas_np.memory import allocate
from pallas_np.params import InterpretParams
from pallas_np.state import dma


class KernelPlan:
  """A pallas_call compiled for the NumPy interpreter (built once, run many)."""

  def __init__(self, *, jaxpr, grid_mapping, input_output_aliases, out_avals,
               params: InterpretParams, name=None, debug=False,
               compiler_params=None, **_unused):
    if jaxpr.constvars:
      raise UnsupportedError("pallas_np: pallas_call kernels that close over refs are not supported")
    if _unused.get("mesh") is not None:  # what a mesh kernel's fallback lowering builds
      raise UnsupportedError(
          f"pallas_np: pallas_call over a mesh ({_unused['mesh']!r}; pl.kernel/pl.core_map "
          f"mesh kernels) is not supported in numpy mode yet (kernel "
          f"{getattr(jaxpr.debug_info, 'func_src_info', None) or _kernel_name(jaxpr)})")
    memory.tune_once()
    self.params = params
    self.compiler_params = compiler_params
    gm = grid_mapping
    self.grid_mapping = gm
    self.name = name or _kernel_name(jaxpr)
    self.compiler = Compiler(params, self.name)
    self.kernel_jaxpr = jaxpr
    self._kernel = None  # the sequential plan, compiled on first use
    self._device_features = None
    if debug:
      print(f"pallas_np plan for {self.name}:\n{self.kernel.source}")
    self.grid = tuple(gm.grid)
    self.num_dynamic = gm.num_dynamic_grid_bounds
    self.num_index = gm.num_index_operands
    self.num_inputs = gm.num_inputs
    self.num_outputs = gm.num_outputs
    self.vmapped_dims = tuple(gm.vmapped_dims)
    self.local_dims = tuple(d for d in range(len(self.grid)) if d not in self.vmapped_dims)
    self.blocks = [BlockGeometry(bm) for bm in gm.block_mappings]
    self.index_maps = [self.compiler.compile(bm.index_map_jaxpr, first_calls=True)
                       for bm in gm.block_mappings]
    self.scratch_avals = [a.inner_aval if isinstance(a, jc.AbstractRef) else a
                          for a in gm.scratch_avals]
    # JAX numbers aliased inputs over all operands, scalar prefetch
    # included (after the dynamic grid bounds).
    self.out_for_in = {o: i for i, o in input_output_aliases}
    self.out_avals = out_avals
    written = jc.written_invar_positions(jaxpr)
    self.written_inputs = frozenset(
        i for i in range(self.num_index + self.num_inputs) if i in written)
    # The one place operands become a run's buffers (padding, private
    # copies, aliased outputs; pallas_np.grid.buffers).
    self.setup = BufferSetup(self.blocks, gm.block_mappings, num_index=self.num_index,
                             num_inputs=self.num_inputs,
                             out_for_in=self.out_for_in, written=self.written_inputs,
                             params=params, compiler_params=compiler_params)
    # output -> operand position of the aliased pairs that are one buffer
    self.shared_aliases = self.setup.shared
    self.clamp = params.bounds_check == "clamp"
    self.parallel_prefix = _parallel_prefix(compiler_params or {}, len(self.grid))
    if gm.local_grid_env is not None:
      raise UnsupportedError("pallas_np: pallas_call with a mesh/local grid env is not supported")
    self.vectorizer = None
    self._threads = None  # threads.ThreadPlan, built on the first sequential run
    # More than one grid point (or a dynamic grid): vectorizing or threading
    # the grid may pay.
    self.several_points = not all(isinstance(g, int) for g in self.grid) or \
        int(np.prod(self.grid, dtype=np.int64)) > 1
    # "vectorized", "threaded" or "sequential": how the last run() went.
    self.last_mode = None
    # The grid when no dimension is dynamic (every _prepare would rebuild it).
    self._static_grid = (None if self.num_dynamic else tuple(int(g) for g in self.grid))
    self._num_programs = ((), ())  # (grid, num_programs of the local dims), last used
    # Built on the first run, then reused by every call (the per-call floor):
    self._single = None  # a one-point grid's _SinglePoint, or False (set by run)
    self._uses_blas = None  # whether a run needs blas.kernel_run (may_use_blas)
    self._schedules = {}  # grid -> the grid loop's steps, or False (_grid_schedule)

  @property
  def kernel(self):
    """The kernel's sequential plan. Compiled lazily: a vectorized grid
    runs a batched plan instead, and the kernel is the biggest compile."""
    if self._kernel is None:
      self._kernel = self.compiler.compile(self.kernel_jaxpr, first_calls=True)
    return self._kernel

  @property
  def device_features(self):
    """(axis names the kernel reads with axis_index, whether it talks to
    other devices): such a kernel runs as one instance per device inside a
    shard_map (``devices.device_features``)."""
    if self._device_features is None:
      self._device_features = devices.device_features(self.kernel_jaxpr)
    return self._device_features

  # -- execution ---------------------------------------------------------------
  def run(self, *args, placement=None) -> list[np.ndarray]:
    """``placement``: a ``devices.Placement`` when this is one device's
    instance of a multi-device kernel (pallas_np.api passes it inside a
    shard_map); such a run is sequential and meets its peers (devices.py)."""
    # inf/NaN arithmetic is silent, as in XLA: kernels mask with huge
    # negative values on purpose (e.g. paged attention's mask_value).
    new_run()
    uses_blas = self._uses_blas
    if uses_blas is None:
      uses_blas = self._uses_blas = may_use_blas(self.kernel_jaxpr)
      self._single = _SinglePoint.of(self)
    quiet = fp_state.quiet_floats()  # np.errstate(all="ignore"), cheaply
    try:
      if placement is not None:
        with blas.kernel_run():
          return self._run_on_device(args, placement)
      run = self._run_single_point if self._single else self._run
      if not uses_blas:  # no GEMM: the BLAS thread count is not ours to set
        return run(*args)
      with blas.kernel_run():
        return run(*args)
    finally:
      fp_state.restore_floats(quiet)

  def _run_on_device(self, args, placement):
    if self.params.num_cores > 1 and self.parallel_prefix:
      raise UnsupportedError(
          f"pallas_np: kernel '{self.name}': num_cores > 1 together with multi-device "
          "communication (axis_index, remote DMAs) is not supported")
    grid, index_ops, buffers, out_bufs = self._prepare(args)
    scratch = [allocate(a.shape, a.dtype, self.params) for a in self.scratch_avals]
    targets = [*index_ops,
               *(buf if geo.whole else None for geo, buf in zip(self.blocks, buffers)),
               *scratch]
    # A kernel that only reads axis_index needs no peers: no session.
    me = devices.enter(placement, targets) if self.device_features[1] else \
        devices.DeviceContext(placement, targets)
    me.target_names = [*(f"scalar prefetch {i}" for i in range(len(index_ops))),
                       *(str(geo.origin) for geo in self.blocks),
                       *(f"scratch_operands[{i}]" for i in range(len(scratch)))]
    error = None
    try:
      if self.params.detect_races and me.session is not None:
        devices.check_races(me, self.name)
      detector = races.for_run(self, grid, buffers, scratch)
      if detector is not None and me.session is not None and me.session.races is not None:
        detector.device_hook = lambda view, index, kind: me.note_local(
            view, index, kind, detector.point)
      if detector is None:
        self.run_grid(grid, index_ops, buffers, scratch, device=me)
      else:
        with races.activate(detector):
          self.run_grid(grid, index_ops, buffers, scratch, detector, device=me)
    except BaseException as e:
      error = e
      raise
    finally:
      devices.leave(me, error)
    self.last_mode = "sequential"
    return self.setup.results(out_bufs)

  def _run(self, *args) -> list[np.ndarray]:
    cores = self.params.num_cores > 1 and self.parallel_prefix
    fallback = None  # (path, exception) of a fast path that failed
    prepared = None  # fresh buffers the vectorizer made and did not use
    if self.params.vectorize is not False and self.several_points and not cores:
      out, failure, prepared = self._run_vectorized(args)
      if out is not None:
        return out
      fallback = failure and ("vectorized", failure)
    grid, index_ops, buffers, out_bufs = prepared or self._prepare(args)
    if cores:
      self._run_cores(grid, index_ops, buffers)
      self.last_mode = "sequential"
      return self.setup.results(out_bufs)
    if self._threads is None:
      self._threads = threads.ThreadPlan(self)
    if self._threads.reason is None:
      chunks = self._threads.chunks(grid, index_ops)
      if chunks is not None:
        failure = threads.run(self, grid, index_ops, buffers, chunks)
        if failure is None:
          self.last_mode = "threaded"
          return self.setup.results(out_bufs)
        fallback = ("threaded", failure)
        grid, index_ops, buffers, out_bufs = self._prepare(args)  # fresh, to re-run
    scratch = [allocate(a.shape, a.dtype, self.params) for a in self.scratch_avals]
    detector = races.for_run(self, grid, buffers, scratch)
    if detector is None:
      self.run_grid(grid, index_ops, buffers, scratch)
    else:
      with races.activate(detector):
        self.run_grid(grid, index_ops, buffers, scratch, detector)
    if fallback is not None:  # the fast path failed where this run did not
      check_fallback(fallback[1], fallback[0], self.name)
    self.last_mode = "sequential"
    return self.setup.results(out_bufs)

  def _run_vectorized(self, args):
    """(outputs, None, None) of a batched grid (pallas_np.grid.vectorize);
    (None, failure, prepared) when it does not apply (failure None) or
    failed (then the sequential run starts again from fresh buffers and
    reports any error at its exact grid point; if it succeeds instead, the
    failure was a bug). ``prepared``: the untouched fresh buffers of a pass
    declined before it ran, else None."""
    if self.vectorizer is None:
      self.vectorizer = vectorize.GridVectorizer(self, self.compiler_params)
    gv = self.vectorizer
    if gv.reason is not None:
      return None, None, None
    try:
      out_bufs = vectorize.run_vectorized(self, gv, lambda: self._prepare(args))
    except vectorize.NotBatchable as e:
      gv.last_failure = e
      return None, None, None
    except Exception as e:
      gv.last_failure = e
      return None, e, None
    if out_bufs is None:
      return None, None, None
    if isinstance(out_bufs, vectorize.Declined):
      return None, None, out_bufs.prepared
    self.last_mode = "vectorized"
    return self.setup.results(out_bufs), None, None

  def _prepare(self, args):
    """(grid, scalar-prefetch operands, input and output buffers, output
    buffers) of one run: every buffer fresh or read-only (see
    ``BufferSetup``)."""
    grid = self._static_grid
    if grid is None:
      dyn, args = args[:self.num_dynamic], args[self.num_dynamic:]
      dyn_iter = iter(dyn)
      grid = tuple(int(next(dyn_iter)) if isinstance(g, jc.DynamicGridDim) else int(g)
                   for g in self.grid)
    assert len(args) == self.num_index + self.num_inputs, (
        len(args), self.num_index, self.num_inputs)
    return (grid, *self.setup.buffers(args))

  def _run_single_point(self, *args):
    """A one-point grid (``_SinglePoint``): the kernel called once on block
    views of fresh buffers, nothing of the grid loop's machinery."""
    single = self._single
    if single.operand_preps is None:
      preps = self.setup.preps()
      single.operand_preps = (*preps[0], *preps[1])
      single.out_preps = preps[2]
    if len(args) != len(single.operand_preps):
      raise TypeError(f"kernel '{self.name}' takes {len(single.operand_preps)} operands, "
                      f"got {len(args)}")
    # What _prepare does, for the one grid point: every block cut once.
    operands = [prep(a) for prep, a in zip(single.operand_preps, args)]
    out_bufs = [prep(args, operands) for prep in single.out_preps]
    operands += out_bufs
    for b, idx in single.cuts:
      operands[b] = operands[b][idx]
    for fresh in single.scratch:
      operands.append(fresh())
    ctx = RunContext(self.name, self.params)
    ctx.num_programs = single.num_programs
    ctx.grid_point = single.point
    ctx.program_ids = single.program_ids
    trace = self.params.trace
    try:
      if trace is not None:
        trace(self.name, single.point)
      self.kernel.fn(ctx, *operands)
      if ctx.extra:
        dma.check_finished(ctx)
    except KernelError:
      raise
    except Exception as e:
      raise self._kernel_error(e, single.point) from e
    self.last_mode = "sequential"
    return self.setup.results(out_bufs) if single.padded_outputs else out_bufs

  def _run_cores(self, grid, index_ops, buffers):
    """Megacore: the leading 'parallel' grid dims are split into contiguous
    chunks, one per TensorCore (as TPU interpret mode does); each core has its
    own scratch, scalar-prefetch (SMEM) copies and DMA state."""
    n_par = self.parallel_prefix
    par_points = int(np.prod(grid[:n_par], dtype=np.int64))
    rest = int(np.prod(grid[n_par:], dtype=np.int64))
    per_core = -(-par_points // self.params.num_cores) * rest
    points = list(itertools.product(*map(range, grid)))
    detector = races.for_run(self, grid, buffers, [])
    for core in range(self.params.num_cores):
      chunk = points[core * per_core:(core + 1) * per_core]
      if not chunk:
        break
      scratch = [allocate(a.shape, a.dtype, self.params) for a in self.scratch_avals]
      if detector is None:
        self.run_grid(grid, [np.array(a) for a in index_ops], buffers, scratch,
                       points=chunk)
        continue
      for i, buf in enumerate(scratch):
        detector.track(f"scratch_operands[{i}] of core {core}", buf, scratch=True)
      with races.activate(detector):
        self.run_grid(grid, [np.array(a) for a in index_ops], buffers, scratch,
                       detector, points=chunk)

  def run_grid(self, grid, index_ops, buffers, scratch, detector=None, points=None,
                progress=True, device=None):
    params = self.params
    ctx = RunContext(self.name, params)
    ctx.device = device
    local = self.local_dims
    if self._num_programs[0] != grid:
      self._num_programs = (grid, tuple(np.int32(grid[d]) for d in local))
    ctx.num_programs = self._num_programs[1]
    kernel = self.kernel.fn
    blocks = self.blocks
    clamp = self.clamp
    # Blocks whose index map is constant are cut once.
    static_views = [buf if geo.whole else
                    (buf[geo.zero_block_index(clamp)] if geo.trivial_index_map else None)
                    for geo, buf in zip(blocks, buffers)]
    dynamic = [i for i, v in enumerate(static_views) if v is None]
    index_maps = [m.fn for m in self.index_maps] if dynamic else None
    views = static_views
    last_idx = [None] * len(blocks)
    trace = params.trace
    point = ()
    total = math.prod(grid)
    schedule = None
    if dynamic and detector is None and points is None and device is None:
      schedule = self._grid_schedule(grid, dynamic)
    # progress: True = this loop's own bar; or a shared one (threads) it
    # ticks but does not close; or None.
    own_bar = progress is True
    if own_bar:
      progress = debugging.progress_bar(self.name, total, params) if total > 1 else None
    if points is None:
      points = itertools.product(*map(range, grid))
    try:
      if schedule is not None:  # the same steps, index maps evaluated once per grid
        for step, (point, program_ids, changes) in enumerate(schedule):
          ctx.grid_point = point
          ctx.program_ids = program_ids
          for b, idx in changes:
            views[b] = buffers[b][idx]
          if trace is not None:
            trace(self.name, point)
          kernel(ctx, *views, *scratch)
          if progress is not None:
            progress.tick(step + 1)
        points = ()
      for step, point in enumerate(points):
        ids = tuple(np.int32(i) for i in point)
        ctx.grid_point = point
        ctx.program_ids = tuple(ids[d] for d in local)
        for b in dynamic:
          bidx = index_maps[b](ctx, *ids, *index_ops)
          if bidx != last_idx[b]:
            last_idx[b] = bidx
            views[b] = buffers[b][blocks[b].block_index(bidx, clamp)]
        if detector is not None:
          detector.begin(step, point, last_idx)
        if trace is not None:
          trace(self.name, point)
        kernel(ctx, *index_ops, *views, *scratch)
        if progress is not None:
          progress.tick(step + 1)
      if ctx.extra:
        dma.check_finished(ctx)
      if device is not None:
        devices.check_failed(device)
    except KernelError:
      raise
    except Exception as e:
      raise self._kernel_error(e, point, device) from e
    finally:
      if own_bar and progress is not None:
        progress.close()

  def _grid_schedule(self, grid, dynamic):
    """The grid loop's steps for ``grid`` when its index maps read nothing
    but program ids (no scalar prefetch, no effects): per grid point (grid
    order), the point, its program ids and the (block, basic index) of each
    block whose index changes there. Computed on the first run of a grid,
    reused by every later one; None for big grids and where an index map or
    block raises (the loop then raises at its grid point)."""
    hit = self._schedules.get(grid)
    if hit is not None:
      return hit or None
    schedule = False
    if (self.num_index == 0 and math.prod(grid) <= SCHEDULE_MAX_POINTS
        and not any(bm.index_map_jaxpr.effects for bm in self.grid_mapping.block_mappings)):
      try:
        schedule = self._build_schedule(grid, dynamic)
      except Exception:  # noqa: BLE001 - the grid loop reports it at its point
        schedule = False
    if len(self._schedules) >= 16:
      self._schedules.clear()
    self._schedules[grid] = schedule
    return schedule or None

  def _build_schedule(self, grid, dynamic):
    ctx = RunContext(self.name, self.params)
    ctx.num_programs = tuple(np.int32(grid[d]) for d in self.local_dims)
    index_maps = [m.fn for m in self.index_maps]
    blocks, clamp = self.blocks, self.clamp
    last_idx = [None] * len(blocks)
    steps = []
    for point in itertools.product(*map(range, grid)):
      ids = tuple(np.int32(i) for i in point)
      ctx.grid_point = point
      ctx.program_ids = tuple(ids[d] for d in self.local_dims)
      changes = []
      for b in dynamic:
        bidx = index_maps[b](ctx, *ids)
        if bidx != last_idx[b]:
          last_idx[b] = bidx
          changes.append((b, blocks[b].block_index(bidx, clamp)))
      steps.append((point, ctx.program_ids, tuple(changes)))
    return tuple(steps)

  def _kernel_error(self, e: Exception, point, device=None) -> Exception:
    eqns = failing_eqns(e.__traceback__)
    where = ""
    prim = None
    source = None
    if eqns:
      prim = eqns[-1].primitive.name
      # Eqns traced inside JAX helpers (pltpu.sync_copy, ...) have no user
      # frame: name the innermost line that is the user's.
      lines = [jc.source_summary(q.source_info) for q in eqns]
      lines = [l for l in lines if l and l != "<unknown source>"]
      if lines:
        source = lines[-1]
        where = f" in primitive '{prim}' at {source}"
        if len(lines) > 1:
          where += f" (called from {' <- '.join(reversed(lines[:-1]))})"
      else:
        where = f" in primitive '{prim}'"
    origin = index_map_origin(self, e.__traceback__)
    if origin is not None:
      where = f" in the index map of {origin}" + (f" ({where.strip()})" if where else "")
    point = tuple(int(p) for p in point)
    on = f" on {device.placement.describe()}" if device is not None else ""
    msg = (f"{type(e).__name__} in Pallas kernel '{self.name}'{on} at grid point "
           f"{point}{where}: {e}")
    cls = kernel_error_class(type(e))
    err = cls(msg, kernel=self.name, program_ids=point, primitive=prim, source=source,
              original=e)
    for k, v in getattr(e, "__dict__", {}).items():  # e.g. RaceError.buffer
      if getattr(err, k, None) is None:
        setattr(err, k, v)
    if self.params.pdb:
      debugging.post_mortem(e, self, point)
    debugging.remember(err)
    return err


# Grids of at most this many points keep their grid loop's steps (block
# indices per point: a few hundred bytes each) instead of evaluating the
# index maps at every step of every run.
SCHEDULE_MAX_POINTS = 4096


class _SinglePoint:
  """What every run of a one-point grid shares: the basic index of each
  block that is not its whole buffer, the scratch allocators, the program
  ids, whether an output is padded (then cut back by ``BufferSetup.results``)."""
  __slots__ = ("cuts", "scratch", "point", "program_ids", "num_programs", "padded_outputs",
               "operand_preps", "out_preps")

  @classmethod
  def of(cls, kp) -> _SinglePoint | bool:
    """The recipe of ``kp``'s runs, or False where its grid has more (or a
    dynamic number of) points, a block's index map is not constant zero,
    or the run must go through the grid loop (race detection, explain,
    megacore)."""
    grid = kp._static_grid
    params = kp.params
    if (grid is None or math.prod(grid) != 1 or params.detect_races
        or params.explain is not None or (params.num_cores > 1 and kp.parallel_prefix)):
      return False
    if not all(geo.whole or geo.trivial_index_map for geo in kp.blocks):
      return False
    try:
      indices = [None if geo.whole else geo.zero_block_index(kp.clamp) for geo in kp.blocks]
    except Exception:  # e.g. a block bigger than its array: the grid loop raises it
      return False
    self = cls()
    self.operand_preps = self.out_preps = None  # the plan's, on the first run
    # (operand position, basic index): scalar prefetch operands come first.
    self.cuts = [(b + kp.num_index, idx) for b, idx in enumerate(indices) if idx is not None]
    self.padded_outputs = any(geo.needs_padding for geo in kp.blocks[kp.num_inputs:])
    self.scratch = [memory.allocator(a.shape, a.dtype, params) for a in kp.scratch_avals]
    self.point = (0,) * len(grid)
    self.program_ids = tuple(np.int32(0) for _ in kp.local_dims)
    self.num_programs = tuple(np.int32(grid[d]) for d in kp.local_dims)
    return self


def may_use_blas(jaxpr) -> bool:
  """Whether a kernel may call BLAS: a matrix product anywhere, or a rule
  with its own state (the MXU rules multiply)."""
  for eqn in lanes.all_eqns(jaxpr):
    rule = registry.properties(eqn.primitive)
    if rule.gemm or (rule.needs_ctx and not rule.context_free):
      return True
  return False


def _parallel_prefix(compiler_params, ndim: int) -> int:
  """Number of leading grid dims with 'parallel' semantics (TPU
  ``dimension_semantics``; other compiler params are ignored)."""
  if isinstance(compiler_params, dict):  # older JAX: {"mosaic_tpu": params}
    compiler_params = compiler_params.get("mosaic_tpu") or compiler_params.get("mosaic")
  sems = getattr(compiler_params, "dimension_semantics", None)
  if not sems:
    return 0
  n = 0
  for sem in sems:
    name = getattr(sem, "name", None) or getattr(sem, "value", None) or str(sem)
    if str(name).lower() not in ("parallel", "core_parallel"):
      break
    n += 1
  return min(n, ndim)


def _kernel_name(jaxpr) -> str:
  dbg = getattr(jaxpr, "debug_info", None)
  name = getattr(dbg, "func_name", None) if dbg is not None else None
  return name or "kernel"
