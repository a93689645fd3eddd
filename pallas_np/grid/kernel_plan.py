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
from pallas_np import blas, debugging, devices, fp_state, memory, registry
from pallas_np.compiler import Compiler, RunContext, new_run
from pallas_np.errors import UnsupportedError, KernelError
from pallas_np.grid import lanes, run_strategies, threads
from pallas_np.grid.blocks import BlockGeometry, index_map_origin
from pallas_np.grid.buffers import BufferSetup
from pallas_np.params import InterpretParams
from pallas_np.state import dma


# Wrappers of a kernel's sequential plan, ``(plan, jaxpr, params) -> plan``
# (the same calls, same bits): the native tier registers its compiled kernel
# bodies here (native/bodies.py), as the grid cannot import the native package.
PLAN_WRAPPERS: list = []


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
    self._scratch_allocators = None  # ``fresh_scratch``
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
    self.loop_front = None  # a warm sequential grid's run (grid/loop_front.py), False: none
    self._threads = None  # threads.ThreadPlan, built on the first sequential run
    # More than one grid point (or a dynamic grid): vectorizing or threading
    # the grid may pay.
    self.several_points = not all(isinstance(g, int) for g in self.grid) or \
        int(np.prod(self.grid, dtype=np.int64)) > 1
    # "vectorized", "threaded" or "sequential": how the last run() went.
    self.last_mode = None
    # The grid when no dimension is dynamic (every _prepare would rebuild it).
    self.static_grid = (None if self.num_dynamic else tuple(int(g) for g in self.grid))
    self._num_programs = ((), ())  # (grid, num_programs of the local dims), last used
    # Built on the first run, then reused by every call (the per-call floor):
    # How run() runs (run_strategies: one grid point, megacore or the grid
    # with its fast paths), chosen on the first run; _single: the
    # SinglePoint strategy, or False.
    self.strategy = None
    self._single = None
    self._uses_blas = None  # whether a run needs blas.kernel_run (may_use_blas)
    self._schedules = {}  # grid -> the grid loop's steps, or False (_grid_schedule)

  @property
  def kernel(self):
    """The kernel's sequential plan. Compiled lazily: a vectorized grid
    runs a batched plan instead, and the kernel is the biggest compile."""
    if self._kernel is None:
      plan = self.compiler.compile(self.kernel_jaxpr, first_calls=True)
      for wrap in PLAN_WRAPPERS:  # (the native tier's compiled bodies: native/bodies.py)
        plan = wrap(plan, self.kernel_jaxpr, self.params)
      self._kernel = plan
    return self._kernel

  def compile(self):
    """The sequential plan compiled now (the traced path, at lowering time:
    an unsupported primitive raises from the ``jax.jit`` call)."""
    self.kernel  # noqa: B018
    return self

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
    strategy = self.strategy
    if strategy is None:  # chosen once, on the first run (run_strategies.choose)
      strategy = self._choose_strategy()
    quiet = fp_state.quiet_floats()  # np.errstate(all="ignore"), cheaply
    try:
      if placement is not None:
        with blas.kernel_run():
          return run_strategies.run_on_device(self, args, placement)
      if not self._uses_blas:  # no GEMM: the BLAS thread count is not ours to set
        return strategy.run(self, args)
      with blas.kernel_run():
        return strategy.run(self, args)
    finally:
      fp_state.restore_floats(quiet)

  def _choose_strategy(self):
    self._uses_blas = may_use_blas(self.kernel_jaxpr)
    strategy = self.strategy = run_strategies.choose(self)
    self._single = strategy if isinstance(strategy, run_strategies.SinglePoint) else False
    return strategy

  def uses_blas(self) -> bool:
    """Whether a run sets BLAS's thread count (``blas.kernel_run``)."""
    if self._uses_blas is None:
      self._uses_blas = may_use_blas(self.kernel_jaxpr)
    return self._uses_blas

  def direct_runner(self, puts):
    """``run`` as one function of the operand sequence where the strategy
    has such a form (``SinglePoint.direct``: a one-point grid on fresh
    buffers), else None. ``puts``: per output, a
    ``_compat.exact_array_putter``: the function returns jax.Arrays."""
    strategy = self.strategy
    if strategy is None:
      strategy = self._choose_strategy()
    direct = getattr(strategy, "direct", None)
    return direct(self, puts) if direct is not None else None

  def fresh_scratch(self) -> list[np.ndarray]:
    """The scratch buffers of one run (``memory.allocate``'s), through
    allocators built on the first run: the dtype lookups and the fill
    value once, small buffers copied from a filled template."""
    fresh = self._scratch_allocators
    if fresh is None:
      fresh = self._scratch_allocators = [memory.allocator(a.shape, a.dtype, self.params)
                                          for a in self.scratch_avals]
    return [f() for f in fresh]

  def prepare(self, args):
    """``_prepare``: what every run strategy starts from."""
    return self._prepare(args)

  def thread_plan(self) -> threads.ThreadPlan:
    """Whether and how the grid runs on threads (built on first use)."""
    if self._threads is None:
      self._threads = threads.ThreadPlan(self)
    return self._threads

  def _prepare(self, args):
    """(grid, scalar-prefetch operands, input and output buffers, output
    buffers) of one run: every buffer fresh or read-only (see
    ``BufferSetup``)."""
    grid = self.static_grid
    if grid is None:
      dyn, args = args[:self.num_dynamic], args[self.num_dynamic:]
      dyn_iter = iter(dyn)
      # (a bound may be a 1-element array, e.g. shape (1,), as JAX accepts)
      grid = tuple(int(np.asarray(next(dyn_iter)).item()) if isinstance(g, jc.DynamicGridDim)
                   else int(g) for g in self.grid)
    assert len(args) == self.num_index + self.num_inputs, (
        len(args), self.num_index, self.num_inputs)
    return (grid, *self.setup.buffers(args))

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
      schedule = self._grid_schedule(grid, dynamic, index_ops)
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
          kernel(ctx, *index_ops, *views, *scratch)
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
            views[b] = buffers[b][blocks[b].index_of(bidx, clamp)]
        if detector is not None:
          detector.begin(step, point, last_idx)
        if trace is not None:
          trace(self.name, point)
        kernel(ctx, *index_ops, *views, *scratch)
        if progress is not None:
          progress.tick(step + 1)
      if ctx.rules is not None:
        dma.check_finished(ctx, buffers)
      if device is not None:
        devices.check_failed(device)
    except KernelError:
      raise
    except Exception as e:
      raise self.kernel_error(e, point, device) from e
    finally:
      if own_bar and progress is not None:
        progress.close()

  def _grid_schedule(self, grid, dynamic, index_ops=()):
    """The grid loop's steps for ``grid`` when its index maps read nothing
    but program ids and scalar-prefetch operands (no other effects), and
    the kernel writes no scalar-prefetch operand: per grid point (grid
    order), the point, its program ids and the (block, basic index) of each
    block whose index changes there. Computed on the first run of a grid
    (with scalar prefetch: of a grid and the operands' contents, compared
    by their bytes at each run), reused by every later one; None for big
    grids and where an index map or block raises (the loop then raises at
    its grid point)."""
    key = grid
    if self.num_index:
      key = self._prefetch_key(grid, index_ops)
      if key is None:
        return None
    hit = self._schedules.get(key)
    if hit is not None:
      return hit or None
    schedule = False
    if math.prod(grid) <= SCHEDULE_MAX_POINTS and not any(
        any(not isinstance(e, jc.ReadEffect) for e in bm.index_map_jaxpr.effects)
        for bm in self.grid_mapping.block_mappings):
      try:
        schedule = self._build_schedule(grid, dynamic, index_ops)
      except Exception:  # noqa: BLE001 - the grid loop reports it at its point
        schedule = False
    if len(self._schedules) >= 16:
      self._schedules.clear()
    self._schedules[key] = schedule
    return schedule or None

  def _prefetch_key(self, grid, index_ops):
    """(grid, the scalar-prefetch operands' dtypes, shapes and bytes), or
    None where their schedules are not kept: a kernel that writes one (the
    index maps would read other values at later points), operands over
    ``SCHEDULE_MAX_PREFETCH_BYTES`` (their comparison would cost more than
    the index maps)."""
    if any(i < self.num_index for i in self.written_inputs):
      return None
    if sum(a.nbytes for a in index_ops) > SCHEDULE_MAX_PREFETCH_BYTES:
      return None
    return (grid, *((a.dtype.str, a.shape, a.tobytes()) for a in index_ops))

  def _build_schedule(self, grid, dynamic, index_ops=()):
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
        bidx = index_maps[b](ctx, *ids, *index_ops)
        if bidx != last_idx[b]:
          last_idx[b] = bidx
          changes.append((b, blocks[b].block_index(bidx, clamp)))
      steps.append((point, ctx.program_ids, tuple(changes)))
    return tuple(steps)

  def kernel_error(self, e: Exception, point, device=None) -> Exception:
    """The KernelError of ``e`` raised at grid ``point`` (naming the kernel
    line, the primitive and the device)."""
    point = tuple(int(p) for p in point)
    on = f" on {device.placement.describe()}" if device is not None else ""
    err = debugging.kernel_error(e, self.name, f"Pallas kernel '{self.name}'",
                                 f"{on} at grid point {point}", point,
                                 index_map_origin(self, e.__traceback__))
    if self.params.pdb:
      debugging.post_mortem(e, self, point)
    debugging.remember(err)
    return err


# Grids of at most this many points keep their grid loop's steps (block
# indices per point: a few hundred bytes each) instead of evaluating the
# index maps at every step of every run.
SCHEDULE_MAX_POINTS = 4096
# Scalar-prefetch operands of at most this many bytes in all key the steps
# of their grid (splash attention's mask tables, paged attention's page
# indices: a few hundred bytes; their bytes compared at each run).
SCHEDULE_MAX_PREFETCH_BYTES = 1 << 16


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
