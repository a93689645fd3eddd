"""What differs between the supported JAX versions in eqn params and
primitives, each behind one accessor (docs/jax_versions.md lists them).

A new JAX version starts here: compare the params of the primitives the
evaluator reads in both versions, and give each param that moved an
accessor that detects the layout it finds (never the version string)."""
from __future__ import annotations

import numpy as np
from jax._src.lib import version as jaxlib_version

from pallas_np._compat.core import optional_primitive, trace_to_jaxpr


def scan_counts(params) -> tuple[int, int]:
  """(num_consts, num_carry) of a scan eqn: plain params up to JAX 0.10, the
  ``ft_in`` FlatTree of (consts, carry, xs) from 0.11 on."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


# JAX >= 0.12: jnp functions (searchsorted, nonzero, einsum, ldexp, frexp)
# bind one primitive whose params hold a HiPrim object that knows how to
# expand itself into ordinary ("lojax") primitives.
call_hi_primitive_p = optional_primitive("hijax", "call_hi_primitive_p")


def hi_primitive_expansion(eqn):
  """Jaxpr (closed) of a call_hi_primitive eqn's expansion into lojax
  primitives: JAX's own decomposition, so its results are JAX's."""
  prim = eqn.params["_prim"]
  lower = call_hi_primitive_p.to_lojax
  return trace_to_jaxpr(lambda *args: lower(*args, _prim=prim),
                        [v.aval for v in eqn.invars])


# Behaviour that changed inside XLA's compiled code has no Python feature to
# detect, and asking XLA would compile on an XLA-free path: for these alone
# the jaxlib version is the signal.
def jaxlib_at_least(*version) -> bool:
  return tuple(jaxlib_version[:len(version)]) >= version


def digamma_at_zero():
  """digamma(±0): NaN in XLA up to jaxlib 0.10, -inf from 0.11 on."""
  return -np.inf if jaxlib_at_least(0, 11) else np.nan


def bf16_to_bool_flushes_denormals() -> bool:
  """bfloat16 -> bool: XLA's CPU backend reads bf16 denormals as zero (via
  float32 with DAZ) in newer jaxlibs; 0.10 compares them with zero exactly."""
  return jaxlib_at_least(0, 11)
