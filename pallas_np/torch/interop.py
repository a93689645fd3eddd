"""torchax-style ``jax_view`` / ``torch_view`` (the seed's vocabulary).

``jax_view`` turns torch things into JAX things: a torch dtype into the JAX
dtype, a tensor into a JAX array, a function written with torch ops into a
function of JAX values/refs (the kernel body of ``torch_pallas_call``).
``torch_view`` goes the other way: a JAX/NumPy dtype into a torch dtype, an
array into a tensor, and a JAX function into one taking and returning torch
tensors, evaluated in numpy mode.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
import torch

from pallas_np.torch.convert import numpy_dtype_to_torch, to_numpy, to_torch
from pallas_np.torch.kernels import TorchNumpyRunner, eager_under_compile
from pallas_np.torch.torch_ops import torch_kernel
from pallas_np.torch.values import JaxTensor, TorchRef, jax_dtype


def jax_view(x):
  if isinstance(x, torch.dtype):
    return jax_dtype(x)
  if isinstance(x, torch.Tensor):
    return jax.numpy.asarray(to_numpy(x))
  if isinstance(x, JaxTensor):
    return x._value
  if isinstance(x, TorchRef):
    return x._ref
  if callable(x):
    return torch_kernel(x)
  if isinstance(x, (list, tuple, dict)):
    return jax.tree_util.tree_map(jax_view, x, is_leaf=lambda v: v is not x)
  return x


def torch_view(x):
  if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
    return numpy_dtype_to_torch(x)
  if isinstance(x, (jax.Array, np.ndarray)):
    return to_torch(np.asarray(x))
  if callable(x):
    runner = TorchNumpyRunner(x)

    @eager_under_compile  # torch.compile: a graph break, then this runs eagerly
    @functools.wraps(x)
    def torch_fn(*args, **kwargs):
      return runner(args, kwargs)
    return torch_fn
  if isinstance(x, (list, tuple, dict)):
    return jax.tree_util.tree_map(torch_view, x, is_leaf=lambda v: v is not x)
  return x
