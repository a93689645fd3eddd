"""The compiler: jaxpr -> ``Plan``, a straight-line Python function.

``compiler.Compiler`` walks a jaxpr's eqns and emits one line per eqn
(``emitter``), with constant folding and the passes over the finished lines
(``passes``), the float max/min zero guards (``zeros``) and the peepholes
(``fusion``); ``plan.Plan`` runs the result (compiled, or as data for its
first calls); ``sourcemap`` maps each generated line back to its eqn, for
errors and pdb.
"""
from pallas_np.compiler.compiler import INLINE_CALLS, Compiler
from pallas_np.compiler.emitter import np_constant
from pallas_np.compiler.plan import Plan, RunContext, failing_eqns, new_run, plan_filename

__all__ = ["Compiler", "INLINE_CALLS", "Plan", "RunContext", "failing_eqns",
           "new_run", "np_constant", "plan_filename"]
