"""The native tier: a loop that keeps running is compiled (by lite or
numba, in a compile process beside the caller's) and then runs as machine
code, with the NumPy path's bits and errors (docs/native.md).

``NativeLoop`` wraps a loop rule's callable (the NumPy path) and times it.
At its first run, where this process or the disk cache has pre-keys
(``prekey``), the loop's library is looked up by its pre-key: found, it is
loaded (a ``dlopen``) and swapped in (one attribute store), with no source
generated. Else the tier spends the caller's own time (its GIL) on the
loop only in proportion to what the loop has cost: a step costing the
caller c seconds is taken once its NumPy path has cost c /
``CALLER_SHARE`` (3%), so that no first N calls are slower than "off" by
more than that share. Once the caller's seconds in its kernel runs reach
``LOOKUP_PRICE`` (~0.3 s, ``START_LEAD`` before its build is due) it gets
a price (the measured or estimated build time, from its size: no source
is generated yet) and, where a core is idle, lite's compile process is
started (its imports, ~0.15 s, run on another core); the build is
started once it has cost both the build's caller part over
``CALLER_SHARE`` (~0.57 s) and the compile's price at the load's weight
(``scheduler``, which also prices builds and weighs them against the
load): the caller generates the source (``codegen``), looks the library
built from that source up in memory and on disk (``disk_cache``,
``lite_cache``) and, not found, writes a job that the tier's one thread
hands to a compile process (``scheduler.Compiler``; it waits on a pipe,
holding no GIL): lite's (``lite_cache``, ``lite_worker``: the source
translated to LLVM IR and linked into a shared library, ~0.05-1 s) or,
where lite refuses it, priced again, numba's; the loop's next run loads
the library and swaps it in (``build_steps``). Until then, and for good
when the loop is refused or the build fails (logged once at debug
level), the NumPy path runs. ``"sync"`` builds at the first run, in the
caller (tests).
What a loop's pre-key records, and what a warm process skips by it (a
kernel body's probe, BLAS's checks): ``tier_records``.
"""
from __future__ import annotations

import functools
import logging
import time
import types

import numpy as np

from pallas_np import _compat as jc
from pallas_np.env_switches import env_switch
from pallas_np.native import (blas_calls, build_steps, codegen, cost_rule, disk_cache, dma_calls,
                              guards, lanes, loop_errors, loop_step, lite_cache, prekey, scheduler)
from pallas_np.native.build_steps import UNSET as _UNSET, BuildSteps, signature as _signature
from pallas_np.native.cost_rule import HOT_RUNS, CostRule
from pallas_np.native import tier_records as records

log = logging.getLogger("pallas_np.native")

MODES = ("background", "sync", "off")
ENV_OFF = "PALLAS_NP_NATIVE_LOOPS"  # off (env_switches): never compile
_state = scheduler.state  # (the counters: scheduler.stats)
_addresses_set_up: list = []  # (its BLAS and libm addresses: "blas", "libm" once done)
# Primitives whose emitters may read an address from the status array
# (native/dots.py: a float dot's BLAS routine; transcendental.py: the NumPy
# rule's float32 loop): a loop holding none needs no ``blas_calls.status``
# in its one-off set-up (``_one_off_set_up``; a wrong guess costs time only:
# the tier's thread then looks the addresses up itself).
ADDRESS_PRIMITIVES = frozenset(("dot_general", "exp", "log", "tanh", "exp2", "log2"))
# Of those, the ones whose emitters read the NumPy rule's float32 loops
# (``transcendental``: libm's loops, ~3.6 ms to load once per process); a
# loop holding none (integer and float dots) gets BLAS's addresses only.
LIBM_PRIMITIVES = ADDRESS_PRIMITIVES - {"dot_general"}


def enabled(params) -> bool:
  """Whether loops of a kernel with these params may be compiled: never
  under the debugging options, whose guarantees the NumPy path keeps."""
  if not env_switch(ENV_OFF, True):
    return False
  mode = getattr(params, "native_loops", "off")
  return (mode != "off" and not params.pdb and not params.detect_races
          and params.explain is None and not params.check_avals and params.trace is None
          and getattr(params, "oob_reads", "raise") == "raise")  # (fill: state/past_end.py)


def holds(jaxpr, names) -> bool:
  """Whether ``jaxpr`` or a nested jaxpr has an eqn of a primitive in ``names``."""
  for e in jaxpr.eqns:
    if e.primitive.name in names:
      return True
    for sub in jc.eqn_subjaxprs(e):
      if holds(sub, names):
        return True
  return False


def _layouts(args) -> tuple:
  """(C-contiguous, writeable) of each array operand (None for scalars):
  the compiled signature matches them exactly."""
  return tuple((a.flags.c_contiguous, a.flags.writeable) if isinstance(a, np.ndarray) else None
               for a in args)


class NativeLoop(CostRule, BuildSteps):
  """A loop rule's callable with its native tier (see the module doc)."""

  def __init__(self, eqn, params, numpy_fn, in_batched=None, out_batched=None):
    functools.update_wrapper(self, numpy_fn)  # (its name and doc: plans are inspected)
    if in_batched is not None:  # a vectorized pass: all its lanes in one call (lanes.py)
      eqn = lanes.LanesEqn(eqn, in_batched, out_batched)
    self.eqn = eqn
    self.in_batched = in_batched
    self.out_batched = out_batched
    self.numpy_fn = numpy_fn
    self.clamp = params.bounds_check == "clamp"
    self.uninitialized = params.uninitialized  # (a masked load's fill: native/masked.py)
    self.sync = params.native_loops == "sync"
    self.params = params  # (the NumPy rules of DMA/semaphore call sites: dma_calls)
    self.pycalls = None  # dma_calls.runner: the loop's call sites bound to a run
    self.native = None
    self.fast = None  # once swapped: the run as one generated function (loop_step)
    self.runs = 0
    self.spent = 0.0  # seconds the NumPy path ran
    # The caller's seconds in the kernel runs this loop ran in (each from its
    # start, ``RunContext.t0``, to the loop's last run in it): what the
    # tier's own cost is weighed against (``CALLER_SHARE``); ``closed``:
    # those of the runs before the last.
    self.called = self.closed = 0.0
    self.last_ctx = None
    self.prechecked = False
    self.phase = "new"  # -> "priced" -> "building" (-> "landed") -> "done"
    self.price = 0.0
    # The caller's seconds (``called``, at least ``spent``) at which the next
    # step is looked at (below it a run only adds its time): LOOKUP_PRICE
    # (pricing and lite's process start), then the build.
    self.due = 0.0 if self.sync else cost_rule.LOOKUP_PRICE
    self.invars = [v.aval for v in eqn.invars]
    self.outs = []
    self.kinds = None
    self.sites = ()
    self.layouts = None
    self.guard = ()
    self._checks = ((), None)  # (guard, its unrolled checks: native/guards.py)
    self.scalars = ()  # (position, type) of each scalar operand
    self.job = None
    self.prekey = _UNSET  # (computed at the first run where pre-keys exist, else when built)
    self._lite = None  # (lite's build first: False once lite refused it; ``lite``)
    self.prestarted = False  # (lite's compile process asked for: _prestart_lite)
    self.record = None  # (what its pre-key recorded: _remember)
    # (whether its code reads the status array's addresses: ``reads_status``)
    self.addresses = True
    # (a kernel body's probe recorded by an earlier process, reused: "kept" or "dropped")
    self.probed = None

  @property
  def lite(self) -> bool:
    """Whether lite builds this loop (lite available here, and not refused
    it). Read when the loop is first priced, not at its plan's build: the
    check (llvmlite's dist-info listed, NumPy's structs probed, ~0.7 ms
    once per process) stays out of a kernel's first call."""
    if self._lite is None:
      # (lite refuses DMA and semaphore call sites, ``_build_lite``: such a loop is numba's from
      # its pricing on, with no lite process started and no source generated for a refusal)
      self._lite = lite_cache.enabled() and not dma_calls.has_calls(self.eqn)
    return self._lite

  @lite.setter
  def lite(self, value: bool) -> None:
    self._lite = value

  @property
  def phase(self) -> str:
    return self._phase

  @phase.setter
  def phase(self, phase: str) -> None:
    self._phase = phase
    # (the entry's usual run: the NumPy path timed, nothing else)
    self.timing = self.prechecked and not self.sync and phase in ("new", "priced")
    # (a background build under way: the NumPy path, untimed, with no __call__ in between;
    # seconds to minutes of runs on a busy machine, where ~2 us a run showed in small kernels;
    # "landed": its reply is in, the next run's __call__ lands it, ``BuildSteps.land``;
    # "done" with no library, refused or failed: the NumPy path for good, from the entry too,
    # where ``__call__`` cost a refused loop's every run ~1 us more. ``_swap`` sets "done"
    # before its library is in, and clears this once it is)
    self.waiting = not self.sync and (
        phase == "building" or (phase == "done" and self.native is None))

  def entry(self):
    """What the loop's plan calls: a plain function (calling this object
    costs a Python-level ``__call__`` more), whose usual run while the loop
    is on the NumPy path (``timing``) times it, counts it and compares its
    cost with the next step's (``due``); every other run is ``__call__``'s."""
    loop, numpy_fn, perf = self, self.numpy_fn, time.perf_counter

    def native_loop(ctx, *args):
      if loop.timing:
        t0 = perf()
        res = numpy_fn(ctx, *args)
        t1 = perf()
        loop.spent += t1 - t0
        if ctx is not loop.last_ctx:
          loop.last_ctx = ctx
          loop.runs += 1
          loop.closed = loop.called
        loop.called = loop.closed + t1 - getattr(ctx, "t0", t0)
        if loop.called >= loop.due:
          loop._step(args)
        return res
      if loop.waiting:
        return numpy_fn(ctx, *args)
      fast = loop.fast
      if fast is not None:
        return fast(ctx, *args)
      return loop(ctx, *args)
    # (with the NumPy path's globals, a generated loop function's constants:
    # plans are inspected; the body reads closure cells only)
    entry = types.FunctionType(native_loop.__code__, numpy_fn.__globals__, native_loop.__name__,
                               None, native_loop.__closure__)
    functools.update_wrapper(entry, numpy_fn)
    entry.native_tier = self
    return entry

  @property
  def __globals__(self):
    """The NumPy path's globals (a generated loop function's constants)."""
    return self.numpy_fn.__globals__

  # -- compiling ---------------------------------------------------------------
  def _jaxprs(self) -> list:
    """The loop's jaxprs (its eqn's params)."""
    return [getattr(p, "jaxpr", p) for p in self.eqn.params.values()
            if isinstance(getattr(p, "jaxpr", p), jc.Jaxpr)]

  def _refuse(self, why: str) -> None:
    _state["refused"] += 1
    self.phase = "done"
    log.debug("pallas_np: loop not compiled natively (%s)", why)

  def remember_probe(self, kept: bool, numpy_s: float, native_s: float) -> None:
    """Records a kernel body's probe (``bodies.BodyPlan.decide``: its fastest
    compiled and NumPy steps, whether it was kept) under its pre-key, for the
    next process (``_prelookup``, ``records.PROBE_KEEP_RATIO``)."""
    if self.sync or self.record is None or "refused" in self.record:
      return
    record = records.probe_record(self.record, kept, numpy_s, native_s)
    # (its file by the tier's thread where it runs; a warm process has none: starting one
    # cost the caller more, ~0.8 ms, than the file, ~0.4 ms)
    try:
      self._remember(record)
    except OSError as e:  # (a cache that cannot be written: probed again next time)
      log.debug("pallas_np: native probe not recorded: %r", e)

  def new_status(self):
    """A fresh status array for a call of the compiled loop: with the BLAS
    and libm addresses where its code reads them (``blas_calls.status``:
    its self-checks and libm's loops, ~5 ms once per process, on the
    caller's first call), else zeros of the same length (a loop whose code
    only stores its error sites: integer dots, cumsum, Collatz)."""
    if self.addresses:  # (with a word per dot site reading an operand in place, if any)
      sites = getattr(getattr(self, "src", None), "transposed", ())
      return blas_calls.status(sites, loops=self._reads_libm())
    return np.zeros(blas_calls.TRANSPOSED, np.int64)

  def _reads_libm(self) -> bool:
    """Whether the loop's code may read libm's loop addresses (a wrong
    False fails loudly: the generated prologue raises on a zero address)."""
    return any(holds(j, LIBM_PRIMITIVES) for j in self._jaxprs())

  def _prelookup(self, args) -> None:
    """At the loop's first run: its library (or its refusal) found by its
    pre-key, with no source generated (``prekey``); else nothing."""
    if not (len(build_steps.prekeys) or disk_cache.has_prekeys()):
      return
    self._prepare(args)
    self.prekey = prekey.loop_prekey(self.eqn, self.clamp, self.layouts, self.uninitialized)
    if self.prekey is None:
      return
    record = build_steps.prekeys.get(self.prekey) or disk_cache.read_prekey(self.prekey)
    if record is None:
      return
    if "refused" in record:
      self._refuse(record["refused"])
      return
    self.probed = None if self.sync else records.probe_decision(record)  # ("sync": never timed)
    if self.probed == "dropped":  # (slower compiled, an earlier process measured: not loaded)
      self.record = record
      _state["dropped"] += 1
      self.phase = "done"
      return
    src = records.Recorded(record)
    args_desc, ret, guard = _signature(src, self.invars, self.layouts)
    if args_desc != record["args"] or ret != record["ret"]:
      return  # (never the case for one pre-key: looked up the usual way)
    k = record["key"]
    fn = build_steps.loaded.get(k)
    if fn is not None:
      _state["reused"] += 1
    else:
      fn = (lite_cache.load(k) if record.get("lite")
            else disk_cache.load(disk_cache.library_path(k)))
      if fn is None:
        return
      _state["disk_hits"] += 1
      build_steps.loaded.put(k, fn)
    build_steps.prekeys.put(self.prekey, record)
    self.record = record
    self.addresses = record.get("addresses", True)
    self.src, self.guard = src, guard
    self.job = {"key": k, "args": args_desc, "ret": ret}
    self._swap(fn)

  def _swap(self, fn) -> None:
    src = self.src
    self.outs = [(tuple(v.aval.shape), codegen.dtype_of(v.aval)) for v in self.eqn.outvars]
    self.kinds, self.sites, self.source = src.kinds, src.sites, src.text
    self.scalars = [(pos, aval.dtype.type) for pos, (kind, aval)
                    in enumerate(zip(src.kinds, self.invars)) if kind == "s"]
    self.phase = "done"
    self.pycalls = dma_calls.runner(self)
    self.scratch = [np.empty(n, dt) for dt, n in src.scratch]  # (passed at every call)
    self.status = self.new_status()
    self.fast = loop_step.build(self, fn)
    self.native = fn  # the swap
    self.waiting = False  # (set by "done" above, while ``native`` was None)
    _state["compiled"] += 1

  def _one_off_set_up(self) -> None:
    """The one-off set-up every build needs, in the caller, once per
    process, when its first build is due: the pre-key's digest of the
    sources, ~200 stat calls, 1.5 ms; the BLAS and libm addresses, 6 ms,
    only when a loop holding a primitive that may read them is built
    (``ADDRESS_PRIMITIVES``: ~6 ms of a cumsum or Collatz caller's calls
    saved).
    On the tier's thread each of their system and ctypes calls waits for
    the GIL behind a busy caller (0.4-0.9 s each there: PERF_LOG 138).
    Its cost is priced in (``cost_rule``: ``SETUP_PRICE`` more NumPy-path
    seconds before the first build), so that a kernel called a few dozen
    times never pays it. (llvmlite's import and target machine, 40-60 ms,
    are the compile process's: ``lite_worker``.)"""
    try:  # (a failure here is the build's: the NumPy path stays, the call goes on)
      if not cost_rule.set_up_done:
        cost_rule.set_up_done.append(1)
        prekey.code_version()
      libm = self._reads_libm()
      need = "libm" if libm else "blas"
      if need not in _addresses_set_up and any(
          holds(j, ADDRESS_PRIMITIVES) for j in self._jaxprs()):
        _addresses_set_up.extend(("blas", "libm") if libm else ("blas",))
        blas_calls.status(loops=libm)
    except Exception as e:  # noqa: BLE001
      log.debug("pallas_np: native tier set-up failed: %r", e)

  def _guarded(self, step) -> None:
    """``step`` in the caller (``"sync"``): a failure leaves the NumPy path."""
    try:
      step()
    except Exception as e:  # noqa: BLE001 - the NumPy path stays
      _state["failed"] += 1
      self.phase = "done"
      log.debug("pallas_np: native loop failed: %r", e)

  def _prepare(self, args) -> None:
    """The operands' layouts, from the loop's first run (or its pricing)."""
    if self.layouts is not None:
      return
    self.layouts = _layouts(args)  # (a vectorized pass's: its lane-stacked operands')

  # -- running ---------------------------------------------------------------------
  def __call__(self, ctx, *args):
    fn = self.native
    if fn is not None:
      res = self.run(fn, args, ctx) if self.in_batched is None else self.run_lanes(fn, ctx, args)
      if res is not None:
        return res
      return self.numpy_fn(ctx, *args)
    if self.phase == "landed":  # (its build's reply is in: loaded and swapped in here)
      self.land()
      return self(ctx, *args) if self.phase != "landed" else self.numpy_fn(ctx, *args)
    if self.phase == "done" or (self.phase == "building" and not self.sync):
      return self.numpy_fn(ctx, *args)
    if not self.prechecked:
      try:
        self._prelookup(args)
      except Exception as e:  # noqa: BLE001 - looked up the usual way
        log.debug("pallas_np: native loop pre-key lookup failed: %r", e)
      self.prechecked = True
      self.phase = self.phase  # (timing from now on, where the NumPy path stays)
      if self.native is not None or self.phase == "done":
        return self(ctx, *args)
    if self.sync and self.phase == "new":
      self._consider(ctx, args, 0.0)
      if self.native is not None:
        return self(ctx, *args)
    t0 = time.perf_counter()
    res = self.numpy_fn(ctx, *args)
    self._consider(ctx, args, time.perf_counter() - t0)
    return res

  def _fits(self, args) -> bool:
    guard, fits = self._checks
    if guard is not self.guard or fits is None:
      self._checks = (self.guard, guards.checker(self.guard))
      fits = self._checks[1]
    return fits(args)

  def run(self, fn, args, ctx=None):
    """The native loop on ``args`` (the NumPy path's operands): its carries,
    or None if the arguments' types are not those compiled for."""
    if not self._fits(args):
      return None
    return self._run(fn, args, ctx)

  def _run(self, fn, args, ctx=None):
    if self.scalars:
      args = list(args)
      for pos, t in self.scalars:  # (a scalar operand: its exact type)
        a = args[pos]
        if a.__class__ is not t:
          args[pos] = t(a)
    # (with the BLAS and float32-loop addresses: blas_calls; one per loop, as its scratch:
    # a call holds the GIL throughout, unless it calls back into Python: DMA call sites)
    st = self.status if self.pycalls is None else blas_calls.status()
    try:
      res = fn(st, *args, *self.scratch) if self.pycalls is None else \
          self.pycalls(fn, st, args, ctx)
    except IndexError:
      self.status = self.new_status()  # (the next call's: this one holds the error)
      if not st[0]:  # (no bounds-check site's: a DMA call site's own error, dma_calls)
        raise
      self._raise_oob(st, args)
    _state["native_calls"] += 1
    return tuple([v.reshape(shape) if shape else dt.type(v)
                  for v, (shape, dt) in zip(res[1:], self.outs)])

  def run_lanes(self, fn, ctx, args):
    """The native loop on every lane of a vectorized pass, in one call."""
    return lanes.run(self, fn, ctx, args)

  def _raise_oob(self, st, args):
    loop_errors.raise_oob(self, st, args)
