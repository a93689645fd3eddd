"""Wrap a jnp function of arrays as a grid-less Pallas kernel (whole arrays as
blocks), so one interpret=True compile checks many ops at once."""
import jax
import numpy as np
from jax.experimental import pallas as pl

import pallas_np
from tests.helpers import INLINED, assert_identical, is_inlined


def kernel_call(fn, *args, interpret):
  """pallas_call whose kernel reads every input, applies ``fn`` and writes
  every output leaf (``fn`` returns an array or a tuple/list of arrays)."""
  args = [np.asarray(a) for a in args]
  out_struct = jax.eval_shape(fn, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args])
  leaves, treedef = jax.tree_util.tree_flatten(out_struct)

  def kernel(*refs):
    in_refs, out_refs = refs[:len(args)], refs[len(args):]
    vals = [r[...] for r in in_refs]
    outs = jax.tree_util.tree_leaves(fn(*vals))
    for o, v in zip(out_refs, outs):
      o[...] = v

  entry = pallas_np.pallas_call if is_inlined(interpret) else pl.pallas_call
  call = entry(kernel, out_shape=leaves, interpret=interpret)
  return jax.tree_util.tree_unflatten(treedef, call(*args))


def both(fn, *args):
  """(numpy-mode result, interpret=True result) as lists of np arrays; the
  kernel traced with ``fn``'s jit calls inlined must match the former."""
  got = jax.tree_util.tree_leaves(kernel_call(fn, *args, interpret="numpy"))
  assert_identical(kernel_call(fn, *args, interpret=INLINED), got)
  want = jax.tree_util.tree_leaves(kernel_call(fn, *args, interpret=True))
  return [np.asarray(g) for g in got], [np.asarray(w) for w in want]
