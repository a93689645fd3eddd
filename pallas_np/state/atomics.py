"""Atomics (``pltriton.atomic_*`` / ``plgpu.atomic_*``) and ``atomic_cas``.

The interpreter runs one grid point at a time, so an atomic is a plain
read-modify-write that returns the old value. Integer-array indices that
repeat accumulate once per lane (``ufunc.at``), as concurrent atomics on the
GPU would; the *returned* old values of repeated lanes then all show the
state before the access (the GPU would serialize them in some order).
Masks follow ``masked.py``: masked-off lanes may point out of bounds.
"""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.state.masked import MaskedAccess, split_args

tp = jc.triton_primitives


def _combine(kind: str, dtype):
  """The ufunc that merges (old, val) for one AtomicOpType value."""
  if kind == "xchg":
    return None
  if kind == "add":
    return np.add
  if kind == "max":
    return np.maximum
  if kind == "min":
    return np.minimum
  if np.dtype(dtype).kind not in "biu":
    raise NotImplementedError(f"atomic_{kind} on {np.dtype(dtype)}")
  return {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[kind]


_PER_LANE = registry.unbatched(
    "a Triton atomic on a ref: run lane by lane (refused on a shared output)")


if tp is not None:
  @registry.register(tp.atomic_rmw_p, batch=_PER_LANE)
  def _atomic_rmw(e):
    ref_pos, transforms_pos, val_pos, mask_pos = split_args(e)
    acc = MaskedAccess(e, ref_pos, transforms_pos)
    kind = e.params["atomic_type"].value
    dtype = np.dtype(jc.physical_dtype(e.in_avals[ref_pos].dtype))
    ufunc = _combine(kind, dtype)

    def update(view, index, old, val):
      """Write op(old, val) at view[index]; ``old`` is what index reads."""
      if ufunc is None:
        view[index] = val
      elif isinstance(index, tuple) and any(isinstance(i, np.ndarray) for i in index):
        ufunc.at(view, index, val)  # repeated indices: every lane counts
      else:
        view[index] = ufunc(old, val)

    def atomic(*args):
      val = np.asarray(args[val_pos], dtype=dtype)
      mask = args[mask_pos] if mask_pos is not None else None
      hit = acc.resolve(args)
      if hit is not None and mask is None:
        view, idx = hit
        old = np.array(view[idx])
        update(view, idx, old, np.broadcast_to(val, old.shape))
        return old
      if hit is None and mask is None:
        acc.access.resolve(args[ref_pos], acc.leaves(args))  # raises IndexError
        raise AssertionError("unreachable")
      view, safe, in_bounds, mask = acc.lanes(args, mask)
      old = acc.gather(view, safe, in_bounds)
      active = mask & in_bounds
      index = tuple(np.broadcast_to(c, acc.shape)[active] for c in safe)
      update(view, index, old[active], np.broadcast_to(val, acc.shape)[active])
      return old
    return atomic

  @registry.register(tp.atomic_cas_p, batch=_PER_LANE)
  def _atomic_cas(e):
    def cas(ref, cmp, val):
      old = ref[()]  # a NumPy scalar: a copy
      if old == cmp:
        ref[()] = val
      return old
    return cas
