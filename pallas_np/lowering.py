"""How every kernel family lowers in numpy mode (the traced path): one
unordered ``io_callback`` into the kernel's host run, or, for one device's
part of a ``shard_map``/``pmap`` body, a callback that also hands the run its
device coordinates (``pallas_np.devices``).

The kernel is any family's compiled kernel (``kernel_family``: ``name``,
``out_avals``, ``run(*numpy_arrays, placement=None)``): a
``grid.KernelPlan`` or a ``meshes.MeshKernel`` (TPU or Mosaic GPU meshes).
``kernel_family.lower`` is the one caller.
"""
from __future__ import annotations

import jax
import numpy as np

from pallas_np import _compat as jc
from pallas_np import devices
from pallas_np.errors import UnsupportedError


def lower_kernel(ctx, in_nodes, kernel, axis_names=(), remote=False):
  """The lowering of one call of ``kernel``. ``axis_names``: the axes it
  reads with ``axis_index``; ``remote``: whether it talks to other devices
  (remote DMAs, semaphores): then, inside a ``shard_map``/``pmap`` body,
  each device's instance runs with its placement."""
  axis_sizes = jc.axis_env_sizes()
  if (axis_names or remote) and axis_sizes:
    return _lower_on_devices(ctx, in_nodes, kernel, axis_names, remote, axis_sizes)
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in kernel.out_avals]
  run = kernel.run

  def host_run(*args):
    return run(*args)

  def impl(*args):
    return jax.experimental.io_callback(host_run, shapes, *args, ordered=False)
  return jc.lower_fun(impl, multiple_results=True)(ctx, *in_nodes)


def _lower_on_devices(ctx, in_nodes, kernel, axis_names, remote, axis_sizes):
  """One device's part of a shard_map/pmap body: the bound axes are known
  here; each device's coordinates (and, for a kernel that talks to other
  devices, the call's id) are computed in the lowered program and handed to
  its callback (pallas_np.devices)."""
  missing = sorted(set(axis_names) - set(axis_sizes), key=str)
  if missing:
    raise UnsupportedError(
        f"pallas_np: kernel '{kernel.name}' reads jax.lax.axis_index of {missing}, not "
        f"axes bound around the pallas_call (bound: {tuple(axis_sizes)})")
  if remote and jc.mesh_spans_processes(ctx):
    raise UnsupportedError(
        f"pallas_np: kernel '{kernel.name}' sends remote DMAs/semaphore signals between "
        "devices of a mesh that spans several processes (jax.distributed): the devices' "
        "kernel instances meet in one process's memory, so every device of the mesh must "
        "be local (jax.local_devices()). axis_index alone works across processes.")
  names, sizes = tuple(axis_sizes), tuple(axis_sizes.values())
  key = (id(kernel), names, sizes)

  def host_run_on_device(*args):
    call = args[0] if remote else None
    coords, args = args[remote:remote + len(names)], args[remote + len(names):]
    placement = devices.Placement(key, names, sizes, [int(c) for c in coords], call=call)
    return kernel.run(*args, placement=placement)

  def placement_operands():
    coords = [jax.lax.axis_index(n) for n in names]
    if not remote:
      return coords
    # Pair the devices' instances by call, not by arrival order: one ticket
    # per device, the mesh-wide max is this call's id (devices.py).
    ticket = jax.experimental.io_callback(
        devices.new_ticket, jax.ShapeDtypeStruct((), np.int32), ordered=False)
    return [jax.lax.pmax(ticket, names), *coords]
  extra_avals = [jax.core.ShapedArray((), np.int32)] * (int(remote) + len(names))
  extra = jc.lower_fun(placement_operands, multiple_results=True)(
      ctx.replace(avals_in=[], avals_out=extra_avals))
  return jc.emit_host_callback(ctx, host_run_on_device, [*extra, *in_nodes],
                               [*extra_avals, *ctx.avals_in])
