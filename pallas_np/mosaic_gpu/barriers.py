"""``plgpu.Barrier`` scratch, ``barrier_arrive``, ``barrier_wait`` and
``barrier_test``.

A barrier ref is an object array of ``threads.Barrier``. A wait observes the
next phase of its thread: it blocks (hands the baton to another warpgroup)
until that phase completes, then writes the copies issued on that phase.
A wait that can never complete raises (``threads.BarrierDeadlock``)."""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import memory, registry
from pallas_np.mosaic_gpu import cluster, operands, race_clocks, threads

memory.register_allocator(jc.mgpu_core.BarrierType, threads.new_barriers)


_UNBATCHED = registry.unbatched("barriers synchronise the warpgroups of one block")


def _has_predicate(e) -> bool:
  return jc.has_user_predicate(e.params)


def arrive_on(ctx, view, idx):
  """One arrival on the barrier ``view[idx]`` names: on a
  ``plgpu.ClusterBarrier`` in a cluster, on its copy in every block along
  its axes (only the leader's when ``leader_tracked``)."""
  bar = operands.one_barrier(view, idx)
  targets = [bar]
  state = operands.block_of(ctx)
  if isinstance(bar, cluster.ClusterBarrierCell) and state.cluster is not None:
    cl = state.cluster
    blocks = (cl.peers(state.index, bar.axes)[:1] if bar.leader_tracked
              else cl.arrival_targets(state.index, bar.axes))
    targets = [cl.peer_barrier(view, idx, b) for b in blocks]
  for b in targets:
    race_clocks.release((b, b.phase))
    b.arrive()


def barrier_wait(ctx, bar: threads.Barrier, source: str):
  st = operands.block_of(ctx)
  t = operands.thread_of(ctx)
  target = bar.observed.get(t, 0) + 1
  if bar.phase > target:
    # JAX's GPU interpreter's words first (its test file checks them): phases
    # counted from 1 there, from 0 in the rest of this message.
    raise ValueError(
        f"pallas_np: Thread {ctx.family.thread if ctx.family is not None else 0} is awaiting phase {target}, but barrier is already at phase "
        f"{bar.phase}: {operands.thread_name(ctx)} waits for phase {target - 1} of a barrier "
        f"that has already completed phase {bar.phase - 1} (block {st.block}, at {source}); "
        "a thread that waits on a barrier must observe every phase")
  st.wait_until(ctx, lambda: bar.phase >= target,
                f"barrier_wait (phase {target - 1} of {bar!r})", source)
  bar.observed[t] = target
  race_clocks.acquire((bar, target - 1))
  bar.land(target - 1)


@registry.register(jc.mgpu_primitive("barrier_wait_p"), needs_ctx=True, foldable=False,
                   batch=_UNBATCHED)
def _barrier_wait(e):
  get, _ = operands.ref_accessor(e, 0, e.params["transforms_treedef"], 1)
  source = e.source

  def wait(ctx, *args):
    barrier_wait(ctx, operands.one_barrier(*get(args)), source)
    return []
  return wait


@registry.register(jc.mgpu_primitive("barrier_arrive_p"), needs_ctx=True, foldable=False,
                   batch=_UNBATCHED)
def _barrier_arrive(e):
  get, end = operands.ref_accessor(e, 0, e.params["transforms_treedef"], 1)
  pred_pos = end if _has_predicate(e) else None

  def arrive(ctx, *args):
    if pred_pos is None or bool(args[pred_pos]):
      arrive_on(ctx, *get(args))
    return []
  return arrive


if jc.mgpu_primitive("barrier_arrive_and_wait_p") is not None:
  @registry.register(jc.mgpu_primitive("barrier_arrive_and_wait_p"), needs_ctx=True,
                     foldable=False, batch=_UNBATCHED)
  def _barrier_arrive_and_wait(e):
    get, _ = operands.ref_accessor(e, 0, e.params["transforms_treedef"], 1)
    source = e.source

    def arrive_and_wait(ctx, *args):
      view, idx = get(args)
      arrive_on(ctx, view, idx)
      barrier_wait(ctx, operands.one_barrier(view, idx), source)
      return []
    return arrive_and_wait


def _hand_on_once():
  """A predicate false on its first call, then true: waiting on it hands
  the baton round the other threads once (a failed ``barrier_test`` in a
  spin loop lets the threads that would complete the phase run)."""
  calls = []

  def predicate():
    calls.append(None)
    return len(calls) > 1
  return predicate


if jc.mgpu_primitive("barrier_test_p") is not None:
  @registry.register(jc.mgpu_primitive("barrier_test_p"), needs_ctx=True, foldable=False,
                     batch=_UNBATCHED)
  def _barrier_test(e):
    """``plgpu.barrier_test``: has the phase this warp waits for next
    completed? If so the warp has observed it (as a wait would: the copies
    of that phase land); if not, the other threads get a turn. Only in a
    warp (``plgpu.warp_map``), as JAX's lowering (elsewhere: "Unimplemented
    primitive in Pallas Mosaic GPU lowering")."""
    get, _ = operands.ref_accessor(e, 0, e.params["transforms_treedef"], 1)
    source = e.source

    def test(ctx, *args):
      st = operands.block_of(ctx)
      if not operands.in_warp(ctx):
        raise e.unsupported("barrier_test outside a warp (plgpu.warp_map): JAX's lowering "
                            "refuses it too (Unimplemented primitive in Pallas Mosaic GPU "
                            "lowering)")
      bar = operands.one_barrier(*get(args))
      t = operands.thread_of(ctx)
      target = bar.observed.get(t, 0) + 1
      if bar.phase >= target:
        barrier_wait(ctx, bar, source)
        return np.bool_(True)
      st.wait_until(ctx, _hand_on_once(), "barrier_test", source)
      return np.bool_(False)
    return test
