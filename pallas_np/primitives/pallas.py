"""Pallas' own primitives: grid queries, hints and debugging helpers."""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import is_low_precision_float, np_dtype

pp = jc.pallas_primitives


def _program_id_batched(bc, rule, info, in_batched):
  """An int32 array of the lanes' ids on a batched grid axis."""
  axis = int(info.params["axis"])
  return (lambda ctx: ctx.program_ids[axis]), True, (axis in bc.batched_pid_axes,)


@registry.register(pp.program_id_p, needs_ctx=True, context_free=True,
                   batch=_program_id_batched)
def _program_id(e):
  axis = int(e.params["axis"])
  return lambda ctx: ctx.program_ids[axis]


def _num_programs_batched(bc, rule, info, in_batched):
  return rule.compile(info), True, (False,)


@registry.register(pp.num_programs_p, needs_ctx=True, context_free=True,
                   batch=_num_programs_batched)
def _num_programs(e):
  axis = int(e.params["axis"])
  return lambda ctx: ctx.num_programs[axis]


@registry.register(pp.multiple_of_p, batch=registry.IDENTITY)
def _multiple_of(e):
  return lambda x: x


if hasattr(pp, "max_contiguous_p"):
  registry.register(pp.max_contiguous_p, batch=registry.IDENTITY)(lambda e: (lambda x: x))


if hasattr(pp, "reciprocal_p"):
  @registry.register(pp.reciprocal_p, batch=registry.ELEMENTWISE)
  def _reciprocal(e):
    dt = np_dtype(e.in_avals[0].dtype)
    if is_low_precision_float(dt):
      return lambda x: np.asarray(1.0 / np.asarray(x, np.float32), dt)[()]
    return lambda x: np.asarray(np.reciprocal(x), dt)[()]
