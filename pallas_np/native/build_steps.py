"""What a native loop's build does, and which thread does each part
(docs/native.md, "Which thread does what"). ``BuildSteps`` is the half of
``tier.NativeLoop`` that builds: ``cost_rule`` decides when, ``tier``
runs the loop.

A background build has three parts:

* ``start_build``, in the caller, when the build is due: the loop's source
  generated (``codegen``), its library looked up in memory and on disk
  (``disk_cache``, ``lite_cache``: a hit is swapped in at once) and, not
  found, the compile process's job written. This is Python under the GIL
  either way; on the tier's thread, beside a caller busy calling kernels,
  every system call in it waited for the GIL again (up to ~0.2 s each,
  p90 60 ms), and the job reached the compile process 0.1-1.2 s after the
  build was due. In the caller it takes its CPU time alone (priced:
  ``scheduler.CALLER_PRICE``, paid only over ``cost_rule.CALLER_SHARE``).
* ``arrived``, on the tier's thread (``scheduler.submit_build``): the job
  written to the compile process's pipe and its reply awaited, holding no
  GIL while the compile process works.
* ``land``, in the caller again, at the loop's next run (or in
  ``native.wait``): the library loaded (a ``dlopen``) and swapped in, or,
  where lite refused the loop, the loop priced for numba's build.

``"sync"`` (``build``) runs all three in the caller, one after another.
"""
from __future__ import annotations

import logging
import threading

import numpy as np

from pallas_np.lru import LRU
from pallas_np.native import codegen, disk_cache, lite_cache, prekey, scheduler
from pallas_np.native import tier_records as records

log = logging.getLogger("pallas_np.native")

_state = scheduler.state  # (the counters: scheduler.stats)
# Loaded loops by library key: the eager and the jax.jit path of one
# kernel, its sequential and vectorized plans, and equal loops of other
# kernels share one library.
loaded = LRU(256)
# Pre-key records of this process (``prekey``; on disk: ``disk_cache``).
prekeys = LRU(1024)
UNSET = object()
# (a landed reply taken once: the loop's run and ``native.wait`` may both try)
_landing = threading.Lock()


def signature(src, avals, layouts):
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
  args += [["a", np.dtype(dt).str, 1, True, True] for dt, _ in src.scratch]  # (codegen.finish)
  ret = [["s", "int64"]] + [["s", dt.str] if kind == "s" else ["a", dt.str, 1, True, True]
                            for kind, dt in src.outs]
  return args, ret, tuple(guard)


class BuildSteps:
  """The build of a ``tier.NativeLoop`` (which supplies ``eqn``,
  ``layouts``, ``invars``, ``lite``, ``sync``, ``_refuse``, ``_price``
  and ``_swap``): see the module doc."""

  reply = None  # (the compile process's reply, once ``arrived``: (job, reply))

  def _generate(self) -> bool:
    """Generate the loop's source, its signature and library key (False,
    the loop refused for good, where something is outside the table)."""
    if self.prekey is UNSET:
      self.prekey = prekey.loop_prekey(self.eqn, self.clamp, self.layouts, self.uninitialized)
    try:
      src = codegen.loop_source(self.eqn, self.clamp, self.uninitialized)
      if any(self.layouts[k] is not None and not self.layouts[k][1] for k in src.written):
        raise codegen.Refused("a written ref is read-only")
      args, ret, guard = signature(src, self.invars, self.layouts)
    except codegen.Refused as e:
      self._refuse(str(e))
      self._remember({"refused": str(e)})
      return False
    k = disk_cache.loop_key(src, args, ret, self.invars)
    self.src, self.guard = src, guard
    self.addresses = records.reads_status(src.text)
    self.job = {"key": k, "args": args, "ret": ret, "externals": src.externals}
    return True

  def build(self) -> None:
    """The whole build in the calling thread (``"sync"``): its three parts
    one after another; a loop lite refuses is then built by numba."""
    step = self.start_build()
    while step is not None:
      compiler, job = step
      step = self._land(job, compiler.build(job))

  def start_build(self):
    """The build's first part, in the caller (see the module doc): the
    library from memory or disk swapped in, or the loop refused, and None;
    else (compiler, job) for the compile process."""
    if not self._generate():
      return None
    k = self.job["key"]
    fn = loaded.get(k)
    if fn is not None:
      _state["reused"] += 1
      self._finish(fn)
      return None
    path = disk_cache.library_path(k)
    fn = disk_cache.load(path)
    if fn is None and self.lite:
      fn = lite_cache.load(k)
      if fn is None:
        return self._lite_job(k)
    if fn is None:
      return self._numba_job(k)
    _state["disk_hits"] += 1
    loaded.put(k, fn)
    self._finish(fn)
    return None

  def _lite_job(self, k):
    """lite's compile process and the loop's job (``lite_cache.job``), or
    where lite refuses the loop, ``_lite_refused``'s next step."""
    try:
      if self.src.calls:
        raise codegen.Refused("lite: DMA call sites")
      job = lite_cache.job(k, self.src, lite_cache.arg_descs(self.src.kinds, self.invars,
                                                             self.layouts))
    except Exception as e:  # noqa: BLE001 - Refused, or a job that cannot be written
      return self._lite_refused(e)
    return (scheduler.sync_compiler if self.sync else scheduler.lite_compiler), job

  def _numba_job(self, k):
    """numba's compile process and the loop's job (``aot_worker``)."""
    srcfile, consts = disk_cache.write_job(k, self.src.text, self.src.globals)
    compiler = scheduler.sync_compiler if self.sync else scheduler.compiler
    return compiler, {"src": srcfile, "consts": consts, "args": self.job["args"],
                      "ret": self.job["ret"], "externals": self.job["externals"],
                      "out": disk_cache.library_path(k)}

  def _lite_refused(self, why):
    """lite refused the loop (its table, LLVM's own error, or a library
    not written): ``"sync"`` builds it with numba now (the next step);
    a background loop is priced for numba's build (``cost_rule``) and
    stays on the NumPy path until that is due (None)."""
    _state["lite_refused"] += 1
    log.debug("pallas_np: lite refused a loop (%s)", why)
    self.lite = False
    if self.sync:
      return self._numba_job(self.job["key"])
    self._price()
    return None

  def arrived(self, job, reply) -> None:
    """On the tier's thread: the compile process's reply is in; the loop's
    next run (``tier.NativeLoop.__call__``) lands it (``land``)."""
    self.reply = (job, reply)
    self.phase = "landed"
    scheduler.landed(self)

  def land(self) -> None:
    """In the caller: the reply that ``arrived`` taken, once (see the
    module doc); a failure leaves the NumPy path."""
    with _landing:
      if self.phase != "landed" or self.reply is None:
        return
      (job, reply), self.reply = self.reply, None
      self.phase = "building"
      scheduler.landing(self)
    self._guarded(lambda: self._land(job, reply))

  def _land(self, job, reply):
    """The library a reply says was built, loaded and swapped in; or the
    build's failure (the NumPy path for good) or lite's refusal (its next
    step: ``_lite_refused``)."""
    k = self.job["key"]
    if job.get("kind") == "lite":
      fn = lite_cache.load(k) if reply.get("ok") else None
      if fn is None:
        return self._lite_refused(reply.get("refused") or reply.get("error")
                                  or f"{job['out']}: not written by its build")
      _state["lite"] += 1
    else:
      if not reply.get("ok"):
        _state["failed"] += 1
        self.phase = "done"
        log.debug("pallas_np: native loop build failed: %s", reply.get("error"))
        return None
      fn = disk_cache.load(job["out"])
      if fn is None:
        raise disk_cache.LoadError(f"{job['out']}: not written by its build")
    loaded.put(k, fn)
    self._finish(fn)
    return None

  def _finish(self, fn) -> None:
    """The library swapped in, and what the loop's pre-key generated
    recorded (``_remember``; on disk by the tier's thread where it runs)."""
    k = self.job["key"]
    record = records.record(self.src, k, self.job["args"], self.job["ret"])
    if getattr(fn, "lite", False):
      record["lite"] = True
    self._swap(fn)
    self._remember(record)

  def _remember(self, record: dict) -> None:
    """Records what this loop's pre-key generated (in this process and on
    disk), for the next plan or process that runs it (``_prelookup``);
    the file (written and renamed, ~0.4 ms) by the tier's thread where
    it runs."""
    if self.prekey is None or self.prekey is UNSET:
      return
    self.record = record
    prekeys.put(self.prekey, record)
    if scheduler.running() and not self.sync:
      scheduler.submit(None, lambda: disk_cache.write_prekey(self.prekey, record))
      return
    disk_cache.write_prekey(self.prekey, record)
