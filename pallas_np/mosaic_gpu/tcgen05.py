"""Blackwell's tensor core: TMEM (``plgpu.TMEM``), ``tcgen05_mma``,
``tcgen05_commit_arrive``, ``async_load_tmem``/``wait_load_tmem``,
``async_store_tmem``/``commit_tmem`` and ``async_copy_smem_to_tmem``.

TMEM buffers are NumPy arrays in their logical shape (``packed`` is a
layout). The tensor core runs its operations in issue order, so each one
runs when issued: ``acc = (acc if accumulate else 0) + a @ b`` with the
product in the accumulator's type, as JAX's GPU interpret mode computes it.
A kernel may only rely on the result after the barrier a
``tcgen05_commit_arrive`` (or the MMA's own ``barrier``) arrives on has been
waited for: ``detect_races=True`` reports an access before that
(``race_clocks``: the "MMA" agent); without detection such a kernel reads
the finished result (a GPU might not).

A collective MMA (``collective_axis``: 2 blocks of a cluster, the leader
issuing) computes in each block ``k`` of the pair ``acc_k (+)= a_k @ [b_0 |
b_1]``: each block holds half of M (its rows of ``a`` and of the
accumulator) and half of N (its columns of ``b``); its barrier arrival (and
a collective ``tcgen05_commit_arrive``) arrives in both blocks. Collective
copies into TMEM, block-scaled and sparse MMAs raise ``UnsupportedError``."""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import races, registry
from pallas_np.mosaic_gpu import operands, race_clocks

_UNBATCHED = registry.unbatched("the tensor core of one block")


def _no_collective(e):
  axis = e.params.get("collective_axis")
  if axis is not None:
    raise e.unsupported(f"{e.primitive.name} with collective_axis={axis!r} (a 2-block "
                        "cluster copy into TMEM)")


def _pair(ctx, axis, where):
  """(block state, [leader, peer]) of a collective (2-block) tensor-core
  operation along cluster axis ``axis``; None outside a cluster."""
  state = operands.block_of(ctx)
  cl = state.cluster
  if cl is None:
    return state, None
  peers = cl.peers(state.index, (axis,))
  if len(peers) == 1:
    return state, None
  if len(peers) != 2:
    raise ValueError(f"a collective tcgen05 operation along {axis!r} needs 2 blocks along it, "
                     f"not {len(peers)} (at {where})")
  return state, peers


@registry.register(jc.mgpu_primitive("tcgen05_mma_p"), foldable=False, batch=_UNBATCHED,
                   gemm=True)
def _tcgen05_mma(e):
  p = e.params
  if p.get("scaled") or p.get("sparse"):
    raise e.unsupported("tcgen05_mma with block scales or sparse metadata")
  arrive = bool(p.get("arrive"))
  pos = 4 + arrive
  get_acc, pos = operands.ref_accessor(e, 0, p.get("acc_transforms_tree"), pos)
  get_a, pos = operands.ref_accessor(e, 1, p.get("a_transforms_tree"), pos)
  get_b, pos = operands.ref_accessor(e, 2, p.get("b_transforms_tree"), pos)
  get_bar = None
  if arrive:
    get_bar, pos = operands.ref_accessor(e, 4, p.get("barrier_transforms_tree"), pos)
  acc_dt = np.dtype(e.in_avals[0].inner_aval.dtype)
  axis = p.get("collective_axis")
  where = e.source

  def run(det, accs, a_wins, b, bars, accumulate):
    """``acc_k = (acc_k if accumulate else 0) + a_k @ b`` for each block k,
    then one arrival on each barrier."""
    if det is not None:
      reads = a_wins + [w for w in b[1]] + (list(accs) if accumulate else [])
      det.issue("MMA", reads=reads, writes=list(accs),
                key=None if not bars else (bars[0], bars[0].phase))
      for bar in bars[1:]:
        det.release_agent("MMA", (bar, bar.phase))
    rhs = b[0].astype(acc_dt, copy=False)
    for (acc_view, acc_idx), a_win in zip(accs, a_wins):
      product = np.matmul(operands.read(*a_win).astype(acc_dt, copy=False), rhs)
      acc_view[acc_idx] = acc_view[acc_idx] + product if accumulate else product
    for bar in bars:
      bar.arrive()

  def mma(*args):
    b_win = get_b(args)
    bars = [operands.one_barrier(*get_bar(args))] if get_bar is not None else []
    run(race_clocks.current(), [get_acc(args)], [get_a(args)],
        (operands.read(*b_win), [b_win]), bars, bool(args[3]))
    return []

  def collective_mma(ctx, *args):
    state, pair = _pair(ctx, axis, where)
    if pair is None:
      return mma(*args)
    if state.index != pair[0]:  # only the leader block issues a 2-block MMA
      return []
    cl = state.cluster

    def peer(win, blk):
      return cl.peer_view(win[0], blk), win[1]
    acc, a_win, b_win = get_acc(args), get_a(args), get_b(args)
    b_wins = [peer(b_win, blk) for blk in pair]
    # Each block holds half of M (its rows of a and acc) and half of N (b's columns).
    rhs = np.concatenate([operands.read(*w) for w in b_wins], axis=-1)
    bars = []
    if get_bar is not None:
      bar_view, bar_idx = get_bar(args)
      bars = [cl.peer_barrier(bar_view, bar_idx, blk) for blk in pair]
    run(race_clocks.current(), [peer(acc, blk) for blk in pair],
        [peer(a_win, blk) for blk in pair], (rhs, b_wins), bars, bool(args[3]))
    return []
  return mma if axis is None else registry.NeedsCtx(collective_mma)


@registry.register(jc.mgpu_primitive("tcgen05_commit_arrive_p"), needs_ctx=True,
                   foldable=False, batch=_UNBATCHED)
def _tcgen05_commit_arrive(e):
  get, end = operands.ref_accessor(e, 0, e.params.get("barrier_transforms_tree"), 1)
  pred_pos = end if jc.has_user_predicate(e.params) else None
  axis = e.params.get("collective_axis")
  where = e.source

  def commit_arrive(ctx, *args):
    if pred_pos is not None and not bool(args[pred_pos]):
      return []
    view, idx = get(args)
    bars = [operands.one_barrier(view, idx)]
    if axis is not None:
      state, pair = _pair(ctx, axis, where)
      if pair is not None:
        if state.index != pair[0]:  # the leader commits for both blocks
          return []
        bars = [state.cluster.peer_barrier(view, idx, blk) for blk in pair]
    det = race_clocks.current()
    for bar in bars:
      if det is not None:  # the MMAs issued so far complete before the arrival
        det.release_agent("MMA", (bar, bar.phase))
      bar.arrive()
    return []
  return commit_arrive


_LOAD_REDUCE = {"max": lambda x: np.max(x, -1), "min": lambda x: np.min(x, -1),
                "absmax": lambda x: np.max(np.abs(x), -1),
                "absmin": lambda x: np.min(np.abs(x), -1)}


@registry.register(jc.mgpu_primitive("async_load_tmem_p"), foldable=False, batch=_UNBATCHED)
def _async_load_tmem(e):
  get, _ = operands.ref_accessor(e, 0, e.params["tree"], 1)
  reduce = jc.tmem_load_reduction(e.params)
  if reduce is not None and str(reduce) not in _LOAD_REDUCE:
    raise e.unsupported(f"async_load_tmem with reduce={reduce!r}")
  reducer = _LOAD_REDUCE.get(str(reduce))
  multiple = e.primitive.multiple_results

  def load(*args):
    view, idx = get(args)
    det = race_clocks.current()
    if det is not None:  # TMEM is read until wait_load_tmem
      det.tmem_load(view, idx)
    value = operands.read(view, idx)
    if reducer is not None:
      return [value, reducer(value).astype(value.dtype)]
    return [value] if multiple else value
  return load


def _wait_load_tmem(e):
  def wait(*args):
    det = race_clocks.current()
    if det is not None:
      det.wait_tmem_loads()
    return []
  return wait


@registry.register(jc.mgpu_primitive("async_store_tmem_p"), foldable=False, batch=_UNBATCHED)
def _async_store_tmem(e):
  return operands.store_rule(e)


@registry.register(jc.mgpu_primitive("async_copy_smem_to_tmem_p"), foldable=False,
                   batch=_UNBATCHED)
def _async_copy_smem_to_tmem(e):
  _no_collective(e)
  p = e.params
  get_src, pos = operands.ref_accessor(e, 0, p["smem_tree"], 2)
  get_dst, pos = operands.ref_accessor(e, 1, p["tmem_tree"], pos)

  def copy(*args):
    src, dst = get_src(args), get_dst(args)
    det = race_clocks.current()
    if det is not None:  # the tensor core copies, in order with its MMAs
      det.issue("MMA", reads=[src], writes=[dst])
    data = operands.read(*src)
    if np.shape(dst[0][dst[1]]) != data.shape:
      raise ValueError(f"async_copy_smem_to_tmem: source shape {data.shape} does not match "
                       f"destination shape {np.shape(dst[0][dst[1]])}")
    dst[0][dst[1]] = data
    return []
  return copy


def _no_op(e):
  return lambda *args: []


if jc.mgpu_primitive("wait_load_tmem_p") is not None:
  registry.register(jc.mgpu_primitive("wait_load_tmem_p"), foldable=False,
                    batch=_UNBATCHED)(_wait_load_tmem)
if jc.mgpu_primitive("commit_tmem_p") is not None:
  # Makes async_store_tmem visible to the tensor core: stores land when issued here.
  registry.register(jc.mgpu_primitive("commit_tmem_p"), foldable=False,
                    batch=_UNBATCHED)(_no_op)
