"""``copy_gmem_to_smem`` over the blocks of a cluster (``collective_axes``):
multicast, and the leader-tracked forms (``leader_tracked=
plgpu.CopyPartition.PARTITIONED(axis)`` / ``REPLICATED``).

Every block along the collective axes issues the same copy. As on the GPU's
mbarriers, a barrier phase completes when its arrivals are in *and* the
transaction units it expects have arrived (``threads.Barrier.complete_tx``):

* multicast: each block's copy arrives on its own barrier expecting one unit
  per block, and delivers the data and one unit to the barrier of every block
  along the axes; the data lands in each block's SMEM when that block's wait
  observes the phase, so only once every block issued its part;
* ``PARTITIONED(axis)``: block ``k`` receives slice ``k`` (along ``axis``) of
  the source window; only the leader's barrier (block 0 along the axes)
  tracks the copy: the leader's copy arrives on it expecting one unit per
  block, and every block's slice lands (in its own SMEM) when the leader's
  wait observes that phase; the other blocks' barriers are not touched;
* ``REPLICATED``: as partitioned, but every block receives the whole window."""
from __future__ import annotations

import numpy as np

from pallas_np.memory import fill_value
from pallas_np.mosaic_gpu import race_clocks


def _writer(view, idx, data):
  def land():
    view[idx] = data
  return land


def _partition(leader_tracked):
  """('multicast' | 'partitioned' | 'replicated', axis)."""
  if leader_tracked is None:
    return "multicast", None
  axis = getattr(leader_tracked, "axis", None)
  if axis is not None:
    return "partitioned", int(axis)
  return "replicated", None


def collective_copy(state, peers, data, dst, bar_ref, window, leader_tracked, params, source):
  """Issue block ``state.index``'s part of a collective copy of ``data``
  (its source window, identical in every block) into ``dst`` = (view, idx)
  of each block in ``peers`` (leader first), tracked by ``bar_ref`` =
  (view, idx) of the barrier operand."""
  cl = state.cluster
  k = peers.index(state.index)
  n = len(peers)
  kind, axis = _partition(leader_tracked)
  dst_view, dst_idx = dst
  bar_view, bar_idx = bar_ref
  if kind == "partitioned":
    if data.shape[axis] % n:
      raise ValueError(f"copy_gmem_to_smem partitioned along axis {axis} over {n} blocks: "
                       f"the source window {data.shape} does not split evenly, at {source}")
    size = data.shape[axis] // n
    data = np.take(data, np.arange(k * size, (k + 1) * size), axis=axis)
  shape = np.shape(dst_view[dst_idx])
  if shape != data.shape:
    raise ValueError(f"copy_gmem_to_smem: source shape {data.shape} does not match "
                     f"destination shape {shape}, at {source}")
  part = Ellipsis
  if kind == "multicast":
    # Each block fetches one part of the window (along its first axis that
    # splits evenly; block 0 all of it where none does) and sends it to all.
    targets = [(cl.peer_view(dst_view, b), cl.peer_barrier(bar_view, bar_idx, b)) for b in peers]
    own = cl.peer_barrier(bar_view, bar_idx, state.index)
    part = _part(data.shape, k, n)
    data = data[part] if part is not None else data[:0]
  else:  # leader-tracked: my SMEM, the leader's barrier
    leader = cl.peer_barrier(bar_view, bar_idx, peers[0])
    targets = [(dst_view, leader)]
    own = leader if k == 0 else None
  dsts = [(view, dst_idx) for view, _ in targets]
  if part is not Ellipsis:  # this block's part of each destination
    dsts = [] if part is None else [(_Sub(view, dst_idx), part) for view, _ in targets]
  if params.uninitialized == "nan":  # in flight: the destinations read garbage (NaN)
    for view, idx in dsts:
      view[idx] = fill_value(view.dtype, params)
  det = race_clocks.current()
  if det is not None:
    det.issue("TMA", reads=[window], writes=[d for d in dsts if isinstance(d[0], np.ndarray)],
              key=(targets[0][1], targets[0][1].phase))
    for _, bar in targets[1:]:
      det.release_agent("TMA", (bar, bar.phase))
  if own is not None:
    own.arrive(expect=n)
  for (_, bar), (view, idx) in zip(targets, dsts or [(None, None)] * len(targets)):
    bar.complete_tx(1, None if view is None else _writer(view, idx, data))


def _part(shape, k: int, n: int):
  """Block ``k``'s part (an index) of a multicast window of ``shape``."""
  for axis, size in enumerate(shape):
    if size % n == 0:
      step = size // n
      return (slice(None),) * axis + (slice(k * step, (k + 1) * step),)
  return Ellipsis if k == 0 else None


def _Sub(view, idx):  # noqa: N802 - a view, named like the class it stands for
  """``view[idx]`` as a view (basic indexing only: TMA windows are boxes)."""
  sub = view[idx]
  if not isinstance(sub, np.ndarray) or not np.shares_memory(sub, view):
    raise ValueError("a multicast copy into a non-box SMEM window")
  return sub
