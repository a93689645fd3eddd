"""Mosaic GPU (plgpu) kernels in numpy mode: each construct against a NumPy
reference written from the semantics and, where it runs, against JAX's GPU
interpret mode (``InterpretGPUParams``, the oracle for ``plgpu.kernel``)."""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from tests.mgpu_helpers import assert_close, both, gpu_interpret, plgpu, producer_consumer

import pallas_np
from pallas_np.errors import KernelError

TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _x(shape, dtype=jnp.float16, seed=0):
  return (jax.random.normal(jax.random.key(seed), shape, jnp.float32)).astype(dtype)


def _run_with_timeout(fn, seconds=60):
  """Run fn() in a thread: a hang fails the test instead of blocking CI."""
  box = {}

  def target():
    try:
      box["out"] = fn()
    except BaseException as e:  # noqa: BLE001
      box["err"] = e
  th = threading.Thread(target=target, daemon=True)
  th.start()
  th.join(seconds)
  assert not th.is_alive(), "the kernel hung"
  if "err" in box:
    raise box["err"]
  return box["out"]


# -- TMA copies, barriers, layout transforms ------------------------------------
def _roundtrip_kernel():
  def body(x_ref, o_ref):
    def scoped(smem, bar):
      plgpu.copy_gmem_to_smem(x_ref, smem, bar)
      plgpu.barrier_wait(bar)
      smem[...] = smem[...] * 2 + 1
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(smem, o_ref)
      plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(scoped, plgpu.SMEM((128, 64), jnp.float16, transforms=TILED),
                  plgpu.Barrier(num_arrivals=1))
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128, 64), jnp.float16))


def test_tma_roundtrip_tiled_swizzled_vs_gpu_interpret():
  x = _x((128, 64))
  ours, theirs = both(_roundtrip_kernel(), x)
  want = np.asarray(x) * np.float16(2) + np.float16(1)  # f16 arithmetic, as the kernel
  assert_close(ours, want, atol=0)
  assert_close(ours, theirs, atol=0)


def test_tma_roundtrip_under_jit_and_interpret_argument():
  x = _x((128, 64))
  want = np.asarray(x) * np.float16(2) + np.float16(1)
  with pallas_np.force_numpy_interpret():
    assert_close(jax.jit(_roundtrip_kernel())(x), want, atol=0)
  # interpret="numpy" on the kernel itself, no force switch.
  def body(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + 1
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128, 64), jnp.float16),
                   interpret="numpy")
  assert_close(f(x), want, atol=0)
  assert_close(jax.jit(f)(x), want, atol=0)


def test_pl_kernel_with_plgpu_mesh():
  x = _x((2, 64, 64))

  def body(x_ref, o_ref):
    b = jax.lax.axis_index("b")
    o_ref[b] = x_ref[b] + b.astype(jnp.float16)
  f = pl.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                mesh=plgpu.Mesh(grid=(2,), grid_names=("b",)))
  with pallas_np.force_numpy_interpret():
    out = f(x)
  want = np.asarray(x) + np.arange(2, dtype=np.float16)[:, None, None]
  assert_close(out, want, atol=0)


def test_copies_not_visible_before_their_wait():
  """TMA data lands at the barrier wait (gmem->smem) and at
  wait_smem_to_gmem (smem->gmem); before that, reads see the old contents
  (NaN, the uninitialised fill). Reference: the semantics."""
  x = _x((64, 64), jnp.float32)

  def body(x_ref, o_ref, early_ref, late_ref, gmem_early_ref):
    def scoped(smem, bar):
      plgpu.copy_gmem_to_smem(x_ref, smem, bar)
      early_ref[...] = smem[...]  # before the wait: not there yet
      plgpu.barrier_wait(bar)
      late_ref[...] = smem[...]
      plgpu.copy_smem_to_gmem(smem, o_ref)
      gmem_early_ref[...] = o_ref[...]  # before wait_smem_to_gmem
      plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(scoped, plgpu.SMEM((64, 64), jnp.float32), plgpu.Barrier(num_arrivals=1))
  shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
  f = plgpu.kernel(body, out_type=(shape,) * 4)
  with pallas_np.force_numpy_interpret():
    out, early, late, gmem_early = f(x)
  assert np.isnan(np.asarray(early)).all()
  assert np.isnan(np.asarray(gmem_early)).all()
  np.testing.assert_array_equal(late, x)
  np.testing.assert_array_equal(out, x)


def test_barrier_wait_that_never_completes_raises():
  def body(o_ref):
    def scoped(bar):
      o_ref[...] = jnp.zeros_like(o_ref)
      plgpu.barrier_wait(bar)  # nobody arrives
    pl.run_scoped(scoped, plgpu.Barrier(num_arrivals=1))
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                   grid=(2,), grid_names=("x",))

  def call():
    with pallas_np.force_numpy_interpret():
      return f()
  with pytest.raises(KernelError) as info:
    _run_with_timeout(call)
  msg = str(info.value)
  assert "deadlocked" in msg and "block (0,)" in msg
  assert "test_mosaic_gpu.py" in msg and "barrier_wait" in msg


def test_deadlock_between_warpgroups_names_each():
  def body(o_ref):
    def scoped(a, b):
      wg = jax.lax.axis_index("wg")

      @pl.when(wg == 0)
      def _():
        plgpu.barrier_wait(a)  # wg 1 waits on b first: neither ever arrives
        plgpu.barrier_arrive(b)

      @pl.when(wg == 1)
      def _():
        plgpu.barrier_wait(b)
        plgpu.barrier_arrive(a)
      o_ref[...] = jnp.zeros_like(o_ref)
    pl.run_scoped(scoped, plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1),
                  collective_axes="wg")
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                   num_threads=2, thread_name="wg")

  def call():
    with pallas_np.force_numpy_interpret():
      return f()
  with pytest.raises(KernelError) as info:
    _run_with_timeout(call)
  msg = str(info.value)
  assert "deadlocked" in msg and "warpgroup 0" in msg and "warpgroup 1" in msg


# -- warp specialisation: producer and consumer warpgroups ----------------------
def test_warp_specialized_pipeline_vs_gpu_interpret():
  x = _x((256, 128), jnp.float32)
  ours, theirs = both(producer_consumer(), x)
  np.testing.assert_array_equal(ours, np.asarray(x) * 3.0)
  np.testing.assert_array_equal(ours, theirs)


# -- wgmma ----------------------------------------------------------------------
def _wgmma_kernel(m=64, k=64, n=128):
  def body(a_ref, b_ref, o_ref):
    def scoped(a_smem, b_smem, bar):
      plgpu.copy_gmem_to_smem(a_ref, a_smem, bar.at[0])
      plgpu.copy_gmem_to_smem(b_ref, b_smem, bar.at[1])
      plgpu.barrier_wait(bar.at[0])
      plgpu.barrier_wait(bar.at[1])

      def with_acc(acc):
        plgpu.wgmma(acc, a_smem, b_smem)
        plgpu.wgmma(acc, a_smem, b_smem)  # accumulates: 2 a @ b
        plgpu.wgmma_wait(0)
        o_ref[...] = acc[...]
      pl.run_scoped(with_acc, plgpu.ACC((m, n), jnp.float32))
    pl.run_scoped(scoped, plgpu.SMEM((m, k), jnp.float16, transforms=TILED),
                  plgpu.SMEM((k, n), jnp.float16, transforms=TILED),
                  plgpu.Barrier(num_arrivals=1, num_barriers=2))
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), jnp.float32))


def test_wgmma_accumulator_vs_reference_and_gpu_interpret():
  a, b = _x((64, 64), seed=1), _x((64, 128), seed=2)
  with pallas_np.force_numpy_interpret():
    ours = _wgmma_kernel()(a, b)
  want = 2 * (np.asarray(a, np.float32) @ np.asarray(b, np.float32))
  assert_close(ours, want, atol=1e-4, rtol=1e-5)
  if hasattr(plgpu, "InterpretGPUParams"):  # JAX 0.10's GPU interpret mode fails on it
    with gpu_interpret():
      theirs = _wgmma_kernel()(a, b)
    assert_close(ours, theirs, atol=1e-4, rtol=1e-5)


# -- pl.pallas_call with plgpu.CompilerParams ------------------------------------
def test_pallas_call_with_barrier_scratch():
  x = _x((128, 64), jnp.float32)

  def kernel(x_ref, o_ref, smem, bar):
    plgpu.copy_gmem_to_smem(x_ref, smem, bar)
    plgpu.barrier_wait(bar)
    o_ref[...] = smem[...] * 2 + 1
  f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                     in_specs=[pl.BlockSpec(memory_space=plgpu.GMEM)],
                     scratch_shapes=[plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier(num_arrivals=1)],
                     compiler_params=plgpu.CompilerParams(), interpret="numpy")
  np.testing.assert_array_equal(f(x), np.asarray(x) * 2 + 1)
  np.testing.assert_array_equal(jax.jit(f)(x), np.asarray(x) * 2 + 1)


def test_pallas_call_tiled_block_specs_and_scratch():
  """plgpu.BlockSpec / SMEM transforms are layout only (NumPy reference; GPU
  interpret mode rejects transformed pallas_call blocks)."""
  x, y = _x((128, 64), seed=3), _x((64, 128), seed=4)

  def kernel(x_ref, y_ref, o_ref, tmp):
    tmp[...] = x_ref[...] + y_ref[...].T
    o_ref[...] = tmp[...] * 2
  f = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
      in_specs=[plgpu.BlockSpec((64, 64), lambda i: (i, 0), transforms=TILED),
                plgpu.BlockSpec((64, 64), lambda i: (0, i))],
      out_specs=plgpu.BlockSpec((64, 64), lambda i: (i, 0), transforms=TILED),
      scratch_shapes=[plgpu.SMEM((64, 64), jnp.float16, transforms=TILED)],
      compiler_params=plgpu.CompilerParams(), interpret="numpy")
  want = (np.asarray(x, np.float32) + np.asarray(y, np.float32).T) * 2
  assert_close(f(x, y), want, atol=2e-2)


# -- emit_pipeline, nd_loop -----------------------------------------------------
def test_emit_pipeline():
  """NumPy reference (GPU interpret mode does not run emit_pipeline's
  predicated SMEM->GMEM copies: "predicate not supported")."""
  x = _x((256, 128), jnp.float32)

  def body(x_ref, o_ref):
    def step(_, x_smem, o_smem):
      o_smem[...] = x_smem[...] + 1.0
    plgpu.emit_pipeline(
        step, grid=(4,), max_concurrent_steps=2,
        in_specs=[pl.BlockSpec((64, 128), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((64, 128), lambda i: (i, 0))])(x_ref, o_ref)
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype))
  with pallas_np.force_numpy_interpret():
    out = f(x)
  np.testing.assert_array_equal(out, np.asarray(x) + 1.0)


def test_nd_loop_over_blocks():
  """Each of 2 blocks takes every other step of a 6-step loop (NumPy
  reference: row i holds i + 100 * the block that ran it)."""
  def body(o_ref):
    @plgpu.nd_loop((6,), collective_axes="x")
    def _(info):
      (i,) = info.index
      blk = jax.lax.axis_index("x")
      o_ref[i] = jnp.full((128,), i + 100 * blk, jnp.int32)
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((6, 128), jnp.int32),
                   grid=(2,), grid_names=("x",))
  with pallas_np.force_numpy_interpret():
    out = f()
  want = np.array([i + 100 * (i % 2) for i in range(6)], np.int32)[:, None]
  np.testing.assert_array_equal(out, np.broadcast_to(want, (6, 128)))


# -- atomics --------------------------------------------------------------------
def test_atomic_add_from_every_block_and_warpgroup():
  """4 blocks x 2 warpgroups update one GMEM ref (NumPy reference; the
  outputs start at zero: uninitialized="zero")."""
  x = _x((8, 128), jnp.float32)

  def body(x_ref, sum_ref, max_ref):
    blk, wg = jax.lax.axis_index("b"), jax.lax.axis_index("wg")
    scaled = x_ref[...] * (blk * 2 + wg + 1).astype(jnp.float32)
    plgpu.atomic_add(sum_ref, scaled)
    plgpu.atomic_max(max_ref.at[2:6], scaled[2:6])
  shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
  f = plgpu.kernel(body, out_type=(shape, shape), grid=(4,), grid_names=("b",),
                   num_threads=2, thread_name="wg")
  with pallas_np.force_numpy_interpret(pallas_np.InterpretParams(uninitialized="zero")):
    total, biggest = f(x)
  xs = np.asarray(x)
  np.testing.assert_allclose(total, xs * sum(range(1, 9)), rtol=1e-6)
  want = np.zeros_like(xs)
  want[2:6] = np.maximum(0, np.maximum(xs[2:6] * 8, xs[2:6]))
  np.testing.assert_array_equal(biggest, want)


def test_reading_a_slot_while_its_copy_is_in_flight_reads_nan():
  """A second copy into an SMEM buffer that already holds data: until the
  barrier wait the buffer holds garbage (NaN under uninitialized="nan"),
  not the old data (semantics: the TMA unit may be midway through it)."""
  x = _x((2, 64, 128), jnp.float32)

  def body(x_ref, first_ref, racy_ref, second_ref):
    def scoped(smem, bar):
      plgpu.copy_gmem_to_smem(x_ref.at[0], smem, bar)
      plgpu.barrier_wait(bar)
      first_ref[...] = smem[...]
      plgpu.copy_gmem_to_smem(x_ref.at[1], smem, bar)
      racy_ref[...] = smem[...]  # the kernel forgot the wait
      plgpu.barrier_wait(bar)
      second_ref[...] = smem[...]
    pl.run_scoped(scoped, plgpu.SMEM((64, 128), jnp.float32), plgpu.Barrier(num_arrivals=1))
  shape = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  f = plgpu.kernel(body, out_type=(shape,) * 3)
  with pallas_np.force_numpy_interpret():
    first, racy, second = f(x)
  np.testing.assert_array_equal(first, x[0])
  assert np.isnan(np.asarray(racy)).all()
  np.testing.assert_array_equal(second, x[1])


def test_plgpu_reductions_and_layout_cast():
  """NumPy reference (GPU interpret mode has no rule for plgpu.sum)."""
  if not hasattr(plgpu, "sum"):
    pytest.skip("plgpu.sum/max are JAX 0.12 API")  # the other tests cover 0.10
  x = _x((64, 128), jnp.float32)

  def body(x_ref, s_ref, m_ref):
    v = plgpu.layout_cast(x_ref[...], plgpu.Layout.WGMMA)
    s_ref[...] = plgpu.sum(v, axis=1)
    m_ref[...] = plgpu.max(v, axis=0)
  f = plgpu.kernel(body, out_type=(jax.ShapeDtypeStruct((64,), jnp.float32),
                                   jax.ShapeDtypeStruct((128,), jnp.float32)))
  with pallas_np.force_numpy_interpret():
    s, m = f(x)
  np.testing.assert_allclose(s, np.asarray(x).sum(1), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(m, np.asarray(x).max(0))


def test_waiting_after_a_missed_phase_raises():
  """Two phases complete before the warpgroup's first wait: on a GPU its
  parity wait would hang or pass on the wrong phase; here it raises."""
  def body(o_ref):
    def scoped(bar):
      plgpu.barrier_arrive(bar)
      plgpu.barrier_arrive(bar)
      plgpu.barrier_wait(bar)
      o_ref[...] = jnp.zeros_like(o_ref)
    pl.run_scoped(scoped, plgpu.Barrier(num_arrivals=1))
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32))
  with pallas_np.force_numpy_interpret(), pytest.raises(KernelError, match="observe every phase"):
    f()


def test_pallas_np_jit_and_vmap_of_a_plgpu_kernel():
  """pallas_np.jit (the whole program in the NumPy evaluator) and jax.vmap
  (plgpu.kernel's batching rule adds a grid axis); NumPy reference."""
  x = _x((3, 128, 64))
  f = _roundtrip_kernel()
  want = np.asarray(x) * np.float16(2) + np.float16(1)
  np.testing.assert_array_equal(pallas_np.jit(f)(x[0]), want[0])
  with pallas_np.force_numpy_interpret():
    np.testing.assert_array_equal(jax.vmap(f)(x), want)


def test_unsupported_construct_raises_naming_primitive_and_line():
  """``barrier_test`` (a non-blocking barrier poll) is not interpreted yet:
  UnsupportedError naming the primitive and the kernel line, never another
  interpreter."""
  def body(o_ref):
    def scoped(bar):
      done = plgpu.barrier_test(bar)
      o_ref[...] = jnp.full(o_ref.shape, done.astype(jnp.float32))
    pl.run_scoped(scoped, plgpu.Barrier(num_arrivals=1))
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32))
  with pallas_np.force_numpy_interpret(), pytest.raises(
      pallas_np.UnsupportedError, match=r"'barrier_test'.*test_mosaic_gpu\.py"):
    f()
  with pallas_np.force_numpy_interpret(), pytest.raises(
      pallas_np.UnsupportedError, match=r"'barrier_test'"):
    jax.jit(f)()


def test_cp_async_copies_land_at_wait_gmem_to_smem():
  """Pre-Hopper copies without a barrier land at wait_gmem_to_smem(n) (all
  but the last n), in issue order (NumPy reference from the semantics)."""
  if not hasattr(plgpu, "wait_gmem_to_smem"):
    pytest.skip("copies without a barrier are JAX 0.12 API")  # 0.10: the other tests
  x = _x((2, 64, 128), jnp.float32)

  def body(x_ref, none_ref, one_ref, both_ref):
    def scoped(smem):
      plgpu.async_prefetch(x_ref)  # an L2 hint: no effect on values
      plgpu.copy_gmem_to_smem(x_ref.at[0], smem.at[0], None)
      plgpu.copy_gmem_to_smem(x_ref.at[1], smem.at[1], None)
      none_ref[...] = smem[...]
      plgpu.wait_gmem_to_smem(1)
      one_ref[...] = smem[...]
      plgpu.wait_gmem_to_smem(0)
      both_ref[...] = smem[...]
    pl.run_scoped(scoped, plgpu.SMEM((2, 64, 128), jnp.float32))
  shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
  f = plgpu.kernel(body, out_type=(shape,) * 3)
  with pallas_np.force_numpy_interpret():
    none, one, both_ = f(x)
  assert np.isnan(np.asarray(none)).all()
  np.testing.assert_array_equal(one[0], x[0])
  assert np.isnan(np.asarray(one[1])).all()
  np.testing.assert_array_equal(both_, x)


# -- pl.core_map(plgpu.Mesh) on refs, through pl.run_state -----------------------
def _core_map_on_refs(x):
  def stateful(refs):
    x_ref, o_ref = refs

    @pl.core_map(plgpu.Mesh(grid=(2,), grid_names=("b",)))
    def _():
      b = jax.lax.axis_index("b")
      o_ref[pl.ds(b * 64, 64)] = x_ref[pl.ds(b * 64, 64)] * 2 + b.astype(jnp.float32)
  return pl.run_state(stateful)((x, jnp.zeros_like(x)))[1]


@pytest.mark.parametrize("entry", ["jax.jit", "eager", "pallas_np.jit"])
def test_core_map_on_refs_through_run_state(entry):
  """The discharged core_map aliases its output to the ref operand the body
  writes: the output must be that buffer (it once came back as zeros).
  NumPy reference: block b doubles its half and adds b."""
  x = jnp.arange(128.0, dtype=jnp.float32)
  want = np.concatenate([np.arange(64.0) * 2, np.arange(64.0, 128.0) * 2 + 1])
  fn = {"jax.jit": jax.jit(_core_map_on_refs), "eager": _core_map_on_refs,
        "pallas_np.jit": pallas_np.jit(_core_map_on_refs)}[entry]
  with pallas_np.force_numpy_interpret():
    got = np.asarray(fn(x))
  np.testing.assert_array_equal(got, want)
