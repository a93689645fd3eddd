"""Wrap a jnp function of arrays as a grid-less Pallas kernel (whole arrays as
blocks), so one interpret=True compile checks many ops at once."""
import jax
import numpy as np
from jax.experimental import pallas as pl


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

  call = pl.pallas_call(kernel, out_shape=leaves, interpret=interpret)
  return jax.tree_util.tree_unflatten(treedef, call(*args))


def both(fn, *args):
  """(numpy-mode result, interpret=True result) as lists of np arrays."""
  got = jax.tree_util.tree_leaves(kernel_call(fn, *args, interpret="numpy"))
  want = jax.tree_util.tree_leaves(kernel_call(fn, *args, interpret=True))
  return [np.asarray(g) for g in got], [np.asarray(w) for w in want]
