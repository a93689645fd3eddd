"""Identity-like primitives that only matter to compilers or autodiff."""
from __future__ import annotations

import numpy as np
from jax import lax

from pallas_np import _compat as jc
from pallas_np import registry

_identity_single = lambda e: (lambda x: x)

for _p in [getattr(lax, "stop_gradient_p", None),
           jc.optional_primitive("jax._src.ad_util", "stop_gradient_p"),
           lax.reduce_precision_p if False else None,
           jc.optional_primitive("jax._src.pjit", "sharding_constraint_p"),
           jc.optional_primitive("jax._src.core", "pvary_p"),
           jc.optional_primitive("jax._src.lax.parallel", "pvary_p")]:
  if _p is not None and not _p.multiple_results:
    registry.register(_p)(_identity_single)


@registry.register(lax.optimization_barrier_p)
def _optimization_barrier(e):
  return lambda *xs: xs


# Autodiff's own addition (JVPs of kernels sum tangents with it): a plain add.
_add_any_p = jc.optional_primitive("jax._src.ad_util", "add_jaxvals_p")
if _add_any_p is not None:
  registry.register_numpy(_add_any_p, np.add)
