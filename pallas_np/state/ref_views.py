"""Views of a ref under its layout transforms (bitcast, reshape, transpose,
zero-stride broadcast): each builder returns ``f(view, leaves)``, composed by
``indexing.RefAccess`` after the indexers. A view NumPy cannot express (a
width-changing bitcast, a reshape of a non-contiguous view) becomes a
``lens.LensView``, read and written through its parent."""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np.dtypes import bit_width
from pallas_np.errors import UnsupportedError
from pallas_np.state import lens


def bitcast_shape(shape, from_dtype, to_dtype):
  if from_dtype is None:
    return shape
  src, dst = np.dtype(jc.physical_dtype(from_dtype)), np.dtype(to_dtype)
  if bit_width(src) != bit_width(dst) and min(bit_width(src), bit_width(dst)) < 8:
    raise UnsupportedError(  # NumPy arrays cannot hold packed sub-byte elements
        f"pallas_np: ref bitcast {src.name} -> {dst.name} (a sub-byte type of another "
        "width) is not supported")
  a, b = src.itemsize, dst.itemsize
  if a == b or not shape:
    return shape
  # Pallas/TPU convention: the second-minor dimension absorbs the width change.
  if len(shape) >= 2:
    return (*shape[:-2], shape[-2] * a // b, shape[-1])
  return (shape[0] * a // b,)


def bitcast_view(dtype):
  """Same width, or a 1-D ref: a NumPy view. A width change packs along the
  second-minor dim (``lens.tpu_bitcast``), which no strided view can do."""
  def f(view, leaves):
    if isinstance(view, lens.LensView) or (
        view.dtype.itemsize != dtype.itemsize and view.ndim >= 2):
      return lens.bitcast(view, dtype)
    return view.view(dtype)
  return f


def broadcast_view(shape):
  """A zero-stride slice: the one row broadcast, a read-only view (a store
  through it raises NumPy's "assignment destination is read-only")."""
  def f(view, leaves):
    return np.broadcast_to(lens.value(view), shape)
  return f


def reshape_view(shape):
  def f(view, leaves):
    if isinstance(view, lens.LensView):
      return lens.reshaped(view, shape)
    try:
      return np.reshape(view, shape, copy=False)
    except ValueError:  # a non-contiguous view: read and written through a copy
      return lens.reshaped(view, shape)
  return f


def transpose_view(perm):
  def f(view, leaves):
    if isinstance(view, lens.LensView):
      return lens.transposed(view, perm)
    return view.transpose(perm)
  return f

