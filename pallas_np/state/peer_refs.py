"""``plgpu.remote_ref`` in ref accesses: the ``PeerMemRef`` transform names
the same kernel-level GMEM ref on another device. Only the Mosaic GPU
executor knows which device a warpgroup runs on, so it installs the
resolver (``pallas_np.mosaic_gpu.peers``); ``state.indexing`` applies it
before the other transforms (they commute, as JAX's ``commute_ndindexer``
says). ``plgpu.cluster_ref`` (``ClusterRefTransform``) likewise names the
same SMEM buffer in another block of the cluster (resolver:
``pallas_np.mosaic_gpu.cluster_refs``)."""
from __future__ import annotations

from pallas_np.errors import UnsupportedError

# fn(view, device_id, device_id_type) -> the peer's copy of view
_resolvers: list = []


def install_peer_resolver(fn) -> None:
  _resolvers[:] = [fn]


# fn(view, {cluster axis: block index}) -> view in that block of the cluster
_cluster_resolvers: list = []


def install_cluster_resolver(fn) -> None:
  _cluster_resolvers[:] = [fn]


def is_cluster_transform(t) -> bool:
  return type(t).__name__ == "ClusterRefTransform" and hasattr(t, "dims")


def cluster_view(t, dyn_type):
  """``f(view, leaves)``: ``view`` in the block of the cluster that ``t``
  (a ``ClusterRefTransform``) names."""
  def f(view, leaves):
    if not _cluster_resolvers:
      raise UnsupportedError("pallas_np: plgpu.cluster_ref outside a Mosaic GPU kernel")
    block = {d: int(leaves[x.k] if isinstance(x, dyn_type) else x)
             for d, x in zip(t.dims, t.idxs)}
    return _cluster_resolvers[0](view, block)
  return f


def peer_view(t, dyn_type):
  """``f(view, leaves)``: the peer's copy of ``view`` that ``t`` (a
  ``PeerMemRef`` whose dynamic leaves are ``dyn_type`` placeholders with
  their position ``k`` among ``leaves``) names."""
  dev = t.device_id

  def value(x, leaves):
    return int(leaves[x.k] if isinstance(x, dyn_type) else x)
  if isinstance(dev, dict):
    read = lambda leaves: {a: value(v, leaves) for a, v in dev.items()}  # noqa: E731
  elif isinstance(dev, (tuple, list)):
    read = lambda leaves: tuple(value(v, leaves) for v in dev)  # noqa: E731
  else:
    read = lambda leaves: value(dev, leaves)  # noqa: E731

  def f(view, leaves):
    if not _resolvers:
      raise UnsupportedError("pallas_np: plgpu.remote_ref outside a Mosaic GPU kernel")
    return _resolvers[0](view, read(leaves), t.device_id_type)
  return f
