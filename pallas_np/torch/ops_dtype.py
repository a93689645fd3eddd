"""Dtype-conversion torch methods (``.to``, ``.type``, ``.float()`` ...) and
the identity-like ones (``.contiguous()``, ``.clone()``, ``.detach()`` ...)."""
from __future__ import annotations

import jax
import numpy as np
import torch

from pallas_np import _compat as jc
from pallas_np.torch.ops_table import op, unsupported
from pallas_np.torch.values import astype


# dtype conversion and identity-like methods
def _dtype_in(args, kwargs):
  if kwargs.get("dtype") is not None:
    return kwargs["dtype"]
  for a in args:
    if isinstance(a, (torch.dtype, np.dtype)):
      return a
    if isinstance(a, (jax.Array, jc.Tracer)):  # .to(other_tensor)
      return a.dtype
  return None


@op("to")
def _to(input, *args, **kwargs):
  return astype(input, _dtype_in(args, kwargs))


@op("type")
def _type(input, dtype=None, non_blocking=False):
  if dtype is None:
    raise unsupported("Tensor.type() without a dtype")
  return astype(input, dtype)


@op("type_as")
def _type_as(input, other):
  return input.astype(other.dtype)


for _n, _dt in [("float", torch.float32), ("double", torch.float64), ("half", torch.float16),
                ("bfloat16", torch.bfloat16), ("int", torch.int32), ("long", torch.int64),
                ("short", torch.int16), ("char", torch.int8), ("byte", torch.uint8),
                ("bool", torch.bool)]:
  op(_n)(lambda input, memory_format=None, _dt=_dt: astype(input, _dt))

for _n in ("contiguous", "clone", "detach", "cpu", "requires_grad_", "cuda"):
  op(_n)(lambda input, *args, **kwargs: input)
