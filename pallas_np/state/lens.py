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
  __slots__ = ("parent", "get", "put", "dtype")

  def __init__(self, parent, get, put, dtype):
    self.parent, self.get, self.put, self.dtype = parent, get, put, np.dtype(dtype)

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
    return self.value().shape

  @property
  def ndim(self):
    return len(self.shape)

  @property
  def size(self):
    return int(np.prod(self.shape, dtype=np.int64))


def bitcast(parent, dtype) -> LensView:
  src = parent.dtype

  def put(p, new):
    p[...] = tpu_bitcast(new, src)
  return LensView(parent, lambda a: tpu_bitcast(a, dtype), put, dtype)


def indexed(parent, idx) -> LensView:
  def put(p, new):
    p[idx] = new
  return LensView(parent, lambda a: a[idx], put, parent.dtype)


def reshaped(parent, shape) -> LensView:
  def put(p, new):
    p[...] = new.reshape(p.shape)
  return LensView(parent, lambda a: np.reshape(a, shape), put, parent.dtype)


def transposed(parent, perm) -> LensView:
  inverse = tuple(int(i) for i in np.argsort(perm))

  def put(p, new):
    p[...] = new.transpose(inverse)
  return LensView(parent, lambda a: a.transpose(perm), put, parent.dtype)
