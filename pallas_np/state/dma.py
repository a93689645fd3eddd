"""Semaphores and DMAs with the visibility rules of TPU interpret mode.

TPU interpret mode (``pltpu.InterpretParams()``, ``dma_execution_mode=
"on_wait"``, the default) does not move data when a DMA starts: the DMA is
queued on its semaphore(s) and runs when somebody waits on one of them and the
count is too low. Waiting pops the *most recently* queued DMA first, reads the
source at that moment and writes the destination. We do the same, so a kernel
that races its own DMAs sees the same values as under TPU interpret mode.

A semaphore is a 0-d cell of an int64 NumPy array (``memory.allocate`` gives
semaphore scratch int64 so byte counts of DMA semaphores cannot overflow); its
address identifies it in the per-run table of pending DMAs kept in
``RunContext.rules``. The interpreter runs one core, so a wait that its queued
DMAs cannot satisfy can never be satisfied: it raises instead of hanging.
Between devices (``shard_map``) waits block on the other devices' signals
and remote DMAs copy at start; see ``pallas_np.devices``.
"""
from __future__ import annotations

import numpy as np

from pallas_np import devices, races
from pallas_np.kernel_context import rule_state


STARTED, READ, DONE = 0, 1, 2


class DmaState:
  """Per-run DMA bookkeeping (``RunContext.rules.dma``)."""
  __slots__ = ("tasks", "dmas", "barrier", "native")

  def __init__(self):
    self.tasks: dict[int, list] = {}  # semaphore address -> FIFO of callables (start order)
    self.dmas: list[Dma] = []  # started, not yet completed
    self.barrier = None
    self.native = None  # DMAs compiled loops queued in machine code (native/dma_stash.py)


def settle(ctx) -> None:
  """DMAs a compiled loop left in its machine-code queue join this queue
  (in start order) before anything here reads or changes it."""
  rules = ctx.rules
  st = rules.dma if rules is not None else None
  if st is not None and st.native is not None:
    native, st.native = st.native, None
    native.flush(ctx)


def state_of(ctx) -> DmaState:
  rules = rule_state(ctx)
  st = rules.dma
  if st is None:
    st = rules.dma = DmaState()
  return st


def sem_cell(view, idx) -> np.ndarray:
  """A writable 0-d view of one semaphore."""
  if idx is Ellipsis:
    cell = view
  else:
    cell = view[(*idx, Ellipsis)] if isinstance(idx, tuple) else view[idx, ...]
  if cell.ndim != 0:
    raise ValueError(f"expected a single semaphore, got a semaphore array of shape {cell.shape}")
  return cell


def sem_key(cell: np.ndarray) -> int:
  return cell.__array_interface__["data"][0]


class Dma:
  __slots__ = ("src", "dst", "src_sem", "dst_sem", "state", "data", "add",
               "source", "grid_point", "nbytes")

  def __init__(self, src, dst, src_sem, dst_sem, add, source, grid_point, nbytes=None):
    self.src = src  # (view, idx)
    self.dst = dst
    self.src_sem = src_sem
    self.dst_sem = dst_sem
    self.add = add
    self.source = source
    self.grid_point = grid_point
    self.state = STARTED
    self.data = None
    self.nbytes = nbytes  # what the semaphores get (None: the bytes moved)

  def read(self):
    if self.state != STARTED:
      return
    view, idx = self.src
    races.note(view, idx, "read")
    self.data = np.array(view[idx])
    if self.src_sem is not None:
      self.src_sem[...] += self.data.nbytes if self.nbytes is None else self.nbytes
    self.state = READ

  def read_and_write(self):
    self.read()
    if self.state == DONE:
      return
    view, idx = self.dst
    data = self.data
    races.note(view, idx, "readwrite" if self.add else "write")
    if self.add:
      view[idx] += data
    else:
      view[idx] = data
    self.dst_sem[...] += data.nbytes if self.nbytes is None else self.nbytes
    self.data = None
    self.state = DONE


def check_shapes(src: np.ndarray, dst: np.ndarray):
  """Source and destination of a DMA with a traced size agree when it runs."""
  if src.shape != dst.shape:
    raise ValueError(f"DMA shape mismatch: source {src.shape}, destination {dst.shape}")


def start(ctx, src, dst, dst_sem, src_sem, *, add, source, nbytes=None):
  """Queue a DMA; ``nbytes`` overrides what it signals (an indexed DMA that
  skips ignored rows still signals the whole copy)."""
  settle(ctx)
  st = state_of(ctx)
  dma = Dma(src, dst, src_sem, dst_sem, add, source, ctx.grid_point, nbytes)
  if isinstance(src[0], np.ndarray) and src[0][src[1]].size == 0:  # a traced pl.ds size of 0: nothing to move or wait for
    dma.state = DONE
    if nbytes:  # every row skipped: the copy is still signalled whole
      for sem in (src_sem, dst_sem):
        if sem is not None:
          sem[...] += nbytes
    return
  st.dmas.append(dma)
  if src_sem is not None:
    st.tasks.setdefault(sem_key(src_sem), []).append((src_sem, dma.read))
  st.tasks.setdefault(sem_key(dst_sem), []).append((dst_sem, dma.read_and_write))


def wait(ctx, cell: np.ndarray, value: int, *, what: str, decrement: bool = True):
  """Wait until the semaphore reaches ``value`` and decrement it, running
  queued DMAs (oldest first: a DMA engine completes same-semaphore copies in
  the order they were started, which library kernels rely on; JAX's TPU
  interpret mode runs them newest first) while it is too low. In a multi-device run
  (``ctx.device``) a wait still too low blocks until another device signals
  it, or raises when no device ever can (``pallas_np.devices``)."""
  settle(ctx)
  with devices.lock(ctx):
    if cell[()] < value:
      st = ctx.rules.dma if ctx.rules is not None else None
      queue = st.tasks.get(sem_key(cell)) if st is not None else None
      while cell[()] < value and queue:
        _, task = queue.pop(0)
        task()
      if st is not None:
        st.dmas = [d for d in st.dmas if d.state != DONE]
      if cell[()] < value and ctx.device is not None:
        devices.block_until(
            ctx, lambda: cell[()] >= value,
            f"{what} waits for the semaphore to reach {value} (it is {int(cell[()])})")
      if cell[()] < value:
        raise RuntimeError(
            f"deadlock: {what} waits for the semaphore to reach {value}, but its "
            f"value is {int(cell[()])} and no pending DMA or other core can signal "
            "it: on a TPU this wait would hang forever. (Kernels that split a "
            "'parallel' grid dim across TensorCores, e.g. megacore modes, need "
            "InterpretParams(num_cores=2).)")
    dev_races = devices.races_of(ctx)
    if dev_races is not None:
      dev_races.waited(ctx.device.logical_id, sem_key(cell))
    if decrement:
      cell[...] -= value
    acquire = getattr(races.current(), "acquire", None)  # a mesh kernel's race detector
    if acquire is not None:
      acquire(sem_key(cell))


def signal(ctx, cell: np.ndarray, inc: int):
  """Add ``inc`` to one of this device's semaphores."""
  lk = devices.lock(ctx)
  with lk:
    _released(cell)
    cell[...] += inc
    lk.notify_all()


def _released(cell):
  release = getattr(races.current(), "release", None)  # a mesh kernel's race detector
  if release is not None:
    release(sem_key(cell))


# -- between devices (pallas_np.devices) -------------------------------------------
def _peer(ctx, target: int):
  me = ctx.device
  devices.check_failed(me)
  return me, me.session.members[target]


def remote_start(ctx, target: int, src, dst, dst_sem, src_sem, *, add, source):
  """A DMA to another device: copies now (source read, the peer's
  destination written, the send semaphore and the peer's receive semaphore
  counted), under the session lock."""
  what = f"remote DMA at {source}"
  lk = devices.lock(ctx)
  with lk:
    me, peer = _peer(ctx, target)
    d_view, d_idx = dst
    peer_dst = me.peer_ref(peer, d_view, what)
    s_view, s_idx = src
    data = np.array(s_view[s_idx])
    dev_races = me.session.races
    if dev_races is not None:
      me.note_local(s_view, s_idx, "read", ctx.grid_point)
      dev_races.remote_write(me.logical_id, target, peer_dst, d_idx,
                             name=me.target_name(d_view), owner=peer.placement.describe(),
                             source=source, grid_point=ctx.grid_point)
    if add:
      peer_dst[d_idx] += data
    else:
      peer_dst[d_idx] = data
    sem_view, sem_idx = dst_sem
    recv = sem_cell(me.peer_ref(peer, sem_view, what), sem_idx)
    _released(recv)
    recv[...] += data.nbytes
    if src_sem is not None:
      sem_cell(*src_sem)[...] += data.nbytes
    if dev_races is not None:
      dev_races.signal(me.logical_id, sem_key(recv))
      if src_sem is not None:
        dev_races.signal(me.logical_id, sem_key(sem_cell(*src_sem)))
    lk.notify_all()


def remote_signal(ctx, target: int, sem, inc: int, *, source):
  """``semaphore_signal(..., device_id=target)`` to another device."""
  lk = devices.lock(ctx)
  with lk:
    me, peer = _peer(ctx, target)
    view, idx = sem
    cell = sem_cell(me.peer_ref(peer, view, f"remote semaphore_signal at {source}"), idx)
    _released(cell)
    cell[...] += inc
    if me.session.races is not None:
      me.session.races.signal(me.logical_id, sem_key(cell))
    lk.notify_all()


def barrier_semaphore(ctx) -> np.ndarray:
  if ctx.device is not None:  # one per device per kernel invocation
    return ctx.device.barrier
  st = state_of(ctx)
  if st.barrier is None:
    st.barrier = np.zeros((), np.int64)
  return st.barrier


def check_finished(ctx, operands=()):
  """Called when a kernel's grid is done: DMAs nobody waited for.

  A DMA whose destination and semaphore are kernel operands (an output in
  ``pl.ANY``/HBM or VMEM and a ``pltpu.SEMAPHORE`` output, or buffers aliased
  to them) outlives the kernel: that is how a DMA "future" is returned to a
  later kernel which waits on it (JAX's ``tpu_pallas_async_test``). It
  completes now, in start order: its data lands in the destination and the
  semaphore output carries the byte count the later wait consumes (on a TPU
  it completes at some time after its start; now is one such time). Any other
  pending DMA (a scratch semaphore or destination) can never be waited on:
  it raises."""
  settle(ctx)
  st = ctx.rules.dma if ctx.rules is not None else None
  if st is None:
    return
  pending = [d for d in st.dmas if d.state != DONE]
  st.dmas = []
  st.tasks = {}
  lost = [d for d in pending if not _outlives_kernel(d, operands)]
  if lost:
    d = lost[0]
    raise RuntimeError(
        f"{len(lost)} DMA(s) still in flight when the kernel ended; the first "
        f"was started at {d.source} at grid point {tuple(int(p) for p in d.grid_point)} and never "
        "waited on (TPU interpret mode would never copy its data). Wait on its "
        "semaphore (`.wait()`) before the kernel ends, or make its semaphore and "
        "destination outputs of the kernel (a DMA future a later kernel waits on).")
  for d in pending:
    d.read_and_write()


def _outlives_kernel(d: Dma, operands) -> bool:
  """The DMA's destination and semaphore(s) are (parts of) kernel operands,
  not scratch: a later kernel can see its data and wait on its count."""
  def in_operands(arr):
    return isinstance(arr, np.ndarray) and any(
        isinstance(o, np.ndarray) and np.shares_memory(arr, o) for o in operands)
  sems = [d.dst_sem] + ([d.src_sem] if d.src_sem is not None else [])
  return in_operands(d.dst[0]) and all(in_operands(s) for s in sems)
