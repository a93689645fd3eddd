"""How a ``KernelPlan`` runs: one strategy per kind of run, chosen once
(``choose``, on the plan's first run) and kept by the plan.

* ``SinglePoint``: a one-point grid, the kernel called once on block views
  of fresh buffers, nothing of the grid loop's machinery.
* ``Megacore``: ``num_cores > 1`` with leading parallel grid dims: the grid
  loop over each core's chunk of grid points.
* ``GridRun``: every other grid: a batched pass (``vectorize``), else chunks
  of grid points on threads (``threads``), else the sequential grid loop; a
  fast path that fails reruns the loop from fresh buffers.
* ``MeshProgram``: one program of a mesh kernel (a core, a subcore), run by
  its mesh runner at its point of the mesh; chosen by the mesh kernel.
* ``run_on_device``: one device's instance of a multi-device kernel (a run
  with a placement), whatever the plan's strategy.

Every strategy gets its buffers from ``KernelPlan.prepare`` (one place for
padding and aliasing: ``grid.buffers``) and walks the grid with
``KernelPlan.run_grid`` (the one grid loop) or the kernel directly.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from pallas_np import devices, fp_state, memory, races
from pallas_np.compiler import RunContext, new_run
from pallas_np.errors import KernelError, UnsupportedError, check_fallback
from pallas_np.grid import loop_front, pass_front, threads, vectorize
from pallas_np.memory import allocate
from pallas_np.state import dma


def choose(kp):
  """The strategy of ``kp``'s runs."""
  single = SinglePoint.of(kp)
  if single:
    return single
  if kp.params.num_cores > 1 and kp.parallel_prefix:
    return Megacore()
  return GridRun()


class GridRun:
  """A grid of several points (or a dynamic grid): batched, threaded or
  the sequential loop."""
  __slots__ = ()

  def run(self, kp, args) -> list[np.ndarray]:
    front = kp.loop_front
    if front:  # a warm sequential grid (loop_front.py)
      out = front(kp, args)
      if out is not None:
        return out
      kp.loop_front = None  # (the full path decides again)
    fallback = None  # (path, exception) of a fast path that failed
    prepared = None  # fresh buffers the vectorizer made and did not use
    if kp.params.vectorize is not False and kp.several_points:
      out, failure, prepared = _front_or_vectorized(kp, args)
      if out is not None:
        return out
      fallback = failure and ("vectorized", failure)
    grid, index_ops, buffers, out_bufs = prepared or kp.prepare(args)
    thread_plan = kp.thread_plan()
    if thread_plan.reason is None:
      chunks = thread_plan.chunks(grid, index_ops)
      if chunks is not None:
        failure = threads.run(kp, grid, index_ops, buffers, chunks)
        if failure is None:
          kp.last_mode = "threaded"
          return kp.setup.results(out_bufs)
        fallback = ("threaded", failure)
        # fresh buffers (private copies of the caller's arrays), to re-run
        grid, index_ops, buffers, out_bufs = kp.prepare(args)
    scratch = kp.fresh_scratch()
    detector = races.for_run(kp, grid, buffers, scratch)
    if detector is None:
      kp.run_grid(grid, index_ops, buffers, scratch)
    else:
      with races.activate(detector):
        kp.run_grid(grid, index_ops, buffers, scratch, detector)
    if fallback is not None:  # the fast path failed where this run did not
      check_fallback(fallback[1], fallback[0], kp.name)
    kp.last_mode = "sequential"
    if kp.loop_front is None and detector is None:
      kp.loop_front = loop_front.LoopFront.of(kp) or False
    return kp.setup.results(out_bufs)


def _front_or_vectorized(kp, args):
  """``_run_vectorized`` through the front of a warm one-pass grid where it
  has one that still holds (``pass_front``)."""
  gv = kp.vectorizer
  if gv is not None and gv.front:
    done = gv.front(kp, args)
    if done is not None:
      return done[0], done[1], None
  return _run_vectorized(kp, args)


def _run_vectorized(kp, args):
  """(outputs, None, None) of a batched grid (pallas_np.grid.vectorize);
  (None, failure, prepared) when it does not apply (failure None) or
  failed (then the sequential run starts again from fresh buffers and
  reports any error at its exact grid point; if it succeeds instead, the
  failure was a bug). ``prepared``: the untouched fresh buffers of a pass
  declined before it ran, else None."""
  if kp.vectorizer is None:
    kp.vectorizer = vectorize.GridVectorizer(kp, kp.compiler_params)
  gv = kp.vectorizer
  if gv.reason is not None or kp.static_grid in gv.declined_grids:
    return None, None, None
  try:
    out_bufs = vectorize.run_vectorized(kp, gv, lambda: kp.prepare(args))
  except vectorize.NotBatchable as e:
    gv.last_failure = e
    return None, None, None
  except Exception as e:
    gv.last_failure = e
    return None, e, None
  if out_bufs is None:
    return None, None, None
  if isinstance(out_bufs, vectorize.Declined):
    if out_bufs.every_call:
      if len(gv.declined_grids) >= 16:  # (as the choices per grid)
        gv.declined_grids.clear()
      gv.declined_grids.add(kp.static_grid)
    return None, None, out_bufs.prepared
  kp.last_mode = "vectorized"
  if gv.front is None:
    gv.front = pass_front.OnePassFront.of(kp) or False
  return kp.setup.results(out_bufs), None, None


class Megacore:
  """Megacore: the leading 'parallel' grid dims are split into contiguous
  chunks, one per TensorCore (as TPU interpret mode does); each core has
  its own scratch, scalar-prefetch (SMEM) copies and DMA state."""
  __slots__ = ()

  def run(self, kp, args) -> list[np.ndarray]:
    grid, index_ops, buffers, out_bufs = kp.prepare(args)
    n_par = kp.parallel_prefix
    par_points = int(np.prod(grid[:n_par], dtype=np.int64))
    rest = int(np.prod(grid[n_par:], dtype=np.int64))
    per_core = -(-par_points // kp.params.num_cores) * rest
    points = list(itertools.product(*map(range, grid)))
    detector = races.for_run(kp, grid, buffers, [])
    for core in range(kp.params.num_cores):
      chunk = points[core * per_core:(core + 1) * per_core]
      if not chunk:
        break
      scratch = [allocate(a.shape, a.dtype, kp.params) for a in kp.scratch_avals]
      if detector is None:
        kp.run_grid(grid, [np.array(a) for a in index_ops], buffers, scratch, points=chunk)
        continue
      for i, buf in enumerate(scratch):
        detector.track(f"scratch_operands[{i}] of core {core}", buf, scratch=True)
      with races.activate(detector):
        kp.run_grid(grid, [np.array(a) for a in index_ops], buffers, scratch, detector,
                    points=chunk)
    kp.last_mode = "sequential"
    return kp.setup.results(out_bufs)


class SinglePoint:
  """What every run of a one-point grid shares: the basic index of each
  block that is not its whole buffer, the scratch allocators, the program
  ids, whether an output is padded (then cut back by ``BufferSetup.results``)."""
  __slots__ = ("cuts", "scratch", "point", "program_ids", "num_programs", "padded_outputs",
               "operand_preps", "out_preps", "fresh_outputs")

  @classmethod
  def of(cls, kp) -> SinglePoint | bool:
    """The recipe of ``kp``'s runs, or False where its grid has more (or a
    dynamic number of) points, a block's index map is not constant zero,
    or the run must go through the grid loop (race detection, explain,
    megacore)."""
    grid = kp.static_grid
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
    self.operand_preps = self.out_preps = self.fresh_outputs = None  # on the first run
    # (operand position, basic index): scalar prefetch operands come first.
    self.cuts = [(b + kp.num_index, idx) for b, idx in enumerate(indices) if idx is not None]
    self.padded_outputs = any(geo.needs_padding for geo in kp.blocks[kp.num_inputs:])
    self.scratch = [memory.allocator(a.shape, a.dtype, params) for a in kp.scratch_avals]
    self.point = (0,) * len(grid)
    self.program_ids = tuple(np.int32(0) for _ in kp.local_dims)
    self.num_programs = tuple(np.int32(grid[d]) for d in kp.local_dims)
    return self

  def _first_run(self, kp):
    """The buffer recipe, from the plan's ``BufferSetup`` (on the first run)."""
    preps = kp.setup.preps()
    self.operand_preps = (*preps[0], *preps[1])
    self.out_preps = preps[2]
    # Outputs of uninitialised memory: their allocator, called directly.
    self.fresh_outputs = [getattr(p, "fresh", None) for p in preps[2]]
    if None in self.fresh_outputs:
      self.fresh_outputs = None

  def run(self, kp, args) -> list[np.ndarray]:
    """The kernel called once on block views of fresh buffers."""
    single = self
    if single.operand_preps is None:
      single._first_run(kp)
    preps = single.operand_preps
    if len(args) != len(preps):
      raise TypeError(f"kernel '{kp.name}' takes {len(preps)} operands, got {len(args)}")
    # What _prepare does, for the one grid point: every block cut once.
    if len(args) == 1:  # (no comprehension frames: the per-call floor)
      operands = [preps[0](args[0])]
    else:
      operands = [prep(a) for prep, a in zip(preps, args)]
    fresh = single.fresh_outputs
    if fresh is None:
      out_bufs = [prep(args, operands) for prep in single.out_preps]
    elif len(fresh) == 1:
      out_bufs = [fresh[0]()]
    else:
      out_bufs = [f() for f in fresh]
    operands += out_bufs
    for b, idx in single.cuts:
      operands[b] = operands[b][idx]
    for fresh in single.scratch:
      operands.append(fresh())
    ctx = RunContext(kp.name, kp.params)
    ctx.num_programs = single.num_programs
    ctx.grid_point = single.point
    ctx.program_ids = single.program_ids
    trace = kp.params.trace
    try:
      if trace is not None:
        trace(kp.name, single.point)
      kp.kernel.fn(ctx, *operands)
      if ctx.rules is not None:
        dma.check_finished(ctx, operands[:len(operands) - len(single.scratch)])
    except KernelError:
      raise
    except Exception as e:
      raise kp.kernel_error(e, single.point) from e
    kp.last_mode = "sequential"
    return kp.setup.results(out_bufs) if single.padded_outputs else out_bufs


  def direct(self, kp, puts):
    """``KernelPlan.run`` of this strategy as one function of the operand
    sequence (the per-call floor: no strategy dispatch, no helper frames;
    generated for this plan's counts, ``_direct_source``), or None where a
    run needs more than the kernel on fresh buffers (an output aliased to
    an input or padded, a trace callback, BLAS's thread setting). Same
    steps, same buffers, same errors as ``run``.
    ``puts``: per output, a function of the one-element list ``[buffer]``
    handing it out (``_compat.exact_array_putter``); the result is the list
    of what they return."""
    if self.operand_preps is None:
      self._first_run(kp)
    if (self.fresh_outputs is None or self.padded_outputs or kp.params.trace is not None
        or kp.uses_blas()):
      return None
    n_args, n_outs = len(self.operand_preps), len(self.fresh_outputs)
    scope = {"new_run": new_run, "quiet": fp_state.quiet_floats, "restore": fp_state.restore_floats,
             "RunContext": RunContext, "KernelError": KernelError, "dma": dma, "kp": kp,
             "name": kp.name, "params": kp.params, "program_ids": self.program_ids,
             "num_programs": self.num_programs, "point": self.point,
             "takes": f"kernel '{kp.name}' takes {n_args} operands, got "}
    scope.update({f"_p{i}": p for i, p in enumerate(self.operand_preps)})
    scope.update({f"_f{j}": f for j, f in enumerate(self.fresh_outputs)})
    scope.update({f"_c{k}": idx for k, (_b, idx) in enumerate(self.cuts)})
    scope.update({f"_s{i}": f for i, f in enumerate(self.scratch)})
    scope.update({f"_u{j}": put for j, put in enumerate(puts)})
    source = _direct_source(n_args, n_outs, [b for b, _ in self.cuts], len(self.scratch))
    exec(compile(source, f"<pallas_np direct run: {kp.name}>", "exec"), scope)  # noqa: S102
    return scope["run"]


def _direct_source(n_args, n_outs, cuts, n_scratch) -> str:
  """``SinglePoint.direct``'s function for ``n_args`` operands, ``n_outs``
  fresh outputs, the operand positions cut to their block (``cuts``, the
  ``k``-th by ``_c<k>``) and ``n_scratch`` scratch buffers: ``run``'s steps
  written out (no comprehension frames, no lists but the result: the
  per-call floor, PERF_LOG ``[floor]``). Names: ``_p<i>`` the operand
  preparations, ``_f<j>`` the output allocators, ``_s<i>`` the scratch
  allocators, ``_u<j>`` the output putters."""
  args = [f"a{i}" for i in range(n_args)]
  outs = [f"o{j}" for j in range(n_outs)]
  ops = args + outs  # (what the kernel gets: cut operands; the puts get the whole outputs)
  lines = ["def run(args):",
           f"    if len(args) != {n_args}:",
           "        raise TypeError(takes + str(len(args)))",
           "    new_run()",
           "    token = quiet()",
           "    try:"]
  if n_args:
    lines.append(f"        {', '.join(args)}, = args")
  lines += [f"        a{i} = _p{i}(a{i})" for i in range(n_args)]
  lines += [f"        o{j} = _f{j}()" for j in range(n_outs)]
  for k, b in enumerate(cuts):
    view = f"v{b}"
    lines.append(f"        {view} = {ops[b]}[_c{k}]")
    ops[b] = view
  scratch = [f"s{i}" for i in range(n_scratch)]
  lines += [f"        s{i} = _s{i}()" for i in range(n_scratch)]
  lines += ["        ctx = RunContext(name, params, program_ids, num_programs)",
            "        ctx.grid_point = point",
            "        try:",
            f"            kp.kernel.fn(ctx{''.join(', ' + o for o in ops + scratch)})",
            "            if ctx.rules is not None:",
            f"                dma.check_finished(ctx, [{', '.join(ops)}])",
            "        except KernelError:",
            "            raise",
            "        except Exception as e:",
            "            raise kp.kernel_error(e, point) from e",
            "    finally:",
            "        restore(token)",
            "    kp.last_mode = \"sequential\"",
            f"    return [{', '.join(f'_u{j}([o{j}])' for j in range(n_outs))}]"]
  return "\n".join(lines) + "\n"


class MeshProgram:
  """One program of a mesh kernel (``pallas_np.meshes``): the body once, at
  the program's point of the mesh (``sizes``, ``coords``), on the operands
  the mesh runner gave it (whole refs, shared with its peers where the
  hardware shares that memory), as one instance among its peers
  (``device``: its ``meshes.programs.ProgramContext``). Chosen when the
  mesh kernel builds the plan (``MeshKernel.program``); the programs runner
  calls ``run_program``, never ``KernelPlan.run``."""
  __slots__ = ()

  def run(self, kp, args):
    raise TypeError(f"kernel '{kp.name}' is a program of a mesh kernel: its mesh runner "
                    "runs it (run_program)")

  def run_program(self, kp, sizes, coords, operands, num_blocks, detector, device):
    ctx = RunContext(kp.name, kp.params)
    ctx.device = device
    point = tuple(coords)
    ids = tuple(np.int32(c) for c in point)
    ctx.grid_point = point
    ctx.num_programs = tuple(np.int32(sizes[d]) for d in kp.local_dims)
    ctx.program_ids = tuple(ids[d] for d in kp.local_dims)
    blocks, scratch = operands[:num_blocks], operands[num_blocks:]
    try:
      views, block_indices = [], []
      for geo, index_map, buf in zip(kp.blocks, kp.index_maps, blocks):
        bidx = None
        if geo.whole:
          view = buf
        elif geo.trivial_index_map:
          view = buf[geo.zero_block_index(kp.clamp)]
        else:
          bidx = index_map.fn(ctx, *ids)
          view = buf[geo.block_index(bidx, kp.clamp)]
        views.append(view)
        block_indices.append(bidx)
      if detector is not None:
        detector.begin(0, point, block_indices)
      if kp.params.trace is not None:
        kp.params.trace(kp.name, point)
      kp.kernel.fn(ctx, *views, *scratch)
      if ctx.rules is not None:
        dma.check_finished(ctx)
      devices.check_failed(device)
    except KernelError:
      raise
    except Exception as e:
      raise kp.kernel_error(e, point, device) from e


def run_on_device(kp, args, placement) -> list[np.ndarray]:
  """One device's instance of a multi-device kernel (``KernelPlan.run``'s
  ``placement``): the sequential grid loop, meeting its peers (devices.py)."""
  if kp.params.num_cores > 1 and kp.parallel_prefix:
    raise UnsupportedError(
        f"pallas_np: kernel '{kp.name}': num_cores > 1 together with multi-device "
        "communication (axis_index, remote DMAs) is not supported")
  grid, index_ops, buffers, out_bufs = kp.prepare(args)
  scratch = [allocate(a.shape, a.dtype, kp.params) for a in kp.scratch_avals]
  targets = [*index_ops,
             *(buf if geo.whole else None for geo, buf in zip(kp.blocks, buffers)),
             *scratch]
  # A kernel that only reads axis_index needs no peers: no session.
  me = devices.enter(placement, targets) if kp.device_features[1] else \
      devices.DeviceContext(placement, targets)
  me.target_names = [*(f"scalar prefetch {i}" for i in range(len(index_ops))),
                     *(str(geo.origin) for geo in kp.blocks),
                     *(f"scratch_operands[{i}]" for i in range(len(scratch)))]
  error = None
  try:
    if kp.params.detect_races and me.session is not None:
      devices.check_races(me, kp.name)
    detector = races.for_run(kp, grid, buffers, scratch)
    if detector is not None and me.session is not None and me.session.races is not None:
      detector.device_hook = lambda view, index, kind: me.note_local(
          view, index, kind, detector.point)
    if detector is None:
      kp.run_grid(grid, index_ops, buffers, scratch, device=me)
    else:
      with races.activate(detector):
        kp.run_grid(grid, index_ops, buffers, scratch, detector, device=me)
  except BaseException as e:
    error = e
    raise
  finally:
    devices.leave(me, error)
  kp.last_mode = "sequential"
  return kp.setup.results(out_bufs)
