"""Reduction torch ops: sum/mean/prod, max/min (with indices), arg-reductions,
logsumexp, cumulative ops, var/std and norm."""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import torch

from pallas_np.torch.ops_table import no_out, op
from pallas_np.torch.values import astype, jax_dtype


def _axis(dim):
  if isinstance(dim, (list, tuple)):
    return tuple(dim)
  return dim


# reductions
def _reduction(jfn):
  def fn(input, dim=None, keepdim=False, *, dtype=None, out=None):
    no_out(out)
    return jfn(astype(input, dtype), axis=_axis(dim), keepdims=keepdim)
  return fn


for _n, _f in [("sum", jnp.sum), ("mean", jnp.mean), ("nansum", jnp.nansum),
               ("nanmean", jnp.nanmean), ("prod", jnp.prod)]:
  op(_n)(_reduction(_f))


@op("amax")
def _amax(input, dim=(), keepdim=False):
  return jnp.max(input, axis=_axis(dim) if dim != () else None, keepdims=keepdim)


@op("amin")
def _amin(input, dim=(), keepdim=False):
  return jnp.min(input, axis=_axis(dim) if dim != () else None, keepdims=keepdim)


@op("all")
def _all(input, dim=None, keepdim=False):
  return jnp.all(input, axis=_axis(dim), keepdims=keepdim)


@op("any")
def _any(input, dim=None, keepdim=False):
  return jnp.any(input, axis=_axis(dim), keepdims=keepdim)


MinMax = collections.namedtuple("MinMax", ["values", "indices"])


def _minmax(reduce, arg, elementwise):
  def fn(input, dim=None, keepdim=False, *, out=None):
    no_out(out)
    if dim is None:
      return reduce(input)
    if not isinstance(dim, (int, np.integer)):  # torch.max(x, other)
      return elementwise(input, dim)
    values = reduce(input, axis=dim, keepdims=keepdim)
    indices = arg(input, axis=dim, keepdims=keepdim).astype(jax_dtype(torch.int64))
    return MinMax(values, indices)
  return fn


op("max")(_minmax(jnp.max, jnp.argmax, jnp.maximum))
op("min")(_minmax(jnp.min, jnp.argmin, jnp.minimum))


@op("argmax")
def _argmax(input, dim=None, keepdim=False):
  return jnp.argmax(input, axis=dim, keepdims=keepdim).astype(jax_dtype(torch.int64))


@op("argmin")
def _argmin(input, dim=None, keepdim=False):
  return jnp.argmin(input, axis=dim, keepdims=keepdim).astype(jax_dtype(torch.int64))


@op("logsumexp")
def _logsumexp(input, dim, keepdim=False):
  return jax.nn.logsumexp(input, axis=_axis(dim), keepdims=keepdim)


@op("cumsum")
def _cumsum(input, dim, *, dtype=None):
  return jnp.cumsum(astype(input, dtype), axis=dim)


@op("cumprod")
def _cumprod(input, dim, *, dtype=None):
  return jnp.cumprod(astype(input, dtype), axis=dim)


def _correction(unbiased, correction):
  if correction is not None:
    return correction
  return 1 if unbiased in (None, True) else 0


@op("var")
def _var(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
  if isinstance(dim, bool):  # var(x, unbiased)
    dim, unbiased = None, dim
  return jnp.var(input, axis=_axis(dim), ddof=_correction(unbiased, correction),
                 keepdims=keepdim)


@op("std")
def _std(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
  if isinstance(dim, bool):
    dim, unbiased = None, dim
  return jnp.std(input, axis=_axis(dim), ddof=_correction(unbiased, correction),
                 keepdims=keepdim)


@op("norm")
def _norm(input, p="fro", dim=None, keepdim=False, dtype=None):
  x = astype(input, dtype)
  if p in ("fro", 2, 2.0):
    return jnp.sqrt(jnp.sum(jnp.abs(x) ** 2, axis=_axis(dim), keepdims=keepdim))
  if p in (float("inf"), "inf"):
    return jnp.max(jnp.abs(x), axis=_axis(dim), keepdims=keepdim)
  return jnp.sum(jnp.abs(x) ** p, axis=_axis(dim), keepdims=keepdim) ** (1.0 / p)
