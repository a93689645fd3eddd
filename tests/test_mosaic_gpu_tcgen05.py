"""Blackwell's tensor core in numpy mode: TMEM, ``tcgen05_mma``,
``tcgen05_commit_arrive``, TMEM loads/stores and ``async_copy_smem_to_tmem``,
against NumPy references written from the semantics and against JAX's GPU
interpret mode where it runs them (JAX 0.12; 0.10's has no TMEM)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from tests.mgpu_helpers import gpu_interpret, plgpu

import pallas_np

TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
F32, F16 = jnp.float32, jnp.float16
RACES = pallas_np.InterpretParams(detect_races=True)


def _x(shape, seed, dtype=F16):
  return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def _run(f, *args, params=None):
  with pallas_np.force_numpy_interpret(params):
    return f(*args)


def _mma_kernel(*, use_mma_barrier=False, wait_result=True, wait_load=True, m=128, k=128,
                n=128):
  """acc = a @ b; acc += a @ b (completion via commit_arrive or the MMA's
  own barrier), then the accumulator goes out through a TMEM load."""
  def body(a_ref, b_ref, o_ref):
    def scoped(a_smem, b_smem, acc, bar, mma_bar):
      plgpu.copy_gmem_to_smem(a_ref, a_smem, bar.at[0])
      plgpu.copy_gmem_to_smem(b_ref, b_smem, bar.at[1])
      plgpu.barrier_wait(bar.at[0])
      plgpu.barrier_wait(bar.at[1])
      plgpu.tcgen05_mma(acc, a_smem, b_smem, accumulate=False)
      if use_mma_barrier:
        plgpu.tcgen05_mma(acc, a_smem, b_smem, mma_bar, accumulate=True)
      else:
        plgpu.tcgen05_mma(acc, a_smem, b_smem, accumulate=True)
        plgpu.tcgen05_commit_arrive(mma_bar)
      if wait_result:
        plgpu.barrier_wait(mma_bar)
      o_ref[...] = plgpu.async_load_tmem(acc)
      if not wait_result:
        plgpu.barrier_wait(mma_bar)
      if wait_load:
        plgpu.wait_load_tmem()
      # The accumulator is reused: the load must be complete.
      plgpu.tcgen05_mma(acc, a_smem, b_smem, accumulate=False)
      plgpu.tcgen05_commit_arrive(mma_bar)
      plgpu.barrier_wait(mma_bar)
    pl.run_scoped(scoped, plgpu.SMEM((m, k), F16, transforms=TILED),
                  plgpu.SMEM((k, n), F16, transforms=TILED),
                  plgpu.TMEM((m, n), F32),
                  plgpu.Barrier(num_arrivals=1, num_barriers=2),
                  plgpu.Barrier(num_arrivals=1, orders_tensor_core=True))
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), F32))


def _want(a, b):
  return 2 * (np.asarray(a, np.float32) @ np.asarray(b, np.float32))


@pytest.mark.parametrize("use_mma_barrier", [False, True])
def test_tcgen05_matmul_vs_numpy(use_mma_barrier):
  a, b = _x((128, 128), 0), _x((128, 128), 1)
  out = _run(_mma_kernel(use_mma_barrier=use_mma_barrier), a, b)
  np.testing.assert_allclose(out, _want(a, b), rtol=1e-5, atol=1e-4)


def test_tcgen05_matmul_vs_gpu_interpret():
  a, b = _x((128, 128), 0), _x((128, 128), 1)
  ours = _run(_mma_kernel(), a, b)
  try:
    with gpu_interpret():
      theirs = _mma_kernel()(a, b)
  except NotImplementedError as e:  # JAX 0.10: "Unsupported memory space: tmem"
    pytest.skip(f"JAX's GPU interpret mode cannot run TMEM here: {e}")
  np.testing.assert_array_equal(ours, theirs)


def test_tcgen05_matmul_has_no_race_under_detection():
  a, b = _x((128, 128), 0), _x((128, 128), 1)
  for use_mma_barrier in (False, True):
    out = _run(_mma_kernel(use_mma_barrier=use_mma_barrier), a, b, params=RACES)
    np.testing.assert_allclose(out, _want(a, b), rtol=1e-5, atol=1e-4)


def test_reading_tmem_before_the_mma_completes_is_a_race():
  a, b = _x((128, 128), 0), _x((128, 128), 1)
  with pytest.raises(pallas_np.RaceError, match="an MMA .* wrote"):
    _run(_mma_kernel(wait_result=False), a, b, params=RACES)


def test_reusing_tmem_before_wait_load_tmem_is_a_race():
  a, b = _x((128, 128), 0), _x((128, 128), 1)
  with pytest.raises(pallas_np.RaceError, match="an async_load_tmem .* read"):
    _run(_mma_kernel(wait_load=False), a, b, params=RACES)


def test_tmem_lhs_store_and_smem_to_tmem_copy():
  """``a`` from TMEM (filled by async_store_tmem), a second product with
  ``a`` copied SMEM -> TMEM by the tensor core, and a transposed SMEM
  ``b``; NumPy reference."""
  m, k, n = 128, 64, 128
  a, a2, bt = _x((m, k), 0), _x((m, k), 1), _x((n, k), 2)

  def body(a_ref, a2_ref, bt_ref, o_ref):
    def scoped(a_smem, bt_smem, a_tmem, acc, bar, mma_bar):
      plgpu.copy_gmem_to_smem(a2_ref, a_smem, bar.at[0])
      plgpu.copy_gmem_to_smem(bt_ref, bt_smem, bar.at[1])
      plgpu.barrier_wait(bar.at[0])
      plgpu.barrier_wait(bar.at[1])
      plgpu.async_store_tmem(a_tmem, a_ref[...])
      plgpu.commit_tmem()
      b_view = bt_smem.T
      plgpu.tcgen05_mma(acc, a_tmem, b_view, accumulate=False)
      plgpu.async_copy_smem_to_tmem(a_smem, a_tmem)
      plgpu.tcgen05_mma(acc, a_tmem, b_view, accumulate=True)
      plgpu.tcgen05_commit_arrive(mma_bar)
      plgpu.barrier_wait(mma_bar)
      o_ref[...] = plgpu.async_load_tmem(acc)
      plgpu.wait_load_tmem()
    pl.run_scoped(scoped, plgpu.SMEM((m, k), F16, transforms=TILED),
                  plgpu.SMEM((n, k), F16, transforms=TILED),
                  plgpu.TMEM((m, k), F16, packed=True),
                  plgpu.TMEM((m, n), F32),
                  plgpu.Barrier(num_arrivals=1, num_barriers=2),
                  plgpu.Barrier(num_arrivals=1, orders_tensor_core=True))
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), F32))
  out = _run(f, a, a2, bt, params=RACES)
  b32 = np.asarray(bt, np.float32).T
  want = np.asarray(a, np.float32) @ b32 + np.asarray(a2, np.float32) @ b32
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


def test_collective_copy_into_tmem_raises_unsupported():
  # Collective MMAs run (tests/test_mosaic_gpu_cluster.py); copies into the
  # TMEM of 2 blocks do not yet.
  def body(a_ref, b_ref, o_ref):
    def scoped(a_smem, acc):
      plgpu.async_copy_smem_to_tmem(a_smem, acc, collective_axis="x")
      o_ref[...] = plgpu.async_load_tmem(acc)
    pl.run_scoped(scoped, plgpu.SMEM((128, 128), F32), plgpu.TMEM((128, 128), F32))
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128, 128), F32),
                   cluster=(2,), cluster_names=("x",))
  with pytest.raises(pallas_np.UnsupportedError, match="collective_axis"):
    _run(f, _x((128, 64), 0), _x((64, 64), 1))
