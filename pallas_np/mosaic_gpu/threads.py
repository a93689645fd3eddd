"""One Mosaic GPU cluster: its blocks' warpgroup threads (and the warps of a
``plgpu.warp_map``), barriers and pending copies.

Execution model (docs/gpu.md, "Mosaic GPU"): clusters (grid points) run one
after another. Inside a cluster, each warpgroup of each block (``cluster`` x
``num_threads``) is a Python thread running the same kernel plan, but only
one runs at a time: a thread keeps the *baton* until it finishes or blocks on
a barrier wait, then hands it to the next thread (round robin) that can go
on. ``plgpu.warp_map`` adds the 4 warps of its warpgroup as threads for the
duration of the call (the warpgroup waits for them). So the interleaving is
deterministic, barrier state needs no locks, and a deadlock is exact: when no
unfinished thread can go on, no arrival can ever come, and every blocked
thread raises naming its kernel line, block, warpgroup (and warp), instead of
hanging.

Asynchronous copies (``copy_gmem_to_smem`` and ``copy_smem_to_gmem``) read
their source when issued and write their destination only when the
synchronisation that completes them runs: the wait on their barrier's phase,
``wait_smem_to_gmem``, or the block's end. Reading an SMEM destination before
that reads what was there before (the uninitialised fill: NaN under
``uninitialized_memory="nan"``).
"""
from __future__ import annotations

import threading

import numpy as np

from pallas_np import _compat as jc
from pallas_np.errors import PallasNumpyError

BLOCK_KEY = "mgpu_block"  # RunContext.extra: this block's BlockState
THREAD_KEY = "mgpu_thread"  # RunContext.extra: the warpgroup id
SLOT_KEY = "mgpu_slot"  # RunContext.extra: the thread's slot in its cluster
TASK_KEY = "mgpu_task"  # RunContext.extra: the thread's scheduler Task
ERROR_KEY = "mgpu_error"  # RunContext.extra: wraps an error with the thread's place
DETECTOR_KEY = "mgpu_detector"  # RunContext.extra: slot -> race detector (or None)
WARPS_PER_WARPGROUP = 4
SLOTS_PER_WARPGROUP = 1 + WARPS_PER_WARPGROUP  # the warpgroup, then its warps


class BarrierDeadlock(PallasNumpyError, RuntimeError):
  """A Mosaic GPU barrier wait that can never complete."""


class Aborted(Exception):
  """Another thread of the cluster failed: stop this one."""


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
  """One thread of the scheduler: a warpgroup of a block, or a warp."""
  __slots__ = ("name", "done", "waiting")

  def __init__(self, name: str):
    self.name = name
    self.done = False
    self.waiting = None  # (predicate, what, where)


class Scheduler:
  """The baton of one cluster: its threads take turns, round robin."""

  def __init__(self, describe: str, kernel_name: str):
    self.describe = describe
    self.kernel_name = kernel_name
    self.cv = threading.Condition()
    self.tasks: list[Task] = []
    self.turn: Task | None = None
    self.failed: BaseException | None = None

  def _can_run(self, task) -> bool:
    if task.done:
      return False
    w = task.waiting
    return w is None or w[0]()

  def _pass_baton(self, me):
    """The next task that can go on (``me`` included, last); None if none."""
    n = len(self.tasks)
    start = self.tasks.index(me) if me in self.tasks else -1
    for step in range(1, n + 1):
      t = self.tasks[(start + step) % n]
      if self._can_run(t):
        return t
    return None

  def _deadlock(self) -> BarrierDeadlock:
    lines = [f"  {t.name}: {t.waiting[1]} at {t.waiting[2]}" for t in self.tasks
             if t.waiting is not None and not t.done]
    return BarrierDeadlock(
        f"pallas_np: Mosaic GPU kernel '{self.kernel_name}' deadlocked in {self.describe}: "
        "every thread still running waits on a barrier that no arrival or copy can "
        "complete any more:\n" + "\n".join(lines))

  def wait_until(self, task, predicate, what: str, where: str):
    """Block ``task``'s thread until ``predicate()`` holds (a barrier wait)."""
    if predicate():
      return
    with self.cv:
      task.waiting = (predicate, what, where)
      nxt = self._pass_baton(task)
      if nxt is None or (nxt is task and not predicate()):
        self.failed = self.failed or self._deadlock()
        self.cv.notify_all()
        raise self.failed
      self.turn = nxt
      self.cv.notify_all()
      while self.turn is not task and self.failed is None:
        self.cv.wait()
      task.waiting = None
      if self.failed is not None:
        raise (self.failed if isinstance(self.failed, BarrierDeadlock) else Aborted())

  def _body(self, task, run_one, errors, k):
    with self.cv:
      while self.turn is not task and self.failed is None:
        self.cv.wait()
    try:
      if self.failed is None:
        run_one()
    except Aborted:
      pass
    except BaseException as err:  # noqa: BLE001 - re-raised by the caller
      errors[k] = err
      with self.cv:
        self.failed = self.failed or err
    with self.cv:
      task.done = True
      if self.failed is None:
        nxt = self._pass_baton(task)
        if nxt is None and not all(t.done for t in self.tasks):
          self.failed = self._deadlock()
        elif nxt is not None:
          self.turn = nxt
      self.cv.notify_all()

  def _start(self, tasks, fns, errors):
    threads = [threading.Thread(target=self._body, args=(t, fn, errors, k),
                                name=f"pallas_np-{t.name}", daemon=True)
               for k, (t, fn) in enumerate(zip(tasks, fns))]
    for th in threads:
      th.start()
    return threads

  def run(self, named_fns):
    """Run every ``(name, fn)`` as a thread, one at a time (the baton)."""
    tasks = [Task(name) for name, _ in named_fns]
    fns = [fn for _, fn in named_fns]
    self.tasks = list(tasks)
    self.turn = tasks[0]
    errors: list = [None] * len(tasks)
    if len(tasks) == 1:
      self._body(tasks[0], fns[0], errors, 0)
    else:
      for th in self._start(tasks, fns, errors):
        th.join()
    first = next((e for e in errors if e is not None), None)
    if first is not None:
      raise first
    if self.failed is not None:
      raise self.failed

  def spawn(self, parent: Task, named_fns, where: str):
    """Run ``named_fns`` as threads of their own while ``parent`` (which
    holds the baton) waits for all of them (``plgpu.warp_map``)."""
    children = [Task(name) for name, _ in named_fns]
    errors: list = [None] * len(children)
    with self.cv:
      at = self.tasks.index(parent) + 1
      self.tasks[at:at] = children
    threads = self._start(children, [fn for _, fn in named_fns], errors)
    try:
      self.wait_until(parent, lambda: all(c.done for c in children),
                      f"the end of its warp_map ({len(children)} warps)", where)
    finally:
      if self.failed is not None:
        with self.cv:
          self.cv.notify_all()
      for th in threads:
        th.join()
      with self.cv:
        self.tasks = [t for t in self.tasks if t not in children]


class BlockState:
  """What the threads of one block share: the collective scratch, pending
  SMEM->GMEM copies per thread; ``sched``: the cluster's scheduler."""

  def __init__(self, describe_block: str, num_threads: int, kernel_name: str,
               sched: Scheduler | None = None, cluster=None, index: int = 0):
    self.block = describe_block
    self.kernel_name = kernel_name
    self.num_threads = num_threads
    self.sched = sched or Scheduler(f"block {describe_block}", kernel_name)
    self.cluster = cluster  # the ClusterState of a cluster, or None
    self.index = index  # this block's number in its cluster
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
    t = ctx.extra.get(THREAD_KEY, 0)
    n = self.entries.get((t, id(eqn)), 0)
    self.entries[(t, id(eqn))] = n + 1
    key = (id(eqn), n)
    hit = self.shared.get(key)
    if hit is None:
      # In a cluster, a peer block may have made this block's buffers
      # already (a multicast copy into them): the same allocation site.
      bufs = fresh() if self.cluster is None else self.cluster.buffers(self.index, key, fresh)
      hit = self.shared[key] = [bufs, self.num_threads]
    hit[1] -= 1
    if hit[1] == 0:
      del self.shared[key]
    return hit[0]

  def private_scope(self, ctx, eqn, fresh):
    """A private run_scoped in a cluster: the buffers of the same thread's
    k-th entry in every block are peers (``cluster.ClusterState``)."""
    slot = ctx.extra.get(SLOT_KEY, 0) % (self.num_threads * self.slots_per_wg)
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
  def wait_until(self, ctx, predicate, what: str, where: str):
    """Block this thread until ``predicate()`` holds (a barrier wait)."""
    task = ctx.extra.get(TASK_KEY)
    if task is None:  # a pl.pallas_call program: nobody else can arrive
      if predicate():
        return
      task = Task(f"block {self.block}")
      self.sched.tasks = [task]
    self.sched.wait_until(task, predicate, what, where)
