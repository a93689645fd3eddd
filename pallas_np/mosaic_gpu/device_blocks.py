"""One Mosaic GPU kernel instance (one device): its clusters, blocks and
warpgroup threads on the one scheduler (``threads.Scheduler``), and the run
context each thread gets (``Launch.context``: the one context builder).

Clusters (points of ``grid``) come from the launch queue
(``cluster.WorkQueue``: a ``try_cluster_cancel`` claims later ones); each is
a ``threads.Group`` of every warpgroup of each of its blocks. A kernel that
waits on semaphores (``pl.semaphore_wait``, ``pl.get_global``) or talks to
other devices (``plgpu.remote_ref``, multimem, semaphores signalled across
devices, a ``shard_map``) may make a block wait for a later block or for
another device, so its clusters *overlap*: the next one starts whenever no
started thread can go on, and the instance joins a multi-device session
(``pallas_np.devices``; a one-device session outside ``shard_map``) whose
lock its semaphores use. Other kernels run their clusters one after
another, without a session.

Memory: GMEM refs are the kernel's operands and outputs on each device
(symmetric, as on GPUs: ``remote_ref``, ``multimem_*`` and semaphores on a
peer name its copy of the same ref); ``run_scoped`` semaphores are per block
(the same block on a peer), ``pl.get_global`` ones per device."""
from __future__ import annotations

import itertools

import numpy as np

from pallas_np import blas, devices, races
from pallas_np.compiler import RunContext
from pallas_np.errors import KernelError, UnsupportedError
from pallas_np.mosaic_gpu import cluster as cluster_mod
from pallas_np.kernel_context import ThreadContext
from pallas_np.mosaic_gpu import cluster_refs, peers, race_clocks, threads


class BlockDevice(devices.DeviceContext):
  """``RunContext.device`` of one block: its device's session and memory;
  ``run_scoped`` semaphores are this block's (keyed by block)."""
  __slots__ = ("block", "scheduler")

  def __init__(self, device: devices.DeviceContext, block, scheduler):
    super().__init__(device.placement, device.targets)
    self.session = device.session
    self.target_names = device.target_names
    self.barrier = device.barrier
    self.scoped = device.scoped  # one dict per device: peers find them by key
    self.block = block
    self.scheduler = scheduler

  def scoped_semaphore(self, key, fresh):
    return super().scoped_semaphore((self.block, key), fresh)

  def global_semaphore(self, key, fresh):
    """A ``pl.get_global`` semaphore: one per device, shared by its blocks."""
    return super().scoped_semaphore(("global", key), fresh)

  def wait_in_turn(self, ctx, pred, what):
    """A semaphore wait (``devices.block_until``): through the scheduler."""
    self.scheduler.wait_until(ctx.family.task, pred, what, None)


class Launch:
  """One kernel instance: ``run()`` runs every cluster to its end."""

  def __init__(self, kernel, ins, outs, device=None):
    self.kernel = kernel
    self.ins, self.outs = ins, outs
    self.device = device  # the instance's DeviceContext (overlapping clusters), or None
    mesh = kernel.mesh
    sizes = dict(zip(kernel.block_names, kernel.block_shape))
    if kernel.thread_name is not None:
      sizes[kernel.thread_name] = kernel.num_threads
    self.sizes = sizes
    self.num_programs = tuple(np.int32(s) for s in sizes.values())
    self.cluster_shape = tuple(int(c) for c in mesh.cluster)
    self.cluster_coords = list(itertools.product(*map(range, self.cluster_shape)))
    self.work = cluster_mod.WorkQueue(
        tuple(int(g) for g in mesh.grid),
        cluster_mod.resident_clusters(len(self.cluster_coords)) if kernel.cancels else 1)
    self.detection = None
    overlap = device is not None
    if kernel.params.detect_races:
      gmem = [(f"operand {i}", a) for i, a in enumerate(ins)]
      gmem += [(f"output {i}", o) for i, o in enumerate(outs)
               if not any(o is a for a in ins)]  # aliased: registered as its operand
      self.detection = race_clocks.KernelRaces(
          kernel.name, kernel.num_threads, kernel.thread_name is not None, gmem,
          self.cluster_coords, kernel.slots_per_wg,
          clusters=len(self.work.order) if overlap else None,
          record=kernel.params.race_policy == "record")
    self.names: dict = {}  # cluster number -> its grid point (race reports)
    lock = device.session.cond if overlap else None
    self.sched = threads.Scheduler(kernel.name, lock, overlap, device)
    if overlap:
      self.sched.describe = "the blocks of this kernel"

  def run(self):
    self.sched.run(self._clusters())

  def _clusters(self):
    for number, point in enumerate(self.work.launch()):
      yield self._cluster(number, tuple(point))

  # -- one cluster -------------------------------------------------------------------
  def _cluster(self, number: int, point) -> threads.Group:
    """The blocks of the cluster at grid point ``point``, as one group of threads."""
    kernel = self.kernel
    multi = len(self.cluster_coords) > 1
    cl = cluster_mod.ClusterState(kernel.mesh.cluster_names, self.cluster_shape, point,
                                  self.work) if multi else None
    blocks = [point + tuple(c) for c in self.cluster_coords]
    descs = [str(b) for b in blocks]
    states = []
    for i, (block, desc) in enumerate(zip(blocks, descs)):
      dev = BlockDevice(self.device, block, self.sched) if self.device is not None else None
      st = threads.BlockState(desc, kernel.num_threads, kernel.name, self.sched, cl, i, dev)
      st.slots_per_wg = kernel.slots_per_wg
      st.work = self.work
      st.grid_names = tuple(kernel.mesh.grid_names)
      st.thread_axis = kernel.thread_name
      states.append(st)
    make_detector = None
    if self.detection is not None:
      self.names[number] = str(point)
      make_detector = self.detection.block(number, str(point), self.names, point)
    named = kernel.thread_name is not None
    always_block = multi or self.device is not None  # several blocks may be waiting
    fns = []
    for b, block in enumerate(blocks):
      for t in range(kernel.num_threads):
        who = f"warpgroup {t}" if named else "the block"
        if always_block:
          who = f"{who} of block {descs[b]}" if named else f"block {descs[b]}"
        fns.append((who, self._thread_fn(states[b], block, b, t, make_detector),
                    self._wrapper(block, t)))
    name = f"block {descs[0]}" if not multi else f"the cluster of blocks {', '.join(descs)}"

    def on_end():
      for st in states:
        st.finish()  # the blocks' outstanding copies land
      if self.detection is not None:
        self.detection.end_block(number)
    return threads.Group(name, fns, on_end)

  def _wrapper(self, block, t):
    def wrap(err, warp=None):
      if isinstance(err, KernelError):
        return err
      return self.kernel.block_error(err, block, t, warp)
    return wrap

  def context(self, state, block, b: int, t: int, task, make_detector) -> RunContext:
    """The run context of warpgroup ``t`` of block ``b`` of a cluster."""
    kernel = self.kernel
    ctx = RunContext(kernel.name, kernel.params)
    coords = (*block, t) if kernel.thread_name is not None else block
    ctx.program_ids = tuple(np.int32(c) for c in coords)
    ctx.num_programs = self.num_programs
    ctx.grid_point = block
    ctx.family = ThreadContext(
        mesh_axes={n: np.int32(c) for n, c in zip(self.sizes, coords)},
        mesh_sizes=self.sizes,
        mesh=kernel.mesh,  # special registers of inline_mgpu bodies
        block=state, thread=t, slot=(b * kernel.num_threads + t) * kernel.slots_per_wg,
        task=task, wrap_error=self._wrapper(block, t), make_detector=make_detector,
        shared_scope=state.shared_scope,
        private_scope=state.private_scope if state.cluster is not None else None)
    ctx.device = state.device
    return ctx

  def _thread_fn(self, state, block, b, t, make_detector):
    plan = self.kernel.plan.fn
    args = (*self.ins, *self.outs)

    def run_thread(task):
      if state.device is not None:
        peers.activate(state.device)
      ctx = self.context(state, block, b, t, task, make_detector)
      cluster_refs.activate(state)  # plgpu.cluster_ref resolves against this block
      try:
        if make_detector is None:
          plan(ctx, *args)
        else:
          with races.activate(make_detector(ctx.family.slot)):
            plan(ctx, *args)
      except (KernelError, threads.Aborted):
        raise
      except Exception as e:
        raise self.kernel.block_error(e, block, t) from e
      finally:
        cluster_refs.activate(None)
    return run_thread


def _one_device(placement, targets) -> devices.DeviceContext:
  """A session of this device alone: waits between its own blocks."""
  placement = placement or devices.Placement(("mgpu",), (), (), ())
  me = devices.DeviceContext(placement, targets)
  me.session = devices.Session(1)
  me.session.members[me.logical_id] = me
  return me


def run(kernel, ins, outs, placement, remote: bool, waits: bool):
  """Run ``kernel`` (a ``MeshKernel``) as one device's instance; clusters
  overlap when it waits on semaphores or runs across devices."""
  if not (placement is not None or remote or waits):
    with blas.kernel_run():  # small GEMMs (wgmma, tcgen05_mma) on one BLAS thread
      Launch(kernel, ins, outs).run()
    return outs
  if kernel.params.detect_races and remote and placement is not None \
      and placement.num_devices > 1:
    raise UnsupportedError(
        f"pallas_np: detect_races=True on Mosaic GPU kernel '{kernel.name}', which runs on "
        f"{placement.num_devices} devices: races across devices are not detected in Mosaic "
        "GPU kernels yet (run it outside shard_map, or without detect_races)")
  targets = [*ins, *outs]
  me = devices.enter(placement, targets) if placement is not None and remote else \
      _one_device(placement, targets)
  me.target_names = [*(f"operand {i}" for i in range(len(ins))),
                     *(f"output {i}" for i in range(len(outs)))]
  error = None
  try:
    Launch(kernel, ins, outs, me).run()
  except BaseException as e:
    error = e
    raise
  finally:
    devices.leave(me, error)
  return outs
