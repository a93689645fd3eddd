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


# -- eqn params that moved between JAX 0.10 and 0.12 -----------------------------
# Found by recording each primitive's ``eqn.params`` keys in both versions
# (docs/jax_versions.md, "Adding a JAX version"); every rule reads these
# through the accessors below.
def mesh_kernel_meshes(params) -> tuple:
  """The meshes of a mesh-kernel eqn: ``mpmd_map``'s ``meshes``; JAX 0.10's
  ``core_map`` (gone in 0.12) has one ``mesh``."""
  return tuple(params.get("meshes") or (params.get("mesh"),))


def mesh_kernel_bodies(params) -> tuple:
  """The body jaxprs of a mesh-kernel eqn: ``mpmd_map``'s ``jaxprs``; JAX
  0.10's ``core_map`` has one ``jaxpr``."""
  return tuple(params.get("jaxprs") or (params.get("jaxpr"),))


def has_user_predicate(params) -> bool:
  """Whether a plgpu barrier arrive (``barrier_arrive``,
  ``tcgen05_commit_arrive``: JAX 0.12) or SMEM->GMEM copy carries a
  predicate operand; JAX 0.10's arrives have no such param (no predicate)."""
  return bool(params.get("has_user_predicate"))


def static_wait_count(params):
  """``n`` of a plgpu wait (``wait_smem_to_gmem``, ``wgmma_wait``): a param
  in JAX 0.12; None in 0.10, which passes it as the eqn's first operand."""
  return params.get("n")


def copy_has_barrier(params) -> bool:
  """Whether a ``copy_gmem_to_smem`` eqn has a barrier operand: JAX 0.12's
  ``has_barrier`` (False: a cp.async copy); 0.10's copies always have one."""
  return params.get("has_barrier", True)


def tpu_bitcast_dim(params):
  """The dim a pltpu ``bitcast`` packs along: JAX 0.12's ``dim``; None (the
  second minor) in 0.10, which has no such param."""
  return params.get("dim")


def composite_body(params):
  """The body of a ``lax.composite`` eqn: ``jaxpr`` in JAX 0.10,
  ``call_jaxpr`` in 0.12."""
  return params["call_jaxpr"] if "call_jaxpr" in params else params["jaxpr"]


def tmem_load_reduction(params):
  """``async_load_tmem``'s ``reduce`` (JAX 0.12); None (no reduction) before."""
  return params.get("reduce")
