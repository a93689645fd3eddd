"""Call-like primitives: the callee's jaxpr is compiled to a plan and called.

Under an interpreter there is no derivative to take, so custom_jvp/custom_vjp
calls run their primal function; remat and jit are plain calls."""
from __future__ import annotations

from pallas_np import _compat as jc
from pallas_np import registry


def _call_rule(jaxpr_param):
  def compile_rule(e):
    plan = e.compiler.compile(e.params[jaxpr_param]).fn
    return plan
  return compile_rule


_prim = jc.optional_primitive

# Calls are inlined into the caller's plan (the evaluator's INLINE_CALLS) or,
# where not, run their callee's plan: never batched as one eqn.
_CALL = registry.unbatched("a call: its body is inlined and batched eqn by eqn")

for _prim_obj, _param in [
    (_prim("pjit", "jit_p"), "jaxpr"),
    (_prim("pjit", "pjit_p"), "jaxpr"),
    (jc.jax_core.closed_call_p, "call_jaxpr"),
    (getattr(jc.jax_core, "call_p", None), "call_jaxpr"),
    (_prim("lax.eval_jaxpr", "eval_jaxpr_p"), "jaxpr"),
    (_prim("custom_derivatives", "custom_jvp_call_jaxpr_p"), "fun_jaxpr"),
    (_prim("custom_derivatives", "custom_jvp_call_p"), "call_jaxpr"),
    (_prim("custom_derivatives", "custom_vjp_call_p"), "call_jaxpr"),
    (_prim("custom_derivatives", "custom_vjp_call_jaxpr_p"), "fun_jaxpr"),
    (_prim("ad_checkpoint", "remat_p"), "jaxpr"),
    (_prim("pallas.primitives", "jaxpr_call_p"), "jaxpr"),
]:
  if _prim_obj is not None:
    registry.register(_prim_obj, needs_ctx=True, context_free=True, batch=_CALL)(
        _call_rule(_param))


if jc.call_hi_primitive_p is not None:
  @registry.register(jc.call_hi_primitive_p, needs_ctx=True, context_free=True, batch=_CALL)
  def _call_hi_primitive(e):
    """jnp functions JAX >= 0.12 binds as one high-level primitive: run the
    expansion into ordinary primitives JAX itself lowers."""
    return e.compiler.compile(jc.hi_primitive_expansion(e.eqn)).fn
