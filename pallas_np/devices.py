"""Kernels that span devices: ``jax.lax.axis_index``, remote DMAs and
semaphores between the devices of a ``shard_map``.

Execution model (see docs/tpu.md, "Multi-device kernels"). pallas_np does not
schedule devices: JAX's multi-device runtime does. Under ``jax.jit`` of a
``shard_map`` over N host devices, XLA runs each device's part of the program
on its own thread, so each device calls the kernel's ``io_callback`` itself,
with its own operands and its mesh coordinates (computed with
``lax.axis_index`` in the lowered program, ``pallas_np.api``). The N kernel
instances of one invocation meet here, in a ``Session``:

* every instance *enters* the session once its buffers are allocated and
  waits until all N have entered (a remote DMA needs its peer's buffers);
* remote DMAs copy at ``start`` (source read, peer's destination written, the
  send semaphore and the peer's receive semaphore counted, all under the
  session lock); local DMAs keep TPU interpret mode's on-wait order
  (``pallas_np.state.dma``);
* a semaphore wait that is too low blocks on the session's condition; every
  change of a semaphore wakes the waiters;
* deadlock: when every instance that has not left is blocked on a wait that
  is not satisfied, nothing can ever signal them: all of them raise, each
  naming its own kernel line, device and grid point, and listing the others;
* an error on one device fails the session: the others raise at their next
  wait (or at once if blocked), so no device is left waiting;
* a session is dropped when all N have left. Instances are matched *by call*:
  the lowered program draws a ticket per device (``new_ticket``, a host
  callback) and takes the maximum over the mesh with ``lax.pmax``; XLA pairs
  that collective per execution, so the N instances of one call carry the same
  ticket and two concurrent calls (two Python threads) carry different ones.
  Callers without a ticket (``Placement.call`` None) are matched by the count
  of runs of the same plan per device (the k-th run on device d meets the k-th
  run on every other device).

A backstop timeout (``PALLAS_NP_DEVICE_TIMEOUT`` seconds, default 120) bounds
only what the deadlock check cannot see: a device whose kernel instance
never starts (a runtime that serialised the devices' callbacks).
"""
from __future__ import annotations

import itertools
import math
import os
import threading

import numpy as np

from pallas_np import _compat as jc
from pallas_np.device_races import DeviceRaces, elements_of_view
from pallas_np.errors import UnsupportedError

_DEFAULT_TIMEOUT_S = 120.0


def timeout_s() -> float:
  return float(os.environ.get("PALLAS_NP_DEVICE_TIMEOUT", _DEFAULT_TIMEOUT_S))


class DeviceError(RuntimeError):
  """A multi-device kernel invocation cannot go on (deadlock, a peer failed)."""


# -- which kernels need the device context ------------------------------------
_REMOTE_PRIMS = (jc.mosaic_primitives.dma_start_p, jc.mosaic_primitives.dma_wait_p,
                 jc.pallas_primitives.semaphore_signal_p)


def _has_device_id(eqn) -> bool:
  tree = eqn.params.get("tree", eqn.params.get("args_tree"))
  if tree is None:
    return False
  # (objects, not ints: a pl.select_ref operand's refs must not look like a shape)
  marks = [object() for _ in eqn.invars]
  parts = tree.unflatten(marks) if hasattr(tree, "unflatten") else \
      jc.tree_unflatten(tree, marks)
  if eqn.primitive is jc.pallas_primitives.semaphore_signal_p:
    return parts[3] is not None
  return parts[4] is not None


def device_features(jaxpr) -> tuple[frozenset, bool]:
  """(axis names the kernel reads with ``axis_index``, whether it talks to
  other devices: a DMA/signal with a ``device_id`` or the barrier semaphore)."""
  names, remote = set(), False
  stack = [jaxpr]
  while stack:
    jx = stack.pop()
    jx = getattr(jx, "jaxpr", jx) if not isinstance(jx, jc.Jaxpr) else jx
    for eqn in jx.eqns:
      if eqn.primitive is jc.axis_index_p:
        name = eqn.params["axis_name"]
        names.update(name if isinstance(name, tuple) else (name,))
      elif eqn.primitive is jc.mosaic_primitives.get_barrier_semaphore_p:
        remote = True
      elif eqn.primitive in _REMOTE_PRIMS and _has_device_id(eqn):
        remote = True
    stack.extend(jc.subjaxprs(jx))
  return frozenset(names), remote


# -- one device's view ----------------------------------------------------------
_tickets = itertools.count(1)
_TICKET_RANGE = 2**31 - 1


def new_ticket() -> np.int32:
  """A per-device number for one call of a multi-device kernel; the lowered
  program takes the maximum over the mesh (``lax.pmax``), which is one of
  this call's tickets and so differs from every concurrent call's."""
  return np.int32(next(_tickets) % _TICKET_RANGE)


class Placement:
  """Where one kernel instance runs: the bound axes (mesh order), their
  sizes and this device's coordinates. ``key`` names the kernel (plan);
  ``call`` (optional) identifies the call, the same on every device of it."""
  __slots__ = ("key", "names", "sizes", "coords", "call")

  def __init__(self, key, names, sizes, coords, call=None):
    self.key = key
    self.names = tuple(names)
    self.sizes = tuple(int(s) for s in sizes)
    self.coords = tuple(int(c) for c in coords)
    self.call = None if call is None else int(call)

  @property
  def num_devices(self) -> int:
    return math.prod(self.sizes)

  @property
  def logical_id(self) -> int:
    return self.to_logical(self.coords)

  def to_logical(self, coords) -> int:
    ret = 0
    for c, s in zip(coords, self.sizes):
      ret = ret * s + int(c)
    return ret

  def describe(self, logical=None) -> str:
    logical = self.logical_id if logical is None else logical
    coords, rest = [], logical
    for s in reversed(self.sizes):
      coords.append(rest % s)
      rest //= s
    coords = ", ".join(f"{n}={c}" for n, c in zip(self.names, reversed(coords)))
    return f"device {logical} ({coords})"


class DeviceContext:
  """One kernel instance inside a session (``RunContext.device``)."""
  __slots__ = ("placement", "session", "targets", "barrier", "logical_id", "target_names",
               "scoped")

  def __init__(self, placement: Placement, targets):
    self.placement = placement
    self.session = None
    self.logical_id = placement.logical_id
    # The kernel's top-level refs (scalar prefetch, whole operands/outputs,
    # scratch) a peer's remote DMA or signal may name; None: not addressable.
    self.targets = list(targets)
    self.target_names = None  # optional names of the targets, for messages
    self.barrier = np.zeros((), np.int64)
    # run_scoped semaphores, (site, index) -> array: one per invocation, so a
    # peer can signal one before this device has entered its scope.
    self.scoped: dict = {}

  def axis_index(self, name) -> np.int32:
    names = name if isinstance(name, tuple) else (name,)
    idx = 0
    for n in names:
      if n not in self.placement.names:
        raise UnsupportedError(
            f"pallas_np: jax.lax.axis_index({n!r}) inside a kernel: {n!r} is not an axis "
            f"of the mesh the kernel runs on ({self.placement.names})")
      k = self.placement.names.index(n)
      idx = idx * self.placement.sizes[k] + self.placement.coords[k]
    return np.int32(idx)

  def target_id(self, device_id, device_id_type) -> int:
    """The logical id of a DMA/signal target (``pltpu.DeviceIdType``)."""
    pl_ = self.placement
    if isinstance(device_id, dict):
      coords = list(pl_.coords)
      for axis, idx in device_id.items():
        for a in axis if isinstance(axis, tuple) else (axis,):
          if a not in pl_.names:
            raise UnsupportedError(f"pallas_np: device id names {a!r}, not a mesh axis "
                                   f"({pl_.names})")
        if isinstance(axis, tuple):
          # One logical axis over several mesh axes (JAX's _device_id_dict_to_mesh):
          # the index is row-major over them, each coordinate modulo its axis size.
          sizes = [pl_.sizes[pl_.names.index(a)] for a in axis]
          for k, a in enumerate(axis):
            coords[pl_.names.index(a)] = int(idx) // math.prod(sizes[k + 1:]) % sizes[k]
        else:
          coords[pl_.names.index(axis)] = int(idx)
      device_id, device_id_type = tuple(coords), jc.DeviceIdType.MESH
    if device_id_type == jc.DeviceIdType.LOGICAL:
      if isinstance(device_id, tuple):
        if len(device_id) != 1:
          raise ValueError("LOGICAL device ids are one integer")
        device_id = device_id[0]
      target = int(device_id)
    else:
      coords = device_id if isinstance(device_id, tuple) else (device_id,)
      if len(coords) != len(pl_.sizes):
        raise ValueError(f"a MESH device id has one coordinate per mesh axis {pl_.names}, "
                         f"got {len(coords)}")
      for c, s, n in zip(coords, pl_.sizes, pl_.names):
        if not 0 <= int(c) < s:
          raise ValueError(f"device id coordinate {n}={int(c)} is outside the mesh "
                           f"({n} has size {s})")
      target = pl_.to_logical(coords)
    if not 0 <= target < pl_.num_devices:
      raise ValueError(f"device id {target} is outside the mesh ({pl_.num_devices} devices)")
    return target

  # -- peers' memory -------------------------------------------------------------
  def scoped_semaphore(self, key, fresh: np.ndarray) -> np.ndarray:
    """This device's semaphore of a ``run_scoped`` site (``fresh`` if it is
    the first to need it)."""
    with self.session.cond:
      return self.scoped.setdefault(key, fresh)

  def _peer_scoped(self, peer: "DeviceContext", view):
    for key, sem in self.scoped.items():
      if sem is view:
        return peer.scoped.setdefault(key, np.zeros(view.shape, view.dtype))
    return None

  def note_local(self, view, index, kind: str, grid_point):
    """This device reads/writes ``view[index]``: checked against remote
    writes into it when the session checks races (``device_races``)."""
    session = self.session
    if session is None or session.races is None or not isinstance(view, np.ndarray):
      return
    for j, t in enumerate(self.targets):
      if t is None or not isinstance(t, np.ndarray):
        continue
      elems = elements_of_view(t, view, index)
      if elems is not None:
        with session.cond:
          name = self.target_names[j] if self.target_names else f"kernel ref #{j}"
          session.races.local_access(self.logical_id, t, elems, kind, name=name,
                                     grid_point=grid_point)
        return

  def target_name(self, view) -> str:
    if view is self.barrier:
      return "the barrier semaphore"
    for j, t in enumerate(self.targets):
      if t is view:
        names = self.target_names
        return names[j] if names is not None and j < len(names) else f"kernel ref #{j}"
    return "a kernel ref"

  def peer_ref(self, peer: "DeviceContext", view, what: str):
    """The array on ``peer`` that ``view`` (one of our top-level refs, or our
    barrier semaphore) is on this device."""
    if view is self.barrier:
      return peer.barrier
    scoped = self._peer_scoped(peer, view)
    if scoped is not None:
      return scoped
    for j, t in enumerate(self.targets):
      if t is view:
        other = peer.targets[j]
        if other is None or other.shape != view.shape:
          break
        return other
    raise UnsupportedError(
        f"pallas_np: {what}: the remote ref must be a kernel operand or output in "
        "pl.ANY/HBM memory (or a whole-array block), a scratch buffer or semaphore, a "
        "run_scoped semaphore, or the barrier semaphore; a blocked ref, a run_scoped "
        "buffer or a ref passed "
        "through a loop/cond is not addressable on another device here")


# -- sessions --------------------------------------------------------------------
class Session:
  """The N kernel instances of one invocation."""

  def __init__(self, n, unit: str = "device"):
    self.n = n
    self.unit = unit  # what an instance is, for messages: a device, a core
    self.cond = threading.Condition(threading.RLock())
    self.members: dict[int, DeviceContext] = {}
    self.left: set[int] = set()
    self.finished: set[int] = set()  # instances done, waiting for the others (leave)
    self.blocked: dict[int, tuple] = {}  # logical id -> (predicate, what, grid point)
    self.failed: BaseException | None = None
    self.failed_by = None
    self.races = None  # device_races.DeviceRaces when detect_races is on

  def fail(self, err, by):
    if self.failed is None:
      self.failed, self.failed_by = err, by
    self.cond.notify_all()


_lock = threading.Lock()
_sessions: dict = {}  # (key, ("call", ticket) or generation) -> Session
_generation: dict = {}  # (key, logical id) -> runs entered (calls without a ticket)


def _peer_failed(session: Session, me: DeviceContext) -> DeviceError:
  if isinstance(session.failed, DeviceError):
    return DeviceError(f"on {me.placement.describe()}: {session.failed}")
  by = me.placement.describe(session.failed_by) if session.failed_by is not None else "a device"
  return DeviceError(f"{by} failed in this kernel invocation "
                     f"({type(session.failed).__name__}: {session.failed}); "
                     f"{me.placement.describe()} stops too")


def enter(placement: Placement, targets) -> DeviceContext:
  """Join this invocation's session; returns when every device has joined."""
  me = DeviceContext(placement, targets)
  dev = me.logical_id
  with _lock:
    if placement.call is not None:
      key = (placement.key, ("call", placement.call))
    else:
      gen = _generation.get((placement.key, dev), 0)
      _generation[(placement.key, dev)] = gen + 1
      key = (placement.key, gen)
    session = _sessions.get(key)
    if session is None:
      session = _sessions[key] = Session(placement.num_devices)
  me.session = session
  with session.cond:
    if dev in session.members:
      raise DeviceError(f"{placement.describe()} joined the same kernel invocation twice")
    session.members[dev] = me
    session.cond.notify_all()
    ok = session.cond.wait_for(
        lambda: len(session.members) == session.n or session.failed is not None,
        timeout=timeout_s())
    if session.failed is not None:
      err = _peer_failed(session, me)
      _leave_locked(me)
      raise err
    if not ok:
      missing = sorted(set(range(session.n)) - set(session.members))
      err = DeviceError(
          f"{placement.describe()}: the kernel instances of devices {missing} did not "
          f"start within {timeout_s():g} s (PALLAS_NP_DEVICE_TIMEOUT): a multi-device "
          "kernel needs every device's instance to run at the same time, as XLA's CPU "
          "runtime does for jax.jit(jax.shard_map(...)); this runtime seems to run them "
          "one after another")
      session.fail(err, dev)
      _leave_locked(me)
      _forget(placement.key, key)
      raise err
  return me


def check_races(me: DeviceContext, kernel: str):
  """Turn on the cross-device race check for this invocation
  (``detect_races=True``; every device calls it before its grid runs)."""
  session = me.session
  with session.cond:
    if session.races is None:
      session.races = DeviceRaces(session.n, kernel)


def races_of(ctx):
  """The session's ``DeviceRaces`` (None: not a multi-device run, or off)."""
  dev = getattr(ctx, "device", None)
  return None if dev is None or dev.session is None else dev.session.races


def _forget(plan_key, session_key):
  """Drop a failed session; without call ids, restart the run counts of its
  plan (they can no longer line up)."""
  with _lock:
    _sessions.pop(session_key, None)
    if not isinstance(session_key[1], tuple):
      for k in [k for k in _generation if k[0] == plan_key]:
        del _generation[k]
      for k in [k for k in _sessions if k[0] == plan_key and not isinstance(k[1], tuple)]:
        del _sessions[k]


def _leave_locked(me: DeviceContext):
  session = me.session
  session.left.add(me.logical_id)
  session.blocked.pop(me.logical_id, None)
  session.cond.notify_all()
  _check_deadlock(session)
  if len(session.left) == session.n:
    with _lock:
      for k, s in list(_sessions.items()):
        if s is session:
          del _sessions[k]


def leave(me: DeviceContext, error: BaseException | None = None):
  """The instance is done (``error``: it failed; peers are told).

  A device's instance that finished returns only when every instance of the
  invocation has finished: a peer's remote DMA started later may still write
  this device's outputs and signal its semaphore outputs (a DMA "future" that
  a later kernel waits on, JAX's ``make_async_remote_copy`` tests); on a TPU
  that data lands in HBM after the kernel ended. Waiting is one valid order
  of those events; an instance still blocked on a wait nobody can satisfy
  makes the usual deadlock error. (Mesh programs and Mosaic GPU blocks,
  whose buffers outlive them in the shared kernel, do not wait.)"""
  session = me.session
  if session is None:
    return
  with session.cond:
    if error is not None and session.failed is None:
      session.fail(error, me.logical_id)
    if (error is None and session.unit == "device"
        and getattr(me, "wait_in_turn", None) is None):
      _drain_locked(me, session)
    _leave_locked(me)


def _drain_locked(me: DeviceContext, session: Session):
  """Block (lock held) until every instance finished or the session failed."""
  session.finished.add(me.logical_id)
  session.cond.notify_all()
  done = lambda: len(session.finished) == session.n or session.failed is not None
  what = "finished; waits for the other devices' instances to finish"
  while not done():
    session.blocked[me.logical_id] = (done, what, ())
    _check_deadlock(session)
    if done():
      break
    if not session.cond.wait(timeout=timeout_s()):
      session.fail(DeviceError(
          f"{me.placement.describe()}: the other devices' instances did not finish within "
          f"{timeout_s():g} s (PALLAS_NP_DEVICE_TIMEOUT)"), me.logical_id)
  session.blocked.pop(me.logical_id, None)
  if session.failed is not None and session.failed_by != me.logical_id:
    err = _peer_failed(session, me)
    _leave_locked(me)
    raise err


def check_failed(me: DeviceContext):
  session = me.session
  if session is not None and session.failed is not None:
    raise _peer_failed(session, me)


def _check_deadlock(session: Session):
  """Called with the lock held whenever an instance blocks or leaves."""
  if session.failed is not None or len(session.members) < session.n:
    return
  live = [d for d in session.members if d not in session.left]
  if not live or any(d not in session.blocked for d in live):
    return
  if any(pred() for pred, _, _ in session.blocked.values()):
    return
  placement = next(iter(session.members.values())).placement
  lines = []
  for d in sorted(session.members):
    if d in session.left or d in session.finished:
      lines.append(f"  {placement.describe(d)} has left the kernel")
    else:
      _, what, point = session.blocked[d]
      at = f" at grid point {point}" if point else ""
      lines.append(f"  {placement.describe(d)}{at}: {what}")
  unit = session.unit
  err = DeviceError(
      f"deadlock across {unit}s: every {unit} still in the kernel waits on a semaphore "
      f"that no pending DMA and no other {unit} can signal (on the hardware this kernel "
      "would hang forever):\n" + "\n".join(lines))
  session.fail(err, None)


def block_until(ctx, pred, what: str):
  """Wait (the session lock held by the caller) until ``pred()``; raises on
  a deadlock or when another device failed."""
  me = ctx.device
  session = me.session
  if session is None:  # no peers (an axis_index-only kernel): the caller raises
    return
  in_turn = getattr(me, "wait_in_turn", None)
  if in_turn is not None:  # an instance running threads that take turns (Mosaic GPU blocks)
    in_turn(ctx, pred, what)
    return
  point = tuple(int(p) for p in ctx.grid_point)
  while not pred():
    if session.failed is not None:
      session.blocked.pop(me.logical_id, None)
      raise _peer_failed(session, me)
    session.blocked[me.logical_id] = (pred, what, point)
    _check_deadlock(session)
    if session.failed is not None:
      continue
    if not session.cond.wait(timeout=timeout_s()):
      session.fail(DeviceError(
          f"{me.placement.describe()}: {what} was not satisfied within {timeout_s():g} s "
          "(PALLAS_NP_DEVICE_TIMEOUT)"), me.logical_id)
  session.blocked.pop(me.logical_id, None)


def lock(ctx):
  """The session's lock, for every semaphore change (a no-op lock outside
  multi-device runs)."""
  dev = getattr(ctx, "device", None)
  if dev is None or dev.session is None:
    return _NULL
  return dev.session.cond


class _NullLock:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False

  def notify_all(self):
    pass


_NULL = _NullLock()
