"""``plgpu.async_store_smem``: a warpgroup stores a register array into the
SMEM of a block of its cluster (``cluster_idx`` along ``cluster_dim``; its
own block included), completing a barrier *in the destination block*.

As JAX's lowering: the issuer arrives on the destination's barrier expecting
the bytes, and the asynchronous stores complete them, so the destination's
wait on that barrier sees the data. Here the data lands when that wait
observes the phase (as TMA copies land, ``pallas_np.mosaic_gpu.copies``);
with ``atomic`` (add/max/min/and/or/xor) it is combined with what the
destination holds then, otherwise the destination holds the uninitialised
fill while the store is in flight. Not seen by ``detect_races``."""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.memory import fill_value
from pallas_np.mosaic_gpu import operands

_COMBINE = {"add": np.add, "max": np.maximum, "min": np.minimum, "and": np.bitwise_and,
            "or": np.bitwise_or, "xor": np.bitwise_xor}


def _lander(view, idx, data, combine):
  def land():
    with np.errstate(over="ignore"):
      view[idx] = data if combine is None else combine(view[idx], data)
  return land


def _target_block(state, cluster_dim, cluster_idx: int, source: str) -> int:
  """The block of ``state``'s cluster at ``cluster_idx`` along ``cluster_dim``."""
  cl = state.cluster
  if cl is None:  # a cluster of one block
    if cluster_idx != 0:
      raise IndexError(f"async_store_smem to block {cluster_idx} along {cluster_dim!r} of a "
                       f"cluster of one block, at {source}")
    return state.index
  axis = cluster_dim if isinstance(cluster_dim, int) else cl.names.index(cluster_dim)
  if not 0 <= cluster_idx < cl.shape[axis]:
    raise IndexError(f"async_store_smem to block {cluster_idx} along {cluster_dim!r} (size "
                     f"{cl.shape[axis]}), at {source}")
  coords = list(cl.coords[state.index])
  coords[axis] = cluster_idx
  return cl.coords.index(tuple(coords))


if jc.mgpu_primitive("async_store_smem_p") is not None:
  @registry.register(jc.mgpu_primitive("async_store_smem_p"), needs_ctx=True, foldable=False,
                     batch=registry.unbatched("stores into a block of the cluster"))
  def _async_store_smem(e):
    p = e.params
    get_ref, pos = operands.ref_accessor(e, 1, p["ref_transforms_treedef"], 4)
    get_bar, _ = operands.ref_accessor(e, 2, p["barrier_transforms_treedef"], pos)
    atomic = p.get("atomic")
    combine = None if atomic is None else _COMBINE[str(getattr(atomic, "value", atomic))]
    cluster_dim = p["cluster_dim"]
    poison = e.compiler.params.uninitialized == "nan" and combine is None
    params = e.compiler.params
    source = e.source

    def store(ctx, src, ref, barrier, cluster_idx, *rest):
      args = (src, ref, barrier, cluster_idx, *rest)
      state = operands.block_of(ctx)
      target = _target_block(state, cluster_dim, int(cluster_idx), source)
      view, idx = get_ref(args)
      bar_view, bar_idx = get_bar(args)
      if target != state.index:
        view = state.cluster.peer_view(view, target)
        bar = state.cluster.peer_barrier(bar_view, bar_idx, target)
      else:
        bar = operands.one_barrier(bar_view, bar_idx)
      data = np.array(src)
      if np.shape(view[idx]) != data.shape:
        raise ValueError(f"async_store_smem of shape {data.shape} into a ref window of shape "
                         f"{np.shape(view[idx])}, at {source}")
      if poison:  # in flight: the destination reads garbage (NaN) until the wait
        view[idx] = fill_value(view.dtype, params)
      bar.arrive(expect=1)
      bar.complete_tx(1, _lander(view, idx, data, combine))
      return []
    return store
