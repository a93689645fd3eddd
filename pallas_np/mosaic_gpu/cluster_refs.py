"""``plgpu.cluster_ref(ref, {axis: index})``: the same SMEM buffer in
another block of the cluster (distributed shared memory), read and written
in place. Ref accessors have no run context, so the block a warpgroup
thread runs in is kept per thread (``activate``), set by the one context
builder (``pallas_np.mosaic_gpu.device_blocks``); the buffer's peer is found through the
allocation site (``cluster.ClusterState.peer_view``). Not seen by
``detect_races``; not available inside ``plgpu.warp_map`` warps."""
from __future__ import annotations

import threading

from pallas_np.errors import UnsupportedError
from pallas_np.state import peer_refs

_local = threading.local()


def activate(state) -> None:
  """The block (``threads.BlockState``) this warpgroup thread runs in."""
  _local.block = state


def _in_cluster(view, block_ids: dict):
  state = getattr(_local, "block", None)
  if state is None:
    raise UnsupportedError("pallas_np: plgpu.cluster_ref outside a warpgroup of a plgpu "
                           "kernel (inside a warp_map, or a pl.pallas_call)")
  cl = state.cluster
  if cl is None:  # a cluster of one block: every index is 0
    if any(i != 0 for i in block_ids.values()):
      raise IndexError(f"plgpu.cluster_ref to block {block_ids} of a cluster of one block")
    return view
  coords = list(cl.coords[state.index])
  for axis, i in block_ids.items():
    d = cl.names.index(axis)
    if not 0 <= i < cl.shape[d]:
      raise IndexError(f"plgpu.cluster_ref to block {i} along {axis!r} (size {cl.shape[d]})")
    coords[d] = i
  return cl.peer_view(view, cl.coords.index(tuple(coords)))


peer_refs.install_cluster_resolver(_in_cluster)
