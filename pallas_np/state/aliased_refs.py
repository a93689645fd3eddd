"""Members of a Mosaic GPU ``plgpu.RefUnion`` (the ``ExtractAliasedRef``
transform): a bitcast of the union's byte buffer at a byte offset to the
member's dtype and shape.

The union is one SMEM byte buffer; every member is a view of its bytes, so
writes through one member are seen through the others at the same bytes, as
on the GPU. pallas_np keeps SMEM in logical (row-major) order and treats
tiling/swizzling as layout only (docs/gpu.md), which is exact for a member
whose GPU layout *is* row-major. A member whose tiling or swizzle reorders
its bytes would show another member different bytes here than on the GPU,
so it is refused, as are sub-byte dtypes (NumPy has no packed 4-bit
arrays) and TMEM unions."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from pallas_np import _compat as jc
from pallas_np.errors import UnsupportedError


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
  if _bits(dtype) < 8:
    raise UnsupportedError(
        f"pallas_np: a ref union member of sub-byte dtype {dtype} ({t!r}): the GPU packs it "
        "2 (or more) per byte, which numpy mode does not model")
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
  nbytes = math.prod(t.shape) * dtype.itemsize
  if int(t.offset) + nbytes > base_shape[0]:
    raise UnsupportedError(f"pallas_np: {t!r} runs past its union's {base_shape[0]} bytes")
  return int(t.offset), nbytes, dtype, shape


def alias_view(arg):
  """fn(view, leaves) -> the member's view of the union's bytes."""
  offset, nbytes, dtype, shape = arg

  def view(buf, leaves):
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
      raise UnsupportedError("pallas_np: a ref union member of a non-contiguous buffer")
    return buf.view(np.uint8)[offset:offset + nbytes].view(dtype).reshape(shape)
  return view
