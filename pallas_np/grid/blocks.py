"""How each operand's blocks are cut out of its array: block shapes,
padding of operands whose shape is not a multiple of the block, and the
NumPy index of the block an index map names (``BlockGeometry``).
"""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np.compiler import plan_filename
from pallas_np.errors import UnsupportedError
from pallas_np.memory import allocate


MEMO_MAX = 4096  # block indices a geometry remembers (``index_of``)


class BlockGeometry:
  """How one operand's blocks are cut out of its (padded) array."""
  __slots__ = ("origin", "array_shape", "dtype", "kinds", "sizes", "pad_low",
               "padded_shape", "needs_padding", "whole", "trivial_index_map", "_zero_index",
               "window_layouts", "_memo")

  def __init__(self, bm):
    # Mosaic GPU tiling/swizzling is layout only: blocks stay logical and the
    # kernel's accesses undo the transforms as no-ops (state/indexing.py).
    if bm.transforms and not all(jc.is_layout_only_transform(t) for t in bm.transforms):
      raise UnsupportedError(
          f"pallas_np: block transforms {bm.transforms} on {bm.origin} are not supported")
    self.origin = bm.origin
    self.array_shape = tuple(bm.array_aval.shape)
    self.dtype = bm.array_aval.dtype
    kinds, sizes, pad_low, pad_high = [], [], [], []
    for dim in bm.block_shape:
      if isinstance(dim, jc.Squeezed):
        kinds.append("squeezed"); sizes.append(1); pad_low.append(0); pad_high.append(0)
      elif isinstance(dim, jc.Blocked):
        kinds.append("blocked"); sizes.append(int(dim.block_size))
        pad_low.append(0); pad_high.append(0)
      elif isinstance(dim, jc.Element):
        kinds.append("element"); sizes.append(int(dim.block_size))
        pad_low.append(int(dim.padding[0])); pad_high.append(int(dim.padding[1]))
      else:
        raise UnsupportedError(
            f"pallas_np: block dimension {dim!r} of {bm.origin} is not supported "
            "by the NumPy interpreter")
    self.kinds = tuple(kinds)
    self.sizes = tuple(sizes)
    self.pad_low = tuple(pad_low)
    padded = []
    for n, b, lo, hi in zip(self.array_shape, sizes, pad_low, pad_high):
      n = n + lo + hi
      padded.append(-(-n // b) * b if b else n)
    self.padded_shape = tuple(padded)
    self.needs_padding = self.padded_shape != self.array_shape
    self.whole = (not self.needs_padding and all(k == "blocked" for k in kinds)
                  and self.sizes == self.array_shape)
    outs = bm.index_map_jaxpr.jaxpr.outvars
    self.trivial_index_map = all(
        isinstance(a, jc.Literal) and int(a.val) == 0 for a in outs)
    self._zero_index = {}  # clamp -> block_index of block (0, ...): cut every call
    # (buffer shape, strides) -> (shape, strides) of its block windows
    # (pallas_np.grid.slab_runner.block_windows, cut every vectorized call)
    self.window_layouts = {}
    self._memo = {}  # (block indices, clamp) -> block_index: ``index_of``

  def pad(self, arr: np.ndarray, params) -> np.ndarray:
    """A padded copy, garbage where the array has no data."""
    buf = allocate(self.padded_shape, arr.dtype, params)
    buf[self.unpadded_index()] = arr
    return buf

  def unpadded_index(self):
    return tuple(slice(lo, lo + n) for lo, n in zip(self.pad_low, self.array_shape))

  def zero_block_index(self, clamp: bool):
    """``block_index`` of the first block, computed once (an error, e.g. a
    block bigger than its padded array, raises every time)."""
    idx = self._zero_index.get(clamp)
    if idx is None:
      idx = self._zero_index[clamp] = self.block_index((0,) * len(self.sizes), clamp)
    return idx

  def index_of(self, block_indices, clamp: bool):
    """``block_index``, remembered per block indices (at most ``MEMO_MAX``):
    a grid loop whose index maps read scalar prefetch (no precomputed
    schedule) cuts the same few blocks at every run. An index that raises
    is not remembered: it raises every time."""
    key = (block_indices, clamp)
    try:
      idx = self._memo.get(key)
    except TypeError:  # (an unhashable index: computed every time)
      return self.block_index(block_indices, clamp)
    if idx is None:
      idx = self.block_index(block_indices, clamp)
      if len(self._memo) < MEMO_MAX:
        self._memo[key] = idx
    return idx

  def block_index(self, block_indices, clamp: bool):
    """NumPy basic index of the block at ``block_indices`` (a view)."""
    idx = []
    for d, (kind, b, i) in enumerate(zip(self.kinds, self.sizes, block_indices)):
      i = int(i)
      start = i * b if kind == "blocked" else i
      limit = self.padded_shape[d]
      if start < 0 or start + b > limit:
        if clamp:
          start = min(max(start, 0), limit - b)
        else:
          raise IndexError(
              f"block index {tuple(int(x) for x in block_indices)} of {self.origin} "
              f"is out of bounds: dimension {d} starts at {start} with block size "
              f"{b}, but the array dimension is {self.array_shape[d]}"
              + (f" (padded to {limit})" if limit != self.array_shape[d] else "")
              + ". interpret=True would silently clamp it; pass "
              "InterpretParams(bounds_check='clamp') to do the same.")
      idx.append(start if kind == "squeezed" else slice(start, start + b))
    # The Ellipsis keeps a block whose dims are all squeezed a 0-d *view*
    # (a[1, 2] would be a scalar copy and writes to it would be lost).
    return (*idx, Ellipsis)


def index_map_origin(plan, tb):
  """The operand whose index map (or block slicing) raised, or None."""
  by_file = {m.filename: geo.origin for m, geo in zip(plan.index_maps, plan.blocks)}
  while tb is not None:
    frame = tb.tb_frame
    code = frame.f_code
    origin = by_file.get(plan_filename(frame))
    if origin is not None:
      return origin
    if code is BlockGeometry.block_index.__code__:
      geo = frame.f_locals.get("self")
      return getattr(geo, "origin", None)
    tb = tb.tb_next
  return None
