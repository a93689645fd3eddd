"""How ``pallas_np.pallas_call`` has JAX trace a kernel body: with the
jitted functions it calls inlined.

Every ``jnp`` function is a ``jax.jit`` function. Traced inside a kernel, each
call goes through jit's machinery: argument processing, a cache lookup, and
in a fresh process a sub-trace per new (function, shapes) pair with its own
debug info and DCE, then the sub-jaxpr is inlined or wrapped in a ``pjit``
eqn. Under ``jax.disable_jit()`` the same call runs the function's Python
body directly on the kernel's tracers: the same primitives, none of that
overhead. Measured on the 2-core machine (fresh processes, the suite's
kernels): 25-60% off the trace, which is most of a first call.

``disable_jit`` also changes JAX's loop helpers, which is why it is not
always on: ``lax.scan`` (and ``fori_loop`` with static bounds, ``lax.map``,
``pl.loop``, ``emit_pipeline`` built on them) runs its body once per
iteration in Python, unrolling the loop into the kernel jaxpr: still the same
results, but a trace and a plan N times the size. ``while_loop``, ``cond`` and
``fori_loop`` with traced bounds are unaffected (a loop whose condition is a
tracer falls back to the primitive). So by default the body is inlined only
when no code the kernel reaches names a loop helper (``names_loop_helper``);
``InterpretParams(inline_jit=True/False)`` decides explicitly.
"""
from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable

import jax

# Names of JAX functions that build a scan: unrolled under disable_jit. Any
# code object naming one (as a global, an attribute such as ``lax.fori_loop``,
# or a resolved alias) keeps the kernel on the jit trace. ``map`` also matches
# Python's builtin: a false positive only forgoes the speed-up.
LOOP_HELPERS = frozenset({"scan", "fori_loop", "map", "loop", "nd_loop", "emit_pipeline",
                          "emit_pipeline_with_allocations"})
_MAX_DEPTH = 4  # helper functions followed from the kernel, transitively
# Libraries whose functions build no JAX loops: not followed.
_LIBRARIES = frozenset({"numpy", "scipy", "ml_dtypes", "opt_einsum", "torch", "pallas_np"})
_JAX_KERNELS = "jax.experimental.pallas.ops."  # JAX's kernel library: read like user code


class JitInlinedKernel(functools.partial):
  """The kernel, called under ``jax.disable_jit()``.

  A ``functools.partial`` (of no arguments) so that JAX names, locates and
  inspects the kernel exactly as it would the kernel itself (its debug info
  looks through partials), and error messages keep the kernel's name."""
  __slots__ = ()

  def __call__(self, *args, **kwargs):
    with jax.disable_jit():
      return super().__call__(*args, **kwargs)


def kernel_to_trace(kernel: Callable, inline_jit: bool | None) -> Callable:
  """What to hand ``pl.pallas_call`` for ``kernel``: itself, or itself traced
  with jitted calls inlined (``inline_jit``; ``None``: when safe)."""
  if inline_jit is None:
    inline_jit = not names_loop_helper(kernel)
  return JitInlinedKernel(kernel) if inline_jit else kernel


def names_loop_helper(fn: Any) -> bool:
  """Whether ``fn``'s code, or code it reaches (nested functions, closures,
  ``functools.partial`` arguments, module-level helper functions outside
  JAX, up to ``_MAX_DEPTH`` levels), names a loop helper (``LOOP_HELPERS``).

  Static and conservative: what it cannot see (a method called on an object,
  a helper passed in at run time) it cannot find, which at worst unrolls a
  loop; what it finds may be a false alarm (Python's ``map``), which at worst
  keeps the jit trace."""
  seen: set = set()
  return _reaches_loop_helper(fn, _MAX_DEPTH, seen)


def _reaches_loop_helper(fn, depth, seen) -> bool:
  if depth < 0 or id(fn) in seen:
    return False
  seen.add(id(fn))
  while isinstance(fn, functools.partial):
    for a in (*fn.args, *fn.keywords.values()):
      if callable(a) and _reaches_loop_helper(a, depth - 1, seen):
        return True
    fn = fn.func
  wrapped = getattr(fn, "__wrapped__", None)  # jax.jit, functools.wraps
  if wrapped is not None and _reaches_loop_helper(wrapped, depth, seen):
    return True
  if isinstance(fn, types.MethodType):  # a bound method as the kernel
    fn = fn.__func__
  if not isinstance(fn, types.FunctionType):
    call = getattr(type(fn), "__call__", None)
    if not isinstance(call, types.FunctionType):  # a builtin, a jit object
      return False
    fn = call  # a callable object
  module = getattr(fn, "__module__", None) or ""
  package = module.partition(".")[0]
  if package in ("jax", "jaxlib"):
    if fn.__name__ in LOOP_HELPERS:  # e.g. ``from jax.lax import fori_loop as fl``
      return True
    if not module.startswith(_JAX_KERNELS):  # JAX's API: its loops are named above
      return False
  elif package in _LIBRARIES or package in sys.stdlib_module_names:
    return False
  code_objects = [fn.__code__]
  referenced = []
  while code_objects:
    code = code_objects.pop()
    if not LOOP_HELPERS.isdisjoint(code.co_names):
      return True
    for c in code.co_consts:
      if isinstance(c, types.CodeType):
        code_objects.append(c)
    referenced.extend(code.co_names)
  module_globals = fn.__globals__
  others = [module_globals.get(n) for n in referenced]
  others += [cell.cell_contents for cell in fn.__closure__ or ()
             if _cell_is_set(cell)]
  others += list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
  for other in others:
    if other is None or isinstance(other, (types.ModuleType, type)):
      continue
    if callable(other) and _reaches_loop_helper(other, depth - 1, seen):
      return True
  return False


def _cell_is_set(cell) -> bool:
  try:
    cell.cell_contents  # noqa: B018
  except ValueError:  # an empty cell (a name assigned later)
    return False
  return True
