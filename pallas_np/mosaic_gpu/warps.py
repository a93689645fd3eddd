"""``plgpu.warp_map`` (a ``pl.core_map``/``mpmd_map`` over ``plgpu.WarpMesh``
inside a Mosaic GPU kernel): the 4 warps of the calling warpgroup run the
body as threads of the cluster's scheduler, taking turns with every other
thread (``threads.Scheduler.spawn``); the warpgroup waits until all four
finish. ``lax.axis_index`` of the warp axis reads the warp id. Each warp
waits on barriers as a thread of its own (its own phases), and has its own
TMA unit, tensor core and TMEM-load agents under ``detect_races=True``
(ordered after the warpgroup's work before the map; the warpgroup after
theirs)."""
from __future__ import annotations

import copy
import functools

import numpy as np

from pallas_np import _compat as jc
from pallas_np import races, registry
from pallas_np.compiler import RunContext
from pallas_np.errors import KernelError
from pallas_np.mosaic_gpu import operands, peers, threads


def _warp_mesh(params):
  meshes = jc.mesh_kernel_meshes(params)
  core = jc.mgpu_core
  if core is None or getattr(core, "WarpMesh", None) is None or len(meshes) != 1:
    return None
  return meshes[0] if isinstance(meshes[0], core.WarpMesh) else None


def is_warp_map(params) -> bool:
  """Is this mesh-kernel eqn a ``plgpu.warp_map`` inside a kernel?"""
  return _warp_mesh(params) is not None


def _check_scalar_accesses(jaxpr) -> None:
  """As Mosaic GPU's lowering of warp-level code: ref loads and stores of a
  warp's body move scalars only (a warp has no layout for an array)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  sp = jc.state_primitives
  for eqn in jaxpr.eqns:
    if is_warp_map(eqn.params):
      continue
    if eqn.primitive is jc.mgpu_primitive("inline_mgpu_p"):
      _check_inline_mgpu(eqn)
    if eqn.primitive is sp.get_p and eqn.outvars[0].aval.shape:
      raise ValueError(f"Can only load scalars in warp-level code (pallas_np, as Mosaic GPU's "
                       f"lowering: a load of {eqn.outvars[0].aval.str_short()} at "
                       f"{jc.source_summary(eqn.source_info)} in a plgpu.warp_map body)")
    if eqn.primitive is sp.swap_p and eqn.outvars[0].aval.shape:
      raise NotImplementedError(
          f"Can only store scalars in warp-level lowering (pallas_np, as Mosaic GPU's "
          f"lowering: a store of {eqn.outvars[0].aval.str_short()} at "
          f"{jc.source_summary(eqn.source_info)} in a plgpu.warp_map body)")
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        if isinstance(sub, jc.JAXPR_TYPES):
          _check_scalar_accesses(sub)


def _check_inline_mgpu(eqn) -> None:
  """As Mosaic GPU's lowering of ``inline_mgpu`` in a warp's body, in program
  order (so before a later store's check): the body runs per warp, which has
  no layout for an array argument or result."""
  for r in eqn.params.get("flat_ret_ty") or ():
    if getattr(r, "shape", ()):
      raise ValueError("inline_mgpu in a single-warp context only supports scalar return "
                       f"types. Got shape={tuple(r.shape)}. (pallas_np, as Mosaic GPU's "
                       f"lowering: at {jc.source_summary(eqn.source_info)})")
  for v in eqn.invars:
    aval = v.aval
    if not isinstance(aval, jc.AbstractRef) and getattr(aval, "shape", ()):
      raise ValueError("inline_mgpu in a single-warp context only supports scalar arrays "
                       f"(and Refs). Got {aval}. (pallas_np, as Mosaic GPU's lowering: at "
                       f"{jc.source_summary(eqn.source_info)})")


def compile_warp_map(e: registry.EqnInfo):
  """The rule of a warp_map eqn (JAX 0.12 ``mpmd_map``, 0.10 ``core_map``)."""
  p = e.params
  mesh = _warp_mesh(p)
  for aval in e.in_avals:  # as Mosaic GPU's lowering: each warp would need its own view
    if not isinstance(aval, jc.AbstractRef) and getattr(aval, "shape", ()):
      raise jc.lowering_error(
          f"Can only close over scalars and Refs when using plgpu.warp_map with WarpMesh "
          f"(pallas_np, as Mosaic GPU's lowering: a closed-over {aval.str_short()} at "
          f"{e.source})")
  _check_scalar_accesses(p["jaxprs"][0] if "jaxprs" in p else p["jaxpr"])
  if "jaxprs" in p:  # mpmd_map: the operands are the body's refs
    plan = e.compiler.compile(p["jaxprs"][0]).fn
  else:  # core_map: the body closes over the refs (constvars)
    plan = e.compiler.compile(p["jaxpr"], constvars_as_args=True).fn
  axis = mesh.axis_name
  num_warps = int(mesh.shape[axis])
  where = e.source

  def warp_map(ctx, *args):
    thread = ctx.family
    slot = thread.slot if thread is not None else None
    if slot is None:
      raise e.unsupported("plgpu.warp_map outside a plgpu.kernel / plgpu.Mesh kernel")
    state = operands.block_of(ctx)
    if slot % state.slots_per_wg or state.slots_per_wg == 1:
      raise ValueError(f"plgpu.warp_map inside a warp_map (at {where}): warps cannot be split")
    parent = thread.task
    make_detector = thread.make_detector
    det = races.current() if make_detector is not None else None
    fork = object()
    if det is not None:  # the warps start after what their warpgroup did so far
      det.release(fork)
    joins = [object() for _ in range(num_warps)]
    wrap = thread.wrap_error

    def run_warp(w, task):
      wctx = RunContext(ctx.kernel_name, ctx.params, ctx.program_ids, ctx.num_programs)
      wctx.grid_point = ctx.grid_point
      wctx.device = ctx.device
      wctx.family = thread.for_warp(axis, np.int32(w), slot + 1 + w, task)
      wctx.rules = copy.copy(ctx.rules)  # its own rule state from here on
      if ctx.device is not None:  # a thread of its own: its device for remote refs
        peers.activate(ctx.device)
      try:
        if det is None:
          plan(wctx, *args)
        else:
          wdet = make_detector(slot + 1 + w)
          wdet.acquire(fork)
          with races.activate(wdet):
            plan(wctx, *args)
          wdet.release(joins[w])
      except (KernelError, threads.Aborted):
        raise
      except Exception as err:
        if wrap is None:
          raise
        raise wrap(err, w) from err

    base = parent.name
    state.sched.spawn(parent, [(f"warp {w} of {base}", functools.partial(run_warp, w),
                                (lambda err, w=w: wrap(err, w)) if wrap else None)
                               for w in range(num_warps)], where)
    if det is not None:
      for j in joins:
        det.acquire(j)
    return []
  return registry.NeedsCtx(warp_map)
