"""One Mosaic GPU block: its warpgroup threads, barriers and pending copies.

Execution model (docs/gpu.md, "Mosaic GPU"): blocks (grid x cluster points)
run one after another. Inside a block, each warpgroup (``num_threads`` /
``thread_name``) is a Python thread running the same kernel plan, but only
one runs at a time: a thread keeps the *baton* until it finishes or blocks on
a barrier wait, then hands it to the next thread (round robin) that can go
on. So the interleaving is deterministic, barrier state needs no locks, and a
deadlock is exact: when no unfinished thread can go on, no arrival can ever
come, and every blocked thread raises naming its kernel line, the block and
its warpgroup, instead of hanging.

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


class BarrierDeadlock(PallasNumpyError, RuntimeError):
  """A Mosaic GPU barrier wait that can never complete."""


class _Aborted(Exception):
  """Another warpgroup of the block failed: stop this one."""


class Barrier:
  """One mbarrier: arrivals complete a phase; copies issued on it land when
  a wait observes that phase."""
  __slots__ = ("num_arrivals", "arrivals", "phase", "observed", "in_flight", "landing")

  def __init__(self, num_arrivals: int):
    self.num_arrivals = num_arrivals
    self.arrivals = 0
    self.phase = 0  # completed phases
    self.observed: dict = {}  # thread -> phases it has waited for
    self.in_flight: list = []  # copies of the phase being filled
    self.landing: dict = {}  # completed phase -> copies not yet written

  def arrive(self, copy=None):
    if copy is not None:
      self.in_flight.append(copy)
    self.arrivals += 1
    if self.arrivals >= self.num_arrivals:
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


class BlockState:
  """What the warpgroups of one block share: the scheduler, the collective
  scratch, pending SMEM->GMEM copies per thread."""

  def __init__(self, describe_block: str, num_threads: int, kernel_name: str):
    self.block = describe_block
    self.kernel_name = kernel_name
    self.num_threads = num_threads
    self.cv = threading.Condition()
    self.turn = 0  # the thread holding the baton
    self.done = [False] * num_threads
    self.waiting: list = [None] * num_threads  # thread -> (predicate, what, where)
    self.failed: BaseException | None = None
    self.shared: dict = {}  # (eqn id, k-th entry) -> [buffers, threads left]
    self.entries: dict = {}  # (thread, eqn id) -> entries so far
    self.to_gmem: dict = {t: [] for t in range(num_threads)}  # pending stores
    self.from_gmem: dict = {t: [] for t in range(num_threads)}  # pending cp.async loads
    # False in a pl.pallas_call (no block end to land them at): stores land
    # when issued.
    self.defer_stores = True

  def store_to_gmem(self, thread: int, land):
    if self.defer_stores:
      self.to_gmem[thread].append(land)
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
      hit = self.shared[key] = [fresh(), self.num_threads]
    hit[1] -= 1
    if hit[1] == 0:
      del self.shared[key]
    return hit[0]

  # -- SMEM -> GMEM copies -----------------------------------------------------
  def flush_to_gmem(self, thread: int, keep: int = 0):
    pending = self.to_gmem[thread]
    while len(pending) > keep:
      pending.pop(0)()

  def finish(self):
    """Block end: every outstanding copy lands."""
    for t in range(self.num_threads):
      self.flush_to_gmem(t)
      while self.from_gmem[t]:
        self.from_gmem[t].pop(0)()

  # -- the baton -----------------------------------------------------------------
  def _can_run(self, t) -> bool:
    if self.done[t]:
      return False
    w = self.waiting[t]
    return w is None or w[0]()

  def _pass_baton(self, me):
    """Hand the baton to the next thread that can go on (self included);
    None when none can (a deadlock, unless every thread finished)."""
    n = self.num_threads
    for step in range(1, n + 1):
      t = (me + step) % n
      if self._can_run(t):
        return t
    return None

  def _deadlock(self) -> BarrierDeadlock:
    lines = [f"  warpgroup {t}: {w[1]} at {w[2]}" for t, w in enumerate(self.waiting)
             if w is not None and not self.done[t]]
    return BarrierDeadlock(
        f"pallas_np: Mosaic GPU kernel '{self.kernel_name}' deadlocked in block "
        f"{self.block}: every warpgroup still running waits on a barrier that no "
        "arrival or copy can complete any more:\n" + "\n".join(lines))

  def wait_until(self, ctx, predicate, what: str, where: str):
    """Block this thread until ``predicate()`` holds (a barrier wait)."""
    t = ctx.extra.get(THREAD_KEY, 0)
    if predicate():
      return
    with self.cv:
      self.waiting[t] = (predicate, what, where)
      nxt = self._pass_baton(t)
      if nxt is None or (nxt == t and not predicate()):
        self.failed = self.failed or self._deadlock()
        self.cv.notify_all()
        raise self.failed
      self.turn = nxt
      self.cv.notify_all()
      while self.turn != t and self.failed is None:
        self.cv.wait()
      self.waiting[t] = None
      if self.failed is not None:
        raise (self.failed if isinstance(self.failed, BarrierDeadlock) else _Aborted())

  def run_threads(self, run_one):
    """Run ``run_one(t)`` for every warpgroup t, one at a time (the baton)."""
    if self.num_threads == 1:
      run_one(0)
      return
    errors: list = [None] * self.num_threads

    def body(t):
      with self.cv:
        while self.turn != t and self.failed is None:
          self.cv.wait()
      try:
        if self.failed is None:
          run_one(t)
      except _Aborted:
        pass
      except BaseException as err:  # noqa: BLE001 - re-raised by the caller
        errors[t] = err
        with self.cv:
          self.failed = self.failed or err
      with self.cv:
        self.done[t] = True
        if self.failed is None:
          nxt = self._pass_baton(t)
          if nxt is None and not all(self.done):
            self.failed = self._deadlock()
          elif nxt is not None:
            self.turn = nxt
        self.cv.notify_all()

    threads = [threading.Thread(target=body, args=(t,), name=f"pallas_np-wg{t}", daemon=True)
               for t in range(self.num_threads)]
    for th in threads:
      th.start()
    for th in threads:
      th.join()
    first = next((e for e in errors if e is not None), None)
    if first is not None:
      raise first
    if self.failed is not None:
      raise self.failed
