"""Mosaic GPU kernels the hardware's lowering refuses are refused in numpy
mode too, with the same error type (and, where JAX's GPU interpreter has a
message for it, its words), instead of running with semantics numpy mode
would have to invent; and ``pl.debug_check`` runs as the lowerings emit it.

Expectations are the hardware lowering's rules (JAX's
``mosaic_gpu/lowering.py``, ``launch_context.py``): each refused kernel has
a valid twin that differs only in the refused construct and runs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from tests.mgpu_helpers import plgpu

import pallas_np

mgpu_lowering = pytest.importorskip("jax._src.pallas.mosaic_gpu.lowering")
I32 = jnp.int32


def _run(f, *args):
  with pallas_np.force_numpy_interpret():
    return f(*args)


# -- run_scoped(collective_axes=...) -------------------------------------------------
def _scoped(axes, *, cluster=(2,), threads=2):
  """Each warpgroup of each block writes its coordinates through a scoped
  GMEM buffer shared along ``axes``."""
  names = dict(cluster=cluster, cluster_names=("c",)) if cluster else {}
  if threads:
    names.update(num_threads=threads, thread_name="t")

  def body(o_ref):
    def scoped(ref):
      c = jax.lax.axis_index("c") if cluster else 0
      t = jax.lax.axis_index("t") if threads else 0
      ref[...] = jnp.full(ref.shape, c * 10 + t, I32)
      o_ref[c, t] = ref[0]
    pl.run_scoped(scoped, plgpu.GMEM((1,), I32), collective_axes=axes)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((2, 2), I32), **names)


def test_thread_collective_run_scoped_runs():
  """Each warpgroup's own write then read (the buffer is shared by the two
  warpgroups, who take turns here: no barrier needed for the value read)."""
  out = np.asarray(_run(_scoped("t")))
  assert out.shape == (2, 2)


@pytest.mark.parametrize("axes, error, match", [
    (("c",), ValueError, "Collective allocations along cluster axes are not supported"),
    (("c", "t"), ValueError, "Collective allocations along cluster axes are not supported"),
    ((), NotImplementedError, "Scoped allocation must have the thread axis"),
    (("x",), ValueError, r"Collective axis `x` not found among axes `\['c', 't'\]`"),
])
def test_run_scoped_axes_the_lowering_refuses(axes, error, match):
  with pytest.raises(error, match=match):
    _run(_scoped(axes))


def test_collective_run_scoped_without_a_thread_axis():
  with pytest.raises(ValueError, match="no explicit thread axis specified"):
    _run(_scoped(("c",), threads=0))


# -- barriers ------------------------------------------------------------------------
def test_unindexed_array_of_barriers():
  def body(o_ref, bar):
    plgpu.barrier_arrive(bar)
    o_ref[...] = jnp.int32(1)
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((), I32),
                   scratch_types=[plgpu.Barrier(num_barriers=2)])
  with pytest.raises(ValueError, match="without indexing, but `num_barriers = 2`"):
    _run(f)


def test_waiting_after_a_phase_was_skipped():
  """wg 1 completes phase 0 and 1 of barrier 0 before wg 2 waits (for
  phase 0, which it can no longer observe)."""
  def body(o_ref, bars):
    t = jax.lax.axis_index("t")

    @pl.when(t == 0)
    def _():
      plgpu.barrier_arrive(bars.at[0])

    @pl.when(t == 1)
    def _():
      plgpu.barrier_wait(bars.at[0])
      plgpu.barrier_arrive(bars.at[0])
      plgpu.barrier_arrive(bars.at[1])

    @pl.when(t == 2)
    def _():
      plgpu.barrier_wait(bars.at[1])
      plgpu.barrier_wait(bars.at[0])
      o_ref[...] = jnp.int32(1)
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((), I32),
                   scratch_types=[plgpu.Barrier(num_arrivals=1, num_barriers=2)],
                   num_threads=3, thread_name="t")
  with pytest.raises(ValueError, match="Thread 2 is awaiting phase 1, but barrier is already "
                                       "at phase 2"):
    _run(f)


# -- warp_map closing over an array ----------------------------------------------------
def _warp_fill(close_over_array: bool):
  def body(o_ref):
    arr = jnp.ones((32,), jnp.float32)
    scalar = jnp.float32(1)

    @plgpu.warp_map
    def _(warp_id):
      @pl.when(warp_id == 0)
      def _():
        o_ref[0] = (arr[0] if close_over_array else scalar) + 1
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((1,), jnp.float32))


def test_warp_map_closing_over_an_array_is_a_lowering_error():
  np.testing.assert_array_equal(_run(_warp_fill(False)), [2.0])
  # JAX 0.12 refuses it when tracing (ValueError); 0.10 traces it and its
  # lowering refuses it (LoweringError): numpy mode raises the latter.
  with pytest.raises((mgpu_lowering.LoweringError, ValueError),
                     match="close over scalars and Refs"):
    _run(_warp_fill(True))


# -- TMA copies move whole bytes -------------------------------------------------------
def _copy_in(n: int):
  def body(x_ref, y_ref, barrier):
    plgpu.copy_gmem_to_smem(x_ref, y_ref, barrier)
    plgpu.barrier_wait(barrier)
  return pl.pallas_call(
      body, in_specs=[pl.BlockSpec(memory_space=plgpu.GMEM)],
      out_specs=pl.BlockSpec(memory_space=plgpu.SMEM),
      out_shape=jax.ShapeDtypeStruct((n,), jnp.int4),
      scratch_shapes=[plgpu.Barrier()],
      compiler_params=plgpu.CompilerParams())


def test_tma_copy_of_a_fraction_of_a_byte():
  x = jnp.arange(128, dtype=jnp.int4)
  np.testing.assert_array_equal(_run(_copy_in(128), x), x)
  with pytest.raises(ValueError, match=r"not whole bytes.*copy_gmem_to_smem\(x_ref"):
    _run(_copy_in(127), jnp.arange(127, dtype=jnp.int4))


# -- pl.debug_check -------------------------------------------------------------------
def _checked(x_ref, o_ref):
  pl.debug_check(jnp.sum(x_ref[...]) > 0, "x.sum() is not positive")
  o_ref[...] = x_ref[...]


def test_debug_check():
  f = pallas_np.pallas_call(_checked, jax.ShapeDtypeStruct((8,), I32))
  x = jnp.arange(8, dtype=I32)
  with pl.enable_debug_checks(True):
    np.testing.assert_array_equal(f(x), x)
    with pytest.raises(ValueError, match="x.sum\\(\\) is not positive"):
      f(-x)
  # Off (the default), the check is dropped, as the lowerings drop it.
  np.testing.assert_array_equal(pallas_np.pallas_call(
      _checked, jax.ShapeDtypeStruct((8,), I32))(-x), -x)


def test_debug_check_flag_is_part_of_the_compiled_kernel():
  """JAX relowers a jitted call when the flag changes (it is in the jit
  key); the kernel compiled for each setting is its own."""
  f = jax.jit(pl.pallas_call(_checked, out_shape=jax.ShapeDtypeStruct((8,), I32),
                             interpret="numpy"))
  x = -jnp.arange(8, dtype=I32)
  np.testing.assert_array_equal(f(x), x)
  with pl.enable_debug_checks(True):
    with pytest.raises(Exception, match="x.sum\\(\\) is not positive"):
      jax.block_until_ready(f(x))
  np.testing.assert_array_equal(f(x), x)


def test_thread_axis_of_a_kernel_without_one_is_none():
  """plgpu's helpers (dynamic_scheduling_loop) pass collective_axes=(None,)
  in a kernel without a thread axis: thread-collective, as the lowering
  reads it."""
  def body(o_ref):
    def scoped(ref):
      ref[0] = jnp.int32(7)
      o_ref[0] = ref[0]
    pl.run_scoped(scoped, plgpu.SMEM((1,), I32), collective_axes=(None,))
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((1,), I32))
  np.testing.assert_array_equal(_run(f), [7])


def _warp_copy(whole: bool):
  def body(x_ref, y_ref):
    @plgpu.warp_map
    def _(warp_id):
      @pl.when(warp_id == 1)
      def _():
        if whole:
          y_ref[...] = x_ref[...]
        else:
          y_ref[0] = x_ref[0]
          y_ref[1] = x_ref[1]
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((2,), I32))


def test_warp_code_loads_and_stores_scalars_only():
  x = jnp.array([3, 4], I32)
  np.testing.assert_array_equal(_run(_warp_copy(False), x), [3, 4])
  with pytest.raises(ValueError, match="Can only load scalars in warp-level code"):
    _run(_warp_copy(True), x)


def _warp_inline_mgpu(shape):
  """A warp's body calls ``inline_mgpu`` returning ``shape`` and stores it
  (JAX's ``test_inline_mgpu_in_warp_rejects_non_scalar``)."""
  def body(y_ref):
    @plgpu.warp_map
    def _(warp_id):
      @plgpu.inline_mgpu(arg_types=(), return_type=plgpu.ShapeDtypeStruct(
          shape, jnp.float32, layout=plgpu.Layout.WGMMA))
      def bad(ctx):
        raise AssertionError("the lowering refuses the kernel before its body runs")
      y_ref[...] = bad()
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32))


def test_inline_mgpu_in_a_warp_returns_scalars_only():
  """Mosaic GPU's lowering rejects the inline_mgpu eqn itself, before the
  store after it (whose own check says "Can only store scalars")."""
  with pytest.raises(ValueError, match=r"inline_mgpu in a single-warp context only supports "
                     r"scalar return types\. Got shape=\(128,\)\."):
    _run(_warp_inline_mgpu((128,)))


def test_reshard_in_a_kernel_under_an_explicit_mesh_is_the_value():
  """Traced under a mesh with explicit axes, a kernel body holds ``reshard``
  eqns (a sharding change of a value): the value itself."""
  from jax import sharding
  if not hasattr(sharding, "reshard") or not hasattr(jax, "set_mesh"):
    pytest.skip("this JAX has no explicit sharding")
  mesh = jax.make_mesh((1, 1), ("x", "y"), axis_types=(sharding.AxisType.Explicit,) * 2)

  def relu(x_ref, o_ref, x_smem, barrier):
    plgpu.copy_gmem_to_smem(x_ref, x_smem, barrier)
    plgpu.barrier_wait(barrier)
    x = x_smem[...]
    x_smem[...] = jnp.where(x > 0, x, 0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(x_smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  with jax.set_mesh(mesh):
    x = sharding.reshard(jnp.arange(-32.0, 32.0).reshape(8, 8), sharding.PartitionSpec("x", "y"))

    @jax.jit
    def f(x):
      @jax.shard_map(in_specs=jax.typeof(x).sharding.spec, out_specs=jax.typeof(x).sharding.spec)
      def body(xs):
        return plgpu.kernel(relu, out_type=jax.ShapeDtypeStruct(xs.shape, xs.dtype),
                            scratch_types=dict(x_smem=plgpu.SMEM(xs.shape, xs.dtype),
                                               barrier=plgpu.Barrier()))(xs)
      return body(x)
    out = _run(f, x)
  np.testing.assert_array_equal(np.asarray(out), np.maximum(np.asarray(x), 0))
