"""DMAs and semaphores in a compiled loop: the loop calls back into the
NumPy path's own rules (docs/native_dma.md).

A TPU DMA's data moves when a wait needs it (``state/dma.py``: queued per
semaphore, popped oldest first, source read at that moment), its
bookkeeping lives in the run context and reaches views of arbitrary
operands; a compiled copy of that machinery would be a second
implementation to keep exact. So each ``dma_start``, ``dma_wait``,
``semaphore_signal``, ``semaphore_wait`` and ``semaphore_read`` of a
compiled loop (a *call site*, ``native/dma.py``) is a call from the
machine code into this module, through one ctypes callback whose address
the loop reads from its status array: the scalar operands the loop
computed travel in the status array's slots from ``OPERANDS`` on, the
refs are the loop's own operands (the arrays the NumPy path gets), and
the site's NumPy rule runs on them with the run context. The same bytes
move at the same points, the semaphores count the same, and an error is
the rule's own, raised again under frames that name its eqn (as the
NumPy path's traceback does) once the loop has unwound.

Reads the compiled code makes after a call are fresh loads: the callback
is an opaque function pointer, so LLVM assumes it writes any memory the
loop's arguments reach (numba marks no argument ``noalias``).
"""
from __future__ import annotations

import ctypes
import threading
import types

import numpy as np

from pallas_np import _compat as jc
from pallas_np import races, registry
from pallas_np.native import blas_calls, dma_queue, dma_stash, loop_errors
from pallas_np.state import dma as dma_state

# Status-array slots: the callback's address, then the scalar operands of
# the site being called (a semaphore_read's result comes back in the first).
ADDRESS = blas_calls.PYCALL
OPERANDS = ADDRESS + 1
MAX_OPERANDS = blas_calls.PYCALL_OPERANDS
MODE = dma_queue.MODE  # what the compiled DMA queue may do (dma_queue)
# The primitives a compiled loop calls back for (``native/dma.py`` emits them).
PRIMITIVES = ("dma_start", "dma_wait", "semaphore_signal", "semaphore_wait", "semaphore_read")

# Sites whose rules never read or change a DMA queue: no flush before them
# (``dma.py``), no new ``MODE``/``PENDING`` after them.
QUEUE_FREE = ("semaphore_signal", "semaphore_read")

_tls = threading.local()


class Site:
  """One call site: its eqn, its operands (``("ref", loop operand
  position)``, ``("scalar", slot, dtype)`` or ``("literal", value)``),
  the control-flow eqns around it inside the loop (for the error's
  frames) and whether a result comes back (``semaphore_read``)."""
  __slots__ = ("eqn", "operands", "chain", "result", "call", "writes")

  def __init__(self, eqn, operands, chain, result):
    self.eqn, self.operands, self.chain, self.result = eqn, tuple(operands), tuple(chain), result
    self.call = None  # call(ctx, st, args): the rule on its operands (_bind, at the first call)
    self.writes = ()  # loop operand positions a compiled form writes (dma_queue)


def _scalar_type(dt):
  """int64 bits (a Python int) -> the NumPy scalar of ``dt`` they hold."""
  t = dt.type
  if dt == np.uint64:
    return lambda v: t(v & 0xFFFFFFFFFFFFFFFF)
  return t


class _Run:
  """One call of a compiled loop that has call sites."""
  __slots__ = ("sites", "params", "st", "args", "ctx", "error", "fixed", "stash")

  def __init__(self, sites, params, st, args, ctx, writes=()):
    self.sites, self.params, self.st, self.args, self.ctx = sites, params, st, args, ctx
    self.error = None  # (exception, site) of a call that raised
    # The compiled DMA queue is off for the whole call (``dma_queue.MODE``
    # 2): a multi-device run or a race detector (locks, recorded
    # accesses), or a read-only ref that a compiled form writes (the NumPy
    # rule's write raises).
    fixed = ctx.device is not None or races.current() is not None
    if not fixed:
      for p in writes:  # (a loop, not any() over a generator: ~1 us a grid step less)
        if not args[p].flags.writeable:
          fixed = True
          break
    self.fixed = fixed
    self.stash = None  # the compiled queue (dma_stash.Stash), set by the runner

  def mode(self) -> None:
    """The status slots the compiled queue reads: ``MODE`` and the
    semaphores the NumPy queue holds DMAs on."""
    st = self.st
    st[MODE] = 2 if self.fixed else 0
    rules = self.ctx.rules
    dma = rules.dma if rules is not None else None
    if dma is None:
      st[dma_queue.PENDING_N] = 0
      return
    pending = [key for key, tasks in dma.tasks.items() if tasks]
    st[dma_queue.PENDING_N] = len(pending)
    if not pending:
      return
    if len(pending) <= dma_queue.PENDING_MAX:
      st[dma_queue.PENDING:dma_queue.PENDING + len(pending)] = pending
    else:
      st[dma_queue.PENDING_N] = dma_queue.PENDING_MAX + 1


def _bind(site: Site, params):
  """``call(ctx, st, args)``: the site's NumPy rule, compiled as the plan
  compiles it (with the kernel's ``InterpretParams``), called on its
  operands: the loop's refs, the scalars from the status array (int64 bits
  back to their dtype), the literals; one generated line."""
  rule = registry.lookup(site.eqn.primitive)
  info = registry.EqnInfo(site.eqn, types.SimpleNamespace(params=params),
                          (True,) * len(site.eqn.outvars))
  fn = rule.compile(info)
  scope = {"rule": fn.fn if isinstance(fn, registry.NeedsCtx) else fn}
  parts = []
  for k, op in enumerate(site.operands):
    if op[0] == "ref":
      parts.append(f"args[{op[1]}]")
    elif op[0] == "scalar":
      scope[f"to{k}"] = _scalar_type(op[2])
      parts.append(f"to{k}(st.item({op[1]}))")
    else:
      scope[f"c{k}"] = op[1]
      parts.append(f"c{k}")
  exec(f"def call(ctx, st, args):\n    return rule(ctx, {', '.join(parts)})\n", scope)  # noqa: S102
  return scope["call"]


def _call(run: _Run, k: int) -> None:
  """Site ``k`` of the loop call owning the row or callback (``CALL_OWNER``:
  a flushed row may come from an earlier loop call, with its operands)."""
  st = run.st
  sites, params, args, point = run.stash.owners[int(st[dma_queue.CALL_OWNER])]
  site = sites[k]
  if site.call is None:
    site.call = _bind(site, params)
  order = int(st[dma_queue.ORDER])
  if order >= 0:
    before = len(dma_state.state_of(run.ctx).dmas)
  try:
    res = site.call(run.ctx, st, args)
  except BaseException as e:  # noqa: BLE001 - raised again once the loop unwound
    run.error = (e, site)
    raise
  if site.result:
    st[OPERANDS] = int(res)
  if order >= 0:
    run.stash.started(run.ctx, order, before, point)
  if site.eqn.primitive.name not in QUEUE_FREE:
    run.mode()


def _dispatch(k, _st_address):
  """The ctypes callback: run site ``k`` of the current loop call; 1 if it
  raised (kept for ``runner`` to raise again), else 0."""
  run = _tls.run
  try:
    _call(run, k)
  except BaseException as e:  # noqa: BLE001 - raised again once the loop unwound
    if run.error is None:
      run.error = (e, run.sites[k])
    return 1
  return 0


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)(_dispatch)
_ADDRESS_VALUE = ctypes.cast(_CALLBACK, ctypes.c_void_p).value


def has_calls(eqn) -> bool:
  """Whether the loop ``eqn`` holds a call site (at any depth)."""
  for sub in jc.eqn_subjaxprs(eqn):
    for e in sub.eqns:
      if e.primitive.name in PRIMITIVES or has_calls(e):
        return True
  return False


def runner(loop):
  """``run(fn, st, args, ctx)`` calling the compiled loop ``fn`` of
  ``loop`` (a ``tier.NativeLoop``) with its call sites bound to ``ctx``,
  or None where the loop has none. A library loaded by its pre-key has
  no sites yet: its source is generated again at its first call. (Never
  a vectorized pass's lanes: DMA and semaphore rules keep the grid
  sequential, ``primitives/tpu.py``.)"""
  if not has_calls(loop.eqn):
    return None
  sites = []
  writes = None  # the operand positions compiled DMA forms write

  def run(fn, st, args, ctx):
    nonlocal writes
    if not sites:
      sites.extend(_sites_of(loop))
    if writes is None:
      writes = sorted({p for site in sites for p in site.writes})
    call = _Run(sites, loop.params, st, args, ctx, writes)
    dmas = dma_state.state_of(ctx)
    stash, dmas.native = dmas.native, None  # (the loop's own now: settle() must not flush it)
    if stash is None:
      stash = dma_stash.Stash(_bind)
    elif call.fixed:  # (nothing runs compiled in this call: its rows join the NumPy queue)
      stash.flush(ctx)
    call.stash = stash
    st[dma_queue.QADDR] = stash.qaddr
    st[dma_queue.OWNER] = stash.own(sites, loop.params, args, ctx.grid_point)
    call.mode()
    prev = getattr(_tls, "run", None)
    _tls.run = call
    st[ADDRESS] = _ADDRESS_VALUE
    try:
      return fn(st, *args)
    except RuntimeError:
      if call.error is None:
        raise
      _raise_at(*call.error)
    finally:
      _tls.run = prev
      if stash.live():
        dmas.native = stash
      else:
        stash.settled()
  return run


def _sites_of(loop):
  src = loop.src
  calls = getattr(src, "calls", None)
  if calls is None:  # (loaded by its pre-key: the sites generated now, numbered as compiled)
    calls = loop_errors.regenerated(loop).calls
  return calls


def _raise_at(error, site):
  """Raise ``error`` (``site``'s) under frames naming the site's eqn and
  the control flow around it, as the NumPy path's plans do."""
  def again():
    raise error
  loop_errors.call_under(site.chain, site.eqn, again)
