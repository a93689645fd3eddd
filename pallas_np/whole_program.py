"""Whole programs in the NumPy evaluator: ``pallas_np.jit`` and eager jit
calls.

Library kernels (megablox ``gmm``, ``flash_attention``, ...) are themselves
``jax.jit`` functions with XLA work around the ``pallas_call`` (group
metadata, reshapes, padding). Under ``force_numpy_interpret`` that outer work
is still compiled by XLA on the first call, which can cost more than running
the kernel. Here the program is traced to a jaxpr (no XLA) and evaluated by
the same evaluator the eager ``pallas_np.pallas_call`` uses: its rule for the
``pallas_call`` primitive runs the kernel, jit bodies are inlined.

The same happens without ``pallas_np.jit`` when a jitted function is called
eagerly (``InterpretParams.whole_program``): JAX's eager call of a jit is
hooked (``_compat.install_jit_call_hook``; from the first numpy-mode
kernel traced, ``install``), and a program whose kernels are
all numpy mode (an eager ``pl.pallas_call(..., interpret="numpy")`` is one:
JAX wraps the lone primitive in a jit), or any program with a kernel under
``force_numpy_interpret``, runs here instead of being compiled by XLA.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax

import numpy as np

from pallas_np import _compat as jc
from pallas_np import gc_pause, kernel_family
from pallas_np.api import (PLAN_CACHE_SIZE, EagerPlan, eager_call, is_concrete,
                           force_numpy_interpret)
from pallas_np.lru import LRU
from pallas_np.errors import UnsupportedError
from pallas_np.params import InterpretParams, is_numpy_mode, resolve


def jit(fun: Callable | None = None, *, static_argnums=(), static_argnames=(),
        params: InterpretParams | None = None):
  """Drop-in for ``jax.jit(fun, static_argnums=..., static_argnames=...)``.

  Called on concrete arrays, ``fun`` is traced once per (argument structure,
  shapes/dtypes, static values) and the whole jaxpr is evaluated with NumPy:
  zero XLA compilations, every ``pallas_call`` in NumPy mode with ``params``.
  Called with tracers (inside another ``jit``/``vmap``/``grad``) it is
  ``jax.jit(fun, ...)`` under ``force_numpy_interpret(params)``. A primitive
  of the outer program without a NumPy rule raises ``UnsupportedError``.
  """
  if fun is None:
    return functools.partial(jit, static_argnums=static_argnums,
                             static_argnames=static_argnames, params=params)
  interp = resolve(params if params is not None else "numpy")
  static_argnums, static_argnames = jc.infer_argnums_and_argnames(
      fun, static_argnums, static_argnames)
  static_names = frozenset(static_argnames)
  jax_jitted = jax.jit(fun, static_argnums=static_argnums, static_argnames=static_argnames)
  # static values -> the function of the dynamic arguments; the eager cache
  # is keyed by that function object, so it must stay the same one.
  closures = LRU(PLAN_CACHE_SIZE)

  def closure_for(static_pos, static_kw):
    key = (static_pos, static_kw)
    g = closures.get(key)
    if g is not None:
      return g

    def g(dyn_args, dyn_kwargs):
      full = list(dyn_args)
      for i, v in static_pos:
        full.insert(i, v)
      return fun(*full, **dyn_kwargs, **dict(static_kw))
    return closures.setdefault(key, g)

  @functools.wraps(fun)
  def call(*args, **kwargs):
    n = len(args)
    pos = sorted({i + n if i < 0 else i for i in static_argnums if -n <= i < n})
    static_pos = tuple((i, args[i]) for i in pos)
    static_kw = tuple(sorted(((k, v) for k, v in kwargs.items() if k in static_names),
                             key=lambda kv: kv[0]))
    dyn_args = tuple(a for i, a in enumerate(args) if i not in pos)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_names}
    with force_numpy_interpret(interp):
      if not is_concrete(jax.tree_util.tree_leaves((dyn_args, dyn_kwargs))):
        return jax_jitted(*args, **kwargs)
      return eager_call(closure_for(static_pos, static_kw), interp, (dyn_args, dyn_kwargs))

  call.jax_jitted = jax_jitted
  return call


# -- eager jit calls ----------------------------------------------------------
# (id(closed jaxpr), forced params) -> (closed jaxpr, EagerPlan | None)
_routes = LRU(PLAN_CACHE_SIZE)
_cpu_default: list = []  # [bool], once: is JAX's default device a CPU?


def _eager_jit_call(jax_impl, *args, jaxpr, **jit_params):
  """JAX's eager call of a jitted function, run by the NumPy evaluator when
  ``_route`` says so (no XLA compilation), else by ``jax_impl``."""
  forced = jc.interpret_mode_config.value
  if forced is not None and not is_numpy_mode(forced):
    return jax_impl(*args, jaxpr=jaxpr, **jit_params)
  if not _cpu_default:
    _cpu_default.append(jax.devices()[0].platform == "cpu")
  if not _cpu_default[0]:
    return jax_impl(*args, jaxpr=jaxpr, **jit_params)
  key = (id(jaxpr), forced)
  hit = _routes.peek(key)
  first = hit is None or hit[0] is not jaxpr
  if first:
    kernels = _kernel_interprets(jaxpr.jaxpr)
    if not kernels:  # not ours; XLA's C++ cache keeps it from coming back
      return jax_impl(*args, jaxpr=jaxpr, **jit_params)
    with gc_pause.first_call():
      hit = (jaxpr, _route(jaxpr, jit_params, forced, kernels))
    _routes.put(key, hit)
  eager_plan = hit[1]
  if eager_plan is None:
    return jax_impl(*args, jaxpr=jaxpr, **jit_params)
  for a in args:
    if not _on_cpu(a):
      return jax_impl(*args, jaxpr=jaxpr, **jit_params)
  if first:  # (its plans' first run compiles them)
    with gc_pause.first_call():
      outs = eager_plan.run(args, own_outputs=True)
  else:
    outs = eager_plan.run(args, own_outputs=True)
  return eager_plan.jax_outputs(outs), None, None, []


def _route(closed, jit_params, forced, kernels) -> EagerPlan | None:
  """The NumPy plan of an eagerly called jit's program, or None for XLA.
  ``kernels``: the ``interpret=`` of each pallas_call in it."""
  if forced is not None:  # every kernel runs with the forced options
    interp = resolve(forced)
    if not interp.whole_program:
      return None
  else:  # every kernel must be numpy mode; each keeps its own options
    if not all(is_numpy_mode(k) and resolve(k).whole_program for k in kernels):
      return None
    interp = resolve(kernels[0])
  if any(jc.is_extended_dtype(getattr(a, "dtype", None))
         for a in (*closed.in_avals, *closed.out_avals)):
    return None  # typed PRNG keys in or out: XLA holds them (as their key data)
  if not all(jc.is_unspecified_sharding(s)
             for s in (*jit_params["in_shardings"], *jit_params["out_shardings"])):
    return None  # placement the caller asked for: XLA's business
  if any(l is not None for l in (*jit_params["in_layouts"], *jit_params["out_layouts"])):
    return None
  try:
    return EagerPlan(closed, interp, jit_params["name"],
                     kernel_params_from_eqns=forced is None)
  except UnsupportedError:
    # A primitive around the kernels without a NumPy rule: XLA compiles the
    # program and the kernels run through io_callback (an unsupported
    # primitive inside a kernel raises again when that lowering compiles it).
    return None


def _kernel_interprets(jaxpr) -> list:
  """The ``interpret=`` of every kernel in a program (nested ones too): the
  eqns of every registered kernel family (``kernel_family``)."""
  found = [eqn.params["interpret"] for eqn in jaxpr.eqns
           if kernel_family.family_of(eqn.primitive) is not None]
  for sub in jc.subjaxprs(jaxpr):
    found += _kernel_interprets(sub)
  return found


def _on_cpu(x) -> bool:
  if type(x) is jc.ArrayImpl:  # the common case first: one dict lookup
    found = _cpu_shardings.get(x.sharding)
    if found is not None:
      return found
  if isinstance(x, (np.ndarray, np.generic, int, float, complex, bool)):
    return True
  sharding = getattr(x, "sharding", None)
  if sharding is None:
    return False
  found = _cpu_shardings.get(sharding)
  if found is None:
    devices = sharding.device_set
    found = len(devices) == 1 and next(iter(devices)).platform == "cpu"
    if len(_cpu_shardings) > 1024:
      _cpu_shardings.clear()
    _cpu_shardings[sharding] = found
  return found


_cpu_shardings: dict = {}  # sharding -> on one CPU device? (arrays share a few)
_last_cpu_sharding: list = [None]  # the last sharding _run_routed found on one CPU device


def _runs_here(jit_params) -> bool:
  """Whether the eager jit call of these params is routed to the NumPy
  evaluator (its route was made by an earlier call)."""
  jaxpr = jit_params["jaxpr"]
  hit = _routes.peek((id(jaxpr), jc.interpret_mode_config.value))
  return hit is not None and hit[0] is jaxpr and hit[1] is not None


def _run_routed(jit_params, args_flat):
  """The outputs of an eager jit call whose route (made by an earlier call
  through ``_eager_jit_call``) runs here, on arguments that are all
  jax.Arrays or NumPy arrays on one CPU device; else None (JAX's own path,
  which reaches ``_eager_jit_call``)."""
  jaxpr = jit_params["jaxpr"]
  hit = _routes.peek((id(jaxpr), jc.interpret_mode_config.value))
  if hit is None or hit[0] is not jaxpr or hit[1] is None:
    return None
  plan = hit[1]
  in_dtypes = plan.in_dtypes
  # every argument of the program's dtype (EagerPlan.typed_args)?
  typed = len(args_flat) == len(in_dtypes)
  for i, a in enumerate(args_flat):
    t = type(a)
    if t is jc.ArrayImpl:
      if a.sharding is not _last_cpu_sharding[0]:  # (a sharding's hash is Python)
        if not _on_cpu(a):
          return None
        _last_cpu_sharding[0] = a.sharding
      if a.is_deleted():
        return None
    elif t is not np.ndarray:
      return None
    if typed and a.dtype != in_dtypes[i]:
      typed = False
  if typed:
    direct = plan.direct()
    if direct is not None:
      return direct(args_flat)
  return plan.jax_outputs(plan.run(args_flat, own_outputs=True))


# Traced programs of eager jit calls that run here, by their arguments
# (_compat.install_jit_params_memo).
_jit_params_memo = LRU(PLAN_CACHE_SIZE)


def install():
  """Route eager jit calls as ``InterpretParams.whole_program`` says, from
  the first numpy-mode kernel on (idempotent).

  JAX's eager jit call is hooked only once a program asks for pallas_np: a
  kernel traced with ``interpret="numpy"``, or any kernel traced under the
  force switch (``_asked_for``, watching the kernel primitives' abstract
  evaluation, which runs while JAX traces the program and so before its
  eager call reaches the hooks). Until then ``import pallas_np`` replaces
  nothing that a jitted function without such kernels goes through. The
  watch stays (one check per kernel traced): hooks that something else took
  out (a test's monkeypatch undone) come back with the next kernel."""
  for prim in kernel_family.kernel_primitives():
    jc.watch_abstract_eval(prim, _asked_for)


def install_hooks():
  """Put the eager-jit hooks in (``install`` does it with the first
  numpy-mode kernel; ``PALLAS_NP_FORCE`` at import, at once). Idempotent."""
  jc.install_jit_call_hook(_eager_jit_call)
  jc.install_jit_params_memo(_jit_params_memo, _runs_here)
  jc.install_jit_run_hook(_run_routed)


def _asked_for(params):
  """A kernel is being traced: numpy mode (its own, or forced) installs the hooks."""
  if is_numpy_mode(params.get("interpret")) or is_numpy_mode(jc.interpret_mode_config.value):
    install_hooks()
