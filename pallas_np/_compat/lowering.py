"""Lowering to StableHLO: pallas_call's (and mesh kernels') lowering rules,
host callbacks, cross-lowering for CUDA."""
from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax._src import callback as jax_callback
from jax._src import mesh as mesh_lib
from jax._src.interpreters import mlir

from pallas_np._compat.pallas import pallas_call_p

lower_fun = mlir.lower_fun


def original_pallas_call_lowering():
  """The lowering rule JAX registered for pallas_call (platform independent)."""
  entry = mlir._lowerings[pallas_call_p]
  return getattr(entry, "rule", entry)


def register_pallas_call_lowering(rule):
  mlir.register_lowering(pallas_call_p, rule)


def lowering_rule(prim):
  """The platform-independent lowering rule registered for ``prim``, or None."""
  entry = mlir._lowerings.get(prim)
  return getattr(entry, "rule", entry)


def register_lowering(prim, rule):
  mlir.register_lowering(prim, rule)


def mesh_spans_processes(ctx) -> bool:
  """Whether the mesh being lowered (shard_map's) has devices of other
  processes (``jax.distributed``); without a mesh: whether there are
  other processes at all."""
  mesh = getattr(ctx.module_context.axis_context, "mesh", None)
  devices = getattr(mesh, "devices", None)
  if devices is None:
    return jax.process_count() > 1
  me = jax.process_index()
  return any(getattr(d, "process_index", me) != me for d in np.ravel(devices))


def emit_host_callback(ctx, fn, operands, operand_avals):
  """Lower an unordered, side-effecting call of ``fn(*numpy arrays)`` (like
  ``io_callback``, per device inside a shard_map) returning ``ctx.avals_out``.
  Unlike ``io_callback`` the operands reach ``fn`` as the NumPy arrays XLA
  hands over: io_callback first ``device_put``s them onto CPU device 0, a
  transfer that can wait for a thread held by a device blocked in a
  multi-device kernel, so the devices never all arrive."""
  sharding = jax_callback._callback_op_sharding(ctx.module_context.axis_context, None,
                                                ctx.avals_out)

  def host(*args):
    return tuple(np.asarray(r) for r in fn(*args))
  result, _, _ = jax_callback.emit_python_callback(
      ctx.replace(avals_in=list(operand_avals)), host, None, list(operands),
      list(operand_avals), list(ctx.avals_out), has_side_effect=True, returns_token=False,
      sharding=sharding)
  return result


def cuda_lowering_target():
  """Context for cross-lowering a CUDA kernel on a host without a GPU: JAX >=
  0.11 asks for an abstract GPU device (an H100) in the abstract mesh; older
  JAX needs nothing."""
  device_cls = getattr(mesh_lib, "AbstractDevice", None)
  if device_cls is None:
    return contextlib.nullcontext()
  device = device_cls(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
  return jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((), (), abstract_device=device))
