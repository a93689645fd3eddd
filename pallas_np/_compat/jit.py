"""``jax.jit`` from the inside: tracing a jitted function, its static
arguments, and the hooks on JAX's eager jit call (``pallas_np.whole_program``)."""
from __future__ import annotations

import inspect

import jax
from jax._src import api_util
from jax._src import config as jax_config
from jax._src import core as jax_core
from jax._src import pjit as jax_pjit
from jax._src import sharding_impls as jax_sharding_impls
from jax._src import tree_util as jax_tree_util

from pallas_np._compat.core import ArrayImpl

# The functions the eager-jit hooks replace (installed later, with the first
# numpy-mode kernel): a JAX that renamed one fails here, at import, loudly.
_HOOKED = (jax_pjit._pjit_call_impl_python, jax_pjit._infer_params, jax_pjit._run_python_pjit)

try:
  from jax._src.lib import _jax as _jaxlib_ext
  _JitFunction = _jaxlib_ext.PjitFunction  # what jax.jit returns
except (ImportError, AttributeError):  # pragma: no cover - another jaxlib layout
  _JitFunction = ()


def jit_trace(fn, args):
  """The trace of ``jax.jit(fn)(*args)``. A function that is jitted already
  (``pl.pallas_call`` returns one: jit with inline=True) is traced as it is,
  the trace ``interpret=True``'s first call makes; a second jit level
  around it costs ~800 more Python calls per first call."""
  if isinstance(fn, _JitFunction):
    return fn.trace(*args)
  return jax.jit(fn).trace(*args)


def install_jit_call_hook(hook):
  """Put ``hook(jax_impl, *args, jaxpr=..., **jit_params)`` in front of the
  function JAX runs when a ``jax.jit`` function (or an eagerly bound
  primitive, which JAX runs through a jit) misses its C++ dispatch cache
  and is called on concrete arrays: it lowers, XLA-compiles and runs the
  jaxpr. The hook returns what JAX's does, ``(out_flat, compiled,
  profiler, const_args)``; ``compiled=None`` keeps the C++ cache empty, so
  later calls come back through the hook. Idempotent."""
  current = jax_pjit._pjit_call_impl_python
  if getattr(current, "pallas_np_hook", None) is hook:
    return

  def call_impl(*args, **params):
    return hook(current, *args, **params)
  call_impl.pallas_np_hook = hook
  jax_pjit._pjit_call_impl_python = call_impl


def install_jit_params_memo(memo, keep):
  """Put a memo in front of ``pjit._infer_params``, which every eager call
  of a ``jax.jit`` function that misses the C++ dispatch cache runs (our
  whole-program calls always do: they keep that cache empty) to find its
  traced program: JAX's own cache lookup, argument flattening and
  abstractification, ~25 µs a call. The memo covers calls whose arguments
  are all jax.Arrays, with no keyword or static arguments, and remembers
  only programs ``keep(params)`` accepts (those pallas_np runs). Its key
  holds everything JAX's cache keys on for such calls: the function and
  its jit info, each argument's aval and sharding (JAX's aval is the
  aval updated with the sharding), the context mesh, and the trace context
  (every config option that changes tracing, the force config included).
  In front of that key, the last program of each jit function is kept
  under ``id(ji)`` and found by identity (the same jit info, function,
  mesh and equal trace context; each argument's aval and sharding the very
  objects of that call): no hashing on a loop's repeated calls, and
  nothing stale, as an identical object is an equal one and both entries
  live in ``memo``. ``memo``: an object with ``peek``/``put``. Idempotent."""
  current = jax_pjit._infer_params
  if getattr(current, "pallas_np_memo", None) is keep:
    return
  get_ctx_mesh = jax_pjit.get_ctx_mesh
  trace_context = jax_config.trace_context

  def infer_params(fun, ji, args, kwargs):
    if kwargs or ji.static_argnums or ji.static_argnames:
      return current(fun, ji, args, kwargs)
    mesh, context = get_ctx_mesh(ji.use_resource_env), trace_context()
    # The last program of this jit function, under ``id(ji)``, found by
    # identity (no hashing of avals, shardings, jit info): an argument
    # whose aval and sharding are the very objects it was traced with.
    last = memo.peek(id(ji))
    if (last is not None and last[0] is ji and last[1] is fun and last[2] is mesh
        and len(last[4]) == len(args) and last[3] == context):
      seen = last[4]
      i = 0
      for a in args:
        if type(a) is not ArrayImpl or a.aval is not seen[i][0] or a.sharding is not seen[i][1]:
          break
        i += 1
      else:
        p = last[5]
        return p, [*p.consts, *args]
    sig = []
    for a in args:
      if type(a) is not ArrayImpl:
        return current(fun, ji, args, kwargs)
      sig.append((a.aval, a.sharding))
    sig = tuple(sig)
    key = (fun, ji, sig, mesh, context)
    p = memo.peek(key)
    if p is not None:
      memo.put(id(ji), (ji, fun, mesh, context, sig, p))
      return p, [*p.consts, *args]
    p, args_flat = current(fun, ji, args, kwargs)
    if keep(p.params):
      memo.put(key, p)
      memo.put(id(ji), (ji, fun, mesh, context, sig, p))
    return p, args_flat
  infer_params.pallas_np_memo = keep
  jax_pjit._infer_params = infer_params


def install_jit_run_hook(runner):
  """Put ``runner(params, args_flat)`` in front of ``pjit._run_python_pjit``,
  which the eager call of a ``jax.jit`` function runs after
  ``_infer_params``: argument checks (valid JAX types, no escaped tracer),
  then ``_pjit_call_impl_python`` (the jit call hook). ``runner`` returns
  the flat outputs, or None to leave the call to JAX. It is asked only at
  the top level of tracing with ``debug_key_reuse`` off (JAX binds the jit
  primitive otherwise), and must itself accept only arguments that pass
  JAX's checks. Saves JAX's per-argument checks and the rest of the
  Python around the hook on calls pallas_np runs. Idempotent."""
  current = jax_pjit._run_python_pjit
  if getattr(current, "pallas_np_runner", None) is runner:
    return
  top_level = jax_core.trace_state_clean
  key_reuse = jax_config.debug_key_reuse
  unflatten = jax_tree_util.tree_unflatten

  def run_python_pjit(p, args_flat, fun, args, kwargs):
    if top_level() and not key_reuse.value:
      params = p.params
      out_flat = runner(params, args_flat)
      if out_flat is not None:
        return (unflatten(p.out_tree, out_flat), out_flat, p.out_tree, args_flat,
                params["jaxpr"], None, None, [])
    return current(p, args_flat, fun, args, kwargs)
  run_python_pjit.pallas_np_runner = runner
  jax_pjit._run_python_pjit = run_python_pjit


def is_unspecified_sharding(s) -> bool:
  return isinstance(s, jax_sharding_impls.UnspecifiedValue)


def infer_argnums_and_argnames(fun, static_argnums, static_argnames):
  """jax.jit's own completion of static_argnums <-> static_argnames."""
  try:
    sig = inspect.signature(fun)
  except (TypeError, ValueError):
    sig = None
  if sig is None:
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums or ())
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames or ())
    return nums, names
  return api_util.infer_argnums_and_argnames(sig, static_argnums, static_argnames)


def watch_abstract_eval(prim, watcher) -> None:
  """Call ``watcher(params)`` each time ``prim`` is traced (its abstract
  evaluation), before JAX's own rule: how
  pallas_np notices the first numpy-mode kernel of a program while JAX
  traces it, before JAX runs or compiles the program. Idempotent."""
  current = prim.abstract_eval
  if getattr(current, "pallas_np_watcher", None) is watcher:
    return

  def abstract_eval(*avals, **params):
    watcher(params)
    return current(*avals, **params)
  abstract_eval.pallas_np_watcher = watcher
  prim.abstract_eval = abstract_eval

