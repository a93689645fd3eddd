"""Bounds checks of ref indices: the checked (or clamped) index of one
dimension, and the ``IndexError`` that says what the hardware and
``interpret=True`` would do instead (see ``pallas_np.state.indexing``)."""
from __future__ import annotations

import numpy as np


def wrapped(i, dim):
  """What interpret=True does with a dynamic index: XLA's dynamic_slice and
  jnp gathers add the axis size to a negative index once."""
  return i + dim if i < 0 else i


def oob_error(what, value, dim, axis, shape, jax_index=None):
  if jax_index is None:
    jax_does = "interpret=True would silently clamp it"
  else:
    jax_does = (f"interpret=True would silently use {jax_index} instead (it adds the axis "
                "size to a negative index, then clamps)")
  negative = "-" in str(value).split(":")[0]
  return IndexError(
      f"out-of-bounds ref access: {what} {value} on axis {axis} of a ref of shape "
      f"{tuple(shape)} (axis size {dim})"
      + (". pallas_np does not wrap dynamic negative indices or negative pl.ds starts "
         "around (on a TPU/GPU they address memory before the ref; a static negative "
         "integer index such as x_ref[-1] counts from the end, as in NumPy)"
         if negative else "")
      + f". {jax_does}; pass InterpretParams(bounds_check='clamp') to do the same."
      + LOAD_HINT)


# Appended to every out-of-bounds message (the check does not know whether
# the access is a load): what the hardware does with a load past a ref.
LOAD_HINT = (
    " If this is a load whose value the kernel discards (lax.select / jnp.where "
    "evaluate both sides, look-ahead loads): a TPU reads whatever memory follows the "
    "ref, harmlessly; InterpretParams(oob_reads='fill') runs such kernels, reading the "
    "uninitialized fill (NaN, int min) there, while stores and DMAs still raise.")


def check_int(i, dim, axis, shape, clamp):
  i = int(i)
  if 0 <= i < dim:
    return i
  jax_i = min(max(wrapped(i, dim), 0), dim - 1)
  if clamp:
    return jax_i
  raise oob_error("index", i, dim, axis, shape, jax_i if i < 0 else None)


def check_slice(start, size, stride, dim, axis, shape, clamp):
  start = int(start)
  size = int(size)
  if size < 0 or (size - 1) * stride + 1 > dim:  # only a traced size can be
    fits = (dim - 1) // stride + 1 if dim else 0
    if not clamp:
      raise IndexError(
          f"out-of-bounds ref access: slice pl.ds(start={start}, size={size}"
          + (f", stride={stride}" if stride != 1 else "") + f") on axis {axis} of a "
          f"ref of shape {tuple(shape)}: its dynamic size is "
          + ("negative" if size < 0 else f"larger than the axis ({dim})")
          + f". bounds_check='clamp' clamps the size to [0, {fits}] (and then the "
          "start, as lax.dynamic_slice does); TPU interpret mode raises." + LOAD_HINT)
    size = min(max(size, 0), fits)
  extent = (size - 1) * stride + 1 if size > 0 else 0
  if start < 0 or start + extent > dim:
    jax_start = min(max(wrapped(start, dim), 0), max(dim - extent, 0))
    if clamp:
      start = jax_start
    else:
      raise oob_error(f"slice pl.ds(start={start}, size={size}"
                 + (f", stride={stride}" if stride != 1 else "") + ")",
                 f"[{start}:{start + extent}]", dim, axis, shape,
                 f"start {jax_start}" if start < 0 else None)
  if size == 0:
    return slice(start, start)
  return slice(start, start + extent, stride)


_UNSIGNED = {np.dtype(t): np.dtype(u) for t, u in
             ((np.int8, np.uint8), (np.int16, np.uint16), (np.int32, np.uint32),
              (np.int64, np.uint64))}


def check_array(a, dim, axis, shape, clamp):
  a = np.asarray(a)
  if a.size:
    # One reduction, not two: seen unsigned, a negative index is huge.
    unsigned = _UNSIGNED.get(a.dtype)
    if unsigned is not None and int(a.view(unsigned).max()) < dim:
      return a
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= dim:
      if clamp:
        return np.clip(np.where(a < 0, a + dim, a), 0, dim - 1)
      bad = lo if lo < 0 else hi
      raise oob_error("array index", bad, dim, axis, shape,
                 min(max(wrapped(bad, dim), 0), dim - 1) if bad < 0 else None)
  return a
