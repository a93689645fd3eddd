"""Clusters of more than one block: what their blocks share.

The blocks of a cluster run as threads of one scheduler
(``threads.Scheduler``); each block has its own SMEM, TMEM and barriers, and a
block reaches a peer's through ``ClusterState``: the same allocation site
(collective ``run_scoped`` entry) in the other block, at the same offset.
This serves ``plgpu.ClusterBarrier`` (an arrival arrives in every block
along its ``collective_axes``, or in the leader's only when
``leader_tracked``), multicast and partitioned TMA copies (``copies``),
collective (2-block) ``tcgen05_mma`` (``tcgen05``) and cluster launch
control (``try_cluster_cancel``/``query_cluster_cancel``: ``WorkQueue``)."""
from __future__ import annotations

import itertools

import numpy as np

from pallas_np import _compat as jc
from pallas_np import memory, races, registry
from pallas_np.errors import UnsupportedError
from pallas_np.mosaic_gpu import operands, race_clocks, threads


def _root(view: np.ndarray) -> np.ndarray:
  while isinstance(view.base, np.ndarray):
    view = view.base
  return view


class ClusterBarrierCell(threads.Barrier):
  """One block's copy of a ``plgpu.ClusterBarrier``: it expects
  ``num_arrivals`` from each block along ``axes`` (set when its cluster
  registers it; a one-block cluster keeps ``num_arrivals``)."""
  __slots__ = ("axes", "leader_tracked", "per_block")

  def __init__(self, num_arrivals: int, axes, leader_tracked: bool):
    super().__init__(num_arrivals)
    self.per_block = num_arrivals
    self.axes = tuple(axes)
    self.leader_tracked = leader_tracked


def _cluster_barriers(shape, dtype) -> np.ndarray:
  arr = np.empty(shape, object)
  for idx in np.ndindex(*arr.shape):
    arr[idx] = ClusterBarrierCell(int(dtype.num_arrivals), dtype.collective_axes,
                                  bool(getattr(dtype, "leader_tracked", False)))
  return arr


if jc.mgpu_core is not None and getattr(jc.mgpu_core, "ClusterBarrierType", None) is not None:
  memory.register_allocator(jc.mgpu_core.ClusterBarrierType, _cluster_barriers)


class WorkQueue:
  """Cluster launch control: the clusters (grid points) in launch order;
  ``try_cluster_cancel`` claims the first one the GPU has not launched yet,
  so the loop of ``plgpu.dynamic_scheduling_loop`` visits every work item
  exactly once.

  ``resident`` clusters are launched at once (a GPU runs one per group of
  SMs: the device's SM count over the cluster size, when the device says,
  as under the device persona; else 1), and one more each time one
  finishes; clusters run one after another here, so a cluster claims only
  among those not launched: the first ``resident`` clusters always run, as
  on a GPU whose SMs each hold one of them."""

  def __init__(self, grid_shape, resident: int = 1):
    self.grid = tuple(int(g) for g in grid_shape)
    self.order = list(itertools.product(*map(range, grid_shape)))
    self.claimed: set = set()
    self.next = 0  # the next cluster to run, in launch order
    self.frontier = min(max(1, int(resident)), len(self.order))  # [0, frontier): launched

  def launch(self):
    """The clusters to run, in order, skipping those claimed meanwhile."""
    started = False
    while self.next < len(self.order):
      point = self.order[self.next]
      self.next += 1
      if point in self.claimed:
        continue
      if started:  # the previous cluster finished: its SMs launch the next
        self._launch_one()
      started = True
      yield point

  def _launch_one(self):
    while self.frontier < len(self.order) and self.order[self.frontier] in self.claimed:
      self.frontier += 1
    self.frontier = min(self.frontier + 1, len(self.order))

  def claim(self):
    for i in range(max(self.frontier, self.next), len(self.order)):
      point = self.order[i]
      if point not in self.claimed:
        self.claimed.add(point)
        return point
    return None


def resident_clusters(cluster_size: int) -> int:
  """Clusters a GPU holds at once: its SM count (``core_count`` of JAX's
  device: the hardware's, or the device persona's) over the cluster size;
  1 where the device does not say (a CPU)."""
  import jax
  sms = getattr(jax.devices()[0], "core_count", None)
  return max(1, int(sms) // max(1, int(cluster_size))) if isinstance(sms, int) else 1


class ClusterState:
  """The blocks of one cluster and the buffers they can reach in each other."""

  def __init__(self, names, shape, grid_point, work: WorkQueue | None):
    self.names = tuple(names)
    self.shape = tuple(int(s) for s in shape)
    self.size = int(np.prod(self.shape, dtype=np.int64))
    self.grid_point = tuple(grid_point)
    self.work = work
    self.coords = list(itertools.product(*map(range, self.shape)))
    self._bufs: dict = {}  # (block, site key) -> buffers
    self._sites: dict = {}  # id(root) -> (block, site key, position)
    self._fresh: dict = {}  # site key -> its allocator

  # -- buffers of an allocation site in every block ---------------------------------
  def buffers(self, block: int, key, fresh):
    hit = self._bufs.get((block, key))
    if hit is None:
      hit = self._bufs[(block, key)] = fresh()
      for i, buf in enumerate(hit):
        if isinstance(buf, np.ndarray):
          self._sites[id(_root(buf))] = (block, key, i)
          if buf.dtype == object:
            self._link_barriers(buf)
      self._fresh[key] = fresh
    return hit

  def _link_barriers(self, arr):
    for cell in arr.reshape(-1):
      if isinstance(cell, ClusterBarrierCell):
        cell.num_arrivals = cell.per_block * self.arrivals_along(cell.axes)

  def _site(self, view: np.ndarray):
    hit = self._sites.get(id(_root(view)))
    if hit is None:
      raise UnsupportedError(
          "pallas_np: a cluster operation names a buffer that is not a kernel scratch buffer "
          "or a collective pl.run_scoped allocation: its peers in the other blocks of the "
          "cluster are unknown")
    return hit

  def peer_view(self, view: np.ndarray, block: int) -> np.ndarray:
    """``view`` (a view of a scratch buffer of some block) in ``block``."""
    owner, key, pos = self._site(view)
    if owner == block:
      return view
    mine = self._bufs[(owner, key)][pos]
    peer = self.buffers(block, key, self._fresh[key])[pos]
    if view.dtype == object:
      flat = _root(view).reshape(-1)
      cells = [flat_index(flat, c) for c in view.reshape(-1)]
      return peer.reshape(-1)[cells].reshape(view.shape)
    # Same offset from the buffer's start (buffers sit at different offsets
    # of their raw allocations: memory.aligned_empty).
    peer_root = _root(peer)
    offset = (_address(peer) - _address(peer_root)) + (_address(view) - _address(mine))
    return np.ndarray(view.shape, view.dtype, buffer=peer_root, offset=offset,
                      strides=view.strides)

  def peer_barrier(self, view, idx, block: int) -> threads.Barrier:
    return operands.one_barrier(self.peer_view(view, block), idx)

  # -- cluster geometry -------------------------------------------------------------
  def _axis_positions(self, axes) -> list[int]:
    out = []
    for a in axes:
      for n in (a if isinstance(a, tuple) else (a,)):
        if n not in self.names:
          raise UnsupportedError(f"pallas_np: {n!r} is not a cluster axis of this kernel "
                                 f"(cluster axes: {self.names})")
        out.append(self.names.index(n))
    return out

  def arrivals_along(self, axes) -> int:
    """Blocks whose arrivals a cluster barrier over ``axes`` counts."""
    groups = [[self.names.index(n) for n in (a if isinstance(a, tuple) else (a,))
               if n in self.names] for a in axes]
    sizes = [int(np.prod([self.shape[d] for d in g], dtype=np.int64)) for g in groups]
    return sum(sizes) - len(sizes) + 1

  def peers(self, block: int, axes) -> list[int]:
    """The blocks that differ from ``block`` only along ``axes`` (in
    collective order: the leader, index 0 along them, first)."""
    dims = set(self._axis_positions(axes))
    mine = self.coords[block]
    return [b for b, c in enumerate(self.coords)
            if all(c[d] == mine[d] for d in range(len(mine)) if d not in dims)]

  def arrival_targets(self, block: int, axes) -> list[int]:
    """A cluster barrier arrival: every block that differs from ``block``
    in at most one of ``axes`` (each axis group on its own)."""
    out = []
    for a in axes:
      for b in self.peers(block, (a,)):
        if b not in out:
          out.append(b)
    return out or [block]

  def describe(self, block: int) -> str:
    return str(self.grid_point + self.coords[block])


def _address(a: np.ndarray) -> int:
  return a.__array_interface__["data"][0]


def flat_index(flat: np.ndarray, cell) -> int:
  for i, c in enumerate(flat):
    if c is cell:
      return i
  raise ValueError("barrier not found in its buffer")


# -- cluster launch control: plgpu.dynamic_scheduling_loop ---------------------------
_UNBATCHED = registry.unbatched("cluster launch control of one cluster")


def _encode(point, success: bool, grid) -> np.ndarray:
  """The 16-byte response: the claimed cluster's grid coordinates (a grid of
  more than 3 axes squashed into 3, the leading axes into one, as JAX's
  lowering launches it), success."""
  if len(point) > 3:
    point = (int(np.ravel_multi_index(tuple(point[:-2]), tuple(grid[:-2]))), *point[-2:])
  words = [*point, *([0] * (3 - len(point))), int(success)]
  return np.array(words, np.int32).view(np.int8)


def _decode(words, grid) -> tuple:
  """The grid point of a response's coordinates (``_encode``'s inverse)."""
  if len(grid) <= 3:
    return tuple(int(w) for w in words[:len(grid)])
  lead = np.unravel_index(int(words[0]), tuple(grid[:-2]))
  return (*(int(c) for c in lead), int(words[1]), int(words[2]))


def _sole_issuer(state, axes, thread_axis, num_threads) -> bool:
  """Does one thread of the whole cluster issue the cancellation (so a
  claimed cluster is not claimed twice)?"""
  if num_threads > 1 and thread_axis not in axes:
    return False
  cl = state.cluster
  if cl is None:
    return True
  return all(size == 1 or name in axes for name, size in zip(cl.names, cl.shape))


if jc.mgpu_primitive("try_cluster_cancel_p") is not None:
  @registry.register(jc.mgpu_primitive("try_cluster_cancel_p"), needs_ctx=True,
                     foldable=False, batch=_UNBATCHED)
  def _try_cluster_cancel(e):
    p = e.params
    get_res, pos = operands.ref_accessor(e, 0, p.get("result_transforms_tree"), 2)
    get_bar, _ = operands.ref_accessor(e, 1, p.get("barrier_transforms_tree"), pos)
    given = p.get("collective_axes")  # JAX 0.10: none (wg 0 of the cluster's block 0)

    def try_cancel(ctx, *args):
      state = operands.block_of(ctx)
      t = ctx.family.thread if ctx.family is not None else 0
      thread_axis = state.thread_axis
      cl = state.cluster
      if given is None:
        axes = (*(cl.names if cl else ()), thread_axis)
      else:
        axes = tuple(given)
      first_wg = t == 0 if thread_axis in axes else True
      mine = cl.coords[state.index] if cl else ()
      first_block = all(c == 0 for n, c in zip(cl.names, mine) if n in axes) if cl else True
      res_view, res_idx = get_res(args)
      bar_view, bar_idx = get_bar(args)
      bar = operands.one_barrier(bar_view, bar_idx)
      bar.arrive(expect=1 if first_wg else 0)
      if not (first_wg and first_block):
        return []
      if _sole_issuer(state, axes, thread_axis, state.num_threads):
        point = state.work.claim()
        response = _encode(point or (), point is not None, state.work.grid)
        targets = range(cl.size) if cl else (state.index,)
      else:  # several issuers: each request fails (a GPU may fail any of them)
        response = _encode((), False, state.work.grid)
        targets = (state.index,)
      for b in targets:
        view = cl.peer_view(res_view, b) if cl else res_view
        peer_bar = cl.peer_barrier(bar_view, bar_idx, b) if cl else bar
        det = race_clocks.current()
        if det is not None:
          det.issue("TMA", writes=[(view, res_idx)], key=(peer_bar, peer_bar.phase))
        peer_bar.complete_tx(1, _writer(view, res_idx, response))
      return []
    return try_cancel


def _writer(view, idx, data):
  def land():
    view[idx] = data
  return land


if jc.mgpu_primitive("query_cluster_cancel_p") is not None:
  @registry.register(jc.mgpu_primitive("query_cluster_cancel_p"), needs_ctx=True,
                     foldable=False, batch=_UNBATCHED)
  def _query_cluster_cancel(e):
    get, _ = operands.ref_accessor(e, 0, e.params.get("transforms_tree"), 1)
    wanted = tuple(e.params["grid_names"])

    def query(ctx, *args):
      view, idx = get(args)
      races.note(view, idx, "read")
      words = np.ascontiguousarray(view[idx]).view(np.int32)
      state = operands.block_of(ctx)
      grid_names = list(state.grid_names)
      point = _decode(words, state.work.grid)
      out = [np.int32(point[grid_names.index(n)]) for n in wanted]
      return [*out, np.bool_(words[3] != 0)]
    return query
