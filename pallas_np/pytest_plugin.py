"""pytest plugin: ``pytest --pallas-numpy`` runs every pallas_call of a test
suite in the NumPy interpreter, without editing the tests (kernels tested with
``interpret=True`` get bounds checks, NaN fills and, with
``--pallas-numpy-races``, race detection); and, in every session, a test failing
with a pallas_np error is reported kernel line first, pallas_np's frames hidden."""
from __future__ import annotations

import linecache
import os
import re
import sys

import pytest


def pytest_addoption(parser):
  group = parser.getgroup("pallas_np")
  group.addoption("--pallas-numpy", action="store_true", default=False,
                  help="route every pallas_call to the pallas_np NumPy interpreter")
  group.addoption("--pallas-numpy-races", action="store_true", default=False,
                  help="--pallas-numpy with race detection on parallel grid axes")
  group.addoption("--pallas-device", default=None, metavar="NAME",
                  help="--pallas-numpy as a stand-in for device NAME (h100, b200, tpu-v5e, "
                       "...: pallas_np.emulate_device): JAX's device gates and hardware "
                       "queries answer as NAME, kernel loops have a watchdog")


def pytest_configure(config):
  races = config.getoption("--pallas-numpy-races", default=False)
  device = config.getoption("--pallas-device", default=None)
  if device:
    import pallas_np  # (imported only when asked for, as below)
    # The persona's own default stands unless the flag asks for detection
    # (the cpu persona records races, as JAX's interpreters do).
    pallas_np.set_emulated_device(device, **({"detect_races": True} if races else {}))
    config._pallas_np_device = device
    return
  if races or config.getoption("--pallas-numpy", default=False):
    # Imported only when asked for: suites not using the option skip pallas_np's set-up.
    import pallas_np
    from pallas_np.params import default_params
    pallas_np.set_numpy_interpret(default_params(detect_races=races))
    config._pallas_np_forced = True


def pytest_unconfigure(config):
  if getattr(config, "_pallas_np_device", None):
    import pallas_np  # already imported by pytest_configure
    pallas_np.unset_emulated_device()
  if getattr(config, "_pallas_np_forced", False):
    import pallas_np  # already imported by pytest_configure
    pallas_np.unset_numpy_interpret()


# -- failure reports -------------------------------------------------------------
# A test failing with a pallas_np error (a KernelError naming the kernel, grid
# point and source line; an UnsupportedError; a RaceError) is reported with
# that line on top and pallas_np's own frames (the grid executor, the plan,
# the interpreter; generated plan code) hidden: pytest's default report of
# such a failure is ~240 lines, nearly all of them ours. The user's frames
# stay; ``--full-trace`` (or ``--tb=native``/``line``/``no``) gets pytest's
# own report unchanged.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PLAN_FILE_PREFIX = "<pallas_np plan"  # pallas_np.compiler.sourcemap's file names
_HIDDEN_NOTE = "(pallas_np's own frames are hidden; pytest --full-trace shows them)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  report = yield
  if report.passed or call.excinfo is None:
    return report
  err = pallas_np_error(call.excinfo.value)
  style = {"auto": "long", "long": "long", "short": "short"}.get(
      item.config.getoption("tbstyle", "auto"))
  if err is None or style is None or item.config.getoption("fulltrace", False):
    return report
  try:
    report.longrepr = _short_failure_repr(item, call.excinfo, err, style)
  except Exception:  # noqa: BLE001 - never lose a report: keep pytest's own
    pass
  return report


def pallas_np_error(exc):
  """The first pallas_np error in ``exc``'s chain (itself, then its
  ``__cause__``/``__context__``), or None. Without ``pallas_np.errors``
  imported, no pallas_np error can have been raised."""
  errors = sys.modules.get("pallas_np.errors")
  seen = set()
  while errors is not None and exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if isinstance(exc, errors.PallasNumpyError):
      return exc
    exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
  return None


def is_pallas_np_frame(entry) -> bool:
  path = str(entry.path)
  return path.startswith(_PACKAGE_DIR) or path.startswith(_PLAN_FILE_PREFIX)


def failure_headline(err) -> str:
  """The report's first lines: the error's own first line, and for a
  KernelError the kernel's source line."""
  lines = [f"pallas_np: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"]
  where = re.match(r"(.+?):(\d+)", getattr(err, "source", None) or "")
  if where is not None:
    text = linecache.getline(where.group(1), int(where.group(2))).strip()
    point = getattr(err, "program_ids", None)
    at = f" (grid point {tuple(point)})" if point is not None else ""
    lines.append(f"  kernel line{at}: {where.group(0)}:  {text}")
  lines.append(_HIDDEN_NOTE)
  return "\n".join(lines) + "\n"


def _cause_only_repeats(exc, err) -> bool:
  """Whether the failure is ``err`` itself and its chained cause adds
  nothing: raised in pallas_np's frames only (all hidden), its message
  already in ``err``'s (a KernelError's original exception)."""
  cause = getattr(err, "__cause__", None)
  if exc is not err or cause is None or str(cause) not in str(err):
    return False
  tb = cause.__traceback__
  while tb is not None:
    filename = tb.tb_frame.f_code.co_filename
    if not (filename.startswith(_PACKAGE_DIR) or filename.startswith(_PLAN_FILE_PREFIX)):
      return False
    tb = tb.tb_next
  return True


def _short_failure_repr(item, excinfo, err, style):
  """pytest's report of ``excinfo`` (as ``Node._repr_failure_py`` makes it)
  without pallas_np's frames, the headline printed first."""
  from _pytest._code.code import ReprEntryNative, Traceback

  pytest_filter = getattr(item, "_traceback_filter", None)

  def hide_ours(info):
    base = pytest_filter(info) if pytest_filter is not None else info.traceback.filter(info)
    kept = [entry for entry in base if not is_pallas_np_frame(entry)]
    if kept and style == "long":  # the last kept frame in full, as pytest shows its last
      kept[-1] = kept[-1].with_repr_style("long")
    return Traceback(kept)

  verbosity = item.config.get_verbosity()
  longrepr = excinfo.getrepr(
      funcargs=True, showlocals=item.config.getoption("showlocals", False), style=style,
      tbfilter=hide_ours, truncate_locals=verbosity <= 1,
      chain=not _cause_only_repeats(excinfo.value, err))
  first_traceback = longrepr.chain[0][0]
  first_traceback.reprentries.insert(0, ReprEntryNative([failure_headline(err)]))
  return longrepr
