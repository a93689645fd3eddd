"""The one place pallas_np touches JAX internals: the JAX boundary.

Every import from ``jax._src`` lives in this package so that a JAX upgrade
touches it alone; everything else does ``from pallas_np import _compat as
jc`` and uses the names re-exported here. One submodule per concern:

* ``core``: jaxpr types, avals, dtypes, tracing, internal modules by name;
* ``versions``: eqn params and primitives that differ between the supported
  JAX versions, one accessor each (docs/jax_versions.md);
* ``state``: refs, indexers, ref transforms, effects, state discharge;
* ``pallas``: the pallas_call primitive, grid/block mappings, mesh kernels;
* ``tpu``: Mosaic TPU primitives, meshes, chip info, PRNG keys;
* ``mosaic_gpu``: plgpu, never imported here (predicates read
  ``sys.modules``; its rules register on first use, ``families``);
* ``triton``: the Pallas Triton primitives, named lazily (``LazyPrimitive``);
* ``lowering``: lowering rules, host callbacks, CUDA cross-lowering;
* ``jit``: tracing jitted functions and the hooks on JAX's eager jit call;
* ``arrays``: NumPy arrays to jax.Arrays and back on the per-call floor;
* ``prng``: JAX's PRNG implementations.

Tested with JAX 0.10.2 through 0.12 (docs/jax_versions.md).
"""
import jax  # noqa: F401  (``jc.jax``)

from pallas_np._compat.core import (  # noqa: F401
    ArrayImpl, ClosedJaxpr, DropVar, JAXPR_TYPES, Jaxpr, JaxprEqn, Literal, Primitive,
    ShapedArray, Tracer, Var, axis_env_sizes, axis_index_p, debug_callback_p, debug_print_p,
    eqn_subjaxprs, has_effects, internal_module, is_extended_dtype, is_semaphore_dtype, jax_core,
    lax_internal, lax_slicing, logical_shape, lowering_source,
    merge_callback_args, optional_primitive, physical_aval, physical_dtype, source_summary,
    subjaxprs, trace_to_jaxpr, tree_unflatten, with_leading_invars)
from pallas_np._compat.versions import (  # noqa: F401
    bf16_to_bool_flushes_denormals, call_hi_primitive_p, digamma_at_zero,
    composite_body, copy_has_barrier, has_user_predicate, hi_primitive_expansion,
    jaxlib_at_least, mesh_kernel_bodies, mesh_kernel_meshes, scan_counts, static_wait_count,
    tmem_load_reduction, tpu_bitcast_dim)
from pallas_np._compat.state import (  # noqa: F401
    AbstractRef, AccumEffect, BitcastTransform, NDIndexer, ReadEffect, RefBitcaster,
    RefReshaper, ReshapeTransform, SelectTransform, Slice, TransformedRef, TransposeTransform,
    WriteEffect,
    discharge_run_state, memory_space_of, run_state_p, state_primitives,
    written_invar_positions)
from pallas_np._compat.pallas import (  # noqa: F401
    BlockMapping, Blocked, BoundedSlice, CheckFailedError, DeviceIdType, check_p,
    debug_checks_enabled, failed_check_message, DynamicGridDim, Element, GridMapping,
    Indirect, Squeezed, core_map_p, get_block_shape, interpret_mode_config,
    mesh_grid_mapping, mesh_kernel_primitives, mesh_kernel_sources, mpmd_map_p,
    pallas_call_p, pallas_primitives, uninitialized_value_np)
from pallas_np._compat.tpu import (  # noqa: F401
    SCIndices, ScalarSubcoreMesh, SharedMemRefSliceTransform, TensorCoreMesh,
    VectorSubcoreMesh, is_pallas_tpu_key, mosaic_primitives, register_tpu_device_kind,
    sc_primitives)
from pallas_np._compat.mosaic_gpu import (  # noqa: F401
    barrier_arrivals, is_barrier_dtype, is_layout_only_transform, is_mgpu_compiler_params,
    is_mgpu_imported, is_mgpu_mesh, is_peer_transform, is_wgmma_acc_aval, lowering_error,
    mgpu_primitive)
from pallas_np._compat import mosaic_gpu as _mosaic_gpu
from pallas_np._compat.triton import LazyPrimitive, triton_primitives  # noqa: F401
from pallas_np._compat.lowering import (  # noqa: F401
    cuda_lowering_target, emit_host_callback, lower_fun, lowering_rule,
    mesh_spans_processes, original_pallas_call_lowering, register_lowering,
    register_pallas_call_lowering)
from pallas_np._compat.jit import (  # noqa: F401
    infer_argnums_and_argnames, install_jit_call_hook, install_jit_params_memo,
    install_jit_run_hook, is_unspecified_sharding, jax_pjit, jit_trace, watch_abstract_eval)
from pallas_np._compat.arrays import (exact_array_putter, host_array, jax_array_maker,  # noqa: F401
                                      np_to_jax)
from pallas_np._compat.prng import jax_prng, jax_threefry  # noqa: F401
from pallas_np._compat.families import load_imported as load_imported_families  # noqa: F401
from pallas_np._compat.families import on_first_use  # noqa: F401

MGPU_MODULE = _mosaic_gpu.CORE_MODULE  # a Mosaic GPU kernel exists only once it is imported


def __getattr__(name):
  """``mgpu_core``/``mgpu_primitives``: JAX's Mosaic GPU modules, imported on
  first access (see ``mosaic_gpu``); None without plgpu. ``lax_reference``,
  also imported on first access."""
  if name == "mgpu_core":
    return _mosaic_gpu.core_module()
  if name == "mgpu_primitives":
    return _mosaic_gpu.primitives_module()
  if name == "lax_reference":  # it imports scipy.special: ~0.5 s of import time
    return internal_module("lax_reference")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
