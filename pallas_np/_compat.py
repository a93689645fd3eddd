"""The one place pallas_np touches JAX internals.

Every import from ``jax._src`` lives here so that a JAX upgrade touches one
file. Tested with JAX 0.10.x (see README for the tested range).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect

import jax
import numpy as np
from jax._src import api_util
from jax._src import callback as jax_callback
from jax._src import core as jax_core
from jax._src import mesh as mesh_lib
from jax._src import source_info_util
from jax._src import lax_reference
from jax._src import dtypes as jax_dtypes
from jax._src import tree_util as jax_tree_util
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import lax as lax_internal
from jax._src.lax import slicing as lax_slicing
from jax._src.lax import control_flow as lax_control_flow
from jax._src.lax.control_flow import loops as lax_loops
from jax._src.lax.control_flow import conditionals as lax_conditionals
from jax._src.pallas import core as pallas_core
from jax._src.pallas import pallas_call as pallas_call_mod
from jax._src.pallas import primitives as pallas_primitives
from jax._src.pallas.mosaic import primitives as mosaic_primitives
from jax._src.pallas.mosaic import core as mosaic_core
from jax._src.pallas.mosaic import tpu_info as mosaic_tpu_info
from jax._src.pallas.mosaic import random as mosaic_random
from jax._src.lib import version as jaxlib_version
from jax._src.state import primitives as state_primitives
from jax._src.state import types as state_types
from jax._src.state import indexing as state_indexing
from jax._src import config as jax_config
from jax._src import pjit as jax_pjit
from jax._src import sharding_impls as jax_sharding_impls

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
# jax.Array's concrete type: fast paths test ``type(x) is ArrayImpl``.
from jax._src.array import ArrayImpl  # noqa: E402
Primitive = jax_core.Primitive
ShapedArray = jax_core.ShapedArray
subjaxprs = jax_core.subjaxprs  # the Jaxprs in a jaxpr's eqn params (one level)

pallas_call_p = pallas_call_mod.pallas_call_p
GridMapping = pallas_core.GridMapping
BlockMapping = pallas_core.BlockMapping
Blocked = pallas_core.Blocked
Element = pallas_core.Element
Squeezed = pallas_core.Squeezed
BoundedSlice = pallas_core.BoundedSlice
Indirect = pallas_core.Indirect
DynamicGridDim = pallas_core.DynamicGridDim

AbstractRef = state_types.AbstractRef
TransformedRef = state_types.TransformedRef
NDIndexer = state_indexing.NDIndexer
Slice = state_indexing.Slice
RefBitcaster = getattr(state_types, "RefBitcaster", None)
RefReshaper = getattr(state_types, "RefReshaper", None)
BitcastTransform = getattr(state_types, "BitcastTransform", None)
ReshapeTransform = getattr(state_types, "ReshapeTransform", None)
TransposeTransform = getattr(state_types, "TransposeTransform", None)
WriteEffect = state_types.WriteEffect
AccumEffect = state_types.AccumEffect
ReadEffect = state_types.ReadEffect

interpret_mode_config = jax_config.pallas_tpu_interpret_mode_context_manager


def scan_counts(params) -> tuple[int, int]:
  """(num_consts, num_carry) of a scan eqn: plain params up to JAX 0.10, the
  ``ft_in`` FlatTree of (consts, carry, xs) from 0.11 on."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


def tree_unflatten(treedef, leaves):
  return jax_tree_util.tree_unflatten(treedef, leaves)


def source_summary(source_info) -> str:
  """'file:line (function)' of the user frame that created an eqn."""
  try:
    return source_info_util.summarize(source_info)
  except Exception:  # pragma: no cover - defensive: never mask the real error
    return "<unknown source>"


def physical_dtype(dtype):
  """Map Pallas logical dtypes (semaphores) to the integer dtype interpret=True uses."""
  rules = getattr(dtype, "_rules", None)
  if rules is not None and hasattr(rules, "pallas_interpret_element_aval"):
    return rules.pallas_interpret_element_aval(dtype).dtype
  return dtype


# -- extended dtypes (PRNG keys) and decompositions ---------------------------
from jax._src.random import prng as jax_prng  # noqa: E402
from jax._src.random import threefry2x32 as jax_threefry  # noqa: E402


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


def trace_to_jaxpr(fn, avals):
  """ClosedJaxpr of ``fn`` applied to arrays of the given (physical) avals."""
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
  return jax.make_jaxpr(fn)(*args)


def is_semaphore_dtype(dtype) -> bool:
  return hasattr(getattr(dtype, "_rules", None), "pallas_interpret_element_aval")


def original_pallas_call_lowering():
  """The lowering rule JAX registered for pallas_call (platform independent)."""
  entry = mlir._lowerings[pallas_call_p]
  return getattr(entry, "rule", entry)


def register_pallas_call_lowering(rule):
  mlir.register_lowering(pallas_call_p, rule)


lower_fun = mlir.lower_fun


def mesh_spans_processes(ctx) -> bool:
  """Whether the mesh being lowered (shard_map's) has devices of other
  processes (``jax.distributed``); without a mesh: whether there are
  other processes at all."""
  mesh = getattr(ctx.module_context.axis_context, "mesh", None)
  devices = getattr(mesh, "devices", None)
  if devices is None:
    return jax.process_count() > 1
  me = jax.process_index()
  return any(getattr(d, "process_index", me) != me for d in np.ravel(devices))


def emit_host_callback(ctx, fn, operands, operand_avals):
  """Lower an unordered, side-effecting call of ``fn(*numpy arrays)`` (like
  ``io_callback``, per device inside a shard_map) returning ``ctx.avals_out``.
  Unlike ``io_callback`` the operands reach ``fn`` as the NumPy arrays XLA
  hands over: io_callback first ``device_put``s them onto CPU device 0, a
  transfer that can wait for a thread held by a device blocked in a
  multi-device kernel, so the devices never all arrive."""
  sharding = jax_callback._callback_op_sharding(ctx.module_context.axis_context, None,
                                                ctx.avals_out)

  def host(*args):
    return tuple(np.asarray(r) for r in fn(*args))
  result, _, _ = jax_callback.emit_python_callback(
      ctx.replace(avals_in=list(operand_avals)), host, None, list(operands),
      list(operand_avals), list(ctx.avals_out), has_side_effect=True, returns_token=False,
      sharding=sharding)
  return result


def get_block_shape(block_shape):
  return pallas_core._get_block_shape(block_shape)


def uninitialized_value_np(dtype):
  """Scalar fill interpret=True uses for memory nobody wrote (mirrors
  jax._src.pallas.primitives.uninitialized_value)."""
  dtype = np.dtype(dtype)
  if jax.numpy.issubdtype(dtype, jax.numpy.floating) or jax.numpy.issubdtype(
      dtype, jax.numpy.complexfloating):
    return np.array(np.nan, dtype)
  if jax.numpy.issubdtype(dtype, jax.numpy.integer):
    if dtype == np.dtype(pallas_core.SEMAPHORE_INTERPRET_DTYPE):
      return np.array(0, dtype)
    return np.array(jax.numpy.iinfo(dtype).min, dtype)  # int4 too (ml_dtypes)
  if dtype == np.dtype(bool):
    return np.array(False, dtype)
  return np.zeros((), dtype)


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


def cuda_lowering_target():
  """Context for cross-lowering a CUDA kernel on a host without a GPU: JAX >=
  0.11 asks for an abstract GPU device (an H100) in the abstract mesh; older
  JAX needs nothing."""
  device_cls = getattr(mesh_lib, "AbstractDevice", None)
  if device_cls is None:
    return contextlib.nullcontext()
  device = device_cls(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
  return jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((), (), abstract_device=device))


# Behaviour that changed inside XLA's compiled code has no Python feature to
# detect, and asking XLA would compile on an XLA-free path: for these alone
# the jaxlib version is the signal.
def _jaxlib_at_least(*version) -> bool:
  return tuple(jaxlib_version[:len(version)]) >= version


def digamma_at_zero():
  """digamma(±0): NaN in XLA up to jaxlib 0.10, -inf from 0.11 on."""
  return -np.inf if _jaxlib_at_least(0, 11) else np.nan


def bf16_to_bool_flushes_denormals() -> bool:
  """bfloat16 -> bool: XLA's CPU backend reads bf16 denormals as zero (via
  float32 with DAZ) in newer jaxlibs; 0.10 compares them with zero exactly."""
  return _jaxlib_at_least(0, 11)


def written_invar_positions(jaxpr) -> set[int]:
  """Positions of a jaxpr's invars (refs) that it writes or accumulates into."""
  pos = {v: i for i, v in enumerate(jaxpr.invars)}
  out = set()
  for eff in jaxpr.effects:
    if isinstance(eff, (WriteEffect, AccumEffect)):
      target = getattr(eff, "input", getattr(eff, "input_index", None))
      if isinstance(target, int):
        out.add(target)
      elif target in pos:
        out.add(pos[target])
  return out


from jax._src import debugging as jax_debugging  # noqa: E402
debug_print_p = getattr(jax_debugging, "debug_print_p", None)
debug_callback_p = jax_debugging.debug_callback_p


def merge_callback_args(in_tree, dyn_args, static_args):
  """(args, kwargs) of a debug_print from its dynamic and static parts."""
  return jax_debugging.merge_callback_args(in_tree, dyn_args, static_args)


# Triton (GPU) path primitives; importable on CPU-only installs too.
triton_primitives = None
try:
  from jax._src.pallas.triton import primitives as triton_primitives  # noqa: F811
except Exception:  # pragma: no cover - a jaxlib without the Triton dialect
  triton_primitives = None


def np_to_jax(x, weak_type: bool = False):
  """A jax.Array of a NumPy result (fresh: it may be aliased) by one
  ``batched_device_put`` on the default CPU device; ``weak_type``: the
  traced program's output is weakly typed (what XLA's run would return)."""
  x = np.asarray(x)
  try:
    dev, sharding = _default_placement()
    key = (x.shape, x.dtype, weak_type)
    aval = _avals.get(key)
    if aval is None:
      aval = _avals[key] = ShapedArray(x.shape, x.dtype, weak_type=weak_type)
      if len(_avals) > 4096:
        _avals.clear()
    return _xc.batched_device_put(aval, sharding, [x], [dev], False)
  except Exception:  # pragma: no cover - exotic dtypes/devices: JAX's own route
    return jax.device_put(x)


_avals: dict = {}  # (shape, dtype, weak) -> ShapedArray: building one costs ~3 µs


def jax_array_maker(shape, dtype, weak_type: bool = False):
  """``np_to_jax`` for arrays of exactly this shape and (plain) dtype, the
  aval and placement looked up once (a kernel's outputs: the per-call floor)."""
  dev, sharding = _default_placement()
  shape, dtype = tuple(shape), np.dtype(dtype)
  aval = ShapedArray(shape, dtype, weak_type=weak_type)

  def to_jax(x):  # (batched_device_put trusts the aval: a mismatch would be garbage)
    if type(x) is np.ndarray and x.dtype == dtype and x.shape == shape:
      try:
        return _xc.batched_device_put(aval, sharding, [x], [dev], False)
      except Exception:  # pragma: no cover - exotic dtypes/devices: as np_to_jax
        pass
    return np_to_jax(x, weak_type)
  return to_jax


_host_view = getattr(ArrayImpl, "_single_device_array_to_np_array_did_copy", None)
_one_cpu: dict = {}  # sharding -> on one CPU device? (arrays share a few)


def host_array(x) -> np.ndarray:
  """``np.asarray`` of a jax.Array: ml_dtypes (bfloat16, ...) ones, which
  NumPy reads through ``__array__`` (~6 µs), straight from the buffer (~2 µs)."""
  if x.dtype.isbuiltin != 2 or _host_view is None or x.is_deleted():  # 2: ml_dtypes
    return np.asarray(x)
  sharding = x.sharding
  one = _one_cpu.get(sharding)
  if one is None:
    if len(_one_cpu) > 1024:
      _one_cpu.clear()
    devs = sharding.device_set
    one = _one_cpu[sharding] = len(devs) == 1 and next(iter(devs)).platform == "cpu"
  return _host_view(x)[0] if one else np.asarray(x)


_placement = None


def _default_placement():
  global _placement
  if _placement is None:
    dev = jax.devices()[0]
    _placement = (dev, jax.sharding.SingleDeviceSharding(dev))
  return _placement


from jax._src.lib import xla_client as _xc  # noqa: E402


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
  ``memo``: an object with ``peek``/``put``. Idempotent."""
  current = jax_pjit._infer_params
  if getattr(current, "pallas_np_memo", None) is keep:
    return
  get_ctx_mesh = jax_pjit.get_ctx_mesh
  trace_context = jax_config.trace_context

  def infer_params(fun, ji, args, kwargs):
    if kwargs or ji.static_argnums or ji.static_argnames:
      return current(fun, ji, args, kwargs)
    sig = []
    for a in args:
      if type(a) is not ArrayImpl:
        return current(fun, ji, args, kwargs)
      sig.append((a.aval, a.sharding))
    key = (fun, ji, tuple(sig), get_ctx_mesh(ji.use_resource_env), trace_context())
    p = memo.peek(key)
    if p is not None:
      return p, [*p.consts, *args]
    p, args_flat = current(fun, ji, args, kwargs)
    if keep(p.params):
      memo.put(key, p)
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


def register_tpu_device_kind(kind: str, make_info):
  """Let TPU-only tracing helpers (emit_pipeline's tiling inference) run on a
  non-TPU default device by naming the TpuInfo to assume for it."""
  mosaic_tpu_info.registry[kind] = make_info
  # JAX >= 0.12 caches get_tpu_info(): a chip assumed earlier would stick.
  clear = getattr(mosaic_tpu_info.get_tpu_info, "cache_clear", None)
  if clear is not None:
    clear()


def is_pallas_tpu_key(dtype) -> bool:
  """Keys of pltpu's PRNG impls (the stateful samplers' placeholder key and
  ``pltpu.to_pallas_key``/``sample_block`` keys): their random_bits seeds and
  draws the kernel's hardware PRNG, which needs the run context."""
  impl = getattr(dtype, "_impl", None)
  return impl is mosaic_random.tpu_internal_stateful_impl or impl is mosaic_random.tpu_key_impl


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


# -- mesh kernels: pl.kernel(mesh=...) / pl.core_map ----------------------------
def mesh_kernel_primitives() -> tuple:
  """The primitives of mesh kernels that lower without pallas_call_p (JAX
  0.10: ``mpmd_map``, whose CPU lowering calls JAX's pallas_call lowering
  directly, and ``core_map``), those this JAX has."""
  found = []
  for module, name in (("pallas.mpmd", "mpmd_map_p"), ("pallas.core", "core_map_p")):
    prim = optional_primitive(module, name)
    if isinstance(prim, jax_core.Primitive):
      found.append(prim)
  return tuple(found)


def lowering_rule(prim):
  """The platform-independent lowering rule registered for ``prim``, or None."""
  entry = mlir._lowerings.get(prim)
  return getattr(entry, "rule", entry)


def register_lowering(prim, rule):
  mlir.register_lowering(prim, rule)


def mesh_kernel_sources(params) -> list[str]:
  """'fn at file:line' of the body jaxpr(s) of a mesh-kernel eqn's params;
  where the body is JAX's own wrapper (a discharged core_map), the user
  line of its first eqn."""
  bodies = params.get("jaxprs") or (params.get("jaxpr"),)
  out = []
  for j in bodies:
    j = getattr(j, "jaxpr", j)
    dbg = getattr(j, "debug_info", None)
    src = getattr(dbg, "func_src_info", None)
    if src and "jax/_src/" not in src.replace("\\", "/"):
      out.append(src)
      continue
    for eqn in getattr(j, "eqns", ()):
      line = source_summary(eqn.source_info)
      if line and line != "<unknown source>":
        out.append(line)
        break
  return out


def lowering_source(ctx) -> str:
  """'file:line' of the user frame of the eqn being lowered, or ''."""
  try:
    return source_info_util.summarize(source_info_util.SourceInfo(ctx.traceback, ctx.name_stack))
  except Exception:  # pragma: no cover - never mask the real error
    return ""


# -- multi-device (shard_map) kernels ------------------------------------------
axis_index_p = jax.lax.axis_index_p
# pl.DeviceIdType (JAX 0.12); pltpu.DeviceIdType before (and deprecated after).
DeviceIdType = getattr(pallas_primitives, "DeviceIdType", None) or mosaic_primitives.DeviceIdType


def axis_env_sizes() -> dict:
  """The named axes bound where we are tracing or lowering, with their sizes
  (a shard_map body's manual mesh axes, in mesh order; pmap's axis): what
  TPU interpret mode reads to number devices. Empty outside any."""
  env = jax_core.get_axis_env()
  return dict(getattr(env, "axis_sizes", {}) or {})


# -- mesh kernels: running them (pallas_np.meshes) ------------------------------
from jax._src.state import discharge as state_discharge  # noqa: E402

mpmd_map_p = optional_primitive("pallas.mpmd", "mpmd_map_p")
core_map_p = optional_primitive("pallas.core", "core_map_p")
run_state_p = state_discharge.run_state_p
TensorCoreMesh = mosaic_core.TensorCoreMesh
_sc_core = internal_module("pallas.mosaic.sc_core")
VectorSubcoreMesh = getattr(_sc_core, "VectorSubcoreMesh", None)
ScalarSubcoreMesh = getattr(_sc_core, "ScalarSubcoreMesh", None)
# plsc.Indices(values, ignored_value=) (JAX 0.12): an indexed DMA's indices.
SCIndices = getattr(_sc_core, "Indices", None)
# plsc.slice_subcore_vmem_from_shared's ref transform (JAX 0.12).
SharedMemRefSliceTransform = getattr(_sc_core, "SharedMemRefSliceTransform", None)


def discharge_run_state(jaxpr):
  """A run_state body with its refs discharged (closed, no consts): what
  run_state's own impl evaluates; a core_map inside becomes an mpmd_map."""
  if ClosedJaxpr is not jax_core.Jaxpr:
    jaxpr = ClosedJaxpr(jaxpr, ())
  return state_discharge.discharge_state(jaxpr)


def memory_space_of(aval):
  """The memory space of a ref aval (or of a ShapedArray that carries one)."""
  return getattr(aval, "memory_space", None)


def mesh_grid_mapping(jaxpr, num_inputs: int, num_outputs: int, default_memory_space,
                      grid=(), debug=False):
  """The GridMapping of a mesh kernel's body: the mesh as the grid (what
  ``pl.program_id`` reads inside a core_map), every operand a whole-array
  ref in its memory space (what JAX's fallback lowering of ``mpmd_map``
  builds)."""
  avals = [v.aval for v in jaxpr.invars]

  def spec(aval):
    space = memory_space_of(aval)
    return pallas_core.BlockSpec(memory_space=space if space is not None
                                 else default_memory_space)
  inner = [a.inner_aval if isinstance(a, AbstractRef) else a for a in avals]
  in_avals, out_avals = inner[:num_inputs], inner[num_inputs:num_inputs + num_outputs]
  grid_spec = pallas_core.GridSpec(
      grid=tuple(grid), in_specs=tuple(spec(a) for a in avals[:num_inputs]),
      out_specs=tuple(spec(a) for a in avals[num_inputs:num_inputs + num_outputs]))
  in_tree = jax.tree_util.tree_structure(tuple(in_avals))
  out_tree = jax.tree_util.tree_structure(tuple(out_avals))
  _, gm = pallas_core.get_grid_mapping(
      grid_spec, in_avals, in_tree, [f"arg{i}" for i in range(num_inputs)],
      out_avals, out_tree, [f"out{i}" for i in range(num_outputs)], debug=debug)
  return gm
try:
  sc_primitives = internal_module("pallas.mosaic.sc_primitives")
except ImportError:  # pragma: no cover - a JAX without SparseCore support
  sc_primitives = None


def has_effects(eqn) -> bool:
  """Whether an eqn must run even when its results are unused: it has
  effects, or its primitive says it is effectful (``plsc.parallel_loop``
  over refs carries no effects on the eqn itself in JAX 0.10/0.12)."""
  if eqn.effects:
    return True
  effectful = getattr(eqn.primitive, "is_effectful", None)
  return bool(effectful(eqn.params)) if callable(effectful) else False


# -- Mosaic GPU (plgpu) ----------------------------------------------------------
# plgpu needs absl-py to import; where it cannot be imported, Mosaic GPU
# kernels simply never reach pallas_np (nothing refers to these as None).
try:
  from jax._src.pallas.mosaic_gpu import core as mgpu_core  # noqa: E402
  from jax._src.pallas.mosaic_gpu import primitives as mgpu_primitives  # noqa: E402
except ImportError:  # pragma: no cover - absl-py missing
  mgpu_core = mgpu_primitives = None


def mgpu_primitive(name: str):
  """plgpu primitive ``name`` (e.g. ``"barrier_wait_p"``); None where this
  JAX version (or a missing plgpu) does not have it."""
  return getattr(mgpu_primitives, name, None) if mgpu_primitives is not None else None


def is_mgpu_mesh(mesh) -> bool:
  return mgpu_core is not None and isinstance(mesh, mgpu_core.Mesh)


def is_mgpu_compiler_params(cp) -> bool:
  return mgpu_core is not None and isinstance(cp, mgpu_core.CompilerParams)


def is_barrier_dtype(dtype) -> bool:
  return mgpu_core is not None and isinstance(
      dtype, (mgpu_core.BarrierType, getattr(mgpu_core, "ClusterBarrierType", ())))


def barrier_arrivals(dtype) -> int:
  return int(dtype.num_arrivals)


def is_peer_transform(t) -> bool:
  """``plgpu.remote_ref``'s transform: the same ref on another device."""
  cls = getattr(mgpu_core, "PeerMemRef", None) if mgpu_core is not None else None
  return cls is not None and isinstance(t, cls)


def is_layout_only_transform(t) -> bool:
  """Mosaic GPU's SMEM layout transforms (tiling, swizzle): they change how
  a buffer lies in memory, never which element an index names. pallas_np
  keeps such buffers in their logical shape."""
  if mgpu_core is None:
    return False
  return isinstance(t, (mgpu_core.UntilingTransform, mgpu_core.UnswizzleRef,
                        mgpu_core.TilingTransform, mgpu_core.SwizzleTransform))


def logical_shape(shape, dtype, transforms) -> tuple:
  """The shape after ``transforms`` (Mosaic GPU layout transforms undone)."""
  aval = jax_core.ShapedArray(tuple(shape), dtype)
  for t in transforms:
    aval = t.transform_type(aval)
  return tuple(aval.shape)


def is_wgmma_acc_aval(aval) -> bool:
  return mgpu_core is not None and isinstance(aval, mgpu_core.WGMMAAbstractAccumulatorRef)

