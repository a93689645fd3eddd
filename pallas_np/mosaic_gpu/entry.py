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

from pallas_np import _compat as jc
from pallas_np import lowering, lru
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
  key = (id(params["jaxprs"][0]), interp, jc.debug_checks_enabled())  # as JAX's jit key
  hit = _kernels.get(key)
  if hit is None:
    hit = (params["jaxprs"][0], _executor().kernel.MeshKernel(dict(params), interp))
    _kernels.put(key, hit)
  return hit[1]


def _check_supported(params):
  if "jaxprs" not in params:
    raise UnsupportedError("pallas_np: pl.core_map over a plgpu.Mesh inside pl.run_state "
                           "is not supported in numpy mode yet; use plgpu.kernel")


def lower(ctx, *in_nodes, interp, **params):
  """The traced path: compiled now (unsupported primitives raise from the
  ``jax.jit`` call), then ``pallas_np.lowering`` (one device's instance per
  device inside a ``shard_map`` for kernels that read its axes or talk to
  other devices)."""
  _check_supported(params)
  kernel = get_kernel(params, interp)
  kernel.plan  # noqa: B018 - compiled now: unsupported primitives raise here
  names, remote, _ = kernel.device_features
  return lowering.lower_kernel(ctx, in_nodes, kernel, names, remote)


def compile_eqn(e, interp):
  _check_supported(e.params)
  kernel = get_kernel(e.params, interp)
  kernel.plan  # noqa: B018
  return kernel.run
