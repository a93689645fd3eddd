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
  if any(map(_is_semaphore, [*ctx.avals_in, *ctx.avals_out])):
    return _lower_with_semaphores(ctx, in_nodes, kernel)
  # Typed PRNG keys (key<pl>, key<fry>) cross the callback as their key data.
  shapes = [jax.ShapeDtypeStruct(p.shape, p.dtype)
            for p in map(jc.physical_aval, kernel.out_avals)]
  out_keys = [_key_impl(a) for a in kernel.out_avals]
  run = kernel.run

  def host_run(*args):
    return run(*args)

  def impl(*args):
    args = [jc.jax_prng.random_unwrap(a) if _key_impl(a.aval) else a for a in args]
    outs = jax.experimental.io_callback(host_run, shapes, *args, ordered=False)
    return [jc.jax_prng.random_wrap(o, impl=k) if k else o for o, k in zip(outs, out_keys)]
  return jc.lower_fun(impl, multiple_results=True)(ctx, *in_nodes)


def _is_semaphore(aval) -> bool:
  return jc.is_semaphore_dtype(getattr(aval, "dtype", None))


def _callback_aval(aval):
  """What XLA holds for a semaphore-typed value (a DMA future's semaphore,
  returned by one kernel and waited on by the next): int32, its physical type."""
  return jax.core.ShapedArray(aval.shape, np.int32) if _is_semaphore(aval) else aval


def _semaphores_as_int32(outs, out_avals):
  """pallas_np's semaphores are int64 byte counters: int32 for XLA."""
  return [np.asarray(o, np.int32) if _is_semaphore(a) else o for o, a in zip(outs, out_avals)]


def _lower_with_semaphores(ctx, in_nodes, kernel):
  """A kernel with semaphore operands or outputs: a host callback on their
  int32 physical values (``io_callback`` cannot type a semaphore)."""
  out_avals = list(ctx.avals_out)

  def host_run(*args):
    return _semaphores_as_int32(kernel.run(*args), out_avals)
  return jc.emit_host_callback(ctx.replace(avals_out=[_callback_aval(a) for a in out_avals]),
                               host_run, list(in_nodes), [_callback_aval(a) for a in ctx.avals_in])


def _key_impl(aval):
  """The PRNG implementation of a typed key aval, else None."""
  dtype = getattr(aval, "dtype", None)
  if jc.is_extended_dtype(dtype) and not jc.is_semaphore_dtype(dtype):
    return getattr(dtype, "_impl", None)
  return None


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
    return _semaphores_as_int32(kernel.run(*args, placement=placement), ctx.avals_out)

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
  return jc.emit_host_callback(
      ctx.replace(avals_out=[_callback_aval(a) for a in ctx.avals_out]), host_run_on_device,
      [*extra, *in_nodes], [*extra_avals, *map(_callback_aval, ctx.avals_in)])
