"""Automatic garbage collection paused while a kernel's first call builds
its plans (docs/performance.md, "First calls").

A first call allocates hundreds of thousands of objects that all survive
(the traced jaxpr, the generated plans, their caches): to the collector
they look like a growing old generation, so generation-1 and often full
(generation-2) collections land inside the call, 60-130 ms of scanning on
big kernels, none of which frees anything. ``first_call()`` turns the
automatic collector off for the duration of such a build (the eager
entry's trace and plan, a kernel plan, the first run) and back on when the
outermost one ends, in any thread. Nothing persists: the collector's
state and thresholds are what they were, and the objects allocated
meanwhile are collected as usual afterwards (one young-generation pass,
not several full ones). A collector the user disabled stays disabled.
``PALLAS_NP_GC_PAUSE=0`` turns the pause off. A leaf module.
"""
from __future__ import annotations

import contextlib
import gc
import threading

from pallas_np.env_switches import env_switch

ENV = "PALLAS_NP_GC_PAUSE"
_lock = threading.Lock()
_depth = [0]  # first-call builds in progress, all threads
_resume = [False]  # whether the outermost one turned the collector off


@contextlib.contextmanager
def first_call():
  """The automatic collector off while the block runs (see the module doc)."""
  if not env_switch("PALLAS_NP_GC_PAUSE", True):
    yield
    return
  with _lock:
    if _depth[0] == 0:
      _resume[0] = gc.isenabled()
      gc.disable()
    _depth[0] += 1
  try:
    yield
  finally:
    with _lock:
      _depth[0] -= 1
      if _depth[0] == 0 and _resume[0]:
        _resume[0] = False
        gc.enable()
