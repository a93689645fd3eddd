"""The source map: which eqn each line of a generated plan comes from.

A plan's "file" is a made-up name (``<pallas_np plan 12: kernel>``); its
entry here maps each line to its eqn (line 1 is the ``def``), so an
exception can name the primitive and the kernel's source line without any
bookkeeping on the hot path, and its generated source sits in ``linecache``
for tracebacks, pdb and py-spy.

Lifecycle: ``register`` returns the entry's ``LineEqns`` and the map only
holds it weakly. Whoever can run the plan's lines holds it: the Plan, the
generated function's globals and the line runner's (so a frame on a
traceback keeps the entry of the code it runs). When the last of them is
collected (the plan was evicted from its caches) the entry and its
``linecache`` source go with it. ``clear()`` (``pallas_np.clear_caches()``)
drops every entry at once; a plan still alive after that runs as before,
but its errors no longer name the failing eqn.
"""
from __future__ import annotations

import itertools
import linecache
import threading
import weakref

_entries: dict[str, weakref.ref] = {}  # filename -> weakref to its LineEqns
_counter = itertools.count()
_lock = threading.Lock()


class LineEqns(list):
  """The eqn of each line of one generated plan (None: no eqn), by line
  number minus one; the owner of its source map entry."""
  __slots__ = ("__weakref__",)


def new_filename(name: str) -> str:
  """A fresh file name for a plan of kernel ``name``."""
  with _lock:
    return f"<pallas_np plan {next(_counter)}: {name}>"


def register(filename: str, line_eqns) -> LineEqns:
  """Enter a plan's line eqns; the entry lives as long as the returned
  LineEqns (keep it where the plan's code runs)."""
  lines = LineEqns(line_eqns)
  _entries[filename] = weakref.ref(lines, lambda _, f=filename: forget(f))
  return lines


def show(filename: str, source: str) -> None:
  """Make a registered plan's generated source visible to tracebacks, pdb
  and py-spy (until its entry is forgotten)."""
  if filename in _entries:
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)


def lookup(filename: str):
  """The line eqns of a plan's file, or None (not a plan, or forgotten)."""
  ref = _entries.get(filename)
  return None if ref is None else ref()


def forget(filename: str) -> None:
  """Drop one plan's entry and its source."""
  _entries.pop(filename, None)
  linecache.cache.pop(filename, None)


def clear() -> None:
  """Drop every entry (``pallas_np.clear_caches()``)."""
  for filename in list(_entries):
    forget(filename)


def size() -> int:
  """Entries held now."""
  return len(_entries)
