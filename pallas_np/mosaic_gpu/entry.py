"""The hook api.py calls for mesh kernels (``mpmd_map``/``core_map``): Mosaic
GPU meshes (``plgpu.kernel``, ``pl.core_map(plgpu.Mesh(...))``) run here.

* ``handles(params)``: is this mesh-kernel eqn a Mosaic GPU one?
* ``lower(ctx, *in_nodes, interp, **params)``: the traced path (``jax.jit``):
  an ``io_callback`` into ``MeshKernel.run``, compiled at lowering time so
  an unsupported primitive raises from the ``jax.jit`` call.
* ``compile_eqn(e, interp)``: the eager evaluator's rule (``pallas_np.jit``,
  eager calls, the force switch).
* ``is_warp_map(params)`` / ``compile_warp_map(e)``: ``plgpu.warp_map`` inside
  a kernel (a mesh-kernel eqn over ``plgpu.WarpMesh``).
"""
from __future__ import annotations

import jax

from pallas_np import _compat as jc
from pallas_np import lru
from pallas_np.errors import UnsupportedError

_kernels = lru.LRU(256)


def handles(params) -> bool:
  meshes = jc.mesh_kernel_meshes(params)
  return bool(meshes) and all(jc.is_mgpu_mesh(m) for m in meshes)


def is_warp_map(params) -> bool:
  """Is this mesh-kernel eqn a ``plgpu.warp_map`` (False until plgpu is imported)?"""
  return jc.is_mgpu_imported() and _executor().warps.is_warp_map(params)


def compile_warp_map(e):
  return _executor().warps.compile_warp_map(e)


def _executor():
  """The executor and rules (``mosaic_gpu.rules``), imported with the first
  Mosaic GPU kernel: they read JAX's plgpu modules (see ``mosaic_gpu``)."""
  from pallas_np.mosaic_gpu import rules
  return rules


def get_kernel(params, interp):
  key = (id(params["jaxprs"][0]), interp)
  hit = _kernels.get(key)
  if hit is None:
    hit = (params["jaxprs"][0], _executor().kernel.MeshKernel(dict(params), interp))
    _kernels.put(key, hit)
  return hit[1]


def _check_supported(params):
  if "jaxprs" not in params:
    raise UnsupportedError("pallas_np: pl.core_map over a plgpu.Mesh inside pl.run_state "
                           "is not supported in numpy mode yet; use plgpu.kernel")


def lower(ctx, *in_nodes, interp, on_devices=None, **params):
  """``on_devices(ctx, in_nodes, kernel, axis_names, remote, axis_sizes)``:
  api's lowering of one device's part of a ``shard_map`` body, for kernels
  that read its axes or talk to other devices."""
  _check_supported(params)
  kernel = get_kernel(params, interp)
  kernel.plan  # noqa: B018 - compiled now: unsupported primitives raise here
  names, remote, _ = kernel.device_features
  axis_sizes = jc.axis_env_sizes()
  if (names or remote) and axis_sizes and on_devices is not None:
    return on_devices(ctx, in_nodes, kernel, names, remote, axis_sizes)
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in kernel.out_avals]

  def impl(*args):
    return jax.experimental.io_callback(kernel.run, shapes, *args, ordered=False)
  return jc.lower_fun(impl, multiple_results=True)(ctx, *in_nodes)


def compile_eqn(e, interp):
  _check_supported(e.params)
  kernel = get_kernel(e.params, interp)
  kernel.plan  # noqa: B018
  return kernel.run
