"""When a native loop's next step is due: the cost rule (docs/native.md,
"When: the cost rule"). ``CostRule`` is the half of ``tier.NativeLoop``
that counts what a loop costs the caller (its NumPy path's seconds,
``spent``, and the caller's seconds in its kernel runs, ``called``) and
decides when the loop is priced, when lite's compile process is started
and when its build is submitted to ``scheduler`` (which prices builds
against the load); ``tier`` holds what the steps do (generate, build,
load, swap, run). Every step that takes the caller's own time waits for
its share of the caller's seconds (``CALLER_SHARE``).
"""
from __future__ import annotations

import time

from pallas_np import _compat as jc
from pallas_np.native import codegen, lite_cache, scheduler

# Kernel runs before a loop may be compiled (a loop run once or twice, a
# test or a one-off call, never starts a build; a library already on disk
# is loaded from the first run on).
HOT_RUNS = 3

# The share of the caller's seconds the tier may take of the caller's own
# time (its GIL) before the loop runs compiled: a step that costs the
# caller c seconds (lite's process start, ``PRESTART_PRICE``; a build's own
# part, ``scheduler.CALLER_PRICE``; the process's one-off set-up,
# ``SETUP_PRICE``) is taken only once the caller's seconds in the loop's
# kernel runs (``called``) reach c / CALLER_SHARE, so that over any first N
# calls the tier costs the caller at most this share more than
# ``native_loops="off"`` until the compiled loop pays it back (issue 41:
# "at every N never slower than off"). At 0.03 a process's first build is
# due after ~0.57 s of the kernel's calls (a lite build's share of its
# neighbour's seconds included: scheduler.NEIGHBOUR_SHARE); it was due after ~0.03 s of the
# loop's, where its ~10-20 ms showed as 5-30% slower calls over the first
# 100-1000 (PERF_LOG 160).
CALLER_SHARE = 0.03
# Seconds of the caller's time lite's compile-process start costs: its
# ``Popen`` in the caller (~1 ms) and the tier's thread's start (up to
# ~4 ms: ``scheduler.prestart``), and its imports and warm-up (~0.16 s of CPU) on another
# core, which still slowed the caller's calls by 2-6% while they ran
# (~3.5 ms over 800 calls of cumsum with ``native_loops="off"``, on 2
# vCPUs; a process spinning in Python slowed them by nothing: PERF_LOG
# 161). It is started no earlier than PRESTART_PRICE / CALLER_SHARE
# (~0.17 s of calls), and in fact when the loop is priced (``LOOKUP_PRICE``).
PRESTART_PRICE = 0.005
# The caller's seconds after which a loop whose build waits for lite's
# compile process to be ready (its start: ~0.07 s) looks at it again: a
# run then only adds and compares (a look at every run cost ~1 us each).
STARTING_RECHECK = 0.005
# Generated lines per eqn of a loop, for the price before its source exists.
LINES_PER_EQN = 2
# While a priced loop's cost is below its price at the busy weight, the
# load is read again only after its NumPy path cost another RECHECK_SHARE
# of the price (a run itself only adds and compares: no system call).
RECHECK_SHARE = 0.02

# Seconds of the caller's time of the one-off set-up a process's first
# build pays (``NativeLoop._one_off_set_up``: 1.5 ms, ~5 ms with BLAS's
# checks): priced in as ``CALLER_PRICE`` is (over ``CALLER_SHARE``).
SETUP_PRICE = 0.003

# The caller's seconds before a process's first lite build is due at which
# the steps that serve only that build are taken: the loop's pricing (a
# walk over its eqns; lite's availability, llvmlite's dist-info and
# NumPy's structs, looked up once per process: ~0.8 ms in all) and lite's
# compile-process start (``PRESTART_PRICE``), which needs ~0.05-0.15 s on
# an idle core to be ready for the build. Taken at the loop's first runs
# (pricing after 30 ms of its NumPy path, the start after ~0.17 s of
# calls), they landed in the first 10-20 calls of a 10 ms kernel, which
# paid them whether or not a build ever came due (splash attention's
# first 20 calls ~1.6% slower than "off", 5 rounds of 5: PERF_LOG 162).
START_LEAD = 0.25
# The caller's seconds (``called``, at least the loop's own ``spent``) at
# which a loop is priced and, where a core is idle, lite's compile process
# started: START_LEAD before a process's first lite build is due (its
# caller part over CALLER_SHARE: ``_step``), ~0.32 s. A kernel called for
# less pays the tier nothing but its runs' timing.
LOOKUP_PRICE = (scheduler.CALLER_PRICE + scheduler.NEIGHBOUR_SHARE * lite_cache.PRICE
                + SETUP_PRICE) / CALLER_SHARE - START_LEAD

set_up_done: list = []  # (NativeLoop._one_off_set_up: done)


def eqn_count(jaxpr) -> int:
  """The eqns of ``jaxpr`` and its nested jaxprs (a loop's size, priced
  before its source exists)."""
  n = 0
  for e in jaxpr.eqns:
    n += 1
    for sub in jc.eqn_subjaxprs(e):
      n += eqn_count(sub)
  return n


class CostRule:
  """The cost rule's steps of a ``tier.NativeLoop`` (which supplies
  ``_prepare``, ``_jaxprs``, ``_one_off_set_up``, ``_guarded``, ``build``
  and the counters its ``entry`` keeps)."""

  def _price(self) -> None:
    """The build's price, from the loop's size (no source generated); or
    the loop refused for good where its operands alone refuse it
    (``codegen.prerefusal``: a bfloat16 kernel body's refs), before lite's
    process is started or its build's caller part paid for nothing."""
    why = codegen.prerefusal(self.eqn)
    if why:
      self._refuse(why)
      return
    lines = LINES_PER_EQN * sum(eqn_count(j) for j in self._jaxprs())
    self.price = lite_cache.PRICE if self.lite else scheduler.price(lines)
    starting = (self.lite and not self.sync and scheduler.lite_compiler.proc is None
                and not self.prestarted)
    idle = starting and scheduler.weight() == scheduler.COMPILE_WEIGHT  # (the load read once)
    if starting and not idle:
      self.price += lite_cache.START_PRICE  # (no core idle: started with the build, priced in)
    # (the least weight(): the load is read when it is reached; a lite build's price is the
    # caller's own part: ``_step``)
    least = scheduler.CALLER_PRICE / CALLER_SHARE
    self.due = 0.0 if self.sync else (
        least if self.lite else max(scheduler.COMPILE_WEIGHT * self.price, least))
    if idle:  # (lite's process start, due first where it is not running)
      self.due = min(self.due, self._prestart_due(max(self.called, self.spent), idle) or self.due)
    self.phase = "priced"
    if (not self.sync and not self.lite and scheduler.compiler.proc is None
        and scheduler.weight() == scheduler.COMPILE_WEIGHT):
      # (the compile process's one-off setup, ~1-4 s of a niced process,
      # paid while the build is not yet due, where a core is idle; else
      # when the build is queued. Its ``Popen`` runs here, in the caller:
      # ``scheduler.prestart``)
      scheduler.prestart()

  def _prestart_lite(self, idle: bool | None = None) -> bool:
    """Has lite's compile process started (Python and llvmlite's import,
    ~0.15 s, then its warm-up, on another core) once a loop that found no
    library is priced (``LOOKUP_PRICE``; no earlier than ``PRESTART_PRICE
    / CALLER_SHARE``), where a core is idle (the load is read once): its
    start is then the build's latency, not the caller's cost (a ``Popen``
    in the caller, ~1 ms: ``scheduler.prestart``). It exits with this
    process (the end of its input; during its start, ``aot_worker``'s
    orphan watch). Whether it was asked for (by this loop). ``idle``: the
    load's verdict, where the caller just read it."""
    if idle is None:
      idle = not self.prestarted and scheduler.weight() == scheduler.COMPILE_WEIGHT
    if not self.prestarted and idle:
      self.prestarted = True
      scheduler.prestart(scheduler.lite_compiler)
    return self.prestarted

  def _prestart_due(self, called: float, idle: bool | None = None) -> float:
    """lite's compile process, started (``_prestart_lite``) once the
    caller's seconds in the loop's kernel runs (``called``) reach
    ``LOOKUP_PRICE`` and cover its start's caller part over
    ``CALLER_SHARE``: 0.0 once the loop may go on
    (started, running, or, no core idle, left to start with the build),
    else the caller's seconds it is due at."""
    if self.prestarted or scheduler.lite_compiler.proc is not None:
      return 0.0
    due = max(PRESTART_PRICE / CALLER_SHARE, LOOKUP_PRICE)
    if called < due:
      return due
    self._prestart_lite(idle)
    return 0.0

  def _consider(self, ctx, args, spent) -> None:
    """Counts a run of the NumPy path and takes the next step when its
    cost says so (see the module doc)."""
    if ctx is not self.last_ctx:
      self.last_ctx = ctx
      self.runs += 1
      self.closed = self.called
    self.spent += spent
    t0 = getattr(ctx, "t0", None)
    self.called = self.closed + time.perf_counter() - t0 if t0 is not None else self.spent
    if max(self.called, self.spent) >= self.due:
      self._step(args)

  def _step(self, args) -> None:
    """The next step of a loop whose cost reached ``due``. ``due`` is in
    the caller's seconds (``called``; a kernel body's sampled steps count
    ``spent`` alone); a step priced in the loop's own seconds (pricing, a
    build's compile at the load's weight) is looked at again once the
    caller spent at least the seconds it still lacks."""
    called = max(self.called, self.spent)
    if self.phase == "new":
      if not self.sync and called < LOOKUP_PRICE:
        self.due = LOOKUP_PRICE
        return
      self._prepare(args)
      self._price()
    if self.phase == "priced" and called >= self.due:
      if not self.sync:
        if self.lite:
          due = self._prestart_due(called)
          if due:
            self.due = due
            return
          if scheduler.lite_compiler.starting:
            # (its source generated, its caller's part paid, once lite's compile process can
            # take the build: a kernel called only while it starts, ~0.07 s, never pays it)
            self.due = called + STARTING_RECHECK
            return
        # (the caller's own part over CALLER_SHARE, in the caller's seconds, and the
        # compile process's seconds at the load's weight, in the loop's: both due)
        weight = scheduler.lite_weight() if self.lite else scheduler.weight()
        # (a lite build on an idle core still slows the caller's calls a little: NEIGHBOUR_SHARE)
        neighbour = scheduler.NEIGHBOUR_SHARE * self.price if self.lite and not weight else 0.0
        share = (scheduler.CALLER_PRICE + neighbour
                 + (0.0 if set_up_done else SETUP_PRICE)) / CALLER_SHARE
        lacking = weight * self.price - self.spent
        if called < share or lacking > 0:  # (the load is looked at again after RECHECK_SHARE more)
          self.due = max(share, called + min(max(lacking, 0.0), RECHECK_SHARE * self.price))
          return
        if self.runs < HOT_RUNS:
          return  # (looked at again next run)
      self.phase = "building"
      self.due = float("inf")
      self._one_off_set_up()
      # (the build's first part in the caller: ``build_steps``)
      self._guarded(self.build if self.sync else lambda: scheduler.submit_build(self))
