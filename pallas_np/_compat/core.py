"""JAX's core: jaxpr types, avals, dtypes, tracing a function, internal
modules by name."""
from __future__ import annotations

import importlib

import jax
from jax._src import core as jax_core
from jax._src import source_info_util
from jax._src import tree_util as jax_tree_util
from jax._src.lax import lax as lax_internal  # noqa: F401  (re-exported)
from jax._src.lax import slicing as lax_slicing  # noqa: F401
# jax.Array's concrete type: fast paths test ``type(x) is ArrayImpl``.
from jax._src.array import ArrayImpl  # noqa: F401

Jaxpr = jax_core.Jaxpr
# JAX 0.12 merged ClosedJaxpr into Jaxpr (a Jaxpr carries its consts); where
# it is gone every Jaxpr is "closed" and ``.jaxpr``/``.consts`` are its own.
ClosedJaxpr = getattr(jax_core, "ClosedJaxpr", jax_core.Jaxpr)
JAXPR_TYPES = tuple({jax_core.Jaxpr, ClosedJaxpr})
JaxprEqn = jax_core.JaxprEqn
Literal = jax_core.Literal
Var = jax_core.Var
DropVar = jax_core.DropVar
Tracer = jax_core.Tracer
Primitive = jax_core.Primitive
ShapedArray = jax_core.ShapedArray
subjaxprs = jax_core.subjaxprs  # the Jaxprs in a jaxpr's eqn params (one level)


def eqn_subjaxprs(eqn):
  """The Jaxprs in one eqn's params (cond branches, loop and call bodies;
  one level), in tuples or lists too: ``jax_core.jaxprs_in_params`` looks
  in tuples only."""
  for v in eqn.params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      if isinstance(x, ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, Jaxpr):
        yield x


def tree_unflatten(treedef, leaves):
  return jax_tree_util.tree_unflatten(treedef, leaves)


def source_summary(source_info) -> str:
  """'file:line (function)' of the user frame that created an eqn."""
  try:
    return source_info_util.summarize(source_info)
  except Exception:  # pragma: no cover - defensive: never mask the real error
    return "<unknown source>"


def lowering_source(ctx) -> str:
  """'file:line' of the user frame of the eqn being lowered, or ''."""
  try:
    return source_info_util.summarize(source_info_util.SourceInfo(ctx.traceback, ctx.name_stack))
  except Exception:  # pragma: no cover - never mask the real error
    return ""


def is_semaphore_dtype(dtype) -> bool:
  return hasattr(getattr(dtype, "_rules", None), "pallas_interpret_element_aval")


def physical_dtype(dtype):
  """Map Pallas logical dtypes (semaphores) to the integer dtype interpret=True uses."""
  rules = getattr(dtype, "_rules", None)
  if rules is not None and hasattr(rules, "pallas_interpret_element_aval"):
    return rules.pallas_interpret_element_aval(dtype).dtype
  return dtype


def physical_aval(aval):
  """The aval of the NumPy array that holds values of ``aval`` (key arrays are
  their uint32 key data, with a trailing key dimension)."""
  dtype = getattr(aval, "dtype", None)
  if dtype is not None and jax.numpy.issubdtype(dtype, jax.dtypes.extended) \
      and not is_semaphore_dtype(dtype):
    return jax_core.physical_aval(aval)
  return aval


def is_extended_dtype(dtype) -> bool:
  return dtype is not None and jax.numpy.issubdtype(dtype, jax.dtypes.extended)


def with_leading_invars(jaxpr, invars, eqns, names):
  """``jaxpr`` taking ``invars`` (named ``names`` in its debug info) before
  its own, with ``eqns`` as its eqns (``native/bodies.py``: a kernel body
  whose program-id reads become arguments)."""
  dbg = jaxpr.debug_info
  arg_names = getattr(dbg, "arg_names", None)
  if arg_names is not None:  # (a NamedTuple in every supported JAX)
    dbg = dbg._replace(arg_names=(*names, *arg_names))
  return jaxpr.replace(invars=[*invars, *jaxpr.invars], eqns=list(eqns), debug_info=dbg)


def trace_to_jaxpr(fn, avals):
  """ClosedJaxpr of ``fn`` applied to arrays of the given (physical) avals."""
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
  return jax.make_jaxpr(fn)(*args)


def internal_module(module: str):
  """``jax._src.<module>`` (e.g. ``"pjit"``); raises ImportError if missing."""
  return importlib.import_module(f"jax._src.{module}")


def optional_primitive(module: str, name: str):
  """Primitive ``name`` of ``jax._src.<module>``; None where this JAX version
  does not have it."""
  try:
    return getattr(internal_module(module), name, None)
  except ImportError:
    return None


def has_effects(eqn) -> bool:
  """Whether an eqn must run even when its results are unused: it has
  effects, or its primitive says it is effectful (``plsc.parallel_loop``
  over refs carries no effects on the eqn itself in JAX 0.10/0.12, nor does
  a ``pallas_call`` whose kernel closes over refs of an enclosing
  ``run_state``: its kernel jaxpr's constvars, which it writes)."""
  if eqn.effects:
    return True
  kernel = eqn.params.get("jaxpr")
  if getattr(kernel, "constvars", None) and eqn.primitive.name == "pallas_call":
    return True
  effectful = getattr(eqn.primitive, "is_effectful", None)
  if callable(effectful) and effectful(eqn.params):
    return True
  # A loop or cond whose body holds such an eqn: JAX derives the loop's
  # effects from the body's, so they are missing there too.
  return any(has_effects(inner) for sub in jax_core.jaxprs_in_params(eqn.params)
             for inner in sub.eqns)


def axis_env_sizes() -> dict:
  """The named axes bound where we are tracing or lowering, with their sizes
  (a shard_map body's manual mesh axes, in mesh order; pmap's axis): what
  TPU interpret mode reads to number devices. Empty outside any."""
  env = jax_core.get_axis_env()
  return dict(getattr(env, "axis_sizes", {}) or {})


axis_index_p = jax.lax.axis_index_p


def logical_shape(shape, dtype, transforms) -> tuple:
  """The shape after ``transforms`` (Mosaic GPU layout transforms undone)."""
  aval = jax_core.ShapedArray(tuple(shape), dtype)
  for t in transforms:
    aval = t.transform_type(aval)
  return tuple(aval.shape)


# -- debug printing -------------------------------------------------------------
from jax._src import debugging as jax_debugging  # noqa: E402
debug_print_p = getattr(jax_debugging, "debug_print_p", None)
debug_callback_p = jax_debugging.debug_callback_p


def merge_callback_args(in_tree, dyn_args, static_args):
  """(args, kwargs) of a debug_print from its dynamic and static parts."""
  return jax_debugging.merge_callback_args(in_tree, dyn_args, static_args)
