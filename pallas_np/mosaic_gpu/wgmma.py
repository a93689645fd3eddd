"""Warpgroup matrix multiply: ``wgmma`` into an accumulator ref,
``wgmma_wait``, reading/writing the accumulator.

The product runs when issued (``acc += a @ b`` with products and sums in the
accumulator's type, f32 for f16/bf16 operands as on Hopper); ``wgmma_wait``
has nothing left to wait for. Operands are SMEM refs (with tiling/swizzle
transforms: layout only, see ``pallas_np.mosaic_gpu``) or, for ``a``, a
register value."""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.mosaic_gpu import operands

_UNBATCHED = registry.unbatched("wgmma updates an accumulator of one warpgroup")


def _operand(e, pos, tree, start):
  if isinstance(e.in_avals[pos], jc.AbstractRef):
    get, nxt = operands.ref_accessor(e, pos, tree, start)
    return (lambda args: operands.read(*get(args))), nxt
  return (lambda args: np.asarray(args[pos])), start + operands.num_leaves(tree)


@registry.register(jc.mgpu_primitive("wgmma_ref_p"), foldable=False, batch=_UNBATCHED, gemm=True)
def _wgmma_ref(e):
  p = e.params
  get_acc, pos = operands.ref_accessor(e, 0, p.get("acc_transforms_tree"), 3)
  get_a, pos = _operand(e, 1, p.get("a_transforms_tree"), pos)
  get_b, pos = _operand(e, 2, p.get("b_transforms_tree"), pos)
  acc_dt = np.dtype(e.in_avals[0].inner_aval.dtype)

  def wgmma(*args):
    view, idx = get_acc(args)
    a = get_a(args).astype(acc_dt, copy=False)
    b = get_b(args).astype(acc_dt, copy=False)
    view[idx] = view[idx] + np.matmul(a, b)
    return []
  return wgmma


@registry.register(jc.mgpu_primitive("wgmma_accumulator_deref_p"), batch=_UNBATCHED,
                   foldable=False)
def _wgmma_accumulator_deref(e):
  return lambda acc: np.array(acc)


@registry.register(jc.mgpu_primitive("wgmma_accumulator_store_p"), batch=_UNBATCHED,
                   foldable=False)
def _wgmma_accumulator_store(e):
  def store(acc, value):
    acc[...] = value
    return np.array(value)
  return store


@registry.register(jc.mgpu_primitive("wgmma_wait_p"), foldable=False, batch=registry.unbatched(
    "a fence: nothing to batch"))
def _wgmma_wait(e):
  return lambda *args: []
