"""Linear-algebra torch ops: matmul and its variants, dot/outer, einsum,
addmm and ``F.linear``."""
from __future__ import annotations

import jax.numpy as jnp

from pallas_np.torch.ops_table import no_out, op


# linear algebra
@op("matmul", "mm", "bmm")
def _matmul(input, other, *, out=None):
  no_out(out)
  return jnp.matmul(input, other)


@op("dot", "inner", "vdot")
def _dot(input, other):
  return jnp.dot(input, other)


@op("outer", "ger")
def _outer(input, vec2):
  return jnp.outer(input, vec2)


@op("einsum")
def _einsum(equation, *operands):
  if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
    operands = operands[0]
  return jnp.einsum(equation, *operands)


@op("addmm", "baddbmm")
def _addmm(input, mat1, mat2, *, beta=1, alpha=1):
  return beta * input + alpha * jnp.matmul(mat1, mat2)


@op("linear")
def _linear(input, weight, bias=None):
  y = jnp.matmul(input, jnp.swapaxes(weight, -1, -2))
  return y if bias is None else y + bias
