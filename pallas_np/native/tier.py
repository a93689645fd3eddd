"""The native tier: a loop that keeps running is compiled with numba, in a
process of its own, and then runs as machine code, with the NumPy path's
bits and errors (docs/performance.md, "The native tier").

``NativeLoop`` wraps a loop rule's callable (the NumPy path) and times it.
A loop whose NumPy path has cost this process ``LOOKUP_PRICE`` seconds is
handed to the tier's one thread, which generates its source (``codegen``)
and looks the library built from that source up on disk (``disk_cache``):
found, it is loaded (a ``dlopen``) and swapped in (one attribute store).
Not found, the loop gets a price (the measured or estimated build time);
once its NumPy path has cost ``COMPILE_WEIGHT`` times that price (the
calls so far stand for the calls to come), the thread sends the build to
the compile process (``aot_worker``: numba's ahead-of-time compiler, never
imported here) and waits for it on a pipe, holding no GIL. Until then,
and for good when the loop is refused or the build fails (logged once at
debug level), the NumPy path runs. ``"sync"`` builds at the first run, in
the caller (tests).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time

import numpy as np

from pallas_np.compiler import sourcemap
from pallas_np.env_switches import env_switch
from pallas_np.lru import LRU
from pallas_np.native import aot_worker, blas_calls, codegen, disk_cache

log = logging.getLogger("pallas_np.native")

# Kernel runs before a loop may be compiled (a loop run once or twice, a
# test or a one-off call, never starts a build; a library already on disk
# is loaded from the first run on).
HOT_RUNS = 3
MODES = ("background", "sync", "off")
ENV_OFF = "PALLAS_NP_NATIVE_LOOPS"  # off (env_switches): never compile
# NumPy-path seconds a loop costs before its source is generated and looked
# up on disk (what that costs the caller: ~1-20 ms of the tier thread's
# Python, plus a dlopen on a hit).
LOOKUP_PRICE = 0.02
# A build runs in another process, at the lowest CPU priority: it costs the
# caller only when the machine has no idle core. Its price counts at this
# weight, BUSY_FACTOR times more (in full) when the load average leaves no
# core idle or there is one core.
COMPILE_WEIGHT = 0.1
BUSY_FACTOR = 10.0
# A build's seconds before one was measured: numba's import in a new
# compile process, its typing and LLVM (~0.02 s a generated line), pycc's C
# helpers once per cache directory.
START_PRICE, BASE_PRICE, LINE_PRICE, MIXIN_PRICE = 1.5, 1.0, 0.02, 9.0

_state = {"compiled": 0, "refused": 0, "failed": 0, "native_calls": 0, "reused": 0,
          "disk_hits": 0, "queued": 0, "compiling": 0}
# Loaded loops by library key: the eager and the jax.jit path of one
# kernel, its sequential and vectorized plans, and equal loops of other
# kernels share one library.
_loaded = LRU(256)
_cond = threading.Condition()
_jobs: queue.Queue = queue.Queue()
_thread: list = []
_builds: list = []  # measured build seconds (the price of the next)


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
  """Counters: loops compiled (built or loaded), refused (something outside
  the table), failed (a build failed), loaded from disk (``disk_hits``),
  calls that ran compiled code, and loops ``queued`` for the tier thread or
  ``compiling`` in the compile process now."""
  return dict(_state)


def wait(timeout: float | None = None) -> bool:
  """Wait until no loop is queued or compiling; False on timeout."""
  with _cond:
    return _cond.wait_for(lambda: _state["queued"] + _state["compiling"] == 0, timeout)


class _Compiler:
  """The compile process (``aot_worker``), started on the first build and
  kept: it exits at the end of its input, when this process exits."""

  def __init__(self, nice: bool):
    self.proc = None
    self.nice = nice
    self.lock = threading.Lock()  # (one build at a time on the pipe)

  def build(self, job: dict) -> dict:
    with self.lock:
      return self._build(job)

  def _build(self, job: dict) -> dict:
    if self.proc is None or self.proc.poll() is not None:
      self.proc = subprocess.Popen(
          [sys.executable, "-I", aot_worker.__file__, *(["--nice"] if self.nice else [])],
          stdin=subprocess.PIPE,
          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
    try:
      self.proc.stdin.write(json.dumps(job) + "\n")
      self.proc.stdin.flush()
      line = self.proc.stdout.readline()
    except OSError as e:
      line = json.dumps({"ok": False, "error": f"compile process: {e!r}"})
    if not line:
      return {"ok": False, "error": "the compile process exited"}
    reply = json.loads(line)
    if reply.get("ok"):
      _builds.append(reply["seconds"])
    return reply


_compiler = _Compiler(nice=True)  # background builds
_sync_compiler = _Compiler(nice=False)  # builds a caller waits for ("sync")


def _work():
  while True:
    loop, step = _jobs.get()
    try:
      if step == "lookup":
        loop.lookup()
      else:
        with _cond:
          _state["compiling"] += 1
        try:
          loop.build()
        finally:
          with _cond:
            _state["compiling"] -= 1
    except Exception as e:  # noqa: BLE001 - the NumPy path stays
      _state["failed"] += 1
      loop.phase = "done"
      log.debug("pallas_np: native loop failed: %r", e)
    finally:
      with _cond:
        _state["queued"] -= 1
        _cond.notify_all()


def _submit(loop, step: str) -> None:
  with _cond:
    _state["queued"] += 1
    if not _thread:
      t = threading.Thread(target=_work, name="pallas_np-native", daemon=True)
      t.start()
      _thread.append(t)
  _jobs.put((loop, step))


def price(lines: int) -> float:
  """Seconds the next build of a loop of ``lines`` generated lines takes
  in the compile process (measured builds once there are some)."""
  if _builds:
    return max(sorted(_builds)[len(_builds) // 2], BASE_PRICE * 0.5) + LINE_PRICE * lines * 0.5
  mixins = not os.path.isdir(os.path.join(disk_cache.directory(), "mixins"))
  return START_PRICE + BASE_PRICE + LINE_PRICE * lines + (MIXIN_PRICE if mixins else 0.0)


def weight() -> float:
  """How much of a build's seconds the caller pays (see COMPILE_WEIGHT)."""
  cpus = os.cpu_count() or 1
  try:
    busy = os.getloadavg()[0] > cpus - 1
  except (AttributeError, OSError):
    busy = False
  return COMPILE_WEIGHT * (BUSY_FACTOR if cpus == 1 or busy else 1.0)


def _layouts(args) -> tuple:
  """(C-contiguous, writeable) of each array operand (None for scalars):
  the compiled signature matches them exactly."""
  return tuple((a.flags.c_contiguous, a.flags.writeable) if isinstance(a, np.ndarray) else None
               for a in args)


def _signature(src, avals, layouts):
  """The library's argument and result types, described for the compile
  process (``aot_worker._types``), and the per-argument guard: a call
  whose arrays differ from the compiled types runs the NumPy path (the
  compiled wrapper does not check them)."""
  args, guard = [["a", "int64", 1, True, True]], []
  for pos, (kind, aval, layout) in enumerate(zip(src.kinds, avals, layouts)):
    if kind == "s":
      args.append(["s", codegen.dtype_of(aval).str])
      continue
    if layout is None:
      raise codegen.Refused("a scalar where an array was expected")
    inner = aval.inner_aval if kind == "r" else aval
    contiguous, writeable = layout
    dt = codegen.dtype_of(inner)
    args.append(["a", dt.str, len(inner.shape), contiguous, writeable])
    guard.append((pos, dt, len(inner.shape), contiguous, pos in src.written))
  ret = [["s", "int64"]] + [["s", dt.str] if kind == "s" else ["a", dt.str, 1, True, True]
                            for kind, dt in src.outs]
  return args, ret, tuple(guard)


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
    self.uninitialized = params.uninitialized  # (a masked load's fill: native/masked.py)
    self.sync = params.native_loops == "sync"
    self.native = None
    self.runs = 0
    self.spent = 0.0  # seconds the NumPy path ran
    self.last_ctx = None
    self.phase = "new"  # -> "lookup" -> "priced" -> "building" -> "done"
    self.price = 0.0
    self.invars = [v.aval for v in eqn.invars]
    self.outs = []
    self.kinds = None
    self.sites = ()
    self.layouts = ()
    self.guard = ()
    self.job = None

  @property
  def __globals__(self):
    """The NumPy path's globals (a generated loop function's constants)."""
    return self.numpy_fn.__globals__

  # -- compiling ---------------------------------------------------------------
  def lookup(self) -> None:
    """Generate the loop's source; load its library if one is on disk,
    else price its build (or give up for good)."""
    try:
      src = codegen.loop_source(self.eqn, self.clamp, self.uninitialized)
      if any(self.layouts[k] is not None and not self.layouts[k][1] for k in src.written):
        raise codegen.Refused("a written ref is read-only")
      args, ret, guard = _signature(src, self.invars, self.layouts)
    except codegen.Refused as e:
      _state["refused"] += 1
      self.phase = "done"
      log.debug("pallas_np: loop not compiled natively (%s)", e)
      return
    k = disk_cache.key(src.text, src.globals, args, ret, src.externals)
    self.src, self.guard = src, guard
    self.job = {"key": k, "args": args, "ret": ret, "externals": src.externals}
    fn = _loaded.get(k)
    if fn is not None:
      _state["reused"] += 1
    else:
      fn = disk_cache.load(disk_cache.library_path(k))
      if fn is not None:
        _state["disk_hits"] += 1
        _loaded.put(k, fn)
    if fn is not None:
      self._swap(fn)
      return
    self.price = price(len(src.text.splitlines()))
    self.phase = "priced"

  def build(self) -> None:
    """Build the library in the compile process, then load and swap it in."""
    k = self.job["key"]
    fn = _loaded.get(k)
    if fn is None:
      path = disk_cache.library_path(k)
      fn = disk_cache.load(path)
      if fn is None:
        srcfile, consts = disk_cache.write_job(k, self.src.text, self.src.globals)
        compiler = _sync_compiler if self.sync else _compiler
        reply = compiler.build({"src": srcfile, "consts": consts, "args": self.job["args"],
                                "ret": self.job["ret"], "externals": self.job["externals"],
                                "out": path})
        if not reply.get("ok"):
          _state["failed"] += 1
          self.phase = "done"
          log.debug("pallas_np: native loop build failed: %s", reply.get("error"))
          return
        fn = disk_cache.load(path)
        if fn is None:
          raise disk_cache.LoadError(f"{path}: not written by its build")
      _loaded.put(k, fn)
    else:
      _state["reused"] += 1
    self._swap(fn)

  def _swap(self, fn) -> None:
    src = self.src
    self.outs = [(tuple(v.aval.shape), codegen.dtype_of(v.aval)) for v in self.eqn.outvars]
    self.kinds, self.sites, self.source = src.kinds, src.sites, src.text
    self.phase = "done"
    self.native = fn  # the swap
    _state["compiled"] += 1

  def _consider(self, ctx, args, spent) -> None:
    """Counts a run of the NumPy path and takes the next step when its
    cost says so (see the module doc)."""
    if ctx is not self.last_ctx:
      self.last_ctx = ctx
      self.runs += 1
    self.spent += spent
    if self.phase == "new" and (self.sync or self.spent >= LOOKUP_PRICE):
      self._prepare(args)
      self.phase = "lookup"
      if self.sync:
        self._guarded(self.lookup)
      else:
        _submit(self, "lookup")
    if self.phase == "priced" and (self.sync or (
        self.runs >= HOT_RUNS and self.spent >= weight() * self.price)):
      self.phase = "building"
      if self.sync:
        self._guarded(self.build)
      else:
        _submit(self, "build")

  def _guarded(self, step) -> None:
    """``step`` in the caller (``"sync"``): a failure leaves the NumPy path."""
    try:
      step()
    except Exception as e:  # noqa: BLE001 - the NumPy path stays
      _state["failed"] += 1
      self.phase = "done"
      log.debug("pallas_np: native loop failed: %r", e)

  def _prepare(self, args) -> None:
    if self.in_batched is not None:  # (each lane runs on its lane's views)
      args = [a[0] if b else a for a, b in zip(args, self.in_batched)]
    self.layouts = _layouts(args)

  # -- running ---------------------------------------------------------------------
  def __call__(self, ctx, *args):
    fn = self.native
    if fn is not None:
      res = self.run(fn, args) if self.in_batched is None else self.run_lanes(fn, ctx, args)
      if res is not None:
        return res
      return self.numpy_fn(ctx, *args)
    if self.phase == "done" or (self.phase == "building" and not self.sync):
      return self.numpy_fn(ctx, *args)
    if self.sync and self.phase == "new":
      self._consider(ctx, args, 0.0)
      if self.native is not None:
        return self(ctx, *args)
    t0 = time.perf_counter()
    res = self.numpy_fn(ctx, *args)
    self._consider(ctx, args, time.perf_counter() - t0)
    return res

  def _fits(self, args) -> bool:
    for pos, dt, ndim, contiguous, written in self.guard:
      a = args[pos]
      if (a.__class__ is not np.ndarray or a.dtype != dt or a.ndim != ndim
          or (contiguous and not a.flags.c_contiguous) or (written and not a.flags.writeable)):
        return False
    return True

  def run(self, fn, args):
    """The native loop on ``args`` (the NumPy path's operands): its carries,
    or None if the arguments' types are not those compiled for."""
    if not self._fits(args):
      return None
    call = []
    for a, kind, aval in zip(args, self.kinds, self.invars):
      if kind == "s":
        a = aval.dtype.type(a) if a.__class__ is not aval.dtype.type else a
      call.append(a)
    st = blas_calls.status()  # (with the BLAS and float32-loop addresses: blas_calls)
    try:
      res = fn(st, *call)
    except IndexError:
      self._raise_oob(st, args)
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
