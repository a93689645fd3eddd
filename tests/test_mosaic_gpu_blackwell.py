"""JAX's Blackwell Mosaic GPU kernels (``blackwell_matmul_mgpu``,
``blackwell_ragged_dot_mgpu``) in numpy mode at small shapes, against their
reference functions, with and without 2-block clusters (``collective=True``),
under race detection, and (the matmul without clusters, JAX 0.12) against
JAX's GPU interpret mode, bit for bit.

They use ``plgpu.warp_map``, ``dynamic_scheduling_loop`` (cluster launch
control; ``inline_mgpu`` PTX fences), ``planar_snake``, TMEM and
``tcgen05_mma``, and with ``collective=True`` partitioned TMA copies,
``ClusterBarrier`` and 2-block MMAs (tests/test_mosaic_gpu_cluster.py checks
each construct on its own)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.mgpu_helpers import (blackwell_kernels, gpu_interpret,  # noqa: F401
                                gpu_interpret_params)

import pallas_np

RACES = pallas_np.InterpretParams(detect_races=True)
# JAX 0.12's GPU interpret mode runs the matmul (warps, TMEM, inline_mgpu="ignore").
ORACLE_RUNS_IT = "inline_mgpu" in {
    f.name for f in dataclasses.fields(gpu_interpret_params.InterpretGPUParams)}


def _normal(seed, shape, dtype=jnp.float16):
  # NumPy's generator: jax.random would compile an XLA program per shape.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32)
                     .astype(jnp.dtype(dtype)))


def _run(fn, *args, params=None, **kwargs):
  with pallas_np.force_numpy_interpret(params):
    return fn(*args, **kwargs)


def _matmul_reference(a, b):
  return (np.asarray(a, np.float32) @ np.asarray(b, np.float32)).astype(np.float16)


def _assert_f16_close(got, want):
  # f32 accumulation rounded to f16 once: within an f16 ulp of the f32 product.
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=2 ** -10, atol=2 ** -10)


def _matmul_config(bm, collective, minor="N", width=1, steps=2):
  return bm.TuningConfig(tile_m=128, tile_n=64 if collective else 128, tile_k=64,
                         max_concurrent_steps=steps, collective=collective,
                         epilogue_tile_n=64, grid_minor_dim=bm.MatmulDimension[minor],
                         grid_tile_width=width)


@pytest.mark.parametrize("collective,minor,width", [
    (False, "N", 1), (False, "M", 2), (True, "N", 1), (True, "M", 2)])
def test_blackwell_matmul(blackwell_kernels, collective, minor, width):
  bm = blackwell_kernels["matmul"]
  a, b = _normal(0, (512, 256)), _normal(1, (256, 512))
  out = _run(bm.matmul_kernel, a, b, _matmul_config(bm, collective, minor, width))
  _assert_f16_close(out, _matmul_reference(a, b))


@pytest.mark.parametrize("collective", [False, True])
def test_blackwell_matmul_runs_clean_under_race_detection(blackwell_kernels, collective):
  bm = blackwell_kernels["matmul"]
  a, b = _normal(0, (256, 128)), _normal(1, (128, 256))
  cfg = _matmul_config(bm, collective)
  out = _run(bm.matmul_kernel, a, b, cfg, params=RACES)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(_run(bm.matmul_kernel, a, b, cfg)))


@pytest.mark.skipif(not ORACLE_RUNS_IT, reason="JAX 0.10's GPU interpret mode has no TMEM")
def test_blackwell_matmul_vs_gpu_interpret(blackwell_kernels):
  bm = blackwell_kernels["matmul"]
  a, b = _normal(0, (256, 128)), _normal(1, (128, 256))
  cfg = _matmul_config(bm, False)
  ours = _run(bm.matmul_kernel, a, b, cfg)
  with gpu_interpret(inline_mgpu="ignore"):
    theirs = bm.matmul_kernel(a, b, cfg)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def _ragged_inputs():
  lhs, rhs = _normal(0, (512, 128)), _normal(1, (4, 128, 256))
  return lhs, rhs, jnp.array([100, 0, 250, 162], jnp.int32)


def _ragged_config(rd, bm):
  # The kernel reads the cluster axis in every configuration: it only
  # traces with collective=True (2-block clusters), as its benchmark runs it.
  return rd.TuningConfig(tile_m=128, tile_n=64, tile_k=64, max_concurrent_steps=2,
                         collective=True, grid_tile_width=1,
                         grid_minor_dim=bm.MatmulDimension.N, epilogue_tile_n=64)


def test_blackwell_ragged_dot(blackwell_kernels):
  rd, bm = blackwell_kernels["ragged"], blackwell_kernels["matmul"]
  lhs, rhs, sizes = _ragged_inputs()
  out = _run(rd.ragged_dot_kernel, lhs, rhs, sizes, _ragged_config(rd, bm))
  want = rd.ragged_dot_reference(lhs, rhs, sizes)
  _assert_f16_close(out, want)


def test_blackwell_ragged_dot_race_is_reported(blackwell_kernels):
  """Unlike the matmul (whose ``store_done_barrier`` is a ClusterBarrier when
  collective), the ragged dot's leader reuses an accumulator slot after its
  *own* block's epilogue released it, while the other block's epilogue may
  still be loading its half from TMEM: nothing orders the two."""
  rd, bm = blackwell_kernels["ragged"], blackwell_kernels["matmul"]
  with pytest.raises(pallas_np.RaceError, match=r"an MMA .* issued by warp 1 of warpgroup 0 "
                     r"of block \(0, 0\) writes .* an async_load_tmem issued by warpgroup 1 "
                     r"of block \(0, 1\) read"):
    _run(rd.ragged_dot_kernel, *_ragged_inputs(), _ragged_config(rd, bm), params=RACES)
