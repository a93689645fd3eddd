"""Running the programs of a mesh kernel: one thread per core / subcore.

Every program is an independent instance of its body on its own thread, as
on hardware, meeting the others through ``pallas_np.devices``' session
machinery (the one multi-device kernels use): a semaphore wait that is too
low blocks until another program signals it; when every program still
running waits on a semaphore nobody can signal, all of them raise a deadlock
naming each one's wait and line; an error in one program stops the others at
their next wait. Nothing here times out on a correct kernel.

Races (``InterpretParams(detect_races=True)``): accesses to memory two
programs share are ordered by semaphores (signal = release, wait = acquire,
vector clocks); an access to an element another program wrote without such
an order in between is a race, reported with both programs and the element.
"""
from __future__ import annotations

import threading

import numpy as np

from pallas_np import _compat as jc
from pallas_np import devices, races
from pallas_np.clocks import VectorClocks, ordered
from pallas_np.errors import KernelError, RaceError, UnsupportedError
from pallas_np.grid import KernelPlan
from pallas_np.memory import allocate
from pallas_np.state import indexing


class Program:
  """One instance of a body: where it sits on its mesh and its operands
  (inputs, outputs, scratch; arrays shared with other programs where the
  hardware shares that memory)."""
  __slots__ = ("plan", "names", "sizes", "coords", "operands", "num_blocks", "semaphores",
               "barrier_axes", "unit", "offset")

  def __init__(self, plan: KernelPlan, names, sizes, coords, operands, num_blocks: int,
               semaphores=(), barrier_axes=None, unit="core", offset=0):
    self.plan = plan
    self.names = tuple(names)
    self.sizes = tuple(int(s) for s in sizes)
    self.coords = tuple(int(c) for c in coords)
    self.operands = list(operands)
    self.num_blocks = num_blocks  # inputs + outputs; the rest is scratch
    self.semaphores = frozenset(semaphores)  # scratch positions that are semaphores
    # The axes a subcore barrier spans (the programs differing only along
    # them wait for each other); None: the mesh has no such barrier.
    self.barrier_axes = barrier_axes
    self.unit = unit  # "core", "subcore", "scalar subcore": for messages
    # Global id of the first program of this one's mesh (a kernel over
    # several meshes numbers them one mesh after the other).
    self.offset = offset


class MeshPlacement(devices.Placement):
  """A program's place on its mesh; described as ``core 1 (core=1)``.
  ``peers``: every program's placement, by global program id (several meshes
  of one kernel number their programs one after the other)."""
  __slots__ = ("unit", "peers", "offset")

  def __init__(self, key, names, sizes, coords, unit, offset=0):
    super().__init__(key, names, sizes, coords)
    self.unit = unit
    self.peers = None
    self.offset = offset  # global id of this mesh's first program

  def describe(self, logical=None) -> str:
    if logical is not None and self.peers is not None:
      return self.peers[logical].describe()
    return self.unit + super().describe()[len("device"):]


class MeshSession(devices.Session):
  """The programs of one invocation, and the buffers of collective
  ``run_scoped`` allocations they share."""

  def __init__(self, n, unit):
    super().__init__(n, unit)
    self.allocations: dict = {}  # key -> [buffers, programs that took them]
    self.barriers: dict = {}  # (group, generation) -> [arrived, passed]


class ProgramContext(devices.DeviceContext):
  """``RunContext.device`` of a program: its mesh coordinates and peers."""
  __slots__ = ("shared", "scoped_counts", "barrier_axes", "barriers_passed")

  def __init__(self, placement, targets, shared, barrier_axes=None):
    super().__init__(placement, targets)
    self.shared = shared  # ids of arrays every program sees as the same buffer
    self.scoped_counts: dict = {}
    self.barrier_axes = barrier_axes
    self.barriers_passed = 0

  def subcore_barrier(self, ctx, what: str):
    """Wait until every program of this one's barrier group (same
    coordinates off ``barrier_axes``) has reached its barrier of the same
    generation. For races it orders everything before it in any program
    of the group before everything after it."""
    pl_ = self.placement
    if self.barrier_axes is None:
      raise _unsupported(f"{what}: this mesh has no subcore barrier")
    group = (pl_.offset,) + tuple(c for n, c in zip(pl_.names, pl_.coords)
                                  if n not in self.barrier_axes)
    size = int(np.prod([s for n, s in zip(pl_.names, pl_.sizes) if n in self.barrier_axes]))
    self.barriers_passed += 1
    key = ("barrier", group, self.barriers_passed)
    session = self.session
    det = races.current()
    det = det if hasattr(det, "release") else None
    with session.cond:
      state = session.barriers.setdefault(key, [0, 0])
      state[0] += 1
      if det is not None:
        det.release(key)
      session.cond.notify_all()
      devices.block_until(ctx, lambda: state[0] >= size,
                          f"{what} waits for {size - state[0]} more of its {size} subcores")
      if det is not None:
        det.acquire(key)
      state[1] += 1
      if state[1] == size:
        del session.barriers[key]

  def core_target(self, core: int):
    """Logical id of the program ``core_index=core`` names (TPU
    ``semaphore_signal``), None for this program itself."""
    pl_ = self.placement
    if len(pl_.sizes) != 1:
      raise _unsupported("semaphore_signal(core_index=...) on a mesh with several axes "
                           f"{pl_.names}: use device_id={{axis: index}}")
    t = self.target_id((core,), jc.DeviceIdType.MESH)
    return None if t == self.logical_id else t

  def target_id(self, device_id, device_id_type) -> int:
    """A program of this one's mesh, by its mesh coordinates (global id)."""
    return self.placement.offset + super().target_id(device_id, device_id_type)

  def peer_ref(self, peer, view, what: str):
    if id(view) in self.shared:
      return view
    return super().peer_ref(peer, view, what)

  def collective_alloc(self, key, collective_axes, avals, params):
    """The buffers of a ``run_scoped(..., collective_axes=...)``: the same for
    every program that differs from this one only along those axes."""
    pl_ = self.placement
    axes = set()
    for a in collective_axes:
      axes.update(a if isinstance(a, tuple) else (a,))
    unknown = axes - set(pl_.names)
    if unknown:
      raise _unsupported(f"run_scoped collective_axes {sorted(map(str, unknown))} are not "
                           f"axes of the mesh {pl_.names}")
    count = self.scoped_counts.get(key, 0)
    self.scoped_counts[key] = count + 1
    group = (pl_.offset,) + tuple(c for n, c in zip(pl_.names, pl_.coords) if n not in axes)
    size = int(np.prod([s for n, s in zip(pl_.names, pl_.sizes) if n in axes]))
    full_key = (key, count, group)
    session = self.session
    with session.cond:
      entry = session.allocations.get(full_key)
      if entry is None:
        entry = session.allocations[full_key] = [
            [allocate(a.shape, a.dtype, params) for a in avals], 0]
      entry[1] += 1
      bufs = entry[0]
      if entry[1] == 1:
        track_shared(f"run_scoped(collective_axes={tuple(collective_axes)}) buffer", bufs)
      if entry[1] == size:
        del session.allocations[full_key]
    self.shared |= {id(b) for b in bufs}  # a peer's signal names them as ours
    return bufs


def _unsupported(msg):
  return UnsupportedError("pallas_np: " + msg)


# -- races ---------------------------------------------------------------------------
def track_shared(name, buffers):
  """Track buffers programs share that appear while they run (collective
  run_scoped allocations) in the active mesh race detector, if any."""
  det = races.current()
  clocks = getattr(det, "clocks", None)
  if clocks is None:
    return
  with clocks.lock:
    fresh = races.RaceDetector(det.kernel, (), ())
    for i, buf in enumerate(buffers):
      fresh.track(f"{name}[{i}]", buf)
    for r in fresh.regions:
      r.ensure()
    det.regions[:0] = fresh.regions  # newest first: a reused address finds its own
    for d in clocks.detectors:
      d.forget_views()


class ProgramRaceDetector(races.RaceDetector):
  """One program's view of the shared shadow memory: ``group`` is the
  program, ``step`` its own clock; a foreign write is a race unless this
  program has acquired (through a semaphore) the writer's clock at the write."""

  def __init__(self, kernel, me: int, describe, clocks: VectorClocks, regions):
    super().__init__(kernel, (), ())
    self.me = me
    self.describe = describe
    self.clocks = clocks
    if regions is not None:
      self.regions = regions
    self.group = me
    self.step = 1

  def forget_views(self):
    self._views = {}

  def begin(self, step, point, block_indices=()):
    self.group = self.me
    self.step = self.clocks.step(self.me)

  def release(self, semaphore_key):
    self.step = self.clocks.release(self.me, semaphore_key)

  def acquire(self, semaphore_key):
    self.clocks.acquire(self.me, semaphore_key)

  def _access_general(self, region, ptr, view, index, kind, mask):
    elems = races.accessed_elements(view, index, mask, ptr, region.start, region.itemsize)
    if elems.size == 0:
      return
    writer = region.group[elems]
    when = region.step[elems]
    known = self.clocks.knows(self.me, writer)
    unordered = (writer >= 0) & (writer != self.me) & ~ordered(when, known)
    if (kind != "write" or not region.scratch) and unordered.any():
      k = int(np.argmax(unordered))
      self._report_programs(region, int(elems[k]), int(writer[k]), kind)
    if kind != "read":
      region.step[elems] = self.step
      region.group[elems] = self.me

  def _report_programs(self, region, elem, other, kind):
    where = tuple(int(i) for i in np.unravel_index(elem, region.shape))
    verb = {"read": "reads", "write": "writes", "readwrite": "updates"}[kind]
    self.found(RaceError(
        f"data race on {region.name} in kernel '{self.kernel}': {self.describe(self.me)} "
        f"{verb} element {where} that {self.describe(other)} wrote, with no semaphore "
        "signal/wait (or barrier) ordering the two: on hardware they run concurrently.",
        buffer=region.name, grid_points=(other, self.me), element=where))


def _detectors(kernel, programs, placements):
  record = kernel.params.race_policy == "record"
  if record:
    races.RECORD.begin_run()
  if not kernel.params.detect_races:
    return [None] * len(programs)
  clocks = VectorClocks(len(programs))
  first = ProgramRaceDetector(kernel.name, 0, placements[0].describe, clocks, None)
  seen = set()
  for p in programs:
    plan = p.plan
    for geo, buf in zip(plan.blocks, p.operands[:p.num_blocks]):
      if id(buf) not in seen:
        seen.add(id(buf))
        first.track(str(geo.origin), buf)
  # Scratch every program shares (VMEM_SHARED, HBM scratch) is tracked too;
  # private scratch cannot race.
  counts: dict = {}
  for p in programs:
    for buf in p.operands[p.num_blocks:]:
      counts[id(buf)] = counts.get(id(buf), 0) + 1
  for p in programs:
    for i, buf in enumerate(p.operands[p.num_blocks:]):
      if counts[id(buf)] > 1 and id(buf) not in seen and i not in p.semaphores:
        seen.add(id(buf))
        first.track(f"shared scratch_operands[{i}]", buf)
  for r in first.regions:
    r.ensure()
  dets = [first] + [ProgramRaceDetector(kernel.name, k, placements[0].describe, clocks,
                                        first.regions) for k in range(1, len(programs))]
  for d in dets:
    d.record = record
  clocks.detectors = dets
  return dets


# -- running ---------------------------------------------------------------------------
class _Worker(threading.Thread):
  """A parked thread that runs one task at a time (starting a thread per
  program per call costs more than small kernels do)."""

  def __init__(self, pool):
    super().__init__(daemon=True, name="pallas_np mesh program")
    self.pool = pool
    self.ready = threading.Semaphore(0)
    self.task = None
    self.done = None

  def run(self):
    while True:
      self.ready.acquire()
      task, done = self.task, self.done
      self.task = self.done = None
      try:
        task()
      finally:
        self.pool.park(self)
        done.release()


class _Workers:
  """Parked worker threads. ``run_concurrently`` gives every task a thread
  of its own (programs wait on each other, so none may queue behind
  another), spawning workers when too few are parked."""

  def __init__(self):
    self.lock = threading.Lock()
    self.parked: list[_Worker] = []

  def park(self, worker):
    with self.lock:
      self.parked.append(worker)

  def run_concurrently(self, tasks, here):
    """Run ``tasks`` on workers and ``here`` on this thread; return when all
    are done (tasks must not raise: they record their errors)."""
    with self.lock:
      take = min(len(tasks), len(self.parked))
      workers = [self.parked.pop() for _ in range(take)]
    workers += [_Worker(self) for _ in range(len(tasks) - len(workers))]
    done = threading.Semaphore(0)
    for w, task in zip(workers, tasks):
      w.task, w.done = task, done
      if not w.is_alive():
        w.start()
      w.ready.release()
    here()
    for _ in tasks:
      done.acquire()


_workers = _Workers()


def run_programs(kernel, programs: list[Program]):
  """Run ``programs`` concurrently (each mesh's row-major over its points,
  the meshes one after the other, ``Program.offset`` the global id of its
  mesh's first); raises the first program's own error (peers stopped by it
  say so), or a deadlock; then reports semaphores left signalled at the end."""
  n = len(programs)
  units = {p.unit for p in programs}
  session = MeshSession(n, units.pop() if len(units) == 1 else "program")
  key = id(kernel)
  placements = [MeshPlacement(key, p.names, p.sizes, p.coords, p.unit, p.offset)
                for p in programs]
  for place in placements:
    place.peers = placements
  contexts = []
  for k, (p, place) in enumerate(zip(programs, placements)):
    shared = {id(b) for b in p.operands[:p.num_blocks]}
    ctx = ProgramContext(place, p.operands, shared, p.barrier_axes)
    ctx.logical_id = k
    ctx.session = session
    session.members[k] = ctx
    contexts.append(ctx)
  detectors = _detectors(kernel, programs, placements)
  errors: list = [None] * n

  def run_one(k):
    p, ctx, det = programs[k], contexts[k], detectors[k]
    error = None
    subcore = (p.coords[p.names.index(p.barrier_axes[0])]
               if p.unit == "subcore" and p.barrier_axes else None)
    try:
      with np.errstate(all="ignore"), indexing.vector_subcore(subcore):
        # The program's plan runs with the strategy its mesh kernel chose
        # for it (run_strategies.MeshProgram: one point, whole refs).
        if det is None:
          p.plan.strategy.run_program(p.plan, p.sizes, p.coords, p.operands, p.num_blocks,
                                      None, ctx)
        else:
          with races.activate(det):
            p.plan.strategy.run_program(p.plan, p.sizes, p.coords, p.operands,
                                        p.num_blocks, det, ctx)
    except BaseException as e:  # noqa: BLE001 (reported by the caller)
      error = e
      errors[k] = e
    finally:
      devices.leave(ctx, error)

  _workers.run_concurrently([lambda k=k: run_one(k) for k in range(1, n)],
                             lambda: run_one(0))
  failed = [e for e in errors if e is not None]
  if failed:
    own = [e for e in failed
           if not isinstance(getattr(e, "original", e), devices.DeviceError)]
    raise (own or failed)[0]
  _check_semaphores(kernel, programs, placements)


def _check_semaphores(kernel, programs, placements):
  """Semaphores left non-zero when the kernel ends (a signal nobody waited
  for: TPU interpret mode prints this, hardware leaves the semaphore dirty)."""
  seen = set()
  for p, place in zip(programs, placements):
    for i, buf in enumerate(p.operands[p.num_blocks:]):
      if id(buf) in seen or i not in p.semaphores:
        continue
      seen.add(id(buf))
      nonzero = np.flatnonzero(np.asarray(buf).reshape(-1))
      if nonzero.size:
        k = int(nonzero[0])
        idx = tuple(int(i) for i in np.unravel_index(k, buf.shape))
        value = int(np.asarray(buf).reshape(-1)[k])
        raise KernelError(
            f"semaphore scratch_operands[{i}]{list(idx) if idx else ''} of "
            f"{place.describe()} is {value}, not 0, when kernel '{kernel.name}' "
            f"({kernel.source}) ends: a signal (or DMA) that nothing waited for.",
            kernel=kernel.name, program_ids=place.coords)
