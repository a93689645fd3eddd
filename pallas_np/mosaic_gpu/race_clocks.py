"""Races in Mosaic GPU kernels: ``InterpretParams(detect_races=True)``.

Vector clocks of the clock library (``pallas_np.clocks``) order the accesses
of the threads of a cluster. Each warpgroup (and warp) of each block has
four *agents*, each a thread with a clock: itself, its TMA unit (the copies
it issues), its tensor core (``wgmma``, ``tcgen05_mma``) and its TMEM
loads. Happens-before edges:

* ``barrier_arrive`` (and a copy's arrival) releases its clock onto the
  barrier's phase; the ``barrier_wait`` that observes the phase acquires it;
  ``semaphore_signal`` releases onto the semaphore, a returned
  ``semaphore_wait`` acquires it;
* issuing an asynchronous copy or ``wgmma`` orders the agent after the
  issuing warpgroup; its completion (the barrier wait, ``wait_smem_to_gmem``,
  ``wait_gmem_to_smem``, ``wgmma_wait``) orders the waiter after the agent.

Clusters of a kernel without semaphore waits run one after another and never
order each other (only atomics share GMEM between them safely): each has a
clock space of its own, and an access of another cluster is never ordered.
In a kernel whose blocks wait on semaphores, clusters overlap and one clock
space covers the agents of every cluster, so a signal and its wait order
blocks of different clusters.

An asynchronous copy's destination counts as written by its agent when the
copy is *issued* (and its source read then), so touching it before the
completion - by any warpgroup, the issuer included - is reported.

Every buffer an access reaches gets shadow arrays (a ``races`` region): the
last writer (agent) and its clock per element, and per agent the block and
clock of its last read. A write is a race if an earlier write or read of
another agent is not ordered before it; a read, if the last write is not.
GMEM buffers keep their shadows across clusters; SMEM buffers are dropped at
their cluster's end."""
from __future__ import annotations

import weakref

import numpy as np

from pallas_np import clocks, races
from pallas_np.errors import RaceError
from pallas_np.meshes.programs import ProgramRaceDetector

# Agent kinds; local id = kind * T + t. "MMA": wgmma, tcgen05_mma and
# async_copy_smem_to_tmem (the tensor core); "TMEM load": async_load_tmem.
AGENTS = ("warpgroup", "TMA", "MMA", "TMEM load")


def _root(view: np.ndarray) -> np.ndarray:
  while isinstance(view.base, np.ndarray):
    view = view.base
  return view


def _coordinates(region, view, elem) -> tuple:
  """The index of shadow element ``elem`` in ``view`` (a buffer may be a
  typed view of raw bytes: report in the kernel's terms)."""
  offset = elem * region.itemsize + region.start - view.__array_interface__["data"][0]
  hits = np.argwhere(clocks.byte_offsets(view) == offset)
  if len(hits):
    return tuple(int(i) for i in hits[0])
  return tuple(int(i) for i in np.unravel_index(elem, region.shape))


class KernelRaces:
  """The shadow memory of one run of a Mosaic GPU kernel."""

  def __init__(self, kernel: str, num_threads: int, named: bool, gmem, cluster_coords=((),),
               slots_per_wg: int = 1, clusters: int | None = None, record: bool = False):
    self.kernel = kernel
    self.record = record  # race_policy="record": races are recorded, the run goes on
    self.num_threads = num_threads
    self.named = named  # the kernel has a warpgroup axis (thread_name)
    self.cluster_coords = [tuple(c) for c in cluster_coords]
    # Thread slots of a cluster: per block and warpgroup, the warpgroup and
    # its warps (plgpu.warp_map); each has its asynchronous agents too.
    self.slots_per_wg = slots_per_wg
    self.slots = len(self.cluster_coords) * num_threads * slots_per_wg
    self.agents = len(AGENTS) * self.slots
    # Clusters of a kernel that waits on semaphores run at once and may order
    # each other: one clock space over the agents of all ``clusters``.
    # Otherwise each cluster has its own (clusters never order each other).
    self.shared_clocks = None if clusters is None else \
        clocks.VectorClocks(clusters * self.agents)
    # id(root buffer) -> (root or a weak reference to it, region, readers, owner)
    # (owner: the cluster whose SMEM it is, None for GMEM)
    self.regions: dict = {}
    self.points: dict = {}  # cluster number -> its grid point
    self.gmem = set()
    for name, buf in gmem:
      if np.size(buf) == 0:
        continue
      self.gmem.add(id(_root(buf)))
      self._add(_root(buf), name)

  def _add(self, root, name, owner=None):
    region = clocks.Shadow(name, root, scratch=False)
    region.ensure()
    readers = (np.full((self.agents, root.size), -1, np.int32),  # block of the last read
               np.zeros((self.agents, root.size), np.int32))  # clock of the last read
    key = id(root)
    # Scoped buffers (SMEM, TMEM) are forgotten when freed: their shadows go
    # with them, and a later buffer at the same address starts clean.
    keep = root if key in self.gmem else weakref.ref(root, lambda _: self.regions.pop(key, None))
    hit = self.regions[key] = (keep, region, readers, owner)
    return hit

  def region_of(self, view, cluster: int):
    root = _root(view)
    hit = self.regions.get(id(root))
    if hit is None:
      if root.dtype == object:  # barriers
        return None
      hit = self._add(root, f"SMEM buffer {root.dtype}{list(root.shape)}", cluster)
    return hit

  def block(self, block: int, describe: str, names: dict, point=()):
    """``make(slot)``: the detector of thread slot ``slot`` of cluster
    ``block`` (its warpgroups; ``plgpu.warp_map`` makes its warps')."""
    space = self.shared_clocks if self.shared_clocks is not None else \
        clocks.VectorClocks(self.agents, base=block * self.agents)
    self.points[block] = tuple(point)

    def make(slot: int) -> WarpgroupRaceDetector:
      det = WarpgroupRaceDetector(self, block, describe, slot, space)
      det.record = self.record
      det.block_names = names
      return det
    return make

  def end_block(self, cluster: int):
    """SMEM and registers die with the blocks of ``cluster``."""
    self.regions = {k: v for k, v in self.regions.items()
                    if k in self.gmem or v[3] not in (None, cluster)}

  def describe(self, cluster: int, local: int) -> str:
    kind, slot = divmod(local, self.slots)
    wg, warp = divmod(slot, self.slots_per_wg)
    b, t = divmod(wg, self.num_threads)
    point = self.points.get(cluster)
    block = f"#{cluster}" if point is None else str(point + self.cluster_coords[b])
    who = f"warpgroup {t} of block {block}" if self.named else f"block {block}"
    if warp:
      who = f"warp {warp - 1} of {who}"
    if kind == 0:
      return who
    what = ("a TMA copy", "an MMA (wgmma/tcgen05)", "an async_load_tmem")[kind - 1]
    return f"{what} issued by {who}"


class WarpgroupRaceDetector(ProgramRaceDetector):
  """One warpgroup's detector (``races.current()`` on its thread)."""

  def __init__(self, run: KernelRaces, block: int, block_desc: str, t: int,
               space: clocks.VectorClocks):
    super().__init__(run.kernel, space.row(block * run.agents + t), None, space, [])
    self.run = run
    self.block_id = block
    self.block_desc = block_desc
    self.thread = t
    self.block_names: dict = {}  # other blocks' ids -> descriptions (for reports)
    self.wgmma_tokens: list = []
    self.tmem_load_tokens: list = []

  # -- accesses ----------------------------------------------------------------------
  def access(self, view, index, kind: str, mask=None):
    self._check(view, index, kind, self.thread, mask)

  def _check(self, view, index, kind, local, mask=None):
    if not isinstance(view, np.ndarray) or view.size == 0:
      return
    hit = self.run.region_of(view, self.block_id)
    if hit is None:
      return
    root, region, (read_block, read_clock), _ = hit
    ptr = view.__array_interface__["data"][0]
    elems = clocks.accessed_elements(view, index, mask, ptr, region.start, region.itemsize)
    if elems.size == 0:
      return
    n = self.run.agents
    me = self.block_id * n + local
    space = self.clocks
    row = space.row(me)
    clock = space.step(row)
    writer = region.group[elems]
    when = region.step[elems]
    unordered = (writer >= 0) & (writer != me) & space.unordered_in_units(
        row, writer // n, writer % n, n, when)
    if unordered.any():
      k = int(np.argmax(unordered))
      self._report(region, view, int(elems[k]), int(writer[k]), kind, "wrote", local)
    if kind != "read":
      rb, rc = read_block[:, elems], read_clock[:, elems]
      bad = (rb >= 0) & space.unordered_in_units(row, rb, np.arange(n)[:, None], n, rc)
      bad[local] &= rb[local] != self.block_id  # its own earlier reads
      if bad.any():
        j, k = np.unravel_index(int(np.argmax(bad)), bad.shape)
        other = int(rb[j, k]) * n + int(j)
        self._report(region, view, int(elems[k]), other, kind, "read", local)
      region.group[elems] = me
      region.step[elems] = clock
    if kind != "write":
      read_block[local, elems] = self.block_id
      read_clock[local, elems] = clock

  def _report(self, region, view, elem, other: int, kind, other_did: str, local):
    n = self.run.agents
    where = _coordinates(region, view, elem)
    name = region.name if region.name.startswith(("operand", "output")) else \
        f"SMEM buffer {view.dtype}{list(view.shape)}"
    verb = {"read": "reads", "write": "writes", "readwrite": "updates"}[kind]
    other_block, other_local = divmod(other, n)
    why = ("blocks of different clusters are never ordered with each other (only atomics "
           "may share GMEM)"
           if other_block != self.block_id and self.run.shared_clocks is None else
           "no semaphore signal/wait orders the two"
           if other_block != self.block_id else
           "no barrier arrive/wait (or copy/wgmma completion wait) orders the two"
           if self.run.shared_clocks is None else
           "no barrier arrive/wait, semaphore signal/wait (or copy/wgmma completion wait) "
           "orders the two")
    self.found(RaceError(
        f"data race on {name} in Mosaic GPU kernel '{self.kernel}': "
        f"{self.run.describe(self.block_id, local)} {verb} element {where} that "
        f"{self.run.describe(other_block, other_local)} {other_did}; {why}, so on a GPU "
        "they run concurrently.",
        buffer=name, grid_points=(other, self.block_id * n + local), element=where))

  # -- asynchronous agents -------------------------------------------------------------
  def issue(self, agent: str, reads=(), writes=(), key=None):
    """An asynchronous operation of this warpgroup's ``agent`` ("TMA",
    "wgmma"): ordered after everything the warpgroup did so far; it reads
    and writes now (as far as races go); its clock is released onto
    ``key`` (a barrier phase, or a token the completion acquires)."""
    local = AGENTS.index(agent) * self.run.slots + self.thread
    space = self.clocks
    space.join(self._row(local), self._row(self.thread))
    for view, idx in reads:
      self._check(view, idx, "read", local)
    for view, idx in writes:
      self._check(view, idx, "write", local)
    key = object() if key is None else key
    self.release_agent(agent, key)
    return key

  def release_agent(self, agent: str, key):
    """Release ``agent``'s clock onto ``key`` (``tcgen05_commit_arrive``:
    the tensor core arrives on a barrier once every MMA issued so far is done)."""
    self.clocks.release(self._row(AGENTS.index(agent) * self.run.slots + self.thread), key)

  def _row(self, local: int) -> int:
    return self.clocks.row(self.block_id * self.run.agents + local)

  def wgmma(self, reads):
    self.wgmma_tokens.append(self.issue("MMA", reads=reads))

  def tmem_load(self, view, idx):
    self.tmem_load_tokens.append(self.issue("TMEM load", reads=[(view, idx)]))

  def wait_tmem_loads(self):
    while self.tmem_load_tokens:
      self.acquire(self.tmem_load_tokens.pop(0))

  def wgmma_wait(self, keep: int):
    while len(self.wgmma_tokens) > keep:
      self.acquire(self.wgmma_tokens.pop(0))


def current() -> WarpgroupRaceDetector | None:
  """This warpgroup's detector, None when detection is off (or in a
  ``pl.pallas_call``, whose grid detector treats every program as parallel)."""
  det = races.current()
  return det if isinstance(det, WarpgroupRaceDetector) else None


def release(key):
  det = current()
  if det is not None:
    det.release(key)


def acquire(key):
  det = current()
  if det is not None:
    det.acquire(key)
