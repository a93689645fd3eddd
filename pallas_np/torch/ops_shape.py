"""Shape and indexing torch ops: reshape/view, squeeze, transpose/permute,
expand/repeat, cat/stack/split, flip/roll, tril/triu, gather and
index_select."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from pallas_np.torch.ops_table import no_out, op, unsupported
from pallas_np.torch.values import jax_dtype


# shapes
def shape_args(shape):
  if len(shape) == 1 and isinstance(shape[0], (list, tuple, torch.Size)):
    return tuple(shape[0])
  return tuple(shape)


@op("reshape")
def _reshape(input, *shape):
  return jnp.reshape(input, shape_args(shape))


@op("view")
def _view(input, *shape, dtype=None):
  if dtype is None and len(shape) == 1 and isinstance(shape[0], (np.dtype, type)):
    dtype = shape[0]
  if dtype is not None:
    dt = jax_dtype(dtype)
    if np.dtype(dt).itemsize != np.dtype(input.dtype).itemsize:
      raise unsupported("Tensor.view(dtype) with a different element size")
    return lax.bitcast_convert_type(input, dt)
  return jnp.reshape(input, shape_args(shape))


@op("view_as", "reshape_as")
def _view_as(input, other):
  return jnp.reshape(input, other.shape)


@op("flatten")
def _flatten(input, start_dim=0, end_dim=-1):
  nd = input.ndim
  if nd == 0:
    return input.reshape(1)
  s, e = start_dim % nd, end_dim % nd
  shape = input.shape[:s] + (-1,) + input.shape[e + 1:]
  return input.reshape(shape)


@op("unflatten")
def _unflatten(input, dim, sizes):
  dim = dim % input.ndim
  return input.reshape(input.shape[:dim] + tuple(sizes) + input.shape[dim + 1:])


@op("squeeze")
def _squeeze(input, dim=None):
  if dim is None:
    return jnp.squeeze(input)
  dims = dim if isinstance(dim, (list, tuple)) else (dim,)
  dims = tuple(d for d in dims if input.shape[d] == 1)  # torch ignores non-1 dims
  return jnp.squeeze(input, dims) if dims else input


@op("unsqueeze")
def _unsqueeze(input, dim):
  return jnp.expand_dims(input, dim)


@op("transpose", "swapaxes", "swapdims")
def _transpose(input, dim0, dim1):
  return jnp.swapaxes(input, dim0, dim1)


@op("t")
def _t(input):
  return jnp.transpose(input)


@op("permute")
def _permute(input, *dims):
  return jnp.transpose(input, shape_args(dims))


@op("movedim", "moveaxis")
def _movedim(input, source, destination):
  return jnp.moveaxis(input, source, destination)


@op("expand")
def _expand(input, *sizes):
  sizes = shape_args(sizes)
  lead = len(sizes) - input.ndim
  shape = tuple(input.shape[i - lead] if s == -1 else s for i, s in enumerate(sizes))
  return jnp.broadcast_to(input, shape)


@op("expand_as")
def _expand_as(input, other):
  return jnp.broadcast_to(input, other.shape)


@op("broadcast_to")
def _broadcast_to(input, size):
  return jnp.broadcast_to(input, tuple(size))


@op("repeat")
def _repeat(input, *sizes):
  sizes = shape_args(sizes)
  x = input.reshape((1,) * (len(sizes) - input.ndim) + input.shape)
  return jnp.tile(x, sizes)


@op("tile")
def _tile(input, dims):
  return jnp.tile(input, tuple(dims))


@op("repeat_interleave")
def _repeat_interleave(input, repeats, dim=None, *, output_size=None):
  if not isinstance(repeats, int):
    raise unsupported("repeat_interleave with tensor repeats")
  return jnp.repeat(input, repeats, axis=dim)


@op("cat", "concat", "concatenate")
def _cat(tensors, dim=0, *, out=None):
  no_out(out)
  return jnp.concatenate(list(tensors), axis=dim)


@op("stack")
def _stack(tensors, dim=0, *, out=None):
  no_out(out)
  # Via concatenate: keeps the kernel to primitives every interpreter has.
  return jnp.concatenate([jnp.expand_dims(t, dim) for t in tensors], axis=dim)


@op("split")
def _split(input, split_size_or_sections, dim=0):
  n = input.shape[dim]
  if isinstance(split_size_or_sections, int):
    cuts = list(range(split_size_or_sections, n, split_size_or_sections))
  else:
    cuts = list(np.cumsum(split_size_or_sections)[:-1])
  return tuple(jnp.split(input, cuts, axis=dim))


@op("chunk")
def _chunk(input, chunks, dim=0):
  n = input.shape[dim]
  size = -(-n // chunks)
  return _split(input, size, dim)


@op("unbind")
def _unbind(input, dim=0):
  return tuple(jnp.moveaxis(input, dim, 0))


@op("narrow")
def _narrow(input, dim, start, length):
  return lax.slice_in_dim(input, start, start + length, axis=dim)


@op("flip")
def _flip(input, dims):
  return jnp.flip(input, tuple(dims) if isinstance(dims, (list, tuple)) else dims)


@op("roll")
def _roll(input, shifts, dims=None):
  return jnp.roll(input, shifts, axis=dims)


@op("tril")
def _tril(input, diagonal=0):
  return jnp.tril(input, diagonal)


@op("triu")
def _triu(input, diagonal=0):
  return jnp.triu(input, diagonal)


@op("gather")
def _gather(input, dim, index, *, sparse_grad=False):
  return jnp.take_along_axis(input, index, axis=dim)


@op("index_select")
def _index_select(input, dim, index):
  return jnp.take(input, index, axis=dim)


@op("take_along_dim")
def _take_along_dim(input, indices, dim=None):
  if dim is None:
    return jnp.take(input.reshape(-1), indices.reshape(-1))
  return jnp.take_along_axis(input, indices, axis=dim)
