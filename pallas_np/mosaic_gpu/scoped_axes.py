"""``pl.run_scoped(..., collective_axes=...)`` in a Mosaic GPU mesh kernel:
the allocations Mosaic GPU's lowering refuses are refused here too, before
the kernel runs.

Mosaic GPU lowers only *thread-collective* scoped allocations
(``_run_scoped_lowering_rule``): ``collective_axes`` is ``()`` or the
kernel's thread axis, and in a kernel with a thread axis every allocation
but semaphores and WGMMA accumulators must name it (all warpgroups share
the buffer). Numpy mode would otherwise run such a kernel with some sharing
it chose. The errors carry JAX's GPU interpreter's wording (its test file
checks them) and say what the hardware's lowering does.
"""
from __future__ import annotations

from pallas_np import _compat as jc
from pallas_np.mosaic_gpu import warps

_HARDWARE = ("Mosaic GPU lowers only thread-collective allocations (collective_axes=() "
             "or the thread axis)")


def check_kernel(jaxpr, mesh, kernel_name: str) -> None:
  """Raise for the first ``run_scoped`` in ``jaxpr`` (at any depth, not
  inside a ``plgpu.warp_map``) whose ``collective_axes`` the hardware's
  lowering refuses."""
  cluster = tuple(mesh.cluster_names or ())
  thread = mesh.thread_name
  for eqn in _run_scoped_eqns(getattr(jaxpr, "jaxpr", jaxpr)):
    _check(eqn, cluster, thread, kernel_name)


def _run_scoped_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    if eqn.primitive is jc.pallas_primitives.run_scoped_p:
      yield eqn
    if warps.is_warp_map(eqn.params):
      continue
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        if isinstance(sub, jc.JAXPR_TYPES):
          yield from _run_scoped_eqns(getattr(sub, "jaxpr", sub))


def _check(eqn, cluster, thread, kernel_name) -> None:
  axes = tuple(eqn.params.get("collective_axes") or ())
  # The lowering's test: exactly the thread axis (None in a kernel without
  # one, which is what plgpu's helpers pass there) is thread-collective.
  thread_collective = axes == (thread,)
  names = [*cluster] + ([thread] if thread is not None else [])
  where = (f"pallas_np: pl.run_scoped(..., collective_axes={axes}) at "
           f"{jc.source_summary(eqn.source_info)} in Mosaic GPU kernel '{kernel_name}': ")
  if axes and not thread_collective:
    for a in axes:
      if a not in names:
        raise ValueError(f"{where}Collective axis `{a}` not found among axes `{names}` "
                         f"(the kernel's cluster and thread axes). {_HARDWARE}.")
    if thread is None:
      raise ValueError(f"{where}Requesting collective allocations, but no explicit thread "
                       f"axis specified. {_HARDWARE}.")
    raise ValueError(f"{where}Collective allocations along cluster axes are not supported. "
                     f"{_HARDWARE}.")
  avals = [v.aval for v in eqn.params["jaxpr"].invars]
  if axes and any(jc.is_wgmma_acc_aval(a) for a in avals):
    raise ValueError(f"{where}WGMMA accumulators can only be allocated non-collectively "
                     "(as Mosaic GPU's lowering says): split the run_scoped in two.")
  if thread is not None and not thread_collective:
    shared = [a for a in avals if not jc.is_wgmma_acc_aval(a) and not jc.is_semaphore_dtype(
        getattr(getattr(a, "inner_aval", a), "dtype", None))]
    if shared:
      raise NotImplementedError(
          f"{where}Scoped allocation must have the thread axis in its collective axes. "
          f"Mosaic GPU: only thread-collective allocations are supported in multithreaded "
          f"kernels: add collective_axes='{thread}' to the run_scoped.")
