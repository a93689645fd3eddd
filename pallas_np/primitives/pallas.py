"""Pallas' own primitives: grid queries, hints and debugging helpers."""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry

pp = jc.pallas_primitives


@registry.register(pp.program_id_p, needs_ctx=True)
def _program_id(e):
  axis = int(e.params["axis"])
  return lambda ctx: ctx.program_ids[axis]


@registry.register(pp.num_programs_p, needs_ctx=True)
def _num_programs(e):
  axis = int(e.params["axis"])
  return lambda ctx: ctx.num_programs[axis]


@registry.register(pp.multiple_of_p)
def _multiple_of(e):
  return lambda x: x


if hasattr(pp, "max_contiguous_p"):
  registry.register(pp.max_contiguous_p)(lambda e: (lambda x: x))


if hasattr(pp, "reciprocal_p"):
  @registry.register(pp.reciprocal_p)
  def _reciprocal(e):
    from pallas_np.dtypes import np_dtype, is_low_precision_float
    dt = np_dtype(e.in_avals[0].dtype)
    if is_low_precision_float(dt):
      return lambda x: np.asarray(1.0 / np.asarray(x, np.float32), dt)[()]
    return lambda x: np.asarray(np.reciprocal(x), dt)[()]
