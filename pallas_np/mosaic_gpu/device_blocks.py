"""Mosaic GPU kernels whose blocks wait on semaphores, or that run on the
devices of a ``shard_map`` (``plgpu.remote_ref``, multimem, semaphores
signalled across devices): one kernel instance per device.

Such a kernel may make a block wait for another block (``pl.get_global``
semaphores: JAX's collective matmul waits until every block of the
neighbour device has sent its part) or for another device. So the blocks
of a device do not run one after another: every block's warpgroups are
threads of one scheduler with one *baton*. The baton holder runs until it
finishes or waits (a barrier, a semaphore), then hands the baton to the
next thread that can go on, round robin over the started blocks; when none
can, the next block starts (blocks start in order, as many as the waits
need). When no thread of the device can go on and every block has started,
only another device can help: the device waits on its multi-device session
(``pallas_np.devices``), which raises on a deadlock across devices, naming
every waiting warpgroup with its block, kernel line and device.

Memory: GMEM refs are the kernel's operands and outputs on each device
(symmetric, as on GPUs: ``remote_ref``, ``multimem_*`` and semaphores on a
peer name its copy of the same ref); ``run_scoped`` semaphores are per block
(the same block on a peer), ``pl.get_global`` ones per device. A kernel run
outside ``shard_map`` gets a one-device session, so waits between its own
blocks deadlock-check the same way."""
from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace

import numpy as np

from pallas_np import _compat as jc
from pallas_np import devices
from pallas_np.compiler import RunContext
from pallas_np.errors import KernelError, UnsupportedError
from pallas_np.mosaic_gpu import peers, threads
from pallas_np.state.refs import SHARED_SCOPE_KEY

_KEY = "mgpu_thread_key"  # RunContext.extra: (block number, warpgroup)


class _Aborted(BaseException):
  """Another thread of the device failed: stop this one (not an error of its own)."""


class BlockDevice(devices.DeviceContext):
  """``RunContext.device`` of one block: its device's session and memory;
  ``run_scoped`` semaphores are this block's (keyed by block)."""
  __slots__ = ("block", "scheduler")

  def __init__(self, device: devices.DeviceContext, block, scheduler):
    super().__init__(device.placement, device.targets)
    self.session = device.session
    self.target_names = device.target_names
    self.barrier = device.barrier
    self.scoped = device.scoped  # one dict per device: peers find them by key
    self.block = block
    self.scheduler = scheduler

  def scoped_semaphore(self, key, fresh):
    return super().scoped_semaphore((self.block, key), fresh)

  def global_semaphore(self, key, fresh):
    """A ``pl.get_global`` semaphore: one per device, shared by its blocks."""
    return super().scoped_semaphore(("global", key), fresh)

  def wait_in_turn(self, ctx, pred, what):
    self.scheduler.wait(ctx, pred, what, None)


def _semaphore_positions(eqn) -> list[int]:
  avals = [getattr(v.aval, "inner_aval", v.aval) for v in eqn.params["jaxpr"].invars]
  return [i for i, a in enumerate(avals) if jc.is_semaphore_dtype(a.dtype)]


class DeviceBlockState(threads.BlockState):
  """A block whose waits go through the device's scheduler."""

  def __init__(self, scheduler, describe: str, num_threads: int, kernel_name: str, device):
    super().__init__(describe, num_threads, kernel_name)
    self.scheduler = scheduler
    self.device = device

  def wait_until(self, ctx, predicate, what: str, where: str):
    self.scheduler.wait(ctx, predicate, what, where)

  def shared_scope(self, ctx, eqn, fresh):
    t = ctx.extra.get(threads.THREAD_KEY, 0)
    n = self.entries.get((t, id(eqn)), 0)
    bufs = super().shared_scope(ctx, eqn, fresh)
    for i in _semaphore_positions(eqn):  # a peer may signal them
      bufs[i] = self.device.scoped_semaphore((id(eqn), n, i), bufs[i])
    return bufs


class DeviceScheduler:
  """The warpgroups of every block of one device instance, one baton."""

  def __init__(self, kernel, device: devices.DeviceContext, ins, outs):
    self.kernel = kernel
    self.device = device
    self.cond = device.session.cond
    self.ins, self.outs = ins, outs
    self.blocks = list(itertools.product(*map(range, kernel.block_shape)))
    self.n = kernel.num_threads
    self.started = 0
    self.order: list = []  # (block number, warpgroup), in start order
    self.waiting: dict = {}  # key -> (predicate, what, where) while it waits
    self.done: set = set()
    self.cvs: dict = {}  # key -> its Condition on the session lock
    self.states: list = []
    self.turn = None
    self.failed: BaseException | None = None
    self.errors: list = []
    self.pythreads: list = []
    sizes = dict(zip(kernel.block_names, kernel.block_shape))
    if kernel.thread_name is not None:
      sizes[kernel.thread_name] = self.n
    self.sizes = sizes
    self.num_programs = tuple(np.int32(s) for s in sizes.values())

  # -- the baton (self.cond held) ------------------------------------------------
  def _can_run(self, key) -> bool:
    if key in self.done:
      return False
    w = self.waiting.get(key)
    return w is None or w[0]()

  def _next_runnable(self, me):
    n = len(self.order)
    start = self.order.index(me) + 1 if me in self.order else 0
    for step in range(n):
      key = self.order[(start + step) % n]
      if self._can_run(key):
        return key
    return None

  def _describe_waits(self) -> str:
    lines = []
    for (b, t), (_, what, where) in sorted(self.waiting.items()):
      wg = f" warpgroup {t}" if self.kernel.thread_name is not None else ""
      at = f" at {where}" if where else ""
      lines.append(f"block {self.blocks[b]}{wg}: {what}{at}")
    return "; ".join(lines)

  def _give(self, key):
    self.turn = key
    if key is not None:
      self.cvs[key].notify()

  def _hand_over(self, me):
    """Give the baton to the next thread that can go on; start blocks as
    needed; when nothing on this device can go on, wait for other devices."""
    while True:
      nxt = self._next_runnable(me)
      if nxt is not None:
        self._give(nxt)
        return
      if self.started < len(self.blocks):
        self._start_block()
        continue
      if not self.waiting:
        self._give(None)  # every thread finished
        self.cond.notify_all()
        return
      where = SimpleNamespace(device=self.device, grid_point=())
      devices.block_until(where, lambda: self._next_runnable(me) is not None,
                          f"Mosaic GPU kernel '{self.kernel.name}': {self._describe_waits()}")

  def _fail(self, err):
    if self.failed is None:
      self.failed = err
    for cv in self.cvs.values():
      cv.notify()
    self.cond.notify_all()

  def wait(self, ctx, pred, what: str, where):
    """The calling warpgroup waits until ``pred()`` (a barrier phase, a
    semaphore value), letting the device's other threads run meanwhile."""
    if pred():
      return
    key = ctx.extra[_KEY]
    with self.cond:
      self.waiting[key] = (pred, what, where)
      try:
        self._hand_over(key)
      except BaseException as err:
        self.waiting.pop(key, None)
        self._fail(err)
        raise
      self._park(key)
      self.waiting.pop(key, None)
      if self.failed is not None:
        raise _Aborted()

  def _park(self, key):
    """Wait until ``key`` holds the baton or the run failed. The wait
    releases the session lock however deeply the caller holds it (a
    semaphore wait holds it), so peers and the other threads can go on."""
    cv = self.cvs[key]
    with self.cond:
      while self.turn != key and self.failed is None:
        cv.wait()

  # -- blocks and threads --------------------------------------------------------
  def _start_block(self):
    number = self.started
    self.started += 1
    block = self.blocks[number]
    state = DeviceBlockState(self, str(block), self.n, self.kernel.name, None)
    state.device = BlockDevice(self.device, block, self)
    self.states.append(state)
    for t in range(self.n):
      key = (number, t)
      self.order.append(key)
      self.cvs[key] = threading.Condition(self.cond)
      th = threading.Thread(target=self._body, args=(key,),
                            name=f"pallas_np-b{number}-wg{t}", daemon=True)
      self.pythreads.append(th)
      th.start()

  def _context(self, key) -> RunContext:
    number, t = key
    kernel, block = self.kernel, self.blocks[number]
    state = self.states[number]
    ctx = RunContext(kernel.name, kernel.params)
    coords = (*block, t) if kernel.thread_name is not None else block
    ctx.program_ids = tuple(np.int32(c) for c in coords)
    ctx.num_programs = self.num_programs
    ctx.grid_point = block
    ctx.extra["mesh_axes"] = {n: np.int32(c) for n, c in zip(self.sizes, coords)}
    ctx.extra["mesh_sizes"] = self.sizes
    ctx.extra[threads.BLOCK_KEY] = state
    ctx.extra[threads.THREAD_KEY] = t
    ctx.extra[SHARED_SCOPE_KEY] = state.shared_scope
    ctx.extra[_KEY] = key
    ctx.device = state.device
    return ctx

  def _body(self, key):
    number, t = key
    peers.activate(self.states[number].device)
    self._park(key)
    error = None
    try:
      if self.failed is None:
        ctx = self._context(key)
        try:
          self.kernel.plan.fn(ctx, *self.ins, *self.outs)
        except (KernelError, _Aborted):
          raise
        except Exception as e:
          raise self.kernel.block_error(e, self.blocks[number], t) from e
    except _Aborted:
      pass
    except BaseException as err:  # noqa: BLE001 - re-raised by run()
      error = err
    with self.cond:
      if error is not None:
        self.errors.append(error)
        self._fail(error)
      self.done.add(key)
      if all((number, u) in self.done for u in range(self.n)) and self.failed is None:
        try:
          self.states[number].finish()  # the block's outstanding copies land
        except BaseException as err:  # noqa: BLE001
          self.errors.append(err)
          self._fail(err)
      if self.failed is None and self.turn == key:
        try:
          self._hand_over(key)
        except BaseException as err:  # noqa: BLE001 - a deadlock across devices
          self.errors.append(self._wrap(err, number, t))
          self._fail(err)
      self.cond.notify_all()

  def _wrap(self, err, number, t):
    if isinstance(err, KernelError):
      return err
    return self.kernel.block_error(err, self.blocks[number], t)

  def _finished(self) -> bool:
    if self.failed is not None:
      return len(self.done) == len(self.order)
    return self.started == len(self.blocks) and len(self.done) == len(self.order)

  def run(self):
    with self.cond:
      self._hand_over(None)
      while not self._finished():
        self.cond.wait(timeout=1.0)
    for th in self.pythreads:
      th.join()
    if self.errors:
      raise self.errors[0]
    if self.failed is not None:
      raise self.failed


def _one_device(placement, targets) -> devices.DeviceContext:
  """A session of this device alone: waits between its own blocks."""
  placement = placement or devices.Placement(("mgpu",), (), (), ())
  me = devices.DeviceContext(placement, targets)
  me.session = devices.Session(1)
  me.session.members[me.logical_id] = me
  return me


def run(kernel, ins, outs, placement, remote: bool):
  """Run ``kernel`` (a ``MeshKernel``) as one device's instance."""
  if kernel.params.detect_races:
    raise UnsupportedError(
        f"pallas_np: detect_races=True on Mosaic GPU kernel '{kernel.name}', which waits on "
        "semaphores or talks to other devices: race detection is not supported there yet")
  targets = [*ins, *outs]
  me = devices.enter(placement, targets) if placement is not None and remote else \
      _one_device(placement, targets)
  me.target_names = [*(f"operand {i}" for i in range(len(ins))),
                     *(f"output {i}" for i in range(len(outs)))]
  error = None
  try:
    DeviceScheduler(kernel, me, ins, outs).run()
  except BaseException as e:
    error = e
    raise
  finally:
    devices.leave(me, error)
  return outs
