"""XLA gather and scatter, in every form jnp indexing produces.

Both are turned into one NumPy advanced-indexing operation: the start index
of every window (from the index array, the batching dims and the clamping
mode) plus a broadcast offset per window dimension gives a full integer index
per operand dimension, computed in a canonical (batch..., window...) layout
and transposed to the layout the dimension numbers ask for. Index plans are
built at compile time; only the index values are looked at per call.

Out-of-bounds: CLIP and PROMISE_IN_BOUNDS clamp the window start into range
(what XLA does); FILL_OR_DROP gathers ``fill_value`` for a window that does
not fit and drops a scatter window that does not fit.
"""
from __future__ import annotations

import numpy as np

from jax import lax

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import np_dtype

_FILL_OR_DROP = jc.lax_slicing.GatherScatterMode.FILL_OR_DROP


class _WindowIndex:
  """Compiled index arithmetic shared by gather and scatter.

  ``window_dims``: operand dims that have a window axis (in order);
  ``index_map``: operand dim of each component of the index vector;
  ``operand_batching``/``indices_batching``: paired batching dims.
  """

  def __init__(self, operand_shape, window_sizes, window_dims, index_map,
               operand_batching, indices_batching, num_batch, fill_or_drop):
    self.operand_shape = tuple(operand_shape)
    self.window_sizes = tuple(window_sizes)  # per operand dim
    self.index_map = tuple(index_map)
    self.operand_batching = tuple(operand_batching)
    self.indices_batching = tuple(indices_batching)
    self.num_batch = num_batch
    self.fill_or_drop = fill_or_drop
    nw = len(window_dims)
    # offset index arrays, broadcastable against (batch..., window...)
    self.offsets = {}
    for j, d in enumerate(window_dims):
      shape = [1] * (num_batch + nw)
      shape[num_batch + j] = window_sizes[d]
      self.offsets[d] = np.arange(window_sizes[d]).reshape(shape)
    self.nw = nw
    self.max_start = np.array([n - w for n, w in zip(self.operand_shape, self.window_sizes)])

  def __call__(self, indices):
    """(index tuple into the operand, in-bounds mask over batch dims or None)."""
    indices = np.asarray(indices).astype(np.int64)
    batch_shape = indices.shape[:-1]
    rank = len(self.operand_shape)
    starts = [None] * rank
    mask = None
    for k, d in enumerate(self.index_map):
      s = indices[..., k]
      if self.fill_or_drop:
        ok = (s >= 0) & (s <= self.max_start[d])
        mask = ok if mask is None else mask & ok
      starts[d] = np.clip(s, 0, max(self.max_start[d], 0))
    for od, idim in zip(self.operand_batching, self.indices_batching):
      shape = [1] * len(batch_shape)
      shape[idim] = batch_shape[idim]
      starts[od] = np.arange(batch_shape[idim]).reshape(shape)
    if mask is not None:
      # An out-of-bounds window reads/writes a harmless in-bounds place.
      starts = [None if s is None else np.where(mask, s, 0) if np.shape(s) == mask.shape
                else s for s in starts]
    full = []
    expand = (Ellipsis,) + (None,) * self.nw
    for d in range(rank):
      s = starts[d]
      idx = 0 if s is None else np.asarray(s)[expand]
      if d in self.offsets:
        idx = idx + self.offsets[d]
      full.append(idx)
    full = np.broadcast_arrays(*full)
    return tuple(full), mask


def _canonical_perm(out_rank, window_positions):
  """Permutation taking (batch..., window...) to the output layout."""
  batch_positions = [p for p in range(out_rank) if p not in window_positions]
  canonical_pos = batch_positions + list(window_positions)
  perm = [0] * out_rank
  for canon_axis, out_axis in enumerate(canonical_pos):
    perm[out_axis] = canon_axis
  return tuple(perm), batch_positions


_PER_LANE = registry.unbatched("index arrays per lane: run lane by lane")


@registry.register(lax.gather_p, batch=_PER_LANE)
def _gather(e):
  p = e.params
  dn = p["dimension_numbers"]
  operand_aval, indices_aval = e.in_avals
  operand_shape = tuple(operand_aval.shape)
  rank = len(operand_shape)
  slice_sizes = tuple(int(s) for s in p["slice_sizes"])
  window_dims = [d for d in range(rank) if d not in dn.collapsed_slice_dims
                 and d not in dn.operand_batching_dims]
  num_batch = len(indices_aval.shape) - 1
  fill = p["mode"] == _FILL_OR_DROP
  plan = _WindowIndex(operand_shape, slice_sizes, window_dims, dn.start_index_map,
                      dn.operand_batching_dims, dn.start_indices_batching_dims,
                      num_batch, fill)
  # Collapsed dims have window size 1 but no output axis.
  out_rank = len(e.out_aval.shape)
  perm, _ = _canonical_perm(out_rank, dn.offset_dims)
  identity = perm == tuple(range(out_rank))
  dt = np_dtype(e.out_aval.dtype)
  fill_value = np.array(p["fill_value"] if p["fill_value"] is not None else 0).astype(dt)

  def gather(operand, indices):
    idx, mask = plan(indices)
    out = np.asarray(operand)[idx]
    if mask is not None:
      out = np.where(mask[(Ellipsis,) + (None,) * plan.nw], out, fill_value)
    if not identity:
      out = np.transpose(out, perm)
    return out
  return gather


_SCATTER_UFUNC = {
    lax.scatter_add_p: np.add,
    lax.scatter_mul_p: np.multiply,
    lax.scatter_min_p: np.minimum,
    lax.scatter_max_p: np.maximum,
}
if hasattr(lax, "scatter_sub_p"):
  _SCATTER_UFUNC[lax.scatter_sub_p] = np.subtract


def _scatter_rule(e):
  p = e.params
  dn = p["dimension_numbers"]
  operand_aval, indices_aval, updates_aval = e.in_avals
  operand_shape = tuple(operand_aval.shape)
  rank = len(operand_shape)
  window_dims = [d for d in range(rank) if d not in dn.inserted_window_dims
                 and d not in dn.operand_batching_dims]
  upd_shape = tuple(updates_aval.shape)
  window_sizes = [1] * rank
  for d, ud in zip(window_dims, dn.update_window_dims):
    window_sizes[d] = upd_shape[ud]
  num_batch = len(indices_aval.shape) - 1
  # Scatter never clamps unless asked to: PROMISE_IN_BOUNDS drops like XLA.
  clip = p["mode"] == jc.lax_slicing.GatherScatterMode.CLIP
  plan = _WindowIndex(operand_shape, window_sizes, window_dims,
                      dn.scatter_dims_to_operand_dims, dn.operand_batching_dims,
                      dn.scatter_indices_batching_dims, num_batch, not clip)
  upd_rank = len(upd_shape)
  perm, _ = _canonical_perm(upd_rank, dn.update_window_dims)
  # updates -> canonical layout: inverse permutation.
  to_canonical = tuple(np.argsort(perm))
  identity = to_canonical == tuple(range(upd_rank))
  ufunc = _SCATTER_UFUNC.get(e.primitive)
  dt = np_dtype(e.out_aval.dtype)
  combine = None
  if ufunc is None and p.get("update_jaxpr") is not None:
    combine = e.compiler.compile(p["update_jaxpr"], p.get("update_consts") or ())

  def scatter(operand, indices, updates):
    idx, mask = plan(indices)
    upd = np.asarray(updates)
    if not identity:
      upd = np.transpose(upd, to_canonical)
    upd = np.broadcast_to(upd, idx[0].shape if idx else upd.shape)
    out = np.array(operand, dtype=dt)
    if mask is not None:
      m = np.broadcast_to(mask[(Ellipsis,) + (None,) * plan.nw], upd.shape)
      idx = tuple(i[m] for i in idx)
      upd = upd[m]
    if ufunc is not None:
      ufunc.at(out, idx, upd)
    elif combine is not None:
      flat_idx = [np.ravel(i) for i in idx]
      for n, u in enumerate(np.ravel(upd)):
        where = tuple(int(i[n]) for i in flat_idx)
        out[where] = combine(None, out[where], u)[0]
    else:
      out[idx] = upd
    return out
  return scatter


for _prim in [lax.scatter_p, *_SCATTER_UFUNC]:
  registry.register(_prim, batch=_PER_LANE)(_scatter_rule)
