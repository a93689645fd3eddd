"""Warpgroup matrix multiply: ``wgmma`` into an accumulator ref,
``wgmma_wait``, reading/writing the accumulator; ``plgpu.mma`` (Ampere's
register-level MMA, JAX >= 0.11).

The product runs when issued (``acc += a @ b`` with products and sums in the
accumulator's type, f32 for f16/bf16 operands as on Hopper); ``wgmma_wait``
has nothing left to wait for. Operands are SMEM refs (with tiling/swizzle
transforms: layout only, see ``pallas_np.mosaic_gpu``) or, for ``a``, a
register value."""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.mosaic_gpu import operands, race_clocks

_UNBATCHED = registry.unbatched("wgmma updates an accumulator of one warpgroup")


def _operand(e, pos, tree, start):
  if isinstance(e.in_avals[pos], jc.AbstractRef):
    get, nxt = operands.ref_accessor(e, pos, tree, start)
    read = lambda args: operands.read(*get(args))  # noqa: E731
    read.window = get
    return read, nxt
  return (lambda args: np.asarray(args[pos])), start + operands.num_leaves(tree)


@registry.register(jc.mgpu_primitive("wgmma_ref_p"), foldable=False, batch=_UNBATCHED, gemm=True)
def _wgmma_ref(e):
  p = e.params
  get_acc, pos = operands.ref_accessor(e, 0, p.get("acc_transforms_tree"), 3)
  get_a, pos = _operand(e, 1, p.get("a_transforms_tree"), pos)
  get_b, pos = _operand(e, 2, p.get("b_transforms_tree"), pos)
  acc_dt = np.dtype(e.in_avals[0].inner_aval.dtype)

  smem = [g.window for g in (get_a, get_b) if hasattr(g, "window")]

  def wgmma(*args):
    det = race_clocks.current()
    if det is not None:  # the tensor core reads the SMEM operands until wgmma_wait
      det.wgmma(reads=[get(args) for get in smem])
    view, idx = get_acc(args)
    a = get_a(args).astype(acc_dt, copy=False)
    b = get_b(args).astype(acc_dt, copy=False)
    view[idx] = view[idx] + np.matmul(a, b)
    return []
  return wgmma


@registry.register(jc.mgpu_primitive("wgmma_accumulator_deref_p"), batch=_UNBATCHED,
                   foldable=False)
def _wgmma_accumulator_deref(e):
  wait_n = e.params.get("wait_n", 0)  # it waits for all but wait_n wgmmas first

  def deref(acc):
    det = race_clocks.current()
    if det is not None and wait_n is not None:
      det.wgmma_wait(int(wait_n))
    return np.array(acc)
  return deref


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
  keep = jc.static_wait_count(e.params)

  def wait(*args):
    det = race_clocks.current()
    if det is not None:
      det.wgmma_wait(int(args[0]) if keep is None else int(keep))
    return []
  return wait


if jc.mgpu_primitive("mma_p") is not None:  # JAX >= 0.11: plgpu.mma
  @registry.register(jc.mgpu_primitive("mma_p"), batch=registry.unbatched(
      "a warpgroup's register-level MMA"), gemm=True)
  def _mma(e):
    """``plgpu.mma(acc, a, b)``: ``acc + a @ b`` on register values (Ampere
    ``mma.sync``), synchronous; products and sums in the accumulator's type,
    as ``wgmma`` (int32 for integer operands, wrapping)."""
    acc_dt = np.dtype(e.out_avals[0].dtype)

    def mma(acc, a, b):
      with np.errstate(over="ignore"):
        prod = np.matmul(np.asarray(a).astype(acc_dt), np.asarray(b).astype(acc_dt))
        return (np.asarray(acc, acc_dt) + prod).astype(acc_dt, copy=False)
    return mma
