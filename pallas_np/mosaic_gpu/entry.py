"""Mosaic GPU meshes as mesh runners (``meshes.register_mesh_runner``): a
kernel over a ``plgpu.Mesh`` (``plgpu.kernel``, ``pl.core_map(plgpu.Mesh(...))``)
is a ``meshes.MeshKernel`` like every mesh kernel, lowered, planned and run
through the one kernel-family interface (``pallas_np.kernel_family``); its
runner, ``MosaicGpuRunner``, compiles the body (``kernel.GpuKernelBody``)
and launches its clusters, blocks and warpgroups (``device_blocks``).

``plgpu.warp_map`` inside such a kernel is a mesh eqn over a
``plgpu.WarpMesh``: ``WarpMapRunner`` gives the evaluator its rule
(``warps.compile_warp_map``); it is never a kernel of its own.

Both register when ``pallas_np`` is imported; their predicates answer False
until user code imported plgpu, and the executor (``mosaic_gpu.rules``) is
imported with the first Mosaic GPU kernel.
"""
from __future__ import annotations

from pallas_np import _compat as jc
from pallas_np import meshes
from pallas_np.errors import UnsupportedError


def _executor():
  """The executor and rules (``mosaic_gpu.rules``), imported with the first
  Mosaic GPU kernel: they read JAX's plgpu modules (see ``mosaic_gpu``)."""
  from pallas_np.mosaic_gpu import rules
  return rules


class MosaicGpuRunner(meshes.MeshRunner):
  """Kernels over one ``plgpu.Mesh``: the body compiled once; every run
  one kernel instance (per device inside a ``shard_map``)."""
  default_name = "mosaic_gpu_kernel"

  def check(self, prim, params, call_site):
    if "jaxprs" not in params:
      raise UnsupportedError("pallas_np: pl.core_map over a plgpu.Mesh inside pl.run_state "
                             "is not supported in numpy mode yet; use plgpu.kernel")
    if len(params["jaxprs"]) != 1 or params.get("external_meshes"):
      raise UnsupportedError("pallas_np: mpmd_map over several meshes is not supported")

  def written_inputs(self, kernel):
    # Every input is a private copy: TMA stores and atomics may write GMEM
    # operands (their effects do not say which).
    return frozenset(range(kernel.num_inputs))

  def compile(self, kernel):
    if kernel.executable is None:
      kernel.executable = _executor().kernel.GpuKernelBody(kernel)
    kernel.executable.plan  # noqa: B018 - compiled now: unsupported primitives raise here

  def device_features(self, kernel):
    names, remote, _ = kernel.executable.device_features
    return names, remote

  def run(self, kernel, buffers, placement):
    n = kernel.num_inputs
    kernel.executable.run(buffers[:n], buffers[n:], placement)


class WarpMapRunner(meshes.MeshRunner):
  """``plgpu.warp_map``: a construct inside a Mosaic GPU kernel, not a kernel."""

  def check(self, prim, params, call_site):
    raise meshes.mesh_kernel_error("plgpu.warp_map outside a Mosaic GPU kernel", params,
                                   call_site)

  def inner_rule(self, e):
    return _executor().warps.compile_warp_map(e)


def _is_warp_mesh(mesh) -> bool:
  return jc.is_mgpu_imported() and isinstance(mesh, getattr(jc.mgpu_core, "WarpMesh", ()))


meshes.register_mesh_runner(jc.is_mgpu_mesh, MosaicGpuRunner())
meshes.register_mesh_runner(_is_warp_mesh, WarpMapRunner())  # tried first
