"""``pallas_np.jit``: a ``jax.jit`` whose whole program runs in the NumPy
evaluator.

Library kernels (megablox ``gmm``, ``flash_attention``, ...) are themselves
``jax.jit`` functions with XLA work around the ``pallas_call`` (group
metadata, reshapes, padding). Under ``force_numpy_interpret`` that outer work
is still compiled by XLA on the first call, which can cost more than running
the kernel. Here the program is traced to a jaxpr (no XLA) and evaluated by
the same evaluator the eager ``pallas_np.pallas_call`` uses: its rule for the
``pallas_call`` primitive runs the kernel, jit bodies are inlined.
"""
from __future__ import annotations

import collections
import functools
import threading
from typing import Any, Callable

import jax

from pallas_np import _compat as jc
from pallas_np.api import _eager_call, _is_concrete, _PLAN_CACHE_SIZE, force_numpy_interpret
from pallas_np.params import InterpretParams, resolve


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
  closures: collections.OrderedDict = collections.OrderedDict()
  lock = threading.Lock()

  def closure_for(static_pos, static_kw):
    key = (static_pos, static_kw)
    with lock:
      g = closures.get(key)
      if g is not None:
        closures.move_to_end(key)
        return g

    def g(dyn_args, dyn_kwargs):
      full = list(dyn_args)
      for i, v in static_pos:
        full.insert(i, v)
      return fun(*full, **dyn_kwargs, **dict(static_kw))
    with lock:
      g = closures.setdefault(key, g)
      while len(closures) > _PLAN_CACHE_SIZE:
        closures.popitem(last=False)
    return g

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
      if not _is_concrete(jax.tree_util.tree_leaves((dyn_args, dyn_kwargs))):
        return jax_jitted(*args, **kwargs)
      return _eager_call(closure_for(static_pos, static_kw), interp, (dyn_args, dyn_kwargs))

  call.jax_jitted = jax_jitted
  return call
