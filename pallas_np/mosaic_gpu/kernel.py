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

import numpy as np

from pallas_np import _compat as jc
from pallas_np import debugging, races
from pallas_np.compiler import Compiler
from pallas_np.mosaic_gpu import collectives, device_blocks, scoped_axes, threads, warps


class GpuKernelBody:
  """The compiled body of a Mosaic GPU mesh kernel and its mesh's geometry:
  what ``device_blocks`` launches. The kernel itself is a
  ``meshes.MeshKernel`` (operands, buffers, cache) whose runner,
  ``mosaic_gpu.entry.MosaicGpuRunner``, keeps this as its ``executable``."""

  def __init__(self, kernel):
    self.jaxpr = kernel.jaxprs[0]
    mesh = self.mesh = kernel.meshes[0]
    self.name = kernel.name
    self.params = kernel.params
    self.block_names = (*mesh.grid_names, *mesh.cluster_names)
    self.block_shape = (*mesh.grid, *mesh.cluster)
    self.num_threads = int(mesh.num_threads or 1)
    self.thread_name = mesh.thread_name
    # Thread slots per warpgroup: itself, and its warps if it has a warp_map.
    self.slots_per_wg = threads.SLOTS_PER_WARPGROUP if _uses(
        self.jaxpr, lambda eqn: warps.is_warp_map(eqn.params)) else 1
    # Cluster launch control: clusters are launched as many at once as the
    # GPU holds (cluster.WorkQueue).
    cancel = jc.mgpu_primitive("try_cluster_cancel_p")
    self.cancels = cancel is not None and _uses(self.jaxpr, lambda eqn: eqn.primitive is cancel)
    # Scoped allocations Mosaic GPU's lowering refuses raise now, as there.
    scoped_axes.check_kernel(self.jaxpr, mesh, self.name)
    self.compiler = Compiler(kernel.params, self.name)
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

  def run(self, ins, outs, placement=None) -> list[np.ndarray]:
    """One instance on the kernel's buffers (inputs: private copies, as TMA
    stores and atomics may write GMEM operands; outputs: an aliased one *is*
    its input's buffer); ``placement``: this device's place in a
    ``shard_map`` (``pallas_np.devices``); the clusters, blocks and
    warpgroups run on the kernel's scheduler (``device_blocks``)."""
    if self.params.race_policy == "record":
      races.RECORD.begin_run()
    _, remote, waits = self.device_features
    return device_blocks.run(self, ins, outs, placement, remote, waits)

  def block_error(self, e: Exception, block, thread, warp=None) -> Exception:
    """``e`` raised in ``block``'s warpgroup ``thread`` (and ``warp``), as a
    ``KernelError`` naming the primitive and kernel line."""
    wg = f", warpgroup {thread}" if self.thread_name is not None else ""
    if warp is not None:
      wg += f", warp {warp}"
    block = tuple(int(b) for b in block)
    return debugging.kernel_error(e, self.name, f"Mosaic GPU kernel '{self.name}'",
                                  f" at block {block}{wg}", block)


def _uses(jaxpr, pred) -> bool:
  """Does an eqn of the kernel body (at any depth) satisfy ``pred``?"""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    if pred(eqn):
      return True
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        if isinstance(sub, jc.JAXPR_TYPES) and _uses(sub, pred):
          return True
  return False
