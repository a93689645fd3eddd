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


# -- DMAs into the tile padding past an array's end (buffer_bounds="padded") ---------------
# A TPU stores an array of HBM/VMEM in (sublane, 128)-lane tiles, so its
# buffer reaches to the next tile boundary: a DMA window that runs past the
# logical end but stays inside that padding is legal (emit_pipeline rounds a
# ragged last block up to the tiling; tokamax gmm_v2 with n=500 and 512-wide
# blocks). TPU interpret mode's ``buffer_bounds="padded"`` models it: the
# buffer's padded shape bounds the access, reads there give the uninitialized
# value, writes there are dropped. Its default, "logical", raises, as we do.

def padded_shape(shape, dtype) -> tuple:
  """The shape TPU interpret mode pads a buffer to (``_get_padded_shape``:
  ``tpu_info.infer_tiling``'s compact tiling, rounded up): the last dim to
  128 lanes, the second-minor to a sublane tiling grown from the dtype's
  packing up to 8; a 1-D array to packing x 128 (x 2 before v4)."""
  shape = tuple(int(d) for d in shape)
  itemsize = np.dtype(dtype).itemsize
  if not shape or itemsize > 4:
    return shape
  packing = 8 if np.dtype(dtype).name == "int4" else 4 // itemsize
  base = (1 + int(_generation() < 4)) * packing
  if len(shape) == 1:
    tiles = (base * 128,)
  else:
    sub = base
    while sub < min(shape[-2], 8):
      sub *= 2
    tiles = (1,) * (len(shape) - 2) + (sub, 128)
  return tuple(-(-d // t) * t for d, t in zip(shape, tiles))


def _generation() -> int:
  try:
    from jax.experimental.pallas import tpu as pltpu
    return int(pltpu.get_tpu_info().generation)
  except Exception:  # noqa: BLE001 (no chip known: every current one is v4+)
    return 4


def padded_dma_operand(resolve, access, dtype, params):
  """``resolve(ref, dyn) -> (view, idx)`` of a DMA operand where a window
  past the logical end of the ref but inside its padded shape becomes a
  ``PaddedWindow`` (with ``params.buffer_bounds == "padded"``) or raises
  an ``IndexError`` that says so (the default)."""
  padded = params.buffer_bounds == "padded"
  fill = fill_value(dtype, params)

  def resolve_padded(ref, dyn):
    try:
      return resolve(ref, dyn)
    except IndexError as err:
      got = access.unchecked_coords(ref, dyn)
      if got is None or got[0] is not ref:  # (earlier views: their own layout)
        raise
      view, coords = got
      limit = padded_shape(view.shape, view.dtype)
      if not all(int(np.min(c)) >= 0 and int(np.max(c)) < n for c, n in zip(coords, limit)
                 if np.size(c)):
        raise
      if not padded:
        raise IndexError(
            f"{err} The window stays inside the TPU tile padding of the buffer (padded "
            f"shape {limit}): the hardware accepts such a DMA; "
            "InterpretParams(buffer_bounds='padded') reads the uninitialized fill there "
            "and drops writes there, as TPU interpret mode's buffer_bounds='padded'.") from None
      shape = np.broadcast_shapes(*(np.shape(c) for c in coords))  # (a traced size's too)
      return PaddedWindow(view, coords, shape, fill), Ellipsis
  return resolve_padded


class PaddedWindow:
  """A DMA window over ``view`` at per-axis ``coords`` (slices and ints
  only, so the in-bounds part is a box) that runs into the tile padding:
  read whole (the fill past the end), written only where it is in bounds."""
  __slots__ = ("view", "coords", "shape", "fill", "dtype")

  def __init__(self, view, coords, shape, fill):
    self.view, self.coords, self.shape, self.fill = view, coords, shape, fill
    self.dtype = view.dtype

  def __getitem__(self, idx):
    assert idx is Ellipsis
    return read_filled(self.view, self.coords, self.shape, self.fill)

  def __setitem__(self, idx, data):
    assert idx is Ellipsis
    data = np.broadcast_to(np.asarray(data, self.dtype), self.shape)
    view_idx, keep = [], [None] * len(self.shape)
    for c, n in zip(self.coords, self.view.shape):
      c = np.asarray(c)
      ok = (c >= 0) & (c < n)
      if c.size == 1 or c.ndim == 0:  # an int index: no axis of its own
        if not ok.all():
          return  # the whole window is past the end on this axis
        view_idx.append(np.reshape(c, (1,)))
        continue
      if sum(d > 1 for d in c.shape) != 1:
        raise IndexError("a DMA window into the tile padding whose index varies along "
                         "several axes")
      axis = int(np.argmax(c.shape))  # a slice: varies along one result axis
      flat, ok = c.reshape(-1), ok.reshape(-1)
      keep[axis] = np.flatnonzero(ok)
      view_idx.append(flat[ok])
    if any(len(v) == 0 for v in view_idx):
      return
    inside = data[np.ix_(*[k if k is not None else np.arange(s)
                           for k, s in zip(keep, self.shape)])]
    self.view[np.ix_(*view_idx)] = inside.reshape([len(v) for v in view_idx])
