"""Warps, clusters and cluster launch control of Mosaic GPU kernels in numpy
mode: ``plgpu.warp_map``, ``inline_mgpu`` PTX fences, ``planar_snake``,
``dynamic_scheduling_loop``, clusters of 2 blocks (multicast and partitioned
TMA copies, ``ClusterBarrier``, collective ``tcgen05_mma``), their deadlock
and race reports. Each is checked against a NumPy reference written from the
semantics (docstrings of ``plgpu``) and, where it runs them, JAX's GPU
interpret mode (JAX 0.12: warps, dynamic scheduling; it has no collective
copies or MMAs)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from tests.mgpu_helpers import gpu_interpret, gpu_interpret_params, plgpu

import pallas_np
from pallas_np.errors import KernelError

F32, F16 = jnp.float32, jnp.float16
RACES = pallas_np.InterpretParams(detect_races=True)
HAS_WARP_MAP = hasattr(plgpu, "warp_map")
# JAX 0.12's GPU interpret mode runs warp_map and cluster launch control (its
# InterpretGPUParams has inline_mgpu=); 0.10's cannot ("Higher-order primitive
# core_map").
ORACLE_RUNS_WARPS = "inline_mgpu" in {
    f.name for f in dataclasses.fields(gpu_interpret_params.InterpretGPUParams)}


def _run(f, *args, params=None):
  with pallas_np.force_numpy_interpret(params):
    return f(*args)


def _x(shape, seed, dtype=F32):
  return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def _warp_map(body):
  """``plgpu.warp_map`` (JAX 0.12), or the core_map over a WarpMesh it is."""
  if HAS_WARP_MAP:
    return plgpu.warp_map(body)
  return pl.core_map(plgpu.WarpMesh(axis_name="warp"))(lambda: body(lax.axis_index("warp")))


WG = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


# -- warp_map ----------------------------------------------------------------------------
def _warp_pipeline(consumer_waits=True):
  """Warp 0 copies x's row blocks into SMEM; warp 1 waits for each and
  copies it out (TMA); warps 2 and 3 write their id (scalars: warp-level
  code moves scalars only, as Mosaic GPU's lowering requires)."""
  steps, blk = 4, 64

  def body(x_ref, o_ref, ids_ref, smem, full, free):
    @_warp_map
    def _(w):
      @pl.when(w == 0)
      def _producer():
        @pl.loop(0, steps)
        def _(i):
          @pl.when(i >= 2)
          def _():
            plgpu.barrier_wait(free.at[i % 2])
          plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(i * blk, blk)], smem.at[i % 2], full.at[i % 2])

      @pl.when(w == 1)
      def _consumer():
        @pl.loop(0, steps)
        def _(i):
          if consumer_waits:
            plgpu.barrier_wait(full.at[i % 2])
          plgpu.copy_smem_to_gmem(smem.at[i % 2], o_ref.at[pl.ds(i * blk, blk)])
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          plgpu.barrier_arrive(free.at[i % 2])

      @pl.when(w >= 2)
      def _ids():
        ids_ref[w - 2] = w

  return plgpu.kernel(
      body, out_type=(jax.ShapeDtypeStruct((steps * blk, 128), F32),
                      jax.ShapeDtypeStruct((2,), jnp.int32)),
      compiler_params=WG,
      scratch_types=dict(smem=plgpu.SMEM((2, blk, 128), F32),
                          full=plgpu.Barrier(num_barriers=2),
                          free=plgpu.Barrier(num_barriers=2)))


def _warp_pipeline_reference(x):
  return np.asarray(x), np.array([2, 3], np.int32)


def test_warp_map_warps_take_turns():
  x = _x((256, 128), 0)
  out, ids = _run(_warp_pipeline(), x)
  want_out, want_ids = _warp_pipeline_reference(x)
  np.testing.assert_array_equal(np.asarray(out), want_out)
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  # Under race detection too: warps order each other through the barriers.
  out, _ = _run(_warp_pipeline(), x, params=RACES)
  np.testing.assert_array_equal(np.asarray(out), want_out)


@pytest.mark.skipif(not ORACLE_RUNS_WARPS, reason="JAX 0.10's GPU interpret mode has no warps")
def test_warp_map_vs_gpu_interpret():
  x = _x((256, 128), 0)
  ours = _run(_warp_pipeline(), x)
  with gpu_interpret():
    theirs = _warp_pipeline()(x)
  for a, b in zip(ours, theirs):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_warp_race_is_reported():
  """Warp 1 reads the slot without waiting for warp 0's copy."""
  with pytest.raises(pallas_np.RaceError, match="warp 1 of .* reads .* TMA copy issued by warp 0"):
    _run(_warp_pipeline(consumer_waits=False), _x((256, 128), 0), params=RACES)


def test_warp_deadlock_names_the_warp():
  def body(o_ref, bar):
    @_warp_map
    def _(w):
      @pl.when(w == 2)
      def _():
        plgpu.barrier_wait(bar)  # nobody arrives
      o_ref[w] = jnp.float32(0)

  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((4,), F32), compiler_params=WG,
                   scratch_types=dict(bar=plgpu.Barrier()))
  with pytest.raises(KernelError, match="deadlocked") as info:
    _run(f)
  assert "warp 2 of the block" in str(info.value)
  assert "test_mosaic_gpu_cluster.py" in str(info.value)


# -- inline_mgpu ---------------------------------------------------------------------------
def test_inline_ptx_fence_is_a_no_op_and_other_inline_mgpu_raises():
  from jax._src.pallas.mosaic_gpu import helpers

  def fenced(x_ref, o_ref):
    helpers.inline_ptx(helpers._FENCE_PROXY_ASYNC_GENERIC_RELEASE_SHARED_CTA)
    o_ref[...] = x_ref[...] + 1

  x = _x((8, 128), 0)
  f = plgpu.kernel(fenced, out_type=jax.ShapeDtypeStruct((8, 128), F32))
  np.testing.assert_array_equal(np.asarray(_run(f, x)), np.asarray(x) + 1)

  def other(x_ref, o_ref):
    helpers.inline_ptx("nanosleep.u32 100;")
    o_ref[...] = x_ref[...]

  g = plgpu.kernel(other, out_type=jax.ShapeDtypeStruct((8, 128), F32))
  with pytest.raises(pallas_np.UnsupportedError, match=r"inline_mgpu.*nanosleep.*"
                     r"test_mosaic_gpu_cluster\.py"):
    _run(g, x)


# -- planar_snake, dynamic_scheduling_loop ------------------------------------------------
def test_planar_snake_matches_its_documented_order():
  # The order plgpu.planar_snake's docstring draws for shape (8, 8),
  # minor_dim=0, tile_width=2: order[m, n] is the linear index visiting (m, n).
  order = np.zeros((8, 8), np.int32)
  for tile in range(4):
    for j in range(8):
      n = j if tile % 2 == 0 else 7 - j
      for i in range(2):
        order[tile * 2 + i, n] = tile * 16 + j * 2 + i

  def body(o_ref):
    @pl.loop(0, 64)
    def _(lin):
      m, n = plgpu.planar_snake(lin, (8, 8), 0, 2)
      o_ref[lin] = jnp.stack([m, n])

  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 2), jnp.int32))
  coords = np.asarray(_run(f))
  got = np.zeros((8, 8), np.int32)
  got[coords[:, 0], coords[:, 1]] = np.arange(64)
  np.testing.assert_array_equal(got, order)


def _scheduled(grid=(6,), cluster=(), num_threads=2):
  """Every work item writes its own id + 1 and the loop step that ran it;
  the loop claims items with cluster launch control."""
  def body(o_ref, steps_ref):
    names = ("x",) if cluster else ()

    @plgpu.dynamic_scheduling_loop(grid_names=("g",), thread_axis="wg",
                                   **({"cluster_axes": names} if cluster else {}))
    def _(info):
      (g,) = info.index
      first = lax.axis_index("wg") == 0
      if cluster:
        first = first & (lax.axis_index("x") == 0)

      @pl.when(first)
      def _():
        o_ref[pl.ds(g, 1)] = jnp.full((1,), g + 1, jnp.int32)
        steps_ref[pl.ds(g, 1)] = jnp.full((1,), info.local_index, jnp.int32)

  return plgpu.kernel(
      body, out_type=(jax.ShapeDtypeStruct(grid, jnp.int32),) * 2, grid=grid, grid_names=("g",),
      num_threads=num_threads, thread_name="wg", cluster=cluster,
      cluster_names=("x",) if cluster else (), compiler_params=WG)


@pytest.mark.parametrize("cluster", [(), (2,)])
def test_dynamic_scheduling_loop_visits_every_item_once(cluster):
  f = _scheduled(cluster=cluster)
  items, steps = _run(lambda: f())
  # Every item once (an unvisited one keeps the uninitialised fill) ...
  np.testing.assert_array_equal(np.asarray(items), np.arange(1, 7, dtype=np.int32))
  # ... in launch order: the first cluster claims every later one (clusters
  # run one after another here), one loop step each, so a second visit of
  # any item would show as a later step.
  np.testing.assert_array_equal(np.asarray(steps), np.arange(6, dtype=np.int32))


def test_clusters_a_gpu_holds_at_once_run_their_own_item():
  """On an H100 (132 SMs, under the device persona) the first 132 clusters
  are launched at once: each runs its own item; only the 2 beyond are left
  for cluster launch control to claim (by the first cluster, which runs
  first here: its loop steps 1 and 2)."""
  f = _scheduled(grid=(134,))
  with pallas_np.emulate_device("h100"):
    items, steps = f()
  np.testing.assert_array_equal(np.asarray(items), np.arange(1, 135, dtype=np.int32))
  want = np.zeros(134, np.int32)
  want[132:] = [1, 2]
  np.testing.assert_array_equal(np.asarray(steps), want)


def test_work_queue_claims_only_clusters_not_launched():
  from pallas_np.mosaic_gpu.cluster import WorkQueue
  q = WorkQueue((5,), resident=2)
  run = q.launch()
  assert next(run) == (0,)
  assert q.claim() == (2,)  # 1 is launched (resident) already: not claimable
  assert next(run) == (1,)  # when 0 finished its SM launched 3: left is 4
  assert q.claim() == (4,)
  assert q.claim() is None
  assert list(run) == [(3,)]


def test_cluster_launch_control_over_a_grid_of_four_axes():
  """JAX's lowering squashes the leading grid axes into one launch axis;
  a claimed cluster's coordinates come back whole."""
  grid = (2, 3, 2, 2)
  names = ("a", "b", "c", "d")

  def body(o_ref):
    @plgpu.dynamic_scheduling_loop(grid_names=names)
    def _(info):
      a, b, c, d = info.index
      o_ref[a, b, c, d] = ((a * 3 + b) * 2 + c) * 2 + d
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(grid, jnp.int32), grid=grid,
                   grid_names=names)
  out = _run(lambda: f())
  np.testing.assert_array_equal(np.asarray(out), np.arange(24, dtype=np.int32).reshape(grid))


@pytest.mark.skipif(not ORACLE_RUNS_WARPS, reason="JAX 0.10's GPU interpret mode cannot run it")
def test_dynamic_scheduling_loop_vs_gpu_interpret():
  f = _scheduled()
  ours = _run(lambda: f())[0]
  with gpu_interpret(inline_mgpu="ignore"):
    theirs = f()[0]  # its cancellations always fail: each block runs its own item
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


# -- clusters of 2 blocks ----------------------------------------------------------------
def _cluster_copy(leader_tracked=None):
  """Each block of a 2-block cluster issues the same collective copy of x
  (128 rows) and writes what lands in its SMEM to its half of the output."""
  rows = 128 if leader_tracked is None else 64

  def body(x_ref, o_ref, smem, bar, done):
    b = lax.axis_index("x")
    plgpu.copy_gmem_to_smem(x_ref, smem, bar, collective_axes="x",
                            **({} if leader_tracked is None else
                               {"leader_tracked": leader_tracked}))
    if leader_tracked is None:
      plgpu.barrier_wait(bar)
    else:
      # Only the leader's barrier tracks the copy: it tells the others.
      @pl.when(b == 0)
      def _():
        plgpu.barrier_wait(bar)
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)
    o_ref[pl.ds(b * rows, rows)] = smem[...]

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((2 * rows, 128), F32), cluster=(2,),
      cluster_names=("x",),
      scratch_types=dict(smem=plgpu.SMEM((rows, 128), F32), bar=plgpu.Barrier(),
                          done=plgpu.ClusterBarrier(collective_axes=("x",))))


def test_multicast_copy_lands_in_every_block():
  x = _x((128, 128), 0)
  out = np.asarray(_run(_cluster_copy(), x))
  np.testing.assert_array_equal(out, np.concatenate([x, x]))
  np.testing.assert_array_equal(np.asarray(_run(_cluster_copy(), x, params=RACES)), out)


def test_partitioned_copy_gives_each_block_its_slice():
  x = _x((128, 128), 0)
  f = _cluster_copy(plgpu.CopyPartition.PARTITIONED(0))
  np.testing.assert_array_equal(np.asarray(_run(f, x)), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(_run(f, x, params=RACES)), np.asarray(x))


def test_cluster_barrier_needs_every_block():
  """A ClusterBarrier completes once each block of the cluster arrived:
  with block 1 never arriving, both blocks' waits deadlock."""
  def body(o_ref, bar):
    @pl.when(lax.axis_index("x") == 0)
    def _():
      plgpu.barrier_arrive(bar)
    plgpu.barrier_wait(bar)
    o_ref[...] = jnp.zeros_like(o_ref)

  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8, 128), F32), cluster=(2,),
                   cluster_names=("x",),
                   scratch_types=dict(bar=plgpu.ClusterBarrier(collective_axes=("x",))))
  with pytest.raises(KernelError, match="deadlocked") as info:
    _run(f)
  assert "block (0,)" in str(info.value) and "block (1,)" in str(info.value)


def _collective_mma(wait=True):
  """A 2-block MMA: each block loads its 128 rows of a and its 64 columns
  of b (partitioned copies), the leader multiplies; each block stores its
  rows of the 256 x 128 product."""
  def body(a_ref, b_ref, o_ref, a_smem, b_smem, acc, bar, mma_bar, done):
    blk = lax.axis_index("x")
    plgpu.copy_gmem_to_smem(a_ref, a_smem, bar.at[0], collective_axes="x",
                            leader_tracked=plgpu.CopyPartition.PARTITIONED(0))
    plgpu.copy_gmem_to_smem(b_ref, b_smem, bar.at[1], collective_axes="x",
                            leader_tracked=plgpu.CopyPartition.PARTITIONED(1))

    @pl.when(blk == 0)
    def _():
      if wait:
        plgpu.barrier_wait(bar.at[0])
        plgpu.barrier_wait(bar.at[1])
      plgpu.tcgen05_mma(acc, a_smem, b_smem, accumulate=False, collective_axis="x")
      plgpu.tcgen05_commit_arrive(mma_bar, collective_axis="x")
      if not wait:
        plgpu.barrier_wait(bar.at[0])
        plgpu.barrier_wait(bar.at[1])
    plgpu.barrier_wait(mma_bar)
    o_ref[pl.ds(blk * 128, 128)] = plgpu.async_load_tmem(acc)
    plgpu.wait_load_tmem()
    plgpu.barrier_arrive(done)
    plgpu.barrier_wait(done)  # the leader's SMEM stays until the peer is done

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((256, 128), F32), cluster=(2,), cluster_names=("x",),
      compiler_params=WG,
      scratch_types=dict(a_smem=plgpu.SMEM((128, 64), F16), b_smem=plgpu.SMEM((64, 64), F16),
                          acc=plgpu.TMEM((128, 128), F32, collective=True),
                          bar=plgpu.Barrier(num_barriers=2),
                          mma_bar=plgpu.Barrier(orders_tensor_core=True),
                          done=plgpu.ClusterBarrier(collective_axes=("x",))))


def test_collective_mma_computes_the_whole_product():
  a, b = _x((256, 64), 0, F16), _x((64, 128), 1, F16)
  want = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
  out = np.asarray(_run(_collective_mma(), a, b))
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(_run(_collective_mma(), a, b, params=RACES)), out)


def test_collective_mma_before_the_peer_copy_is_a_race():
  a, b = _x((256, 64), 0, F16), _x((64, 128), 1, F16)
  with pytest.raises(pallas_np.RaceError, match=r"an MMA .* block \(0,\) reads .* a TMA copy "
                     r"issued by block"):
    _run(_collective_mma(wait=False), a, b, params=RACES)


def test_error_in_a_warp_names_it():
  def body(x_ref, o_ref):
    @_warp_map
    def _(w):
      @pl.when(w == 3)
      def _():
        o_ref[0] = x_ref[w * 8]  # element 24 of 16: out of bounds

  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((1,), F32), compiler_params=WG)
  with pytest.raises(KernelError, match=r"warp 3 .*test_mosaic_gpu_cluster\.py"):
    _run(f, _x((16,), 0))
