"""The native tier: a loop that keeps running is compiled with numba and
then runs as machine code, with the NumPy path's bits and errors.

``NativeLoop`` wraps a loop rule's callable (the NumPy path). It counts the
kernel runs the loop takes part in (distinct ``RunContext``s); at the
``HOT_RUNS``-th (``native_loops="background"``, the default) it queues the
loop for the one compile thread, which imports numba (never before: not at
``import pallas_np``, not on a first call), generates the loop's source
(``codegen``), compiles it for the loop's argument types and swaps it in
(one attribute store). Until then, and for good when the loop is refused
or numba fails (logged once at debug level), the NumPy path runs.
``"sync"`` compiles at the first run, in the caller (tests).
"""
from __future__ import annotations

import functools
import logging
import queue
import threading

import numpy as np

from pallas_np.compiler import sourcemap
from pallas_np.env_switches import env_switch
from pallas_np.lru import LRU
from pallas_np.native import codegen
from pallas_np.native.refs import MAX_LEAVES

log = logging.getLogger("pallas_np.native")

# Kernel runs before a loop is compiled in the background: a loop run once
# or twice (a test, a one-off call) never pays numba's import (~0.3 s) and
# compile (~0.3-1 s); a third run means a kernel called in a loop.
HOT_RUNS = 3
MODES = ("background", "sync", "off")
ENV_OFF = "PALLAS_NP_NATIVE_LOOPS"  # off (env_switches): never compile

_state = {"compiled": 0, "refused": 0, "failed": 0, "native_calls": 0, "reused": 0}
# Compiled loops by generated source, constants and signature: the eager and
# the jax.jit path of one kernel, its sequential and vectorized plans, and
# equal loops of other kernels share one compile.
_compiled = LRU(64)
_pending = [0]
_cond = threading.Condition()
_jobs: queue.Queue = queue.Queue()
_worker: list = []


def enabled(params) -> bool:
  """Whether loops of a kernel with these params may be compiled: never
  under the debugging options, whose guarantees the NumPy path keeps."""
  if not env_switch(ENV_OFF, True):
    return False
  mode = getattr(params, "native_loops", "off")
  return (mode != "off" and not params.pdb and not params.detect_races
          and params.explain is None and not params.check_avals and params.trace is None
          and getattr(params, "oob_reads", "raise") == "raise")  # (fill: state/past_end.py)


def stats() -> dict:
  """Counters: loops compiled, refused (something outside the table),
  failed (numba raised), calls that ran compiled code."""
  return dict(_state)


def wait(timeout: float | None = None) -> bool:
  """Wait until no compile is queued or running; False on timeout."""
  with _cond:
    return _cond.wait_for(lambda: _pending[0] == 0, timeout)


def _work():
  while True:
    loop = _jobs.get()
    try:
      loop.compile()
    finally:
      with _cond:
        _pending[0] -= 1
        _cond.notify_all()


def _submit(loop) -> None:
  with _cond:
    _pending[0] += 1
    if not _worker:
      t = threading.Thread(target=_work, name="pallas_np-native", daemon=True)
      t.start()
      _worker.append(t)
  _jobs.put(loop)


def _layouts(args) -> tuple:
  """(C-contiguous, writeable) of each array operand (None for scalars):
  the compiled signature matches them exactly, so numba's dispatcher takes
  its fast path (a call needing a layout conversion costs tens of µs)."""
  return tuple((a.flags.c_contiguous, a.flags.writeable) if isinstance(a, np.ndarray) else None
               for a in args)


def _signature(numba, kinds, avals, layouts):
  from_dtype = numba.from_dtype
  types = numba.types
  sig = [types.Array(types.int64, 1, "C")]
  for kind, aval, layout in zip(kinds, avals, layouts):
    if kind == "s":
      sig.append(from_dtype(codegen.dtype_of(aval)))
      continue
    if layout is None:
      raise codegen.Refused("a scalar where an array was expected")
    inner = aval.inner_aval if kind == "r" else aval
    contiguous, writeable = layout
    sig.append(types.Array(from_dtype(codegen.dtype_of(inner)), len(inner.shape),
                           "C" if contiguous else "A", readonly=not writeable))
  return tuple(sig)


def _frame(eqn, inner):
  """A call of ``inner`` in a frame whose line maps to ``eqn`` (the
  source map): errors raised under it name ``eqn``, as the NumPy path's."""
  filename = sourcemap.new_filename("native loop")
  scope = {"_line_eqns": sourcemap.register(filename, [None, eqn])}
  exec(compile("def _at(inner):\n    return inner()\n", filename, "exec"), scope)  # noqa: S102
  at = scope["_at"]
  return lambda: at(inner)


class NativeLoop:
  """A loop rule's callable with its native tier (see the module doc)."""

  def __init__(self, eqn, params, numpy_fn, in_batched=None, out_batched=None):
    functools.update_wrapper(self, numpy_fn)  # (its name and doc: plans are inspected)
    self.eqn = eqn
    self.in_batched = in_batched  # a vectorized pass: each lane runs the loop
    self.out_batched = out_batched
    self.numpy_fn = numpy_fn
    self.clamp = params.bounds_check == "clamp"
    self.sync = params.native_loops == "sync"
    self.native = None
    self.runs = 0
    self.last_ctx = None
    self.queued = False
    self.invars = [v.aval for v in eqn.invars]
    self.outs = []
    self.kinds = None
    self.sites = ()
    self.layouts = ()

  @property
  def __globals__(self):
    """The NumPy path's globals (a generated loop function's constants)."""
    return self.numpy_fn.__globals__

  # -- compiling ---------------------------------------------------------------
  def compile(self) -> None:
    """Generate, compile and swap in the native loop (or give up for good)."""
    try:
      src = codegen.loop_source(self.eqn, self.clamp)
    except codegen.Refused as e:
      _state["refused"] += 1
      log.debug("pallas_np: loop not compiled natively (%s)", e)
      return
    except Exception as e:  # noqa: BLE001 - the NumPy path stays
      _state["failed"] += 1
      log.debug("pallas_np: native loop generation failed: %r", e)
      return
    try:
      import numba  # (lazily: only a hot loop pays for it)
      if any(self.layouts[k] is not None and not self.layouts[k][1] for k in src.written):
        raise codegen.Refused("a written ref is read-only")
      sig = _signature(numba, src.kinds, self.invars, self.layouts)
      key = (src.text, sig, tuple((k, v.dtype.str, v.tobytes())
                                  for k, v in sorted(src.globals.items())))
      fn = _compiled.get(key)
      if fn is None:
        scope = dict(src.globals, np=np)
        exec(compile(src.text, "<pallas_np native loop>", "exec"), scope)  # noqa: S102
        fn = numba.njit(error_model="numpy", nogil=True)(scope["native_loop"])
        fn.compile(sig)
        fn.disable_compile()
        _compiled.put(key, fn)
      else:
        _state["reused"] += 1
    except Exception as e:  # noqa: BLE001 - the NumPy path stays
      _state["failed"] += 1
      log.debug("pallas_np: native loop compile failed: %r", e)
      return
    self.outs = [(tuple(v.aval.shape), codegen.dtype_of(v.aval)) for v in self.eqn.outvars]
    self.kinds, self.sites, self.source = src.kinds, src.sites, src.text
    self.native = fn  # the swap
    _state["compiled"] += 1

  def _hot(self, ctx, args) -> None:
    if self.in_batched is not None:  # (each lane runs on its lane's views)
      args = [a[0] if b else a for a, b in zip(args, self.in_batched)]
    self.layouts = _layouts(args)
    if ctx is not self.last_ctx:
      self.last_ctx = ctx
      self.runs += 1
    if self.sync:
      self.queued = True
      self.compile()
    elif self.runs >= HOT_RUNS:
      self.queued = True
      _submit(self)

  # -- running ---------------------------------------------------------------------
  def __call__(self, ctx, *args):
    fn = self.native
    if fn is not None:
      res = self.run(fn, args) if self.in_batched is None else self.run_lanes(fn, ctx, args)
      if res is not None:
        return res
    elif not self.queued:
      self._hot(ctx, args)
      if self.native is not None:
        return self(ctx, *args)
    return self.numpy_fn(ctx, *args)

  def run(self, fn, args):
    """The native loop on ``args`` (the NumPy path's operands): its carries,
    or None if the arguments' types were not compiled for."""
    call = []
    for a, kind, aval in zip(args, self.kinds, self.invars):
      if kind == "s":
        a = aval.dtype.type(a) if a.__class__ is not aval.dtype.type else a
      call.append(a)
    st = np.zeros(1 + MAX_LEAVES, np.int64)
    try:
      res = fn(st, *call)
    except IndexError:
      self._raise_oob(st, args)
    except TypeError as e:  # (numba's dispatcher: types it was not compiled for)
      log.debug("pallas_np: native loop skipped: %s", e)
      return None
    _state["native_calls"] += 1
    out = []
    for v, (shape, dt) in zip(res[1:], self.outs):
      out.append(v.reshape(shape) if shape else dt.type(v))
    return tuple(out)

  def run_lanes(self, fn, ctx, args):
    """The native loop once per lane of a vectorized pass (lanes first)."""
    lanes = []
    flags = self.in_batched
    for lane in range(ctx.batch_size):
      res = self.run(fn, [a[lane] if b else a for a, b in zip(args, flags)])
      if res is None:
        return None  # (the first lane: the types are the same for all lanes)
      lanes.append(res)
    return tuple(np.stack([r[k] for r in lanes]) if b else lanes[0][k]
                 for k, b in enumerate(self.out_batched))

  def _raise_oob(self, st, args):
    eqn, access, pos, chain = self.sites[int(st[0]) - 1]
    leaves = [int(v) for v in st[1:1 + access.num_dynamic]]
    ref = args[pos]

    def resolve():
      access.resolve(ref, leaves)
      raise RuntimeError("pallas_np: native loop bounds check disagrees with the NumPy rule")
    fn = resolve
    for e in reversed((*chain, eqn)):
      fn = _frame(e, fn)
    fn()
