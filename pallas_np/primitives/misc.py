"""Primitives that only matter to compilers, autodiff or the host:
identities, platform selection, debug printing and host callbacks."""
from __future__ import annotations

import numpy as np
from jax import lax

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import np_dtype

_identity_single = lambda e: (lambda x: x)

for _p in [getattr(lax, "stop_gradient_p", None),
           jc.optional_primitive("ad_util", "stop_gradient_p"),
           lax.reduce_precision_p if False else None,
           jc.optional_primitive("pjit", "sharding_constraint_p"),
           jc.optional_primitive("pjit", "reshard_p"),  # a sharding change: values as they are
           jc.optional_primitive("core", "pvary_p"),
           jc.optional_primitive("lax.parallel", "pvary_p")]:
  if _p is not None and not _p.multiple_results:
    registry.register(_p, batch=registry.IDENTITY,
                      data_movement=_p.name == "stop_gradient")(_identity_single)


@registry.register(lax.optimization_barrier_p, batch=registry.IDENTITY, data_movement=True)
def _optimization_barrier(e):
  return lambda *xs: xs


# Autodiff's own addition (JVPs of kernels sum tangents with it): a plain add.
_add_any_p = jc.optional_primitive("ad_util", "add_jaxvals_p")
if _add_any_p is not None:
  registry.register_numpy(_add_any_p, np.add, batch=registry.ELEMENTWISE)


# -- platform-dependent code: interpret=True lowers for the CPU ------------
_platform_index_p = jc.optional_primitive(
    "lax.control_flow.conditionals", "platform_index_p")
if _platform_index_p is not None:
  @registry.register(_platform_index_p, batch=registry.unbatched(
      "no operands: one value for every lane, computed once per pass"))
  def _platform_index(e):
    platforms = e.params["platforms"]
    chosen = None
    for i, ps in enumerate(platforms):
      if ps is not None and "cpu" in ps:
        chosen = i
        break
    if chosen is None:
      chosen = next((i for i, ps in enumerate(platforms) if ps is None), None)
    if chosen is None:
      raise e.unsupported(f"lax.platform_dependent without a 'cpu' or default branch "
                          f"(platforms {platforms})")
    value = np.int32(chosen)
    return lambda: value


# -- host callbacks (debug printing/callbacks live in primitives/debug.py) --
for _name in ("pure_callback_p", "io_callback_p"):
  _cb = jc.optional_primitive("callback", _name)
  if _cb is not None:
    @registry.register(_cb, foldable=False, batch=registry.unbatched(
        "a host callback: called once per lane (io_callback, an effect: grid order)"))
    def _host_callback(e):
      callback = e.params["callback"]
      outs = [(tuple(a.shape), np_dtype(a.dtype)) for a in e.out_avals]

      def host_callback(*args):
        results = callback(*args)
        return [np.asarray(r, dt).reshape(shape) for r, (shape, dt) in zip(results, outs)]
      return host_callback


_composite_p = getattr(jc.lax_internal, "composite_p", None)
if _composite_p is not None:
  @registry.register(_composite_p, needs_ctx=True, context_free=True, batch=registry.unbatched(
      "a call of a sub-jaxpr XLA may decompose; not batched (the grid runs sequentially)"))
  def _composite(e):
    return e.compiler.compile(jc.composite_body(e.params)).fn


_random_clone_p = jc.optional_primitive("random", "random_clone_p")
if _random_clone_p is not None:
  registry.register(_random_clone_p, batch=registry.IDENTITY)(_identity_single)


_zeros_like_p = jc.optional_primitive("ad_util", "zeros_like_p")
if _zeros_like_p is not None:
  @registry.register(_zeros_like_p, batch=registry.unbatched("autodiff only: run lane by lane"))
  def _zeros_like(e):
    aval = jc.physical_aval(e.out_aval)
    value = np.zeros(tuple(aval.shape), np_dtype(aval.dtype))
    return lambda x: value
