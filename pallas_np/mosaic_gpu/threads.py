"""The one scheduler of Mosaic GPU kernels: its threads (warpgroups of
blocks, and the warps of a ``plgpu.warp_map``), barriers and pending copies.

Execution model (docs/gpu.md, "Mosaic GPU"): each warpgroup of each block of
a cluster (``cluster`` x ``num_threads``) is a Python thread running the same
kernel plan, but only one runs at a time: a thread keeps the *baton* until it
finishes or blocks on a wait (a barrier, a semaphore, the end of its
``warp_map``), then hands it to the next thread (round robin) that can go
on. ``plgpu.warp_map`` adds the 4 warps of its warpgroup as threads for the
duration of the call. Clusters run one after another, or, in kernels that
wait on semaphores, overlap: the next one starts whenever no started thread
can go on (``device_blocks`` builds the clusters and their threads' run
contexts). So the interleaving is deterministic, barrier state needs no
locks, and a deadlock is exact: when no unfinished thread can go on, no
cluster can start and no other device can help, no arrival or signal can
ever come, and every blocked thread raises naming its kernel line, block,
warpgroup (and warp), instead of hanging.

Asynchronous copies (``copy_gmem_to_smem`` and ``copy_smem_to_gmem``) read
their source when issued and write their destination only when the
synchronisation that completes them runs: the wait on their barrier's phase,
``wait_smem_to_gmem``, or the block's end. Reading an SMEM destination before
that reads what was there before (the uninitialised fill: NaN under
``uninitialized_memory="nan"``).
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np

from pallas_np import _compat as jc
from pallas_np import devices
from pallas_np.errors import PallasNumpyError

WARPS_PER_WARPGROUP = 4
SLOTS_PER_WARPGROUP = 1 + WARPS_PER_WARPGROUP  # the warpgroup, then its warps


class BarrierDeadlock(PallasNumpyError, RuntimeError):
  """A Mosaic GPU barrier (or semaphore) wait that can never complete."""


class Aborted(BaseException):
  """Another thread of the kernel failed: stop this one (not an error of its
  own; a BaseException, so no ``except Exception`` in a rule catches it)."""


class Barrier:
  """One mbarrier: arrivals and transaction units (``expect``/``complete_tx``)
  complete a phase; copies issued on it land when a wait observes that
  phase. ``peers``: the same barrier in each block of the cluster (a
  ``plgpu.ClusterBarrier``: an arrival arrives in every block)."""
  __slots__ = ("num_arrivals", "arrivals", "tx", "phase", "observed", "in_flight", "landing",
               "peers")

  def __init__(self, num_arrivals: int):
    self.num_arrivals = num_arrivals
    self.arrivals = 0
    self.tx = 0  # transaction units expected and not yet completed
    self.phase = 0  # completed phases
    self.observed: dict = {}  # thread slot -> phases it has waited for
    self.in_flight: list = []  # copies of the phase being filled
    self.landing: dict = {}  # completed phase -> copies not yet written
    self.peers = None

  def arrive(self, copy=None, expect: int = 0):
    if copy is not None:
      self.in_flight.append(copy)
    self.tx += expect
    self.arrivals += 1
    self._complete()

  def complete_tx(self, units: int, copy=None):
    """Transaction units (a TMA copy's bytes, a multicast slice) arrive."""
    if copy is not None:
      self.in_flight.append(copy)
    self.tx -= units
    self._complete()

  def _complete(self):
    if self.arrivals >= self.num_arrivals and self.tx == 0:
      self.arrivals = 0
      if self.in_flight:
        self.landing[self.phase] = self.in_flight
        self.in_flight = []
      self.phase += 1

  def land(self, upto_phase: int):
    """Write the copies of every completed phase up to ``upto_phase``."""
    for p in sorted(k for k in self.landing if k <= upto_phase):
      for copy in self.landing.pop(p):
        copy()

  def land_all(self):
    self.land(self.phase)

  def __repr__(self):
    return f"Barrier(num_arrivals={self.num_arrivals}, phase={self.phase})"


def new_barriers(shape, dtype) -> np.ndarray:
  """An object array of fresh barriers (a ``plgpu.Barrier`` scratch ref)."""
  arr = np.empty(shape, object)
  for idx in np.ndindex(*arr.shape):
    arr[idx] = Barrier(jc.barrier_arrivals(dtype))
  return arr


class Task:
  """One thread of the scheduler: a warpgroup of a block, or a warp.
  ``wrap(err)``: ``err`` as this thread's ``KernelError`` (block, warpgroup)."""
  __slots__ = ("name", "done", "waiting", "cv", "wrap", "group")

  def __init__(self, name: str, wrap=None, group=None):
    self.name = name
    self.done = False
    self.waiting = None  # (predicate, what, where)
    self.cv = None  # its Condition on the scheduler's lock (set when it starts)
    self.wrap = wrap
    self.group = group


class Group:
  """Threads that start together and end together: the warpgroups of the
  blocks of one cluster (``named_fns``: ``(name, fn, wrap)``, ``fn(task)``). ``on_end()`` runs when the last one finishes (the
  blocks' outstanding copies land, their SMEM shadows go)."""
  __slots__ = ("name", "tasks", "fns", "on_end", "ended", "pythreads")

  def __init__(self, name: str, named_fns, on_end=None):
    self.name = name
    self.tasks = [Task(n, wrap, self) for n, _, wrap in named_fns]
    self.fns = [fn for _, fn, _ in named_fns]
    self.on_end = on_end
    self.ended = False
    self.pythreads: list = []


class Scheduler:
  """The one scheduler of a Mosaic GPU kernel instance (one device): every
  warpgroup of every started block (and the warps of a ``plgpu.warp_map``)
  is a thread, and they take turns holding one *baton*. The holder runs
  until it finishes or waits (a barrier, a semaphore), then hands the baton
  round robin to the next thread that can go on.

  Clusters (``Group``s) start one at a time, each when the previous one
  ended (``overlap=False``); with ``overlap=True`` (kernels that wait on
  semaphores: a block may wait for a later one) the next cluster starts
  whenever no started thread can go on. When nothing can go on and no
  cluster can start, a ``device`` with peers waits for them on its
  multi-device session (``pallas_np.devices``, which raises on a deadlock
  across devices); otherwise the kernel deadlocked: the waiting threads
  raise ``BarrierDeadlock`` naming each wait and its kernel line.

  ``lock``: a Condition on an RLock; the device session's when there is one
  (semaphore waits run with it held)."""

  def __init__(self, kernel_name: str, lock=None, overlap: bool = False, device=None):
    self.kernel_name = kernel_name
    self.lock = lock if lock is not None else threading.Condition(threading.RLock())
    self.overlap = overlap
    self.device = device
    self.order: list[Task] = []  # the threads of the started clusters, in turn order
    self.turn: Task | None = None
    self.failed: BaseException | None = None
    self.errors: list = []
    self.describe = "the kernel"  # what runs now, for deadlock messages
    self._groups = iter(())
    self._exhausted = False
    self._live: list[Group] = []
    self._pythreads: list = []  # overlap mode: every thread started

  # -- the baton (self.lock held) ------------------------------------------------
  def _next(self, me):
    """The next thread that can go on (``me`` included, last); None if none."""
    order = self.order
    n = len(order)
    try:
      start = order.index(me)
    except ValueError:  # None (nobody holds the baton) or a finished warp
      start = -1
    for step in range(1, n + 1):
      t = order[(start + step) % n]
      if not t.done and (t.waiting is None or t.waiting[0]()):
        return t
    return None

  def _give(self, task):
    self.turn = task
    if task is not None and task.cv is not None:
      task.cv.notify()

  def _waits(self) -> list[str]:
    lines = []
    for t in self.order:
      if t.waiting is not None and not t.done:
        _, what, where = t.waiting
        lines.append(f"{t.name}: {what}" + (f" at {where}" if where else ""))
    return lines

  def _deadlock(self) -> BarrierDeadlock:
    return BarrierDeadlock(
        f"pallas_np: Mosaic GPU kernel '{self.kernel_name}' deadlocked in {self.describe}: "
        "every thread still running waits on a barrier or semaphore that no arrival, copy "
        "or signal can complete any more:\n" + "\n".join(f"  {ln}" for ln in self._waits()))

  def _hand_over(self, me):
    """Give the baton to the next thread that can go on, starting clusters
    as needed; wait for peer devices when only they can help."""
    while True:
      nxt = self._next(me)
      if nxt is not None:
        self._give(nxt)
        return
      if self.overlap and self._start_next():
        continue
      if not any(not t.done for t in self.order):
        self._give(None)  # every started thread finished
        self.lock.notify_all()
        return
      session = getattr(self.device, "session", None)
      if session is None or session.n == 1:
        raise self._deadlock()
      where = SimpleNamespace(device=self.device, grid_point=())
      devices.block_until(where, lambda: self._next(me) is not None,
                          f"Mosaic GPU kernel '{self.kernel_name}': "
                          + "; ".join(self._waits()))

  def _fail(self, err):
    if self.failed is None:
      self.failed = err
    for t in self.order:
      if t.cv is not None:
        t.cv.notify()
    self.lock.notify_all()

  def _park(self, task):
    """Wait until ``task`` holds the baton or the run failed. The wait
    releases the lock however deeply it is held (a semaphore wait holds the
    session lock), so the other threads and devices go on."""
    with self.lock:
      while self.turn is not task and self.failed is None:
        task.cv.wait()

  def wait_until(self, task, predicate, what: str, where):
    """Block ``task``'s thread until ``predicate()`` holds (a barrier phase,
    a semaphore value, the end of a ``warp_map``), letting others run."""
    if predicate():
      return
    with self.lock:
      task.waiting = (predicate, what, where)
      try:
        self._hand_over(task)
      except BaseException as err:
        task.waiting = None
        self._fail(err)
        raise
      while self.turn is not task and self.failed is None:  # parked (the lock is held)
        task.cv.wait()
      task.waiting = None
      if self.failed is not None:
        raise self.failed if isinstance(self.failed, BarrierDeadlock) else Aborted()

  # -- threads and clusters ------------------------------------------------------
  def _thread(self, task, fn):
    th = threading.Thread(target=self._body, args=(task, fn, True),
                          name=f"pallas_np-{task.name}", daemon=True)
    th.start()
    return th

  def _open(self, group: Group):
    for t in group.tasks:
      t.cv = threading.Condition(self.lock)
    self.order.extend(group.tasks)
    self._live.append(group)
    if not self.overlap:
      self.describe = group.name

  def _start_next(self) -> bool:
    """Start the next cluster (overlap mode); False when none is left."""
    if self._exhausted:
      return False
    group = next(self._groups, None)
    if group is None:
      self._exhausted = True
      return False
    self._open(group)
    self._pythreads += [self._thread(t, fn) for t, fn in zip(group.tasks, group.fns)]
    return True

  def _end(self, group: Group):
    group.ended = True
    self.order = [t for t in self.order if t.group is not group]
    self._live.remove(group)
    if self.failed is None and group.on_end is not None:
      try:
        group.on_end()
      except BaseException as err:  # noqa: BLE001 - re-raised by run()
        self.errors.append(err)
        self._fail(err)

  def _body(self, task, fn, threaded: bool):
    if threaded:
      self._park(task)
    error = None
    try:
      if self.failed is None:
        fn(task)
    except Aborted:
      pass
    except BaseException as err:  # noqa: BLE001 - re-raised by run()
      error = err
    with self.lock:
      if error is not None:
        self.errors.append(error)
        self._fail(error)
      task.done = True
      group = task.group
      if group is not None and all(t.done for t in group.tasks):
        self._end(group)
      if self.failed is None and self.turn is task:
        try:
          self._hand_over(task)
        except BaseException as err:  # noqa: BLE001 - a deadlock found at a thread's end
          self._fail(err)
          if not isinstance(err, BarrierDeadlock):  # the waiting threads raise that one
            self.errors.append(task.wrap(err) if task.wrap is not None else err)
      self.lock.notify_all()

  def _finished(self) -> bool:
    if self.failed is not None:
      return all(t.done for t in self.order)
    return self._exhausted and not self._live

  def run(self, groups):
    """Run the clusters ``groups`` yields (lazily: a cluster launch may
    claim later ones) to the end; raises the first error."""
    self._groups = iter(groups)
    if self.overlap:
      with self.lock:
        try:
          self._hand_over(None)
        except BaseException as err:  # a cluster that failed to start: stop the others
          self._fail(err)
          raise
        while not self._finished():
          self.lock.wait(timeout=1.0)
      for th in self._pythreads:
        th.join()
    else:
      for group in self._groups:
        self._run_one(group)
        if self.failed is not None:
          break
      self._exhausted = True
    first = self.errors[0] if self.errors else self.failed
    if first is not None:
      raise first

  def _run_one(self, group: Group):
    """One cluster to its end (``overlap=False``); a one-thread cluster
    runs on the calling thread."""
    with self.lock:
      self._open(group)
      self.turn = group.tasks[0]
    if len(group.tasks) == 1:
      self._body(group.tasks[0], group.fns[0], False)
      return
    group.pythreads = [self._thread(t, fn) for t, fn in zip(group.tasks, group.fns)]
    for th in group.pythreads:  # the last one to finish ends the group
      th.join()

  def spawn(self, parent: Task, named_fns, where: str):
    """Run ``named_fns`` (``(name, fn, wrap)``: ``fn(task)``) as threads of
    their own while ``parent`` (which holds the baton) waits for all of them
    (``plgpu.warp_map``)."""
    children = [Task(name, wrap) for name, _, wrap in named_fns]
    with self.lock:
      for c in children:
        c.cv = threading.Condition(self.lock)
      at = self.order.index(parent) + 1
      self.order[at:at] = children
    pythreads = [self._thread(c, fn) for c, (_, fn, _) in zip(children, named_fns)]
    try:
      self.wait_until(parent, lambda: all(c.done for c in children),
                      f"the end of its warp_map ({len(children)} warps)", where)
    finally:
      with self.lock:
        if self.failed is not None:
          self._fail(self.failed)
      for th in pythreads:
        th.join()
      with self.lock:
        self.order = [t for t in self.order if t not in children]


class BlockState:
  """What the threads of one block share: the collective scratch, pending
  SMEM->GMEM copies per thread; ``sched``: the kernel instance's scheduler;
  ``device``: the block's ``devices.DeviceContext`` in a kernel that waits on
  semaphores (``device_blocks.BlockDevice``), else None."""

  def __init__(self, describe_block: str, num_threads: int, kernel_name: str,
               sched: Scheduler | None = None, cluster=None, index: int = 0, device=None):
    self.block = describe_block
    self.kernel_name = kernel_name
    self.num_threads = num_threads
    self.sched = sched or Scheduler(kernel_name)
    self.cluster = cluster  # the ClusterState of a cluster, or None
    self.index = index  # this block's number in its cluster
    self.device = device
    self.shared: dict = {}  # (eqn id, k-th entry) -> [buffers, threads left]
    self.entries: dict = {}  # (thread, eqn id) -> entries so far
    self.to_gmem: dict = {}  # thread slot -> pending stores
    self.from_gmem: dict = {}  # thread slot -> pending cp.async loads
    # False in a pl.pallas_call (no block end to land them at): stores land
    # when issued.
    self.defer_stores = True
    self.work = None  # cluster launch control (cluster.WorkQueue), set by the kernel
    self.grid_names: tuple = ()
    self.thread_axis = None
    self.slots_per_wg = 1  # thread slots per warpgroup (with warps: SLOTS_PER_WARPGROUP)

  def store_to_gmem(self, thread: int, land):
    if self.defer_stores:
      self.to_gmem.setdefault(thread, []).append(land)
    else:
      land()

  # -- collective run_scoped ---------------------------------------------------
  def shared_scope(self, ctx, eqn, fresh):
    """The k-th entry of thread t into a collective run_scoped gets the same
    buffers as the k-th entry of every other thread."""
    t = ctx.family.thread if ctx.family is not None else 0
    n = self.entries.get((t, id(eqn)), 0)
    self.entries[(t, id(eqn))] = n + 1
    key = (id(eqn), n)
    hit = self.shared.get(key)
    if hit is None:
      # In a cluster, a peer block may have made this block's buffers
      # already (a multicast copy into them): the same allocation site.
      bufs = fresh() if self.cluster is None else self.cluster.buffers(self.index, key, fresh)
      if self.device is not None:  # a peer device may signal its semaphores
        for i in _semaphore_positions(eqn):
          bufs[i] = self.device.scoped_semaphore((id(eqn), n, i), bufs[i])
      hit = self.shared[key] = [bufs, self.num_threads]
    hit[1] -= 1
    if hit[1] == 0:
      del self.shared[key]
    return hit[0]

  def private_scope(self, ctx, eqn, fresh):
    """A private run_scoped in a cluster: the buffers of the same thread's
    k-th entry in every block are peers (``cluster.ClusterState``)."""
    slot = (ctx.family.slot or 0) % (self.num_threads * self.slots_per_wg)
    n = self.entries.get((("private", slot), id(eqn)), 0)
    self.entries[(("private", slot), id(eqn))] = n + 1
    return self.cluster.buffers(self.index, ("private", slot, id(eqn), n), fresh)

  # -- SMEM -> GMEM copies -----------------------------------------------------
  def flush_to_gmem(self, thread: int, keep: int = 0):
    pending = self.to_gmem.get(thread, [])
    while len(pending) > keep:
      pending.pop(0)()

  def finish(self):
    """Block end: every outstanding copy lands."""
    for t in list(self.to_gmem):
      self.flush_to_gmem(t)
    for pending in self.from_gmem.values():
      while pending:
        pending.pop(0)()

  # -- the baton -----------------------------------------------------------------
  def wait_until(self, ctx, predicate, what: str, where):
    """Block this thread until ``predicate()`` holds (a barrier wait)."""
    task = ctx.family.task if ctx.family is not None else None
    if task is None:  # a pl.pallas_call program: nobody else can arrive
      if predicate():
        return
      task = Task(f"block {self.block}")
      self.sched.order = [task]
      self.sched.describe = f"block {self.block}"
    self.sched.wait_until(task, predicate, what, where)


def _semaphore_positions(eqn) -> list[int]:
  avals = [getattr(v.aval, "inner_aval", v.aval) for v in eqn.params["jaxpr"].invars]
  return [i for i, a in enumerate(avals) if jc.is_semaphore_dtype(a.dtype)]
