"""The primitives the native tier never compiles, each with the reason:
attached as the ``native`` field of their rules (``registry.native_refused``),
so that every registered rule says what the tier does with it
(``tests/test_native_registry.py``). A loop holding one of them keeps its
NumPy path; ``native.stats()["refused"]`` counts it and the
``pallas_np.native`` logger says which at debug level.

A primitive that gets an emitter moves from here to its family's module.
"""
from __future__ import annotations

from pallas_np import registry

_REASONS = {
    "its float formula is XLA's or the C library's, computed by a compiled routine the "
    "generated code does not call (primitives/xla_math.py; float32 exp/log/tanh do: "
    "native/transcendental.py)": (
        "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "bessel_i0e",
        "bessel_i1e", "cbrt", "cos", "cosh", "digamma", "erf", "erf_inv", "erfc",
        "expm1", "igamma", "igammac", "lgamma", "log1p", "logistic",
        "polygamma", "pow", "regularized_incomplete_beta", "sin", "sinh", "tan",
        "zeta", "nextafter", "one_minus_square", "polynomial", "reciprocal", "integer_pow", "round",
        "reduce_precision"),
    "an order-dependent or multi-pass reduction, scan or sort (NumPy's order and NaN "
    "choice are not reproduced)": (
        "argmax", "argmin", "cumlogsumexp", "cummax", "cummin", "cumprod", "cumsum",
        "reduce", "reduce_prod", "reduce_xor", "reduce_window", "reduce_window_max",
        "reduce_window_min", "reduce_window_sum", "sort", "top_k", "masked_sort",
        "masked_cummax", "masked_cummin", "masked_cumsum", "unique",
        "all_reduce_ffs", "all_reduce_population_count", "mosaic_gpu_reduce_max",
        "mosaic_gpu_reduce_min", "mosaic_gpu_reduce_prod", "mosaic_gpu_reduce_sum",
        "scan_count"),
    "data movement not emitted yet (gathers, scatters, padding, bit casts, "
    "packing)": (
        "gather", "scatter", "scatter-add", "scatter-max", "scatter-min", "scatter-mul",
        "scatter-sub", "pad", "roll", "split", "stack", "bitcast", "bitcast_convert_type",
        "copy", "zeros_like", "empty", "pack", "unpack", "pack_elementwise",
        "unpack_elementwise", "population_count", "clz", "mulhi", "iota_2x32_shape",
        "eq_to", "le_to", "lt_to"),
    "complex numbers": ("complex", "conj", "real", "imag"),
    "a matrix product of another family (MXU/wgmma/tensor-memory state, convolutions; "
    "dot_general is emitted, native/dots.py)": (
        "matmul_acc_lhs", "matmul_pop", "matmul_push_rhs", "wgmma_ref",
        "wgmma_wait", "wgmma_accumulator_deref_p", "wgmma_accumulator_store_p",
        "tcgen05_mma", "tcgen05_commit_arrive", "conv", "mma", "matmul_lhs_fifo",
        "matmul_pop_fifo", "wgmma_accumulator_deref", "wgmma_accumulator_store"),
    "it needs the run context (grid position, devices, multicast or parallel semaphore "
    "signals, barriers, random state) or has effects outside its refs (local DMAs and "
    "semaphores are calls back into their rules: native/dma.py)": (
        "program_id", "num_programs", "axis_index", "platform_index",
        "semaphore_signal_multicast", "semaphore_signal_parallel", "get_barrier_semaphore", "barrier",
        "barrier_arrive", "barrier_test", "barrier_wait", "atomic_cas", "atomic_rmw",
        "sc_fetch_and_add", "mgpu_atomic_store", "multimem_load_reduce", "multimem_store",
        "debug_print", "debug_callback", "debug_barrier_p", "io_callback", "pure_callback",
        "random_bits", "random_clone", "random_fold_in", "random_seed", "random_split",
        "random_unwrap", "random_wrap", "prng_join", "prng_random_bits", "prng_seed",
        "prng_split", "threefry2x32", "delay", "trace_value", "add_dependency",
        "get_global", "query_cluster_cancel", "try_cluster_cancel",
        "griddepcontrol_launch_dependents", "griddepcontrol_wait", "set_max_registers_p",
        "print_layout", "layout_cast", "elementwise_inline_asm_p", "inline_mgpu_p",
        "barrier_arrive_and_wait", "debug_barrier", "elementwise_inline_asm", "inline_mgpu",
        "set_max_registers", "has_memory_space", "check"),
    "GPU memory operations (masks, TMA/async copies, shared/tensor memory)": (
        "load", "async_load", "async_prefetch",
        "async_store_smem", "async_store_tmem", "async_copy_smem_to_tmem", "copy_gmem_to_smem",
        "copy_smem_to_gmem", "commit_group", "commit_smem", "commit_tmem", "wait_load_tmem",
        "wait_smem_to_gmem", "store", "wait_gmem_to_smem"),
    "a kernel, mesh, scoped allocation or sub-program of its own": (
        "pallas_call", "core_map", "run_scoped", "run_state", "mpmd_map", "parallel_loop",
        "composite", "call_hi_primitive", "jaxpr_call", "call", "custom_jvp_call_jaxpr",
        "emit_pipeline", "empty_ref"),
    "a sharding annotation inside a kernel (the value itself on the NumPy path; too rare in "
    "loops to emit)": ("reshard",),
}

for _why, _names in _REASONS.items():
  for _name in _names:
    registry.attach_native(_name, registry.native_refused(_why))
