"""Helpers of the Mosaic GPU (plgpu) tests: JAX's GPU interpret mode as the
oracle, and stubs for the hardware queries JAX's kernels make at trace time
(number of SMs, CUDA runtime version) that have no answer on a CPU."""
from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

from jax._src import config as jax_config  # noqa: E402
from jax._src.pallas.mosaic_gpu.interpret import params as gpu_interpret_params  # noqa: E402

import pallas_np  # noqa: E402
from pallas_np import blas  # noqa: E402


@contextlib.contextmanager
def gpu_interpret(**options):
  """JAX's GPU interpret mode (``InterpretGPUParams(**options)``, those
  options this JAX has), forced as ``plgpu.force_gpu_interpret_mode`` does
  (JAX 0.10 does not export it). Its MMAs are ``np.matmul``s, whose sums
  depend on OpenBLAS's thread count: they run on one BLAS thread, as numpy
  mode's do (``pallas_np.blas.kernel_run``), so results compare bit for bit."""
  cls = gpu_interpret_params.InterpretGPUParams
  known = {f.name for f in dataclasses.fields(cls)}
  cfg = jax_config.pallas_tpu_interpret_mode_context_manager
  prev = cfg.swap_local(cls(**{k: v for k, v in options.items() if k in known}))
  try:
    with blas.kernel_run():
      yield
  finally:
    cfg.set_local(prev)


def both(fn, *args):
  """(numpy-mode result, GPU-interpret-mode result) of ``fn(*args)``."""
  with pallas_np.force_numpy_interpret():
    ours = fn(*args)
  with gpu_interpret():
    theirs = fn(*args)
  return ours, theirs


class _Device:
  core_count = 2  # SMs: the persistent kernels loop over 2 blocks


class _Backend:
  @staticmethod
  def get_default_device():
    return _Device()


class _CudaVersions:
  @staticmethod
  def cuda_runtime_get_version():
    return 12100  # past the ptxas bug the causal attention kernel checks for


class _JaxWithDevice:
  """``jax`` for a kernel module, but ``jax.devices()`` answers a GPU's SM
  count (without changing ``jax.devices`` for anybody else)."""

  def __getattr__(self, name):
    return getattr(jax, name)

  @staticmethod
  def devices():
    return [_Device()]

  @staticmethod
  def local_devices():
    return [_Device()]


@pytest.fixture
def gpu_kernels(monkeypatch):
  """JAX's Mosaic GPU kernels with their hardware queries stubbed."""
  from jax.experimental.pallas.ops.gpu import (attention_mgpu, hopper_matmul_mgpu,
                                               hopper_mixed_type_matmul_mgpu, ragged_dot_mgpu,
                                               transposed_ragged_dot_mgpu)
  monkeypatch.setattr(hopper_matmul_mgpu, "get_num_sms", lambda: 2)
  monkeypatch.setattr(hopper_mixed_type_matmul_mgpu, "backend", _Backend)
  monkeypatch.setattr(attention_mgpu, "cuda_versions", _CudaVersions)
  monkeypatch.setattr(transposed_ragged_dot_mgpu, "jax", _JaxWithDevice())
  return dict(attention=attention_mgpu, matmul=hopper_matmul_mgpu,
              mixed=hopper_mixed_type_matmul_mgpu, ragged=ragged_dot_mgpu,
              transposed_ragged=transposed_ragged_dot_mgpu)


@pytest.fixture
def blackwell_kernels(monkeypatch):
  """JAX's Blackwell kernels (``blackwell_matmul_mgpu``,
  ``blackwell_ragged_dot_mgpu``), the SM count query stubbed."""
  from jax.experimental.pallas.ops.gpu import blackwell_matmul_mgpu, blackwell_ragged_dot_mgpu
  monkeypatch.setattr(blackwell_ragged_dot_mgpu, "jax", _JaxWithDevice())
  return dict(matmul=blackwell_matmul_mgpu, ragged=blackwell_ragged_dot_mgpu)


def assert_close(got, want, *, atol, rtol=0.0):
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=atol, rtol=rtol)


def producer_consumer(*, consumer_waits=True, release_early=False, steps=4, slots=2):
  """A warp-specialised pipeline: warpgroup 0 copies x's row blocks into
  ``slots`` SMEM slots, warpgroup 1 writes 3 * each. ``consumer_waits=False``
  and ``release_early=True`` remove an ordering edge (the race tests)."""
  blk = 64

  def body(x_ref, o_ref):
    def scoped(smem, full, free):
      wg = jax.lax.axis_index("wg")

      @pl.when(wg == 0)
      def _producer():
        @pl.loop(0, steps)
        def _(i):
          slot = i % slots
          @pl.when(i >= slots)
          def _():
            plgpu.barrier_wait(free.at[slot])
          plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(i * blk, blk)], smem.at[slot], full.at[slot])

      @pl.when(wg == 1)
      def _consumer():
        @pl.loop(0, steps)
        def _(i):
          slot = i % slots
          if consumer_waits:
            plgpu.barrier_wait(full.at[slot])

          def release():
            @pl.when(i + slots < steps)
            def _():
              plgpu.barrier_arrive(free.at[slot])
          if release_early:  # the bug: the slot is handed back before it is read
            release()
          o_ref[pl.ds(i * blk, blk)] = smem[slot] * 3.0
          if not release_early:
            release()
    pl.run_scoped(scoped, plgpu.SMEM((slots, blk, 128), jnp.float32),
                  plgpu.Barrier(num_arrivals=1, num_barriers=slots),
                  plgpu.Barrier(num_arrivals=1, num_barriers=slots),
                  collective_axes="wg")
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((steps * blk, 128), jnp.float32),
                      num_threads=2, thread_name="wg")
