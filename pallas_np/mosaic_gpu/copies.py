"""TMA copies: ``copy_gmem_to_smem`` (lands at the wait on its barrier),
``copy_smem_to_gmem`` (lands at ``wait_smem_to_gmem`` or the block's end),
and the fences around them.

A copy reads its source when issued (what the GPU's TMA unit would read,
the kernel not racing it) and writes its destination only when the
synchronisation that completes it runs, so data is never visible before a
GPU would guarantee it (see ``pallas_np.mosaic_gpu.threads``). Under
``uninitialized="nan"`` (the default) the destination holds NaN (the
uninitialised fill) while the copy is in flight: a kernel that reads it
before the synchronisation reads NaN, even where old data was there."""
from __future__ import annotations

import linecache
import re

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import bit_width
from pallas_np.errors import UnsupportedError
from pallas_np.memory import fill_value
from pallas_np.mosaic_gpu import multicast, operands, race_clocks

_UNBATCHED = registry.unbatched("asynchronous copies are ordered by the block's barriers")


def source_line(source: str) -> str:
  """The code on the kernel line ``source`` ("file:line:col (function)")
  names, for errors a test matches against the kernel's code."""
  m = re.match(r"(.*?):(\d+)(?::\d+)?(?: \(.*\))?$", source or "")
  return linecache.getline(m.group(1), int(m.group(2))).strip() if m else ""


def check_whole_bytes(shape, dtype, what: str, source: str) -> None:
  """A TMA copy moves whole bytes (whole 16-byte rows, even): Mosaic GPU's
  lowering refuses a copy whose size in bits is not a multiple of 8 (its
  check on the copied rows, "Async copies require the number of bits copied
  along the last dimension to be divisible by 128", fires first)."""
  bits = int(np.prod(shape, dtype=np.int64)) * bit_width(dtype)
  if bits % 8:
    code = source_line(source)
    raise ValueError(
        f"{what} of {np.dtype(dtype).name}{list(shape)} ({bits} bits, not whole bytes) at "
        f"{source}{f': {code}' if code else ''}: a TMA copy moves whole bytes; Mosaic GPU's "
        "lowering refuses it (Async copies require the number of bits copied along the "
        "last dimension to be divisible by 128)")


def _writer(view, idx, data):
  def land():
    view[idx] = data
  return land


def _completed(land, det, key):
  """``land``, also ordering the warpgroup completing the copy after it."""
  def complete():
    det.acquire(key)
    land()
  return complete


@registry.register(jc.mgpu_primitive("copy_gmem_to_smem_p"), needs_ctx=True, foldable=False,
                   batch=_UNBATCHED)
def _copy_gmem_to_smem(e):
  p = e.params
  has_barrier = jc.copy_has_barrier(p)  # False: a cp.async copy (wait_gmem_to_smem)
  pos = 3 if has_barrier else 2
  get_src, pos = operands.ref_accessor(e, 0, p["src_transforms_treedef"], pos)
  get_dst, pos = operands.ref_accessor(e, 1, p["dst_transforms_treedef"], pos)
  get_bar = None
  if has_barrier:
    get_bar, pos = operands.ref_accessor(e, 2, p["barrier_transforms_treedef"], pos)
  pred_pos = pos if len(e.eqn.invars) > pos else None
  axes = p.get("collective_axes")
  params = e.compiler.params
  poison = params.uninitialized == "nan"
  leader_tracked = p.get("leader_tracked")
  source = e.source

  def copy(ctx, *args):
    if pred_pos is not None and not bool(args[pred_pos]):
      return []
    state = operands.block_of(ctx)
    if axes and state.cluster is not None:
      peers = state.cluster.peers(state.index, axes)
      if len(peers) > 1:
        if get_bar is None:
          raise UnsupportedError(f"pallas_np: a collective copy_gmem_to_smem without a "
                                 f"barrier, at {source}")
        multicast.collective_copy(state, peers, operands.tma_read(get_src, args),
                                  get_dst(args), get_bar(args),
                                  operands.window(get_src, args), leader_tracked, params,
                                  source)
        return []
    data = operands.tma_read(get_src, args)
    if get_bar is not None:  # a TMA copy (without a barrier: cp.async)
      check_whole_bytes(data.shape, data.dtype, "copy_gmem_to_smem", source)
    dst_view, dst_idx = get_dst(args)
    if np.shape(dst_view[dst_idx]) != data.shape:
      raise ValueError(f"copy_gmem_to_smem: source shape {data.shape} does not match "
                       f"destination shape {np.shape(dst_view[dst_idx])}, at {source}")
    if poison:  # in flight: reading the destination now reads garbage (NaN)
      dst_view[dst_idx] = fill_value(dst_view.dtype, params)
    land = _writer(dst_view, dst_idx, data)
    bar = None if get_bar is None else operands.one_barrier(*get_bar(args))
    det = race_clocks.current()
    if det is not None:  # the barrier's waiter (or wait_gmem_to_smem) acquires its clock
      key = det.issue("TMA", reads=[operands.window(get_src, args)],
                      writes=[(dst_view, dst_idx)],
                      key=None if bar is None else (bar, bar.phase))
      land = _completed(land, det, key) if bar is None else land
    if bar is None:
      operands.block_of(ctx).from_gmem.setdefault(operands.thread_of(ctx), []).append(land)
    else:
      bar.arrive(land)
    return []
  return copy


if jc.mgpu_primitive("wait_gmem_to_smem_p") is not None:
  @registry.register(jc.mgpu_primitive("wait_gmem_to_smem_p"), needs_ctx=True,
                     foldable=False, batch=_UNBATCHED)
  def _wait_gmem_to_smem(e):
    n = int(e.params["n"])

    def wait(ctx, *args):
      pending = operands.block_of(ctx).from_gmem.get(operands.thread_of(ctx), [])
      while len(pending) > n:
        pending.pop(0)()
      return []
    return wait


_REDUCE = {"add": np.add, "min": np.minimum, "max": np.maximum,
           "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}


@registry.register(jc.mgpu_primitive("copy_smem_to_gmem_p"), needs_ctx=True, foldable=False,
                   batch=_UNBATCHED)
def _copy_smem_to_gmem(e):
  p = e.params
  get_src, pos = operands.ref_accessor(e, 0, p["src_transforms_treedef"], 2)
  get_dst, pos = operands.ref_accessor(e, 1, p["dst_transforms_treedef"], pos)
  pred_pos = pos if p.get("has_user_predicate") else None
  params = e.compiler.params
  op = p.get("reduction_op")
  poison = None  # a reduction reads the destination: never poisoned
  if params.uninitialized == "nan" and op is None:
    poison = fill_value(e.in_avals[1].inner_aval.dtype, params)
  reduce = None
  source = e.source
  if op is not None:
    reduce = _REDUCE.get(str(op))
    if reduce is None:
      raise e.unsupported(f"copy_smem_to_gmem with reduction_op={op!r}")

  def copy(ctx, *args):
    if pred_pos is not None and not bool(args[pred_pos]):
      return []
    src = get_src(args)
    data = operands.read(*src)
    check_whole_bytes(data.shape, data.dtype, "copy_smem_to_gmem", source)
    land = operands.tma_writer(get_dst, args, data, reduce, poison=poison)
    det = race_clocks.current()
    if det is not None:  # the source is read until the copy completes
      land = _completed(land, det, det.issue("TMA", reads=[src], writes=[land.window]))
    operands.block_of(ctx).store_to_gmem(operands.thread_of(ctx), land)
    return []
  return copy


@registry.register(jc.mgpu_primitive("wait_smem_to_gmem_p"), needs_ctx=True, foldable=False,
                   batch=_UNBATCHED)
def _wait_smem_to_gmem(e):
  static_n = jc.static_wait_count(e.params)  # None: JAX 0.10 passes it as an operand

  def wait(ctx, *args):
    n = int(args[0]) if static_n is None else int(static_n)
    operands.block_of(ctx).flush_to_gmem(operands.thread_of(ctx), keep=n)
    return []
  return wait


def _no_op(e):
  return lambda *args: []


# Fences, grouping and prefetch hints: the copies above already read at issue
# and land in order, so these change nothing in the values a kernel can observe.
for _name in ("commit_smem_p", "commit_group_p", "commit_smem_to_gmem_group_p",
              "griddepcontrol_wait_p", "griddepcontrol_launch_dependents_p",
              "async_prefetch_p"):  # an L2 prefetch hint
  if jc.mgpu_primitive(_name) is not None:
    registry.register(jc.mgpu_primitive(_name), foldable=False, batch=registry.unbatched(
        "a fence: nothing to batch"))(_no_op)
