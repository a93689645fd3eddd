"""Entry points: ``interpret="numpy"``, ``pallas_np.pallas_call`` and the
force switch.

How a kernel reaches the interpreter:

* Traced (``jax.jit``, ``vmap``, ``grad``, ``scan`` or plain ``pl.pallas_call``
  called eagerly, which JAX runs through a jit): JAX's transformations act on
  the ``pallas_call`` primitive as usual; at lowering time our lowering rule
  (installed in front of JAX's) sees ``interpret`` is numpy mode and emits an
  unordered ``io_callback`` into the host interpreter. Every other
  ``interpret`` value goes to JAX's own lowering untouched.
* Eager ``pallas_np.pallas_call(...)(*concrete_arrays)``: the wrapper is traced
  to a jaxpr (no XLA), and the jaxpr is evaluated by the same evaluator, whose
  rule for the ``pallas_call`` primitive runs the kernel. Nothing is compiled
  by XLA.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import numpy as np
from jax.experimental import pallas as pl

from pallas_np import _compat as jc
from pallas_np import fp_state, gc_pause, kernel_family, lru, meshes
from pallas_np.compiler import Compiler, RunContext, sourcemap
from pallas_np.grid import KernelPlan
from pallas_np.grid.plan_key import structural_key
from pallas_np.mosaic_gpu import entry as mosaic_gpu_entry  # noqa: F401 (its mesh runners)
from pallas_np.params import InterpretParams, is_numpy_mode, resolve
from pallas_np.tracing import kernel_to_trace

# -- plan cache ---------------------------------------------------------------
PLAN_CACHE_SIZE = 256  # the bound of each cache of compiled plans
_plan_cache = lru.LRU(PLAN_CACHE_SIZE)


_structural_plans = lru.LRU(PLAN_CACHE_SIZE)  # structural key -> plan


def _plan_key(params: dict, interp: InterpretParams):
  # The debug-checks flag is part of JAX's jit key: a kernel compiled with
  # pl.debug_check on differs from one compiled with it off.
  return (id(params["jaxpr"]), id(params["grid_mapping"]),
          params["input_output_aliases"], interp, jc.debug_checks_enabled())


def get_kernel_plan(params: dict, interp: InterpretParams) -> KernelPlan:
  """Compile (or fetch) the plan of one pallas_call eqn's params.

  Looked up by the identity of the kernel jaxpr and grid mapping first (the
  objects are kept alive by the cache entry, so ids are not reused while
  cached), then by structure (``grid.plan_key``): a re-traced identical
  kernel reuses its plan instead of compiling it again."""
  key = _plan_key(params, interp)
  hit = _plan_cache.get(key)
  if hit is not None:
    return hit[1]
  skey = structural_key(params)
  skey = None if skey is None else (skey, jc.debug_checks_enabled())
  plan = None if skey is None else _structural_plans.get((skey, interp))
  if plan is None:
    with gc_pause.first_call():
      plan = KernelPlan(params=interp, **{k: v for k, v in params.items()
                                          if k != "interpret"})
    if skey is not None:
      _structural_plans.put((skey, interp), plan)
  _plan_cache.put(key, ((params["jaxpr"], params["grid_mapping"]), plan))
  return plan


def grid_report() -> list[dict]:
  """How each cached kernel's grid ran last, and why not batched: one dict
  per kernel (least recently used first) with ``kernel``, ``grid``, ``mode``
  ("vectorized", "threaded", "sequential", or None if never run), ``why``
  (the vectorizer's reason for a sequential run, else None), ``layout``
  (a vectorized run's lanes: "lanes-first" or "lanes-last", else None) and
  ``batched_axes`` (the grid axes a vectorized run batched, else None)."""
  plans = list({id(entry[1]): entry[1] for entry in _plan_cache.values()}.values())
  report = []
  for kp in plans:
    why = None
    gv = kp.vectorizer
    if kp.last_mode not in (None, "vectorized"):
      if kp.params.vectorize is False:
        why = "vectorize=False"
      elif gv is None:
        why = "one grid point, or a num_cores > 1 run"
      else:
        why = gv.reason or gv.last_failure or "no grid axes whose points own their outputs"
    vectorized = gv is not None and kp.last_mode == "vectorized"
    report.append({"kernel": kp.name, "grid": kp.grid, "mode": kp.last_mode,
                   "why": None if why is None else str(why),
                   "layout": gv.last_layout if vectorized else None,
                   "batched_axes": gv.last_axes if vectorized else None})
  return report


def clear_caches():
  """Drop every compiled plan (e.g. after registering a new rule): every
  cache of compiled things (kernel plans, eager plans, eager-jit routes,
  code objects; see ``pallas_np.lru``) and the source map of the plans."""
  lru.clear_all()
  sourcemap.clear()


# -- the pallas_call family (pallas_np.kernel_family) ----------------------------------
class PallasCallFamily(kernel_family.KernelFamily):
  """``pallas_call``: one ``grid.KernelPlan`` per eqn (``get_kernel_plan``)."""
  name = "pallas_call"
  primitives = (jc.pallas_call_p,)
  sequential_reason = ("a pallas_call inside a kernel runs its own grid: the outer grid runs "
                       "sequentially")

  def plan(self, prim, params, num_inputs, interp, call_site=""):
    return get_kernel_plan(params, interp)


PALLAS_CALLS = kernel_family.register_family(PallasCallFamily())

# -- lowering hooks (traced path) ----------------------------------------------
_jax_lowering = None  # JAX's own pallas_call lowering, for every other interpret mode


def _pallas_call_lowering(ctx, *in_nodes, **params):
  return kernel_family.lower(PALLAS_CALLS, jc.pallas_call_p, _jax_lowering, ctx, in_nodes,
                             params)


def install():
  """Put the numpy-mode lowering of every kernel family in front of JAX's
  (idempotent). Mesh kernels' CPU lowering calls JAX's pallas_call lowering
  directly, past ours: their own primitives get the family's rule too."""
  global _jax_lowering
  for prim in meshes.MESH_KERNELS.primitives:
    current = jc.lowering_rule(prim)
    if current is not None and getattr(current, "pallas_np_family", None) is None:
      jc.register_lowering(prim, kernel_family.lowering_rule(meshes.MESH_KERNELS, prim,
                                                             current))
  current = jc.original_pallas_call_lowering()
  if current is _pallas_call_lowering:
    return
  _jax_lowering = current
  jc.register_pallas_call_lowering(_pallas_call_lowering)


# -- public API ---------------------------------------------------------------
_eager_cache = lru.LRU(PLAN_CACHE_SIZE)


def is_concrete(leaves) -> bool:
  for x in leaves:
    if isinstance(x, jc.Tracer):
      return False
  return True


def pallas_call(kernel, out_shape, *, interpret: Any = "numpy", **kwargs):
  """``pl.pallas_call`` with ``interpret`` defaulting to the NumPy interpreter.

  Called eagerly on concrete arrays it traces the kernel and interprets it
  without any XLA compilation; inside ``jit``/``vmap``/``grad`` it behaves
  exactly like ``pl.pallas_call(..., interpret="numpy")``. Either way the
  kernel body is traced with the jitted functions it calls inlined where that
  is safe (``InterpretParams.inline_jit``, pallas_np.tracing).
  """
  if interpret is None:
    interpret = "numpy"
  if not is_numpy_mode(interpret):
    return pl.pallas_call(kernel, out_shape, interpret=interpret, **kwargs)
  interp = resolve(interpret)
  jax_fn = pl.pallas_call(kernel_to_trace(kernel, interp.inline_jit), out_shape,
                          interpret=interpret, **kwargs)
  # Per-call fast path: flat array arguments' signature -> the eager entry
  # (only with no interpret mode forced; the same entry eager_call finds).
  fast = lru.LRU(FAST_CALL_SIGNATURES)
  # In front of it, the last call whose arguments were all jax.Arrays:
  # (their avals, its runner), found by the avals' identity (the very
  # aval objects: the same signature) without building the signature.
  last = lru.Slot()

  @functools.wraps(kernel)
  def call(*args):
    forced = jc.interpret_mode_config.value
    if forced is None:
      seen = last.value
      if seen is not None and len(args) == len(seen[0]):
        for a, aval in zip(args, seen[0]):
          if type(a) is not jc.ArrayImpl or a.aval is not aval:
            break
        else:
          run, unpack = seen[1]
          if unpack is None:  # (the one-output program: run's only element)
            return run(args)[0]
          return _unpack(seen[1], args)
      sig = flat_signature(args)
      if sig is not None:
        hit = fast.peek(sig)
        if hit is None:
          with gc_pause.first_call():  # (the trace, plans and first run)
            hit = eager_entry(jax_fn, interp, args).runner(args)
            fast.put(sig, hit)
            return _unpack(hit, args)
        avals = []
        for a in args:
          if type(a) is not jc.ArrayImpl:
            break
          avals.append(a.aval)
        else:
          last.value = (tuple(avals), hit)
        run, unpack = hit
        if unpack is None:
          return run(args)[0]
        return _unpack(hit, args)
    elif not is_numpy_mode(forced):
      # Another interpret mode is forced (pltpu.force_tpu_interpret_mode):
      # JAX reads the config when the call is built, so build it now.
      return pl.pallas_call(kernel, out_shape, interpret=forced, **kwargs)(*args)
    leaves = jax.tree_util.tree_leaves(args)
    if not is_concrete(leaves):
      return jax_fn(*args)
    return eager_call(jax_fn, resolve(forced) if forced is not None else interp, args)
  call.jax_callable = jax_fn
  return call


FAST_CALL_SIGNATURES = 16  # per pallas_np.pallas_call: argument shapes/dtypes kept


def _unpack(runner, args):
  """The call's result from an ``EagerEntry.runner`` pair."""
  run, unpack = runner
  if unpack is None:
    return run(args)[0]
  if unpack is True:
    return run(args)
  return jax.tree_util.tree_unflatten(unpack, run(args))


def flat_signature(args) -> tuple | None:
  """(shape, dtype, weak_type) of each argument when every one is a
  concrete jax.Array or NumPy array (no pytree to flatten), else None:
  what the eager cache keys on, built cheaply."""
  sig = []
  for a in args:
    t = type(a)
    if t is jc.ArrayImpl:  # (its aval's fields: no property calls)
      aval = a.aval
      sig.append((aval.shape, aval.dtype, aval.weak_type))
    elif t is np.ndarray:
      sig.append((a.shape, a.dtype, False))
    else:
      return None
  return tuple(sig)


def eager_call(jax_fn, interp, args):
  return eager_entry(jax_fn, interp, args).call(jax.tree_util.tree_leaves(args))


class EagerEntry:
  """A traced program's ``EagerPlan`` and its output structure: one eager
  call on flat concrete arguments, jax.Arrays out."""
  __slots__ = ("plan", "out_tree", "one_output")

  def __init__(self, plan, out_tree):
    self.plan = plan
    self.out_tree = out_tree
    self.one_output = jax.tree_util.treedef_is_leaf(out_tree)

  def call(self, leaves):
    # Outputs become jax.Arrays without a copy, so none may share memory
    # with an input or a constant of the plan (own_outputs).
    outs = self.plan.run(leaves, own_outputs=True)
    if self.one_output and self.plan.out_weak is None:
      return jc.np_to_jax(outs[0])
    return jax.tree_util.tree_unflatten(self.out_tree, self.plan.jax_outputs(outs))

  def runner(self, args):
    """``(run, unpack)`` for flat arguments of ``args``' exact types,
    shapes and dtypes (``flat_signature``: the caller keys it so): the
    call's result is ``run(args)[0]`` where ``unpack`` is None, ``run(args)``
    where it is True, else ``tree_unflatten(unpack, run(args))``. Where the
    program is one kernel taking the arguments as they are, ``run`` is its
    plan's run straight to a list of jax.Arrays (``EagerPlan.direct``, the
    per-call floor); else ``call``."""
    plan = self.plan
    if plan.kernel is None or not plan.typed_args(args):
      return self.call, True
    run = plan.direct()
    if run is None:
      to_jax = plan.kernel_to_jax()
      if to_jax is None:
        return self.call, True
      kernel_run = plan.kernel.run
      if self.one_output:  # (no comprehension frame: the per-call floor)
        one = to_jax[0]
        run = lambda args: [one(kernel_run(*args)[0])]  # noqa: E731
      else:
        run = lambda args: [f(o) for f, o in zip(to_jax, kernel_run(*args))]  # noqa: E731
    return run, None if self.one_output else self.out_tree


class EagerPlan:
  """A traced program (ClosedJaxpr) compiled for eager calls: the whole
  jaxpr in the NumPy evaluator, whose ``pallas_call`` rule runs the kernels.
  A program that is one pallas_call over its own inputs (what
  ``pallas_np.pallas_call`` traces) runs that kernel's plan directly."""
  __slots__ = ("plan", "in_dtypes", "out_weak", "out_avals", "interp", "name", "kernel",
               "_to_jax", "_direct")

  def __init__(self, closed, interp: InterpretParams, name: str = "pallas_call", *,
               kernel_params_from_eqns: bool = False):
    self.plan = Compiler(interp, name, kernel_params_from_eqns=kernel_params_from_eqns
                         ).compile(closed, first_calls=True)
    # Python scalars and float64/int64 NumPy values take JAX's canonical
    # dtypes (float32/int32 without x64), as the traced jaxpr says.
    self.in_dtypes = tuple(np.dtype(jc.physical_dtype(a.dtype)) for a in closed.in_avals)
    # Weakly typed outputs (a Python scalar's arithmetic) stay weak, as in
    # XLA's run: None when there are none (the common case).
    weak = tuple(bool(getattr(a, "weak_type", False)) for a in closed.out_avals)
    self.out_weak = weak if any(weak) else None
    self.out_avals = tuple(closed.out_avals)
    self._to_jax = None  # kernel_to_jax, on first use
    self._direct = None  # direct, on first use
    self.interp = interp
    self.name = name
    self.kernel = _only_kernel(closed, interp, kernel_params_from_eqns)

  def run(self, leaves, *, own_outputs=False) -> list:
    """NumPy outputs of the program on ``leaves`` (flat, concrete).

    ``own_outputs``: copy any output that may share memory with an input, a
    constant of the plan (folded, or a read-only view such as a JAX
    constant's buffer), so the caller may hand it out zero-copy."""
    kernel = self.kernel
    if kernel is not None:  # its outputs are fresh buffers: owned
      if self.typed_args(leaves):  # the kernel takes them as they are
        return kernel.run(*leaves)
      return kernel.run(*[np.asarray(x, dtype=dt) for x, dt in zip(leaves, self.in_dtypes)])
    np_args = [np.asarray(x, dtype=dt) for x, dt in zip(leaves, self.in_dtypes)]
    # Silent inf/NaN and integer wrap-around, as in XLA and inside kernels
    # (KernelPlan.run): 0-d eqns run NumPy's scalar math, which would warn.
    quiet = fp_state.quiet_floats()
    try:
      outs = [np.asarray(o) for o in self.plan(RunContext(self.name, self.interp), *np_args)]
    finally:
      fp_state.restore_floats(quiet)
    if own_outputs:
      consts = self.plan.const_outputs
      outs = [np.array(o) if i in consts or not o.flags.writeable
              or any(np.may_share_memory(o, a) for a in np_args) else o
              for i, o in enumerate(outs)]
    return outs


  def kernel_to_jax(self):
    """Per output of the program's only kernel, a function handing that
    kernel's output buffer (its exact shape and dtype) to JAX with the
    aval looked up once; None where the program is not one kernel or an
    output's dtype is not a plain NumPy one."""
    if self._to_jax is None:
      makers = False
      if self.kernel is not None:
        weak = self.out_weak or (False,) * len(self.out_avals)
        dtypes = [jc.physical_dtype(a.dtype) for a in self.out_avals]
        if all(isinstance(dt, np.dtype) and dt == a.dtype
               for dt, a in zip(dtypes, self.out_avals)):
          makers = tuple(jc.jax_array_maker(a.shape, a.dtype, w)
                         for a, w in zip(self.out_avals, weak))
      self._to_jax = makers
    return self._to_jax or None

  def direct(self):
    """Where the program is one kernel whose outputs are fresh buffers of
    plain dtypes and whose strategy has a one-frame form
    (``KernelPlan.direct_runner``), a function of the flat arguments
    (already of the program's dtypes: ``typed_args``) returning the
    outputs as jax.Arrays (weak types as traced): ``jax_outputs(run(...))``
    without the steps between. Else None."""
    if self._direct is None:
      direct = False
      if self.kernel is not None:
        weak = self.out_weak or (False,) * len(self.out_avals)
        puts = [jc.exact_array_putter(a.shape, a.dtype, w)
                if isinstance(a.dtype, np.dtype) and jc.physical_dtype(a.dtype) == a.dtype
                else None for a, w in zip(self.out_avals, weak)]
        if None not in puts:
          direct = self.kernel.direct_runner(puts) or False
      self._direct = direct
    return self._direct or None

  def jax_outputs(self, outs) -> list:
    """jax.Arrays of ``run``'s outputs (owned), weak types as traced."""
    to_jax = self._to_jax
    if to_jax is None:
      to_jax = self.kernel_to_jax()
    if to_jax:  # the only kernel's outputs (kernel_to_jax)
      return [f(o) for f, o in zip(to_jax, outs)]
    weak = self.out_weak
    if weak is None:
      return [jc.np_to_jax(o) for o in outs]
    return [jc.np_to_jax(o, w) for o, w in zip(outs, weak)]

  def typed_args(self, leaves) -> bool:
    """Whether every leaf is a NumPy array or jax.Array of the program's
    dtype (no conversion needed: the kernel plan reads it as it is)."""
    if len(leaves) != len(self.in_dtypes):
      return False
    for x, dt in zip(leaves, self.in_dtypes):
      t = type(x)
      if (t is not jc.ArrayImpl and t is not np.ndarray) or x.dtype != dt:
        return False
    return True


def _only_kernel(closed, interp, kernel_params_from_eqns):
  """The KernelPlan of a program that is exactly one pallas_call of its
  inputs, in order, returning its outputs (the plan the program's
  ``pallas_call`` rule runs); else None. Its run's outputs are always fresh
  buffers (allocated, or copies for aliased inputs and padding)."""
  jaxpr = closed.jaxpr
  if closed.consts or len(jaxpr.eqns) != 1:
    return None
  eqn = jaxpr.eqns[0]
  if (eqn.primitive is not jc.pallas_call_p or list(eqn.invars) != list(jaxpr.invars)
      or list(eqn.outvars) != list(jaxpr.outvars)
      or len(set(map(id, jaxpr.outvars))) != len(jaxpr.outvars)):
    return None
  if kernel_params_from_eqns:
    interp = resolve(eqn.params["interpret"])
  return get_kernel_plan(dict(eqn.params), interp)


def eager_numpy_call(jax_fn, interp, args, *, own_outputs=False):
  """Evaluate ``jax_fn(*args)`` (concrete arrays) with the NumPy evaluator,
  no XLA: returns the NumPy outputs (flat) and their pytree structure.
  Compiled once per (function, argument shapes/dtypes, params)."""
  entry = eager_entry(jax_fn, interp, args)
  leaves = jax.tree_util.tree_leaves(args)
  return entry.plan.run(leaves, own_outputs=own_outputs), entry.out_tree


def eager_entry(jax_fn, interp, args) -> EagerEntry:
  """The ``EagerEntry`` of ``jax_fn`` on arguments like ``args``: traced
  and compiled once per (function, argument structure and
  shapes/dtypes/weak types, params)."""
  leaves, treedef = jax.tree_util.tree_flatten(args)
  avals = tuple((np.shape(x), _dtype_of(x), getattr(x, "weak_type", False))
                for x in leaves)
  key = (jax_fn, treedef, avals, interp)
  entry = _eager_cache.get(key)
  if entry is None:
    with gc_pause.first_call():
      traced = jc.jit_trace(jax_fn, args)
      entry = EagerEntry(EagerPlan(traced.jaxpr, interp),
                         jax.tree_util.tree_structure(traced.out_info))
    _eager_cache.put(key, entry)
  return entry


def _dtype_of(x):
  dt = getattr(x, "dtype", None)
  if dt is None:
    dt = np.asarray(x).dtype
  return np.dtype(dt)


@contextlib.contextmanager
def force_numpy_interpret(params: InterpretParams | None = None):
  """Route every pallas_call traced in this scope to the NumPy interpreter,
  including calls inside library code and calls written with
  ``interpret=False``.

  Uses the config JAX's ``pltpu.force_tpu_interpret_mode`` uses; the value is
  part of JAX's jit cache key, so functions jitted outside the scope are
  re-traced inside it.
  """
  value = params if params is not None else resolve("numpy")
  prev = jc.interpret_mode_config.swap_local(value)
  try:
    yield
  finally:
    jc.interpret_mode_config.set_local(prev)


def set_numpy_interpret(params: InterpretParams | None = None):
  """Globally route every pallas_call to the NumPy interpreter (see
  ``force_numpy_interpret``); ``unset_numpy_interpret()`` undoes it."""
  jc.interpret_mode_config.set_global(params if params is not None else resolve("numpy"))


def unset_numpy_interpret():
  jc.interpret_mode_config.set_global(None)
