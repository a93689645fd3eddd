"""Ref views NumPy cannot express as strided views, read and written through
a copy.

A width-changing TPU ref bitcast (``ref.bitcast(jnp.int8)`` of an int32 ref)
packs along the second-minor dim, as Mosaic's ``memref_bitcast`` and JAX's
``state.utils.bitcast`` (the interpret=True discharge) do: a (16, 128) int32
ref seen as int8 is (64, 128), with row ``4*m + j`` holding byte ``j``
(little-endian) of row ``m``. That is a permutation of the bytes, not a strided
view, so such a ref (and any index, reshape or transpose of it, and a reshape
of a non-contiguous view) is a ``LensView``: ``lens[idx]`` reads a fresh copy,
``lens[idx] = v`` (and ``+=``) writes the whole view back through its parent.
Every element of the parent maps to exactly one element of the view, so the
write-back loses nothing.

A bitcast only mixes rows along the second-minor dim, in groups (``r``
view rows per parent row when narrowing, ``r`` parent rows per view row
when widening), so indexing one with ints and slices goes through the
parent: only the rows groups the index touches are converted
(``BitcastLens``), not the whole ref. A DMA of a few rows through the
bitcast of a large HBM ref (DeepSeek-V4 ``csa_gather``) then costs what
the rows cost.
"""
from __future__ import annotations

import numpy as np


def tpu_bitcast(x: np.ndarray, dtype) -> np.ndarray:
  """``x`` bitcast to ``dtype`` the TPU way (a copy when the width changes):
  the second-minor dim absorbs the width change."""
  dtype = np.dtype(dtype)
  a, b = x.dtype.itemsize, dtype.itemsize
  if a == b or x.ndim < 2:
    return np.ascontiguousarray(x).view(dtype)
  *lead, m, n = x.shape
  if a > b:  # narrowing: each element's bytes go to r consecutive rows
    r = a // b
    y = np.ascontiguousarray(x).view(dtype).reshape(*lead, m, n, r)
    return np.swapaxes(y, -1, -2).reshape(*lead, m * r, n)
  r = b // a  # widening: r consecutive rows make one
  if m % r:
    raise ValueError(f"cannot bitcast a {x.dtype} ref of shape {x.shape} to {dtype}: "
                     f"its second-minor dim {m} is not a multiple of {r}")
  y = np.swapaxes(x.reshape(*lead, m // r, r, n), -1, -2)
  return np.ascontiguousarray(y).view(dtype).reshape(*lead, m // r, n)


def value(v) -> np.ndarray:
  return v.value() if isinstance(v, LensView) else v


class LensView:
  """A view computed from ``parent`` by ``get``; ``put(parent, new)`` writes
  a whole new value back."""
  __slots__ = ("parent", "get", "put", "dtype", "_shape")

  def __init__(self, parent, get, put, dtype, shape=None):
    self.parent, self.get, self.put, self.dtype = parent, get, put, np.dtype(dtype)
    self._shape = shape

  def value(self) -> np.ndarray:
    return self.get(value(self.parent))

  def __getitem__(self, idx):
    out = self.value()[idx]
    return out.copy() if isinstance(out, np.ndarray) else out

  def __setitem__(self, idx, val):
    new = self.value()
    new[idx] = val
    self.put(self.parent, new)

  def __array__(self, dtype=None, copy=None):
    v = self.value()
    return v if dtype is None else v.astype(dtype)

  @property
  def shape(self):
    if self._shape is None:
      self._shape = self.value().shape
    return self._shape

  @property
  def ndim(self):
    return len(self.shape)

  @property
  def size(self):
    return int(np.prod(self.shape, dtype=np.int64))


def bitcast_shape(shape, src, dst) -> tuple:
  a, b = np.dtype(src).itemsize, np.dtype(dst).itemsize
  *lead, m, n = shape
  return (*lead, m * a // b, n)


class BitcastLens(LensView):
  """A width-changing bitcast of a ref of rank >= 2, indexed through its
  parent: ``lens[idx]`` converts only the row groups ``idx`` touches."""
  __slots__ = ()

  def _window(self, idx):
    """(parent index, index into the converted window) for an index of
    ints, slices of positive step and at most one 1-D integer array; None
    for anything else."""
    shape = self.shape
    nd = len(shape)
    if not isinstance(idx, tuple):
      idx = (idx,)
    if any(i is Ellipsis for i in idx):
      k = idx.index(Ellipsis)
      idx = idx[:k] + (slice(None),) * (nd - len(idx) + 1) + idx[k + 1:]
    idx = idx + (slice(None),) * (nd - len(idx))
    if len(idx) != nd:
      return None
    a, b = self.parent.dtype.itemsize, self.dtype.itemsize
    parent_idx, local = [], []
    arrays = 0
    for axis, (ix, n) in enumerate(zip(idx, shape)):
      if isinstance(ix, np.ndarray) and ix.ndim == 1 and ix.dtype.kind in "iu":
        # One 1-D integer array (an indexed DMA's rows): off the second-minor
        # dim the parent's rows, gathered in place, then all of them; on it
        # the row groups holding the rows (``_gathered_groups``).
        arrays += 1
        if arrays > 1:
          return None
        if axis != nd - 2:
          parent_idx.append(ix)
          local.append(slice(None))
          continue
        groups = _gathered_groups(ix, n, a, b)
        if groups is None:
          return None
        parent_idx.append(groups[0])
        local.append(groups[1])
        continue
      if isinstance(ix, (int, np.integer)):
        i = int(ix) + (n if ix < 0 else 0)
        if not 0 <= i < n:
          return None
        ix = slice(i, i + 1)
        keep = 0
      elif isinstance(ix, slice):
        keep = None
      else:
        return None
      start, stop, step = ix.indices(n)
      if step < 1:
        return None
      if axis != nd - 2:
        parent_idx.append(slice(start, stop, step))
        local.append(slice(None) if keep is None else keep)
        continue
      if stop <= start:  # an empty window
        lo = hi = 0
        plo = phi = 0
      elif a > b:  # narrowing: r view rows per parent row
        r = a // b
        plo, phi = start // r, -(-stop // r)
        lo = plo * r
      else:  # widening: r parent rows per view row
        r = b // a
        plo, phi = start * r, stop * r
        lo = start
      parent_idx.append(slice(plo, phi))
      local.append(slice(start - lo, stop - lo, step) if keep is None else start - lo)
    return tuple(parent_idx), tuple(local)

  def __getitem__(self, idx):
    w = self._window(idx)
    if w is None:
      return LensView.__getitem__(self, idx)
    parent_idx, local = w
    out = tpu_bitcast(np.asarray(self.parent[parent_idx]), self.dtype)[local]
    return out.copy() if isinstance(out, np.ndarray) else out

  def __setitem__(self, idx, val):
    w = self._window(idx)
    if w is None:
      return LensView.__setitem__(self, idx, val)
    parent_idx, local = w
    src = self.parent.dtype
    window = tpu_bitcast(np.asarray(self.parent[parent_idx]), self.dtype)
    window[local] = val
    self.parent[parent_idx] = tpu_bitcast(window, src)


def _gathered_groups(rows, n, a, b):
  """(parent rows, rows of their converted window) for gathering view rows
  ``rows`` of a bitcast from itemsize ``a`` to ``b`` along the second-minor
  dim (``n`` view rows). Each parent row group is taken once, so a write of
  two view rows of one group lands in one converted copy; None when a row
  is out of range (the whole-value path raises the usual error)."""
  if rows.size and (rows.min() < 0 or rows.max() >= n):
    return None
  if a > b:  # narrowing: view row v is byte v % r of parent row v // r
    r = a // b
    parents, which = np.unique(rows // r, return_inverse=True)
    return parents, which.reshape(-1) * r + rows % r
  r = b // a  # widening: view row v is parent rows r*v .. r*v + r-1
  groups, which = np.unique(rows, return_inverse=True)
  return (groups[:, None] * r + np.arange(r)).reshape(-1), which.reshape(-1)


def bitcast(parent, dtype) -> LensView:
  src = parent.dtype

  def put(p, new):
    p[...] = tpu_bitcast(new, src)
  if len(parent.shape) < 2:  # (a 1-D lens: the whole value, bitcast as a view)
    return LensView(parent, lambda a: tpu_bitcast(a, dtype), put, dtype)
  return BitcastLens(parent, lambda a: tpu_bitcast(a, dtype), put, dtype,
                     bitcast_shape(parent.shape, src, dtype))


def indexed(parent, idx) -> LensView:
  """``parent[idx]``; through a ``BitcastLens`` only the indexed rows are
  converted (reads and writes go through ``parent[idx]``)."""
  def put(p, new):
    p[idx] = new
  shape = np.broadcast_to(np.empty((), bool), parent.shape)[idx].shape
  if isinstance(parent, BitcastLens):
    return _Through(parent, idx, put, parent.dtype, shape)
  return LensView(parent, lambda a: a[idx], put, parent.dtype, shape)


class _Through(LensView):
  """``parent[idx]`` of a lens that indexes through its own parent: its
  value is ``parent[idx]``, computed without the parent's whole value."""
  __slots__ = ("idx",)

  def __init__(self, parent, idx, put, dtype, shape):
    LensView.__init__(self, parent, None, put, dtype, shape)
    self.idx = idx

  def value(self) -> np.ndarray:
    return self.parent[self.idx]


def reshaped(parent, shape) -> LensView:
  def put(p, new):
    p[...] = new.reshape(p.shape)
  return LensView(parent, lambda a: np.reshape(a, shape), put, parent.dtype)


def transposed(parent, perm) -> LensView:
  inverse = tuple(int(i) for i in np.argsort(perm))

  def put(p, new):
    p[...] = new.transpose(inverse)
  return LensView(parent, lambda a: a.transpose(perm), put, parent.dtype)
