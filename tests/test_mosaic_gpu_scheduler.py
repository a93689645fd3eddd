"""The one Mosaic GPU scheduler (``pallas_np.mosaic_gpu.threads.Scheduler``):
what kernels that wait on semaphores can combine with now that warps,
clusters, semaphores and devices share it: ``plgpu.warp_map`` warps that wait
on semaphores, clusters of several blocks in such kernels, and
``detect_races=True`` on them (happens-before through semaphores across
blocks). Waits that can never complete still raise, naming the thread and
the kernel line.

JAX's GPU interpret mode cannot run a semaphore kernel (``NotImplementedError``),
so every reference is NumPy, written from the semantics."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from tests.mgpu_helpers import plgpu
from tests.test_mosaic_gpu import _run_with_timeout

import pallas_np
from pallas_np.errors import KernelError

F32 = jnp.float32
RACES = pallas_np.InterpretParams(detect_races=True)
WG = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _run(f, *args, params=None):
  def call():
    with pallas_np.force_numpy_interpret(params):
      return jax.block_until_ready(f(*args))
  return _run_with_timeout(call)


def _warp_map(body):
  """``plgpu.warp_map`` (JAX 0.12), or the core_map over a WarpMesh it is."""
  if hasattr(plgpu, "warp_map"):
    return plgpu.warp_map(body)
  return pl.core_map(plgpu.WarpMesh(axis_name="warp"))(lambda: body(lax.axis_index("warp")))


def _x(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, F32)


# -- semaphores and warp_map ---------------------------------------------------------
def _warps_handshake(waiter_waits=True):
  """Warp 0 waits for warp 1's signal (it runs first, so it must let warp 1
  run), then doubles what warp 1 wrote; warps 2 and 3 signal by 2 and 3 and
  warp 1 waits for both. ``o[0]``: the semaphore's final value. (Warp-level
  code loads and stores scalars only, as Mosaic GPU's lowering requires.)"""
  def body(x_ref, o_ref, cnt_ref):
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    sem2 = pl.get_global(plgpu.SemaphoreType.REGULAR)

    @_warp_map
    def _(w):
      @pl.when(w == 0)
      def _():
        if waiter_waits:
          pl.semaphore_wait(sem, 1)
        o_ref[1] = o_ref[0] * 2.0

      @pl.when(w == 1)
      def _():
        pl.semaphore_wait(sem2, 5)
        o_ref[0] = x_ref[0] + 1.0
        pl.semaphore_signal(sem, 3)

      @pl.when(w >= 2)
      def _():
        pl.semaphore_signal(sem2, w)
    cnt_ref[0] = pl.semaphore_read(sem)

  return plgpu.kernel(body, out_type=(jax.ShapeDtypeStruct((2,), F32),
                                      jax.ShapeDtypeStruct((1,), jnp.int32)),
                      compiler_params=WG)


def test_warps_wait_on_semaphores_signalled_by_later_warps():
  x = _x((1,), 0)
  out, cnt = _run(_warps_handshake(), x)
  xs = np.asarray(x)
  np.testing.assert_array_equal(np.asarray(out), np.concatenate([xs + 1, (xs + 1) * 2]))
  assert int(np.asarray(cnt)[0]) == 2  # signalled 3, decremented by the wait of 1


def test_warp_semaphore_handshake_is_race_free_and_a_missing_wait_is_a_race():
  x = _x((1,), 0)
  out, _ = _run(_warps_handshake(), x, params=RACES)
  xs = np.asarray(x)
  np.testing.assert_array_equal(np.asarray(out), np.concatenate([xs + 1, (xs + 1) * 2]))
  with pytest.raises(pallas_np.RaceError, match=r"warp 1 of .* writes .* warp 0 of .* read"):
    _run(_warps_handshake(waiter_waits=False), x, params=RACES)


def test_jax_global_semaphore_with_multiple_warps():
  """JAX's mosaic_gpu_test ``test_global_semaphore_with_multiple_warps``:
  warp 0 signals twice, warp 1 waits for 2 and decrements: 0 is left."""
  def body(out_ref):
    sem_ref = pl.get_global(plgpu.SemaphoreType.REGULAR)

    @_warp_map
    def _(w):
      @pl.when(w == 0)
      def _():
        pl.semaphore_signal(sem_ref)
        pl.semaphore_signal(sem_ref)

      @pl.when(w == 1)
      def _():
        pl.semaphore_wait(sem_ref, 2)
    out_ref[0] = pl.semaphore_read(sem_ref)
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((1,), jnp.int32),
                   compiler_params=plgpu.CompilerParams())
  np.testing.assert_array_equal(np.asarray(_run(f)), np.zeros((1,), np.int32))


def test_warp_waiting_on_a_semaphore_nobody_signals_names_the_warp():
  def body(o_ref):
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)

    @_warp_map
    def _(w):
      @pl.when(w == 2)
      def _():
        pl.semaphore_wait(sem, 1)  # nobody signals
      o_ref[w] = jnp.float32(0)
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((4,), F32), compiler_params=WG)
  with pytest.raises(KernelError, match="deadlock") as info:
    _run(f)
  msg = str(info.value)
  assert "warp 2 of block ()" in msg and "semaphore_wait" in msg
  assert "test_mosaic_gpu_scheduler.py" in msg
  assert "warp_map" in msg  # the warpgroup waits for its warps


# -- semaphores and clusters -----------------------------------------------------------
def _clusters_handshake(signal_first=False):
  """Grid (2,) of 2-block clusters. The blocks of cluster 1 write their
  rows, meet at a ClusterBarrier and signal a global semaphore; the blocks of
  cluster 0 wait for both signals, then copy cluster 1's rows, doubled.
  ``signal_first``: cluster 1 signals before writing (a race)."""
  def body(x_ref, o_ref, bar):
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    g, c = lax.axis_index("g"), lax.axis_index("c")
    rows = pl.ds((2 + c) * 8, 8)

    @pl.when(g == 1)
    def _():
      if signal_first:
        pl.semaphore_signal(sem)
      o_ref[rows] = x_ref[rows] + 1.0
      plgpu.barrier_arrive(bar)
      plgpu.barrier_wait(bar)  # both blocks of the cluster wrote
      if not signal_first:
        pl.semaphore_signal(sem)

    @pl.when(g == 0)
    def _():
      pl.semaphore_wait(sem, 1)
      o_ref[pl.ds(c * 8, 8)] = o_ref[pl.ds((3 - c) * 8, 8)] * 2.0

  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((32, 128), F32), grid=(2,),
                      grid_names=("g",), cluster=(2,), cluster_names=("c",),
                      scratch_types=dict(bar=plgpu.ClusterBarrier(collective_axes=("c",))))


def _clusters_reference(x):
  x = np.asarray(x)
  out = np.empty_like(x)
  out[16:] = x[16:] + 1
  out[0:8] = out[24:32] * 2
  out[8:16] = out[16:24] * 2
  return out


def test_clusters_in_a_kernel_that_waits_on_semaphores():
  x = _x((32, 128), 1)
  np.testing.assert_array_equal(np.asarray(_run(_clusters_handshake(), x)),
                                _clusters_reference(x))


def test_clusters_with_semaphores_under_race_detection():
  x = _x((32, 128), 1)
  out = _run(_clusters_handshake(), x, params=RACES)
  np.testing.assert_array_equal(np.asarray(out), _clusters_reference(x))
  with pytest.raises(pallas_np.RaceError, match=r"block \(0, [01]\) reads .* block \(1, [01]\) "
                     r"wrote; no semaphore"):
    _run(_clusters_handshake(signal_first=True), x, params=RACES)


def test_cluster_waiting_on_a_semaphore_nobody_signals_raises():
  def body(o_ref, bar):
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    plgpu.barrier_arrive(bar)
    plgpu.barrier_wait(bar)

    @pl.when(lax.axis_index("c") == 1)
    def _():
      pl.semaphore_wait(sem, 1)  # nobody signals
    o_ref[...] = jnp.zeros_like(o_ref)
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8, 128), F32), cluster=(2,),
                   cluster_names=("c",),
                   scratch_types=dict(bar=plgpu.ClusterBarrier(collective_axes=("c",))))
  with pytest.raises(KernelError, match="deadlock") as info:
    _run(f)
  msg = str(info.value)
  assert "block (1,)" in msg and "semaphore_wait" in msg and "test_mosaic_gpu_scheduler.py" in msg


# -- race detection on kernels whose blocks wait for each other ---------------------
def _blocks_handshake(wait=True, signal_first=False):
  """Block 1 writes its rows and signals; block 0 waits, then copies them."""
  def body(x_ref, o_ref):
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    b = lax.axis_index("b")

    @pl.when(b == 1)
    def _():
      if signal_first:
        pl.semaphore_signal(sem)
      o_ref[pl.ds(8, 8)] = x_ref[pl.ds(8, 8)] + 1.0
      if not signal_first:
        pl.semaphore_signal(sem)

    @pl.when(b == 0)
    def _():
      if wait:
        pl.semaphore_wait(sem)
      o_ref[pl.ds(0, 8)] = o_ref[pl.ds(8, 8)] * 2.0
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((16, 128), F32), grid=(2,),
                      grid_names=("b",))


def test_detect_races_orders_blocks_through_semaphores():
  x = _x((16, 128), 2)
  xs = np.asarray(x)
  out = _run(_blocks_handshake(), x, params=RACES)
  np.testing.assert_array_equal(np.asarray(out), np.concatenate([(xs[8:] + 1) * 2, xs[8:] + 1]))


@pytest.mark.parametrize("broken", ["no wait", "signal before the write"])
def test_detect_races_reports_blocks_a_semaphore_does_not_order(broken):
  x = _x((16, 128), 2)
  f = _blocks_handshake(wait=False) if broken == "no wait" else \
      _blocks_handshake(signal_first=True)
  with pytest.raises(pallas_np.RaceError, match=r"block \([01],\) .* block \([01],\)") as info:
    _run(f, x, params=RACES)
  assert "output 0" in str(info.value)
