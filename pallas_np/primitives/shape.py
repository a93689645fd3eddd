"""Shape and data movement: iota, broadcast, reshape, transpose, slicing,
concatenate, pad, rev, dynamic slices, gather/scatter from jnp indexing.

Results may be views of their operands (values are never mutated in place;
only refs are), so most of these cost no copy. Each batched rule (a
vectorized grid's lane-stacked operands, ``pallas_np.batching``) sits right
above its sequential rule: mostly the same NumPy call with axes shifted past
the lane axis.
"""
from __future__ import annotations

import math

import numpy as np

from jax import lax

from pallas_np import _compat as jc
from pallas_np import batching, registry
from pallas_np.dtypes import np_dtype
from pallas_np.errors import NotBatchable


@registry.register(lax.iota_p, batch=registry.unbatched("no operands: one value for every lane, computed once per pass"))
def _iota(e):
  dt = np_dtype(e.params["dtype"])
  shape = tuple(e.params["shape"])
  dim = e.params["dimension"]
  ar = np.arange(shape[dim], dtype=dt)
  bshape = [1] * len(shape)
  bshape[dim] = shape[dim]
  value = np.broadcast_to(ar.reshape(bshape), shape)
  return lambda: value


def broadcast_geometry(e):
  """(out shape, operand reshaped to the out rank) of a broadcast_in_dim."""
  shape = tuple(e.params["shape"])
  in_shape = tuple(e.in_avals[0].shape)
  expanded = [1] * len(shape)
  for i, d in enumerate(e.params["broadcast_dimensions"]):
    expanded[d] = in_shape[i]
  return shape, tuple(expanded)


# Results up to this many elements are materialised: ``np.broadcast_to`` costs
# ~3 us of Python (it builds an nditer), an empty+copyto of a small block <1 us
# (hot in Triton-style kernels, which broadcast index vectors and masks).
SMALL_BROADCAST = 1 << 12


def broadcast(x, expanded: tuple, shape: tuple, size: int):
  """``x`` (reshaped to ``expanded``, same rank as ``shape``) broadcast to
  ``shape``: a view for big results, a fresh array for small ones."""
  x = x.reshape(expanded)
  if expanded == shape:
    return x
  if size <= SMALL_BROADCAST:
    out = np.empty(shape, x.dtype)
    np.copyto(out, x)
    return out
  return np.broadcast_to(x, shape)


def lane_broadcast(shape, expanded):
  """Broadcast a lane-stacked operand laid out as ``expanded`` to ``shape``."""
  size = math.prod(shape)

  def bcast(x):
    n = x.shape[0]
    return broadcast(x, (n, *expanded), (n, *shape), n * size)
  return bcast, False, (True,)


def _broadcast_in_dim_batched(bc, rule, info, in_batched):
  if not in_batched[0]:
    return rule.compile(info), False, (False,)
  if len(in_batched) > 1:
    raise NotBatchable("dynamic broadcast_in_dim")
  return lane_broadcast(*broadcast_geometry(info))


@registry.register(lax.broadcast_in_dim_p, batch=_broadcast_in_dim_batched, data_movement=True)
def _broadcast_in_dim(e):
  shape, expanded = broadcast_geometry(e)
  size = math.prod(shape)
  if expanded == shape:  # only new unit dims
    return lambda x, *dyn: x.reshape(shape)
  return lambda x, *dyn: broadcast(x, expanded, shape, size)


def _reshape_batched(bc, rule, info, in_batched):
  if not in_batched[0]:
    return rule.compile(info), False, (False,)
  if info.params.get("dimensions") is not None:
    raise NotBatchable("reshape with dimensions")
  new_sizes = tuple(info.params["new_sizes"])
  return (lambda x, *dyn: np.reshape(x, (x.shape[0], *new_sizes))), False, (True,)


@registry.register(lax.reshape_p, batch=_reshape_batched, data_movement=True)
def _reshape(e):
  new_sizes = tuple(e.params["new_sizes"])
  dims = e.params.get("dimensions")
  if dims is not None:
    return lambda x, *dyn: np.reshape(np.transpose(x, dims), new_sizes)
  # The method, not np.reshape: a fifth of the cost (hot in sorting networks).
  return lambda x, *dyn: x.reshape(new_sizes)


@registry.register(lax.transpose_p, data_movement=True, batch=batching.unary_batched(
    lambda e: (lambda x, perm=(0, *batching.shift_axes(e.params["permutation"])):
               np.transpose(x, perm))))
def _transpose(e):
  perm = tuple(e.params["permutation"])
  # Materialised, as XLA does: a lazy transposed view would hand its strided
  # layout on to every ufunc result downstream (NumPy keeps 'K' order), making
  # all later elementwise work run at strided speed.
  shape = tuple(e.in_avals[0].shape)
  rank = len(shape)
  if rank >= 2 and perm == (*range(rank - 2), rank - 1, rank - 2):
    itemsize = np.dtype(jc.physical_dtype(e.in_avals[0].dtype)).itemsize
    slab = _transpose_slab_rows(shape[-2], shape[-1], itemsize)
    if slab:
      return lambda x: _swap_last_two_by_slabs(x, slab)
  return lambda x: np.ascontiguousarray(np.transpose(x, perm))


def _transpose_slab_rows(rows: int, cols: int, itemsize: int) -> int:
  """Rows per slab for a blocked swap of the last two axes, or 0 for NumPy's
  plain copy. NumPy writes the output in order and reads the input down
  its columns: with rows of >= 1 KiB (powers of two above all) every read
  of a column maps to the same cache sets and the copy thrashes. Copying
  slabs of a few rows keeps those lines in cache (4x faster or more on big
  blocks: benchmarks/PERF_LOG.md; 8 rows for 4 KiB rows, 16 for 2 KiB, 32
  for 1 KiB, where each was fastest)."""
  row_bytes = cols * itemsize
  if row_bytes < 1024 or rows * cols < 4096:
    return 0
  slab = max(8, min(32, 32768 // row_bytes))
  return slab if rows > slab else 0


def _swap_last_two_by_slabs(x, slab):
  rows = x.shape[-2]
  out = np.empty((*x.shape[:-2], x.shape[-1], rows), x.dtype)
  for i in range(0, rows, slab):
    out[..., i:i + slab] = x[..., i:i + slab, :].swapaxes(-1, -2)
  return out


@registry.register(lax.squeeze_p, data_movement=True, batch=batching.unary_batched(
    lambda e: (lambda x, d=batching.shift_axes(e.params["dimensions"]): np.squeeze(x, axis=d))))
def _squeeze(e):
  out_shape = tuple(jc.physical_aval(e.out_aval).shape)  # PRNG keys: + key dims
  # Dropping size-1 dims is always a view; reshape is the cheapest call.
  return lambda x: x.reshape(out_shape)


if hasattr(lax, "expand_dims_p"):
  @registry.register(lax.expand_dims_p, data_movement=True, batch=batching.unary_batched(
      lambda e: (lambda x, d=batching.shift_axes(e.params["dimensions"]): np.expand_dims(x, d))))
  def _expand_dims(e):
    dims = tuple(e.params["dimensions"])
    return lambda x: np.expand_dims(x, dims)


def _concatenate_batched(bc, rule, info, in_batched):
  dim = int(info.params["dimension"]) + 1
  flags = tuple(in_batched)

  def concat(*xs):
    n = next(x.shape[0] for x, f in zip(xs, flags) if f)
    return np.concatenate([x if f else batching.to_lanes(x, n) for x, f in zip(xs, flags)], axis=dim)
  return concat, False, (True,)


@registry.register(lax.concatenate_p, batch=_concatenate_batched, data_movement=True)
def _concatenate(e):
  dim = e.params["dimension"]
  return lambda *xs: np.concatenate(xs, axis=dim)


if hasattr(jc.lax_internal, "stack_p"):
  @registry.register(jc.lax_internal.stack_p, batch=registry.unbatched("rare in kernels: run lane by lane"))
  def _stack(e):
    axis = int(e.params["axis"])
    return lambda *xs: np.stack(xs, axis=axis)


if hasattr(jc.lax_internal, "unstack_p"):
  @registry.register(jc.lax_internal.unstack_p, batch=registry.unbatched("rare in kernels: run lane by lane"))
  def _unstack(e):
    axis = int(e.params["axis"])
    n = e.in_avals[0].shape[axis]
    return lambda x: [np.take(x, i, axis=axis) for i in range(n)]


def _split_batched(bc, rule, info, in_batched):
  if not in_batched[0]:
    return rule.compile(info), False, (False,) * len(info.out_avals)
  sizes = tuple(info.params["sizes"])
  axis = int(info.params["axis"]) + 1
  bounds = np.cumsum(sizes)[:-1]
  return (lambda x: np.split(x, bounds, axis=axis)), False, (True,) * len(sizes)


@registry.register(lax.split_p, batch=_split_batched)
def _split(e):
  sizes = tuple(e.params["sizes"])
  axis = e.params["axis"]
  bounds = np.cumsum(sizes)[:-1]
  return lambda x: np.split(x, bounds, axis=axis)


def _slice_batched(bc, rule, info, in_batched):
  if not in_batched[0]:
    return rule.compile(info), False, (False,)
  starts = info.params["start_indices"]
  limits = info.params["limit_indices"]
  strides = info.params["strides"] or (1,) * len(starts)
  idx = (slice(None),) + tuple(slice(s, l, st) for s, l, st in zip(starts, limits, strides))
  return (lambda x: x[idx]), False, (True,)


@registry.register(lax.slice_p, batch=_slice_batched, data_movement=True)
def _slice(e):
  starts = e.params["start_indices"]
  limits = e.params["limit_indices"]
  strides = e.params["strides"] or (1,) * len(starts)
  idx = tuple(slice(s, l, st) for s, l, st in zip(starts, limits, strides))
  return lambda x: x[idx]


@registry.register(lax.rev_p, data_movement=True, batch=batching.unary_batched(
    lambda e: (lambda x, d=batching.shift_axes(e.params["dimensions"]): np.flip(x, d))))
def _rev(e):
  dims = set(e.params["dimensions"])
  idx = tuple(slice(None, None, -1) if d in dims else slice(None)
              for d in range(len(e.in_avals[0].shape)))
  return lambda x: x[idx]


def _pad_batched(bc, rule, info, in_batched):
  if in_batched[1]:
    return batching.lane_loop(rule, info, in_batched)
  config = ((0, 0, 0),) + tuple(info.params["padding_config"])
  dt = np.dtype(jc.physical_dtype(info.out_aval.dtype))
  return (lambda x, v: pad_array(x, v, config, dt)), False, (True,)


@registry.register(lax.pad_p, batch=_pad_batched, data_movement=True)
def _pad(e):
  config = tuple(e.params["padding_config"])
  out_shape = tuple(e.out_aval.shape)
  dt = np_dtype(e.out_aval.dtype)

  def pad(x, value):
    x = pad_array(x, value, config, dt)
    assert x.shape == out_shape, (x.shape, out_shape)
    return x
  return pad


def pad_array(x, value, config, dt):
  """lax.pad: interior padding, then edge padding (negative crops)."""
  x = np.asarray(x)
  # Interior padding: scatter into a strided view.
  inter = [i for (_, _, i) in config]
  if any(inter):
    shape = tuple((n - 1) * (i + 1) + 1 if n else 0 for n, i in zip(x.shape, inter))
    y = np.full(shape, value, dt)
    y[tuple(slice(None, None, i + 1) for i in inter)] = x
    x = y
  # Edge padding: positive pads, negative crops.
  pads = [(max(lo, 0), max(hi, 0)) for (lo, hi, _) in config]
  if any(p for pair in pads for p in pair):
    x = np.pad(x, pads, constant_values=value)
  crop = tuple(slice(-lo if lo < 0 else 0, x.shape[d] + hi if hi < 0 else x.shape[d])
               for d, (lo, hi, _) in enumerate(config))
  x = x[crop]
  return x.astype(dt, copy=False)


def _clamped_starts(starts, operand_shape, sizes):
  return tuple(min(max(int(s), 0), n - z) for s, n, z in zip(starts, operand_shape, sizes))


def _dynamic_slice_batched(bc, rule, info, in_batched):
  if any(in_batched[1:]):
    return batching.lane_loop(rule, info, in_batched)
  sizes = tuple(info.params["slice_sizes"])
  shape = tuple(info.in_avals[0].shape)

  def dynamic_slice(x, *starts):
    st = _clamped_starts(starts, shape, sizes)
    return x[(slice(None),) + tuple(slice(s, s + z) for s, z in zip(st, sizes))]
  return dynamic_slice, False, (True,)


@registry.register(lax.dynamic_slice_p, batch=_dynamic_slice_batched, data_movement=True)
def _dynamic_slice(e):
  sizes = tuple(e.params["slice_sizes"])
  shape = tuple(e.in_avals[0].shape)

  def dynamic_slice(x, *starts):
    # XLA clamps the start so the slice stays in bounds.
    st = _clamped_starts(starts, shape, sizes)
    return x[tuple(slice(s, s + z) for s, z in zip(st, sizes))]
  return dynamic_slice


def _dynamic_update_slice_batched(bc, rule, info, in_batched):
  if any(in_batched[2:]):
    return batching.lane_loop(rule, info, in_batched)
  shape = tuple(info.in_avals[0].shape)
  upd_shape = tuple(info.in_avals[1].shape)
  x_batched = in_batched[0]

  def dynamic_update_slice(x, update, *starts):
    st = _clamped_starts(starts, shape, upd_shape)
    if x_batched:
      out = np.array(x)
    else:
      out = np.array(batching.to_lanes(x, update.shape[0]))
    out[(slice(None),) + tuple(slice(s, s + z) for s, z in zip(st, upd_shape))] = update
    return out
  return dynamic_update_slice, False, (True,)


@registry.register(lax.dynamic_update_slice_p, batch=_dynamic_update_slice_batched)
def _dynamic_update_slice(e):
  shape = tuple(e.in_avals[0].shape)
  upd_shape = tuple(e.in_avals[1].shape)

  def dynamic_update_slice(x, update, *starts):
    st = _clamped_starts(starts, shape, upd_shape)
    out = np.array(x)
    out[tuple(slice(s, s + z) for s, z in zip(st, upd_shape))] = update
    return out
  return dynamic_update_slice


@registry.register(lax.copy_p, batch=registry.IDENTITY, data_movement=True)
def _copy(e):
  return lambda x: x


if hasattr(jc.lax_internal, "copy_p"):
  registry.register_numpy(jc.lax_internal.copy_p, lambda x: x, batch=registry.IDENTITY,
                          data_movement=True)


if hasattr(jc.lax_internal, "tile_p"):
  @registry.register(jc.lax_internal.tile_p, batch=registry.unbatched("rare in kernels: run lane by lane"))
  def _tile(e):
    reps = tuple(int(r) for r in e.params["reps"])
    return lambda x: np.tile(x, reps)


if hasattr(jc.lax_internal, "empty_p"):
  @registry.register(jc.lax_internal.empty_p, batch=registry.unbatched("no operands: one value for every lane, computed once per pass"))
  def _empty(e):
    # XLA's CPU lowering materialises zeros.
    aval = jc.physical_aval(e.out_aval)
    value = np.zeros(tuple(aval.shape), np_dtype(aval.dtype))
    return lambda: value
