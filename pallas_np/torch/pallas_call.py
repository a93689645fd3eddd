"""``torch_pallas_call``: ``pl.pallas_call`` for kernels written with torch
ops, called on torch tensors, run by the NumPy interpreter.

Exactly the seed's construction, ``torch_view(pl.pallas_call(jax_view(kernel),
...))``, with our torch->JAX op mapping standing in for torchax.
"""
from __future__ import annotations

from typing import Any

import jax
import torch
from jax.experimental import pallas as pl

from pallas_np.params import InterpretParams, resolve
from pallas_np.torch.interop import jax_view, torch_view
from pallas_np.torch.kernels import eager_under_compile
from pallas_np.torch.values import jax_dtype


def _shape_dtype(x):
  """out_shape leaves: ShapeDtypeStruct, tensors (any device, incl. meta), or
  anything with .shape and a torch/JAX .dtype."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return jax.ShapeDtypeStruct(tuple(x.shape), jax_dtype(x.dtype))
  return x


@eager_under_compile
def torch_pallas_call(kernel, out_shape, *, interpret: Any = None, **kwargs):
  """``pl.pallas_call`` with a kernel body written with torch ops on refs;
  the returned callable takes and returns CPU torch tensors.

  Every ``pl.pallas_call`` keyword (``grid``, ``in_specs``, ``out_specs``,
  ``grid_spec``, ``scratch_shapes``, ``input_output_aliases``, ...) passes
  through. It always runs in numpy mode: ``interpret=True``/``False``/``None``
  (the seed passes ``interpret=True``) all mean the NumPy interpreter; pass an
  ``InterpretParams`` for its options.
  """
  params = interpret if isinstance(interpret, InterpretParams) else resolve("numpy")
  out_shape = jax.tree_util.tree_map(
      _shape_dtype, out_shape,
      is_leaf=lambda v: isinstance(v, (jax.ShapeDtypeStruct, torch.Tensor)))
  jax_fn = pl.pallas_call(jax_view(kernel), out_shape=out_shape, interpret=params,
                          **kwargs)
  return torch_view(jax_fn)
