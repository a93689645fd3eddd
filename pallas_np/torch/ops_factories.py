"""Factory torch functions (``torch.zeros``, ``torch.arange``, ``torch.full``,
``torch.tensor`` ...), reached through the kernel-tracing mode; ``FACTORIES``
names them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from pallas_np import _compat as jc
from pallas_np.torch.ops_shape import shape_args
from pallas_np.torch.ops_table import op
from pallas_np.torch.values import jax_dtype, unwrap


# factories (reached through the kernel-tracing mode)
def _factory_dtype(dtype, fill=None):
  if dtype is not None:
    return jax_dtype(dtype)
  if isinstance(fill, bool):
    return jnp.bool_
  if isinstance(fill, int):
    return jax_dtype(torch.int64)
  return jax_dtype(torch.get_default_dtype())


@op("zeros", "empty")
def _zeros(*size, dtype=None, **_):
  return jnp.zeros(shape_args(size), _factory_dtype(dtype))


@op("ones")
def _ones(*size, dtype=None, **_):
  return jnp.ones(shape_args(size), _factory_dtype(dtype))


@op("full")
def _full(size, fill_value, *, dtype=None, **_):
  return jnp.full(tuple(size), fill_value, _factory_dtype(dtype, fill_value))


@op("zeros_like", "empty_like")
def _zeros_like(input, *, dtype=None, **_):
  return jnp.zeros(input.shape, jax_dtype(dtype) or input.dtype)


@op("ones_like")
def _ones_like(input, *, dtype=None, **_):
  return jnp.ones(input.shape, jax_dtype(dtype) or input.dtype)


@op("full_like")
def _full_like(input, fill_value, *, dtype=None, **_):
  return jnp.full(input.shape, fill_value, jax_dtype(dtype) or input.dtype)


@op("arange")
def _arange(start, end=None, step=1, *, dtype=None, **_):
  if end is None:
    start, end = 0, start
  if dtype is None:
    is_int = all(isinstance(v, (int, np.integer)) for v in (start, end, step))
    dtype = torch.int64 if is_int else torch.get_default_dtype()
  return jnp.arange(start, end, step, dtype=jax_dtype(dtype))


@op("linspace")
def _linspace(start, end, steps, *, dtype=None, **_):
  return jnp.linspace(start, end, steps, dtype=_factory_dtype(dtype, 0.0))


@op("eye")
def _eye(n, m=None, *, dtype=None, **_):
  return jnp.eye(n, m, dtype=_factory_dtype(dtype, 0.0))


@op("tensor", "as_tensor")
def _tensor(data, *, dtype=None, **_):
  host = np.asarray(unwrap(data)) if not isinstance(data, (jax.Array, jc.Tracer)) else None
  if host is None or host.dtype == object:
    arr = jnp.asarray(data)
  else:
    if dtype is None:
      dtype = (torch.get_default_dtype() if host.dtype.kind == "f" else
               torch.int64 if host.dtype.kind in "iu" else host.dtype)
    dt = jax_dtype(dtype)
    # Pallas kernels cannot capture array constants: build it from scalars.
    flat = [jnp.full((1,), v, dt) for v in host.reshape(-1).tolist()]
    arr = (jnp.concatenate(flat) if flat else jnp.zeros((0,), dt)).reshape(host.shape)
  return arr if dtype is None else arr.astype(jax_dtype(dtype))


FACTORIES = {"zeros", "empty", "ones", "full", "arange", "linspace", "eye", "tensor",
              "as_tensor", "zeros_like", "empty_like", "ones_like", "full_like"}
