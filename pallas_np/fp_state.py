"""NumPy's floating-point error state for a kernel run: inf/NaN arithmetic
and integer wrap-around are silent, as in XLA (kernels mask with huge
negative values on purpose). A leaf: it imports nothing of pallas_np.

``np.errstate(all="ignore")`` builds the state anew on every entry (~1-2 µs
per kernel call, a good part of the per-call floor: docs/performance.md).
NumPy 2 keeps the state in a context variable; ``quiet_floats`` sets it to
the all-"ignore" form of the current state, built once per outer state (so
``np.seterrcall``/``np.setbufsize`` still apply), and falls back to
``np.errstate`` where NumPy's internals differ.
"""
from __future__ import annotations

import numpy as np

try:
  from numpy._core._ufunc_config import _extobj_contextvar as _np_errstate
  from numpy._core.umath import _make_extobj as _np_make_errstate
except ImportError:  # pragma: no cover - another NumPy: np.errstate itself
  _np_errstate = None
_quiet_state = (None, None)  # (outer state, its all-"ignore" form), last built


def quiet_floats():
  """Enter ``np.errstate(all="ignore")``; returns the token for
  ``restore_floats`` (call it in a ``finally``)."""
  if _np_errstate is None:  # pragma: no cover
    token = np.errstate(all="ignore")
    token.__enter__()
    return token
  global _quiet_state
  outer = _np_errstate.get()
  state = _quiet_state
  if state[0] is not outer:
    state = _quiet_state = (outer, _np_make_errstate(all="ignore"))
  return _np_errstate.set(state[1])


def restore_floats(token):
  """Leave the state ``quiet_floats`` entered."""
  if _np_errstate is None:  # pragma: no cover
    token.__exit__(None, None, None)
  else:
    _np_errstate.reset(token)
