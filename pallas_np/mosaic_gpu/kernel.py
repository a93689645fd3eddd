"""The executor of a Mosaic GPU mesh kernel (``plgpu.kernel``,
``pl.core_map(plgpu.Mesh(...))``): one ``mpmd_map`` eqn over a
``plgpu.Mesh``.

Clusters (every point of ``grid``) run one after another, in launch order
(less those a ``try_cluster_cancel`` claimed: ``cluster.WorkQueue``); the
warpgroups (``num_threads``) of every block of a cluster run as threads that
take turns (``pallas_np.mosaic_gpu.threads``). The kernel body gets the GMEM refs:
NumPy copies of the operands and the outputs (an aliased output is its
input's copy, the others start uninitialised). ``lax.axis_index`` of a mesh
axis and ``pl.program_id`` read the block's and warpgroup's coordinates."""
from __future__ import annotations

import functools
import itertools

import numpy as np

from pallas_np import _compat as jc
from pallas_np import blas, races
from pallas_np.compiler import Compiler, RunContext, failing_eqns, new_run
from pallas_np.errors import KernelError, UnsupportedError, kernel_error_class
from pallas_np.memory import allocate
from pallas_np.mosaic_gpu import cluster as cluster_mod
from pallas_np.mosaic_gpu import (cluster_refs, collectives, device_blocks, inline, race_clocks,
                                  threads, warps)
from pallas_np.params import InterpretParams
from pallas_np.state.refs import PRIVATE_SCOPE_KEY, SHARED_SCOPE_KEY


class MeshKernel:
  """A compiled Mosaic GPU mesh kernel: ``run(*operands) -> outputs``."""

  def __init__(self, params: dict, interp: InterpretParams):
    jaxprs, meshes = params["jaxprs"], params["meshes"]
    if len(jaxprs) != 1 or params.get("external_meshes"):
      raise UnsupportedError("pallas_np: mpmd_map over several meshes is not supported")
    self.jaxpr = jaxprs[0]
    mesh = self.mesh = meshes[0]
    self.name = str(params.get("name") or "mosaic_gpu_kernel")
    self.params = interp
    self.out_avals = tuple(params["out_avals"])
    aliases = params.get("input_output_aliases") or {}
    self.aliases = dict(aliases.items() if hasattr(aliases, "items") else aliases)
    self.block_names = (*mesh.grid_names, *mesh.cluster_names)
    self.block_shape = (*mesh.grid, *mesh.cluster)
    self.num_threads = int(mesh.num_threads or 1)
    self.thread_name = mesh.thread_name
    # Thread slots per warpgroup: itself, and its warps if it has a warp_map.
    self.slots_per_wg = threads.SLOTS_PER_WARPGROUP if _uses_warps(self.jaxpr) else 1
    self.compiler = Compiler(interp, self.name)
    self._plan = None
    self._features = None

  @property
  def device_features(self):
    """(axis names of other devices it reads, whether it talks to other
    devices, whether its blocks wait on semaphores): see ``collectives``."""
    if self._features is None:
      own = {*self.block_names, self.thread_name}
      self._features = collectives.device_features(self.jaxpr, own)
    return self._features

  @property
  def plan(self):
    if self._plan is None:
      self._plan = self.compiler.compile(self.jaxpr, first_calls=True)
    return self._plan

  def _outputs(self, ins):
    outs = []
    for i, aval in enumerate(self.out_avals):
      src = next((k for k, o in self.aliases.items() if o == i), None)
      # An aliased output *is* its input's buffer (already a copy of the
      # caller's array): a body may write either ref, as a discharged
      # core_map on refs writes the input one.
      outs.append(ins[src] if src is not None
                  else allocate(aval.shape, aval.dtype, self.params))
    return outs

  def run(self, *args, placement=None) -> list[np.ndarray]:
    """``placement``: this device's place in a ``shard_map``
    (``pallas_np.devices``); such runs, and kernels whose blocks wait on
    semaphores, run on the device scheduler (``device_blocks``)."""
    new_run()
    # Copied: TMA stores and atomics may write GMEM operands (their effects
    # do not say which), and the caller's arrays must stay intact.
    ins = [np.array(a) for a in args]
    outs = self._outputs(ins)
    _, remote, waits = self.device_features
    if placement is not None or remote or waits:
      if self.slots_per_wg > 1 or int(np.prod(self.mesh.cluster, dtype=int)) > 1:
        raise UnsupportedError(
            f"pallas_np: Mosaic GPU kernel '{self.name}' waits on semaphores or runs across "
            "devices and also uses plgpu.warp_map or clusters of more than one block: that "
            "combination is not supported yet")
      return device_blocks.run(self, ins, outs, placement, remote)
    mesh = self.mesh
    sizes = dict(zip(self.block_names, self.block_shape))
    if self.thread_name is not None:
      sizes[self.thread_name] = self.num_threads
    num_programs = tuple(np.int32(s) for s in sizes.values())
    cluster_shape = tuple(int(c) for c in mesh.cluster)
    cluster_coords = list(itertools.product(*map(range, cluster_shape)))
    detection = None
    if self.params.detect_races:
      gmem = [(f"operand {i}", a) for i, a in enumerate(ins)]
      gmem += [(f"output {i}", o) for i, o in enumerate(outs)
               if not any(o is a for a in ins)]  # aliased: registered as its operand
      detection = race_clocks.KernelRaces(self.name, self.num_threads,
                                          self.thread_name is not None, gmem, cluster_coords,
                                          self.slots_per_wg)
    names: dict = {}
    work = cluster_mod.WorkQueue(tuple(int(g) for g in mesh.grid))
    with blas.kernel_run():  # small GEMMs (wgmma, tcgen05_mma) on one BLAS thread
      for number, point in enumerate(work.launch()):
        self._run_cluster(number, point, cluster_shape, cluster_coords, work, ins, outs,
                          sizes, num_programs, detection, names)
    return outs

  def block_error(self, e: Exception, block, thread) -> Exception:
    """``e`` raised in ``block``'s warpgroup ``thread``, as a ``KernelError``."""
    return self._error(e, block, thread)

  def _run_cluster(self, number, point, cluster_shape, cluster_coords, work, ins, outs,
                   sizes, num_programs, detection, names):
    """The blocks of the cluster at grid point ``point``, as threads of one
    scheduler."""
    plan = self.plan.fn
    multi = len(cluster_coords) > 1
    cluster = cluster_mod.ClusterState(self.mesh.cluster_names, cluster_shape, point, work) \
        if multi else None
    blocks_desc = [str(tuple(point) + tuple(c)) for c in cluster_coords]
    sched = threads.Scheduler(f"block {blocks_desc[0]}" if not multi else
                              f"the cluster of blocks {', '.join(blocks_desc)}", self.name)
    states = [threads.BlockState(d, self.num_threads, self.name, sched, cluster, i)
              for i, d in enumerate(blocks_desc)]
    for st in states:  # for cluster launch control (cluster.py) and warps
      st.slots_per_wg = self.slots_per_wg
      st.work = work
      st.grid_names = tuple(self.mesh.grid_names)
      st.thread_axis = self.thread_name
    make_detector = None
    if detection is not None:
      names[number] = str(tuple(point))
      make_detector = detection.block(number, str(tuple(point)), names, point)
    named = self.thread_name is not None

    def run_thread(b, t):
      block = tuple(point) + tuple(cluster_coords[b])
      state = states[b]
      ctx = RunContext(self.name, self.params)
      coords = (*block, t) if named else block
      ctx.program_ids = tuple(np.int32(c) for c in coords)
      ctx.num_programs = num_programs
      ctx.grid_point = block
      ctx.extra["mesh_axes"] = {n: np.int32(c) for n, c in zip(sizes, coords)}
      ctx.extra["mesh_sizes"] = sizes
      ctx.extra[inline.MESH_KEY] = self.mesh  # special registers of inline_mgpu bodies
      cluster_refs.activate(state)
      ctx.extra[threads.BLOCK_KEY] = state
      ctx.extra[threads.THREAD_KEY] = t
      ctx.extra[threads.SLOT_KEY] = (b * self.num_threads + t) * self.slots_per_wg
      ctx.extra[threads.TASK_KEY] = sched.turn
      ctx.extra[SHARED_SCOPE_KEY] = state.shared_scope
      if multi:
        ctx.extra[PRIVATE_SCOPE_KEY] = state.private_scope
      ctx.extra[threads.ERROR_KEY] = lambda e, warp=None: self._error(e, block, t, warp)
      ctx.extra[threads.DETECTOR_KEY] = make_detector
      try:
        if make_detector is None:
          plan(ctx, *ins, *outs)
        else:
          with races.activate(make_detector(ctx.extra[threads.SLOT_KEY])):
            plan(ctx, *ins, *outs)
      except KernelError:
        raise
      except threads.Aborted:  # another thread failed first
        raise
      except Exception as e:
        raise self._error(e, block, t) from e
      finally:
        cluster_refs.activate(None)

    fns = []
    for b, c in enumerate(cluster_coords):
      for t in range(self.num_threads):
        who = f"warpgroup {t}" if named else "the block"
        if multi:
          who = f"{who} of block {blocks_desc[b]}" if named else f"block {blocks_desc[b]}"
        fns.append((who, functools.partial(run_thread, b, t)))
    sched.run(fns)
    for st in states:
      st.finish()
    if detection is not None:
      detection.end_block()

  def _error(self, e: Exception, block, thread, warp=None) -> Exception:
    eqns = failing_eqns(e.__traceback__)
    prim = source = None
    where = ""
    if eqns:
      prim = eqns[-1].primitive.name
      lines = [jc.source_summary(q.source_info) for q in eqns]
      lines = [ln for ln in lines if ln and ln != "<unknown source>"]
      source = lines[-1] if lines else None
      where = f" in primitive '{prim}'" + (f" at {source}" if source else "")
    wg = f", warpgroup {thread}" if self.thread_name is not None else ""
    if warp is not None:
      wg += f", warp {warp}"
    msg = (f"{type(e).__name__} in Mosaic GPU kernel '{self.name}' at block "
           f"{tuple(int(b) for b in block)}{wg}{where}: {e}")
    err = kernel_error_class(type(e))(msg, kernel=self.name, program_ids=tuple(block),
                                      primitive=prim, source=source, original=e)
    return err


def _uses_warps(jaxpr) -> bool:
  """Does the kernel body call ``plgpu.warp_map`` (at any depth)?"""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    if warps.is_warp_map(eqn.params):
      return True
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        if isinstance(sub, jc.JAXPR_TYPES) and _uses_warps(sub):
          return True
  return False
