"""Loads past the end of a ref, as a TPU does them
(``InterpretParams(oob_reads="fill")``).

On a TPU a vector or scalar load through an out-of-range address reads
whatever VMEM/SMEM holds there; nothing faults. Kernels rely on it when they
load speculatively and discard the value: ``lax.select(valid, smem[i], 0)``
evaluates both sides, a pipeline loads one row past a scratch to look ahead,
a prologue reads the (negative) expert id of a step that does not exist.
Stores and DMAs past a ref corrupt other buffers and stay errors.

With ``oob_reads="fill"`` such a load returns the in-bounds elements and the
``uninitialized`` fill (NaN for floats, the dtype minimum for signed ints)
for the rest: a discarded value does no harm, and a used one shows up as
NaN / int min instead of plausible garbage. The default, ``"raise"``, keeps
the ``IndexError`` (whose message names this mode).
"""
from __future__ import annotations

import numpy as np

from pallas_np.memory import fill_value
from pallas_np.state import lens


def filling_reads(get, access, dyn_of, params, dtype):
  """``get(ref, *leaves)`` that, where the plain read raises ``IndexError``,
  reads the in-bounds elements and the fill elsewhere. ``dyn_of(leaves)``
  picks the access' dynamic leaves."""
  fill = fill_value(dtype, params)

  def get_or_fill(ref, *leaves):
    try:
      return get(ref, *leaves)
    except IndexError:
      got = access.unchecked_coords(ref, dyn_of(leaves))
      if got is None:  # not an indexer that went out of bounds: re-raise
        raise
      return read_filled(*got, access.result_shape, fill)
  return get_or_fill


def read_filled(view, coords, shape, fill) -> np.ndarray:
  """``view`` at per-axis ``coords`` (broadcastable to ``shape``), the
  fill where a coordinate is outside ``view``."""
  view = lens.value(view)
  in_bounds = np.True_
  safe = []
  for c, n in zip(coords, view.shape):
    ok = (c >= 0) & (c < n)
    in_bounds = in_bounds & ok
    safe.append(np.where(ok, c, 0))
  in_bounds = np.broadcast_to(in_bounds, shape)
  if not view.size:
    return np.full(shape, fill, dtype=view.dtype)
  vals = np.broadcast_to(view[tuple(safe)], shape)
  return np.where(in_bounds, vals, fill).astype(view.dtype, copy=False)
