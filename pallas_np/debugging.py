"""Debugging aids around the kernel executors: the one formatter of errors
raised inside a kernel (``kernel_error``: where it happened, index map or
kernel line), post-mortem pdb positioned at the failing eqn, and the
progress bar for long grids.

Nothing here runs on the hot path unless the matching InterpretParams option
is on (or an exception is already being raised).
"""
from __future__ import annotations

import contextlib
import pdb
import sys
import threading
import time

import jax

from pallas_np import _compat as jc
from pallas_np.compiler import failing_eqns, sourcemap
from pallas_np.env_switches import env_switch
from pallas_np.errors import kernel_error_class

# Seconds a grid must run before the progress bar appears.
PROGRESS_AFTER_S = 2.0
# How often the bar is redrawn.
PROGRESS_EVERY_S = 0.25


# -- the one formatter of errors raised inside a kernel --------------------------
def kernel_error(e: Exception, kernel: str, what: str, place: str, program_ids,
                 origin: str | None = None):
  """``e``, raised inside a kernel, as a ``KernelError`` that is-a
  ``type(e)``: "<Type> in <what><place> in primitive 'p' at file:line
  (called from ...): <e>". ``what`` names the kernel ("Pallas kernel 'k'"),
  ``place`` where in it ("on device 1 at grid point (0, 2)", "at block (1,),
  warpgroup 0"); ``origin``: the block whose index map raised it, if one
  did. Every kernel family formats its errors here."""
  eqns = failing_eqns(e.__traceback__)
  where = ""
  prim = None
  source = None
  if eqns:
    prim = eqns[-1].primitive.name
    # Eqns traced inside JAX helpers (pltpu.sync_copy, ...) have no user
    # frame: name the innermost line that is the user's.
    lines = [jc.source_summary(q.source_info) for q in eqns]
    lines = [ln for ln in lines if ln and ln != "<unknown source>"]
    if lines:
      source = lines[-1]
      where = f" in primitive '{prim}' at {source}"
      if len(lines) > 1:
        where += f" (called from {' <- '.join(reversed(lines[:-1]))})"
    else:
      where = f" in primitive '{prim}'"
  if origin is not None:
    where = f" in the index map of {origin}" + (f" ({where.strip()})" if where else "")
  msg = f"{type(e).__name__} in {what}{place}{where}: {e}"
  err = kernel_error_class(type(e))(msg, kernel=kernel, program_ids=program_ids,
                                    primitive=prim, source=source, original=e)
  for k, v in getattr(e, "__dict__", {}).items():  # e.g. RaceError.buffer
    if getattr(err, k, None) is None:
      setattr(err, k, v)
  return err


# -- typed errors across jit ----------------------------------------------------
_last_error_lock = threading.Lock()
_last_error: list = [None]


def remember(err: BaseException) -> None:
  """Keep the last KernelError: under jit it crosses XLA as a JaxRuntimeError
  (io_callback), losing its type; ``kernel_errors()`` gets it back."""
  with _last_error_lock:
    _last_error[0] = err


@contextlib.contextmanager
def kernel_errors():
  """Re-raise a kernel's typed error (``KernelIndexError``, ``KernelRaceError``
  ...) instead of the ``JaxRuntimeError`` XLA wraps it in under ``jit``::

      with pallas_np.kernel_errors():
        jax.jit(f)(x)          # raises IndexError subclasses, RaceError, ...
  """
  with _last_error_lock:
    _last_error[0] = None
  try:
    yield
  except Exception as jax_error:
    with _last_error_lock:
      err, _last_error[0] = _last_error[0], None
    if (isinstance(jax_error, jax.errors.JaxRuntimeError) and err is not None
        and str(err) in str(jax_error)):
      raise err from err.__cause__
    raise


# -- pdb ----------------------------------------------------------------------
def _plan_aliases(plan, frame) -> dict:
  """Python names of a plan frame's arguments (``x_ref``, ``o_ref``; ``i``,
  ``acc`` in a fori_loop body), from the jaxpr's debug info."""
  jaxprs = {plan.kernel.filename: plan.kernel.jaxpr}
  for jaxpr, sub in getattr(plan.compiler, "_cache", {}).values():
    jaxprs.setdefault(sub.filename, sub.jaxpr)
  jaxpr = jaxprs.get(frame.f_code.co_filename)
  dbg = getattr(jaxpr, "debug_info", None)
  names = getattr(dbg, "arg_names", None) or ()
  argnames = frame.f_code.co_varnames[1:frame.f_code.co_argcount]  # skip ctx
  out = {}
  for user, ours in zip(names, argnames):
    if user and user.isidentifier() and ours in frame.f_locals:
      out[user] = frame.f_locals[ours]
  return out


def post_mortem(e: BaseException, plan, point):
  """pdb at the innermost generated-plan frame of ``e``'s traceback.

  The generated code is ``v7 = f3(v2, v5)``: ``ll`` lists it, every local is
  a NumPy value or a ref (a NumPy array, writable); the frame's arguments
  are also bound under their Python names (``x_ref``; ``j``, ``acc`` in a
  loop body), and ``ctx.grid_point`` is where we are in the grid.
  """
  tb = e.__traceback__
  eqns = failing_eqns(tb)

  class KernelPdb(pdb.Pdb):
    def setup(self, f, t):
      stop = super().setup(f, t)
      for i in range(len(self.stack) - 1, -1, -1):
        frame = self.stack[i][0]
        if sourcemap.lookup(frame.f_code.co_filename) is not None:
          self.curindex = i
          self.curframe = frame
          self.curframe_locals = frame.f_locals
          self.curframe_locals.update(_plan_aliases(plan, frame))
          break
      return stop

  debugger = KernelPdb()
  debugger.reset()
  where = ""
  if eqns:
    where = f"\n  failing eqn: {eqns[-1]}\n  at {jc.source_summary(eqns[-1].source_info)}"
  debugger.message(
      f"pallas_np: {type(e).__name__} in kernel '{plan.name}' at grid point {point}: {e}"
      f"{where}\n  locals are NumPy values/refs; arguments are also bound by their Python names; "
      "'ll' shows the generated plan, 'c' continues (the error is re-raised).")
  debugger.interaction(None, tb)


# -- progress -------------------------------------------------------------------
def _progress_enabled() -> bool:
  return env_switch("PALLAS_NP_PROGRESS", True)


def progress_bar(name, total, params):
  """A progress bar for this grid, or None when opted out. The environment
  variable is read when the bar would first show (reading it on every
  kernel call cost ~2 µs of the per-call floor)."""
  if not params.progress:
    return None
  return _Progress(name, total)


class _Progress:
  """Progress shown once a grid has run PROGRESS_AFTER_S seconds: a
  ``tqdm.auto`` bar when tqdm is installed (a widget in notebooks), else a
  line on stderr. tqdm is looked up only then, so short grids pay nothing."""
  __slots__ = ("name", "total", "start", "next", "shown", "done", "tqdm_bar")

  def __init__(self, name, total):
    self.name = name
    self.total = total
    self.start = time.perf_counter()
    self.next = self.start + PROGRESS_AFTER_S
    self.shown = False
    self.done = 0
    self.tqdm_bar = None

  def tick(self, done):
    self.done = done
    now = time.perf_counter()
    if now < self.next:
      return
    self.next = now + PROGRESS_EVERY_S
    self._draw(now)

  def _draw(self, now):
    if not self.shown:
      if not _progress_enabled():  # opted out: never shows
        self.next = float("inf")
        return
      self.shown = True
      tqdm = _tqdm()
      if tqdm is not None:
        self.tqdm_bar = _started_tqdm(tqdm, self, now)
    done = self.done
    if self.tqdm_bar is not None:
      self.tqdm_bar.update(done - self.tqdm_bar.n)
      return
    elapsed = now - self.start
    frac = done / max(self.total, 1)
    bar = "#" * int(30 * frac)
    eta = elapsed / max(frac, 1e-9) - elapsed
    sys.stderr.write(f"\rpallas_np {self.name}: [{bar:<30}] {done}/{self.total} "
                     f"grid points, {elapsed:.1f}s, ~{eta:.0f}s left")
    sys.stderr.flush()

  def close(self):
    if self.shown:
      self._draw(time.perf_counter())
      if self.tqdm_bar is not None:
        self.tqdm_bar.close()
        return
      sys.stderr.write("\n")
      sys.stderr.flush()


def _started_tqdm(tqdm, progress, now):
  """A tqdm bar for ``progress`` whose clock starts when the grid started,
  not when the bar first shows (PROGRESS_AFTER_S later): tqdm computes
  elapsed time and rate from ``start_t`` and ``last_print_t`` (its own
  clock, ``time.time`` by default), so both are moved back by the time the
  grid has already run."""
  bar = tqdm(total=progress.total, desc=f"pallas_np {progress.name}",
             unit="grid point", leave=True)
  already_ran = now - progress.start
  for attr in ("start_t", "last_print_t"):
    if isinstance(getattr(bar, attr, None), (int, float)):
      setattr(bar, attr, getattr(bar, attr) - already_ran)
  return bar


def _tqdm():
  """``tqdm.auto.tqdm`` (notebook widget or terminal bar), None without tqdm."""
  try:
    from tqdm.auto import tqdm  # an optional dependency
  except ImportError:
    return None
  return tqdm
