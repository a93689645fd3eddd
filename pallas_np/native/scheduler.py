"""The native tier's one build scheduler: the tier's thread, its queue of
build steps, the compile processes (``aot_worker``: lite's translator and
LLVM, or numba's ahead-of-time compiler, neither imported here) and the
rule that prices a build and weighs it against the caller's load. ``tier.NativeLoop`` decides *when* a loop's
build is due; this module runs it, off the caller's thread, and counts
what is queued and compiling (``stats``).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import weakref

from pallas_np.native import aot_worker, disk_cache

log = logging.getLogger("pallas_np.native")

# A build runs in another process, at the lowest CPU priority: it costs the
# caller only when the machine has no idle core. Its price counts at this
# weight, BUSY_FACTOR times more (in full) when the load average leaves no
# core idle or there is one core. The load average counts the caller itself
# (a process calling a kernel in a loop adds ~1): a core is idle while the
# load stays IDLE_MARGIN below the core count.
COMPILE_WEIGHT = 0.1
BUSY_FACTOR = 10.0
IDLE_MARGIN = 0.5
_CPUS = os.cpu_count() or 1  # (os.cpu_count reads /sys: ~20 us a call)
# lite's compile process's nice level. Measured on the loaded 2-core
# machine (load 3-4, PERF_LOG "[remote]"): at nice 10 or 19 a build waited
# for a core for many seconds (never done within a 4 s run); at 0 it lands
# in ~0.3-1 s, taking a share of a core from the caller while it runs,
# which the cost rule prices (``weight``: in full where no core is idle).
LITE_NICE = 0
# A build's seconds before one was measured: numba's import in a new
# compile process, its typing and LLVM (~0.02 s a generated line), pycc's C
# helpers once per cache directory.
START_PRICE, BASE_PRICE, LINE_PRICE, MIXIN_PRICE = 1.5, 1.0, 0.02, 5.0
# numba's time grows faster than linearly with a loop's lines (600 lines
# 14.8 s, 822 lines 157 s at load ~2.5: PERF_LOG 143): each line costs
# LINE_PRICE more per LONG_LINES lines before it.
LONG_LINES = 250
# Seconds of the caller's own time any build costs, in full: its parts in
# the caller (``build_steps``): the source's generation, the pre-key, the
# lookups and the job's files, then the library's load (a dlopen) and its
# swap. Measured as the caller's thread CPU time per build, 2 vCPUs
# (PERF_LOG 164): cumsum 3.5 ms, bitonic 7.9, Collatz 5.4, quant_matmul
# 4.9, int8_matmul 3.2, matmul_acc 4.7, layer_norm_block 4.4 (on the tier's
# thread, where these parts ran before, the same work took 10-19 ms of CPU:
# PERF_LOG 160). The build is due once the caller's seconds in the loop's
# kernel runs reach this over ``cost_rule.CALLER_SHARE``.
CALLER_PRICE = 0.008

# The tier's counters (``stats``): loops compiled, refused, failed, reused,
# loaded from disk, native calls, and builds queued or compiling now.
state = {"compiled": 0, "refused": 0, "failed": 0, "native_calls": 0, "reused": 0,
         "disk_hits": 0, "queued": 0, "compiling": 0, "lite": 0,
         "lite_refused": 0, "dropped": 0}
_cond = threading.Condition()
_jobs: queue.Queue = queue.Queue()
_thread: list = []
builds: list = []  # measured build seconds (the price of the next)
# Loops whose build's reply is in, to be landed by their next run (or
# ``wait``); weak: a loop whose plan is dropped before it runs again goes.
_landed = weakref.WeakSet()


def stats() -> dict:
  """Counters: loops compiled (built or loaded), refused (something outside
  the table), failed (a build failed), loaded from disk (``disk_hits``),
  calls that ran compiled code, loops ``queued`` for the tier thread or
  ``compiling`` in the compile process now, ``landed`` (built, to be
  swapped in by their next run or ``wait``), and kernel bodies ``dropped``
  unloaded (an earlier process's probe found them slower: ``tier_records``)."""
  return dict(state, landed=len(_landed))


def wait(timeout: float | None = None) -> bool:
  """Wait until no loop is queued or compiling, then land, in the calling
  thread, the builds whose replies are in (``BuildSteps.land``: what a
  loop's next run would do); False on timeout."""
  end = None if timeout is None else time.monotonic() + timeout
  while True:
    with _cond:
      left = None if end is None else max(end - time.monotonic(), 0.0)
      if not _cond.wait_for(lambda: state["queued"] + state["compiling"] == 0, left):
        return False
    if not _landed:
      return True
    while _landed:  # (a landing may queue a step: its pre-key's file)
      _landed.pop().land()


class Compiler:
  """The compile process (``aot_worker``), started on the first build and
  kept: it exits at the end of its input, when this process exits."""

  def __init__(self, nice: bool | int, lite: bool = False, warm: bool | None = None):
    self.proc = None
    self.nice = 19 if nice is True else int(nice)  # (the process's nice level; 0: none)
    self.lite = lite  # (a process for lite's builds: its warm-up is lite's)
    self.warm = nice if warm is None else warm  # (a warm-up: background builds)
    self.lock = threading.Lock()  # (one build at a time on the pipe)
    # (a background lite process asked for and not yet ready: ``prestart`` to its ready line)
    self.starting = False
    self.unready = False  # (its ready line not read yet: ``_spawn`` to ``_await_ready``)

  def build(self, job: dict) -> dict:
    with self.lock:
      return self._build(job)

  def start(self) -> None:
    """Starts the compile process, if it is not running: a background one
    imports numba and compiles a small loop first (``aot_worker.warm_up``),
    while the loop whose build comes next still runs its NumPy path (a
    ``"sync"`` build is waited for: no warm-up ahead of it)."""
    try:
      with self.lock:
        self._start()
    finally:
      self.starting = False  # (ready, or failed: a build then starts it again)

  def ready(self) -> None:
    """Waits (on the tier's thread) for a process ``prestart`` spawned in
    the caller to be ready for a build."""
    try:
      with self.lock:
        if self.proc is not None and self.unready:
          self._await_ready()
    finally:
      self.starting = False

  def _start(self) -> None:
    if self.proc is None or self.proc.poll() is not None:
      self._spawn()
    if self.unready:
      self._await_ready()

  def _spawn(self) -> None:
    self.proc = subprocess.Popen(
        [sys.executable, "-I", aot_worker.__file__,
         *(["--nice", str(int(self.nice))] if self.nice else []),
         *(["--warm", str(os.getpid())] if self.warm else []),
         *(["--lite"] if self.lite else [])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
    self.unready = self.lite and self.warm

  def _await_ready(self) -> None:
    """Reads a warm lite process's first line, written once lite's modules
    and llvmlite are imported (``aot_worker``), holding no GIL while it
    waits; a process that exited instead is dropped."""
    self.unready = False
    try:
      ready = self.proc.stdout.readline()
    except OSError:
      ready = ""
    if not ready:
      self._drop()

  def _drop(self) -> None:
    """Forgets a compile process that exited (the next build starts
    another), its pipes closed here: a pipe with unwritten bytes would
    report a broken pipe when collected."""
    proc, self.proc = self.proc, None
    self.unready = False
    for pipe in (proc.stdin, proc.stdout):
      try:
        pipe.close()
      except OSError:
        pass
    proc.poll()

  def _build(self, job: dict) -> dict:
    self._start()
    try:
      self.proc.stdin.write(json.dumps(job) + "\n")
      self.proc.stdin.flush()
      line = self.proc.stdout.readline()
    except OSError as e:
      self._drop()
      return {"ok": False, "error": f"compile process: {e!r}"}
    if not line:
      self._drop()
      return {"ok": False, "error": "the compile process exited"}
    reply = json.loads(line)
    if reply.get("ok") and job.get("kind") != "lite":  # (the next build's price: without the one-off setup this one paid)
      builds.append(max(reply["seconds"] - reply.get("setup_seconds", 0.0), 0.0))
    return reply


compiler = Compiler(nice=True)  # background numba builds
lite_compiler = Compiler(nice=LITE_NICE, lite=True, warm=True)  # background lite builds
sync_compiler = Compiler(nice=False)  # builds a caller waits for ("sync"), lite's and numba's


def _work():
  while True:
    loop, step = _jobs.get()
    try:
      with _cond:
        state["compiling"] += 1
      try:
        step()
      finally:
        with _cond:
          state["compiling"] -= 1
    except Exception as e:  # noqa: BLE001 - the NumPy path stays
      if loop is not None:
        state["failed"] += 1
        loop.phase = "done"
      log.debug("pallas_np: native loop failed: %r", e)
    finally:
      with _cond:
        state["queued"] -= 1
        _cond.notify_all()


def running() -> bool:
  """Whether the tier's thread was started (a warm process may have none)."""
  return bool(_thread)


def submit(loop, step) -> None:
  """Queues a step for the tier's thread (``loop``: the loop it builds)."""
  _enqueue(loop, step)


def submit_build(loop) -> None:
  """A loop's background build: its first part in the caller
  (``BuildSteps.start_build``: the source, the lookups, the job), its
  exchange with the compile process on the tier's thread (which holds no
  GIL while it waits), the reply landed by the loop's next run
  (``BuildSteps`` for why)."""
  step = loop.start_build()
  if step is not None:
    compiler, job = step
    _enqueue(loop, lambda: loop.arrived(job, compiler.build(job)))


def landed(loop) -> None:
  """Holds a loop whose reply is in until it is landed (``wait`` lands
  it, where its next run has not)."""
  _landed.add(loop)


def landing(loop) -> None:
  """A loop's reply taken (``BuildSteps.land``)."""
  _landed.discard(loop)


def prestart(which=None) -> None:
  """Starts a background compile process (``which``, numba's by default;
  its warm-up: ``Compiler.start``) ahead of any build. Its ``Popen`` runs
  in the caller, which holds the GIL anyway: on the tier's thread, behind
  a caller busy calling kernels, the ``Popen`` took 0.07-0.25 s of
  handing the GIL back and forth, and lite's process was ready 0.1-0.45 s
  after it was asked for, against ~0.04 s beside an idle caller (PERF_LOG
  163). The tier's thread then waits for lite's ready line (its imports);
  lite's is ``starting`` until then. Where another thread holds the
  process's lock (a build starting it), the tier's thread starts it."""
  which = which or compiler
  which.starting = which.lite and which.warm
  if not which.lock.acquire(blocking=False):
    _enqueue(None, which.start)
    return
  try:
    if which.proc is None or which.proc.poll() is not None:
      which._spawn()  # noqa: SLF001 - the compile process's own start, here in the caller
  except Exception as e:  # noqa: BLE001 - never the caller's error: a build tries again
    log.debug("pallas_np: compile process start failed: %r", e)
    which.starting = False
    return
  finally:
    which.lock.release()
  _enqueue(None, which.ready)


def _enqueue(loop, step) -> None:
  with _cond:
    state["queued"] += 1
    if not _thread:
      t = threading.Thread(target=_work, name="pallas_np-native", daemon=True)
      t.start()
      _thread.append(t)
  _jobs.put((loop, step))

def price(lines: int) -> float:
  """Seconds the next build of a loop of ``lines`` generated lines takes
  in the compile process (measured builds once there are some)."""
  per_lines = LINE_PRICE * lines * (1.0 + lines / LONG_LINES)
  if builds:
    return max(sorted(builds)[len(builds) // 2], BASE_PRICE * 0.5) + per_lines * 0.5
  mixins = not os.path.isdir(os.path.join(disk_cache.directory(), "mixins"))
  return START_PRICE + BASE_PRICE + per_lines + (MIXIN_PRICE if mixins else 0.0)


# The share of a lite build's seconds on an idle core that still costs the
# caller: lite's process start (its imports and LLVM's warm-up, ~0.16 s of
# CPU on the other core) slowed a caller's calls by ~3.5 ms on 2 vCPUs
# (PERF_LOG 161), ~2% of its seconds; a build is the same kind of work.
# Counted in the caller's part of a lite build (``cost_rule._step``).
NEIGHBOUR_SHARE = 0.02


def lite_weight() -> float:
  """How much of a lite build's seconds the caller pays: none where a core
  is idle (a lite build, 0.1-1 s in lite's compile process, runs on it:
  its wall time is latency, and the caller pays its own part,
  ``CALLER_PRICE``); ``weight``'s busy weight, in full, on one core or
  where no core is idle, where the build takes a share of the caller's."""
  w = weight()
  return 0.0 if w == COMPILE_WEIGHT else w


def weight() -> float:
  """How much of a build's seconds the caller pays (see COMPILE_WEIGHT)."""
  try:
    busy = os.getloadavg()[0] > _CPUS - IDLE_MARGIN
  except (AttributeError, OSError):
    busy = False
  return COMPILE_WEIGHT * (BUSY_FACTOR if _CPUS == 1 or busy else 1.0)
