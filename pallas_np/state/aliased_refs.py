"""Members of a Mosaic GPU ``plgpu.RefUnion`` (the ``ExtractAliasedRef``
transform): a bitcast of the union's byte buffer at a byte offset to the
member's dtype and shape.

The union is one SMEM byte buffer; every member is a view of its bytes, so
writes through one member are seen through the others at the same bytes, as
on the GPU. pallas_np keeps SMEM in logical (row-major) order and treats
tiling/swizzling as layout only (docs/gpu.md), which is exact for a member
whose GPU layout *is* row-major. A member whose tiling or swizzle reorders
its bytes would show another member different bytes here than on the GPU,
so it is refused, as are TMEM unions. A member of a sub-byte dtype (int4,
uint4, float4, ...: NumPy keeps one per byte) is packed as on the GPU, 8 //
bits elements a byte, the first in the low bits: its view is a
``lens.LensView`` that unpacks the union's bytes when read and packs them
when written."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from pallas_np import _compat as jc
from pallas_np.dtypes import bit_width
from pallas_np.errors import UnsupportedError
from pallas_np.state import lens


def is_alias(t) -> bool:
  return type(t).__name__ == "ExtractAliasedRef" and hasattr(t, "alias_group_idx")


def _bits(dtype) -> int:
  dtype = np.dtype(dtype)
  if dtype.kind == "b":
    return 8
  if jnp.issubdtype(dtype, jnp.integer):
    return int(jnp.iinfo(dtype).bits)
  if jnp.issubdtype(dtype, jnp.floating):
    return int(jnp.finfo(dtype).bits)
  return dtype.itemsize * 8


def _row_major(t, shape, dtype) -> bool:
  """Does the layout transform ``t`` keep row-major byte order on ``shape``
  (its logical shape after ``t``)? Swizzles never do; a tiling does when
  every tiled dim but the first is tiled whole."""
  tiling = getattr(t, "tiling", None)
  if tiling is None:
    return False  # a swizzle
  tiled = shape[len(shape) - len(tiling):]
  return all(tile == n for tile, n in zip(tiling[1:], tiled[1:]))


def alias_step(t, later, base_shape, base_dtype):
  """The view arguments for ``t`` (``later``: the transforms after it).
  The view has the member's logical shape (its layout transforms, next in
  ``later``, change no view here)."""
  if getattr(t, "layout", None) is not None:
    raise UnsupportedError(f"pallas_np: a TMEM ref union member ({t!r}) is not supported")
  dtype = np.dtype(t.dtype)
  bits = _bits(dtype)
  if bits < 8 and 8 % bits:
    raise UnsupportedError(f"pallas_np: a ref union member of {bits}-bit dtype {dtype} ({t!r})")
  if len(base_shape) != 1 or np.dtype(base_dtype).itemsize != 1:
    raise UnsupportedError(f"pallas_np: {t!r} of a ref that is not a byte buffer")
  shape = tuple(t.shape)
  for u in later:
    if not jc.is_layout_only_transform(u):
      break
    after = jc.logical_shape(shape, dtype, (u,))
    if not _row_major(u, after, dtype):
      raise UnsupportedError(
          f"pallas_np: a ref union member with layout transform {u!r}: the GPU lays its "
          "bytes out tiled/swizzled, so other members of the union see them in that "
          "order, which numpy mode (logical row-major SMEM) does not model; give the "
          "members untiled layouts (or tilings that span whole rows)")
    shape = after
  nbytes = math.prod(t.shape) * dtype.itemsize if bits >= 8 else \
      -(-math.prod(t.shape) * bits // 8)
  if int(t.offset) + nbytes > base_shape[0]:
    raise UnsupportedError(f"pallas_np: {t!r} runs past its union's {base_shape[0]} bytes")
  return int(t.offset), nbytes, dtype, shape


def alias_view(arg):
  """fn(view, leaves) -> the member's view of the union's bytes."""
  offset, nbytes, dtype, shape = arg

  def view(buf, leaves):
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
      raise UnsupportedError("pallas_np: a ref union member of a non-contiguous buffer")
    raw = buf.view(np.uint8)[offset:offset + nbytes]
    if bit_width(dtype) < 8:
      return packed_view(raw, dtype, shape)
    return raw.view(dtype).reshape(shape)
  return view


def packed_view(raw: np.ndarray, dtype, shape) -> lens.LensView:
  """The sub-byte ``dtype`` elements packed in the bytes ``raw`` (8 // bits
  a byte, the first in the low bits), as a lens of ``shape``."""
  dtype = np.dtype(dtype)
  bits = bit_width(dtype)
  per = 8 // bits
  mask = (1 << bits) - 1
  shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
  n = math.prod(shape)
  signed = dtype.kind == "i" or (dtype.kind == "V" and dtype.name.startswith("int"))

  def get(parent):
    codes = ((parent[:, None] >> shifts) & mask).reshape(-1)[:n]
    if signed:  # sign-extend the field into the byte ml_dtypes holds
      sign = 1 << (bits - 1)
      codes = ((codes.astype(np.int16) ^ sign) - sign).astype(np.int8).view(np.uint8)
    return codes.view(dtype).reshape(shape)

  def put(parent, new):
    codes = np.asarray(new, dtype).reshape(-1).view(np.uint8) & mask
    codes = np.concatenate([codes, np.zeros((-n) % per, np.uint8)]).reshape(-1, per)
    parent[...] = np.bitwise_or.reduce(codes << shifts, axis=1).astype(np.uint8)

  return lens.LensView(raw, get, put, dtype, tuple(shape))
