"""Rule families registered on first use.

Some JAX modules are costly to import (Mosaic GPU's: about as long as
``import jax`` itself) and only kernels of their family need them. A kernel
of such a family can exist only after the user's code imported the JAX
module (``plgpu``'s primitives and types live there), so pallas_np does not
import it: it registers the family's rules the first time a rule or an
allocator is looked up and not found while that module is imported
(``load_imported``). The presence of the module is the feature detected."""
from __future__ import annotations

import sys
import threading
from typing import Callable

_pending: list[tuple[str, Callable[[], None]]] = []  # (JAX module, loader)
_lock = threading.RLock()  # kernels compile on threads too


def on_first_use(jax_module: str, load: Callable[[], None]) -> None:
  """Call ``load()`` (which registers a family's rules) once, the first time
  ``load_imported`` runs with ``jax_module`` in ``sys.modules``."""
  with _lock:
    _pending.append((jax_module, load))
  load_imported()  # already imported (user code imported plgpu first)


def load_imported() -> bool:
  """Register the pending families whose JAX module is imported; whether
  any was (a caller that missed a rule then looks again)."""
  if not _pending:
    return False
  loaded = False
  with _lock:
    for entry in list(_pending):
      if entry[0] in sys.modules and entry in _pending:
        _pending.remove(entry)
        entry[1]()
        loaded = True
  return loaded
