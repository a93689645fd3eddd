"""Mosaic GPU (plgpu) kernels across blocks and devices: semaphores
(``pl.semaphore_signal/wait``, ``pl.get_global``, ``device_id``),
``plgpu.remote_ref``, ``multimem_store``/``multimem_load_reduce``,
``semaphore_signal_multicast``, and JAX's all-gather, reduce-scatter and
collective matmul kernels (``pallas.ops.gpu.*_mgpu``).

Multi-device cases run tests/mgpu_device_kernels.py in a subprocess with N
host devices and a hard timeout. JAX's GPU interpret mode cannot run any
semaphore kernel (``NotImplementedError``), so the references are jax.lax
collectives and NumPy references written from the semantics."""
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from tests.mgpu_helpers import plgpu

import pallas_np
from pallas_np.errors import KernelError, UnsupportedError
from tests.test_mosaic_gpu import _run_with_timeout

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "mgpu_device_kernels.py"


def run_case(case: str, devices: int, timeout=300):
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
             PALLAS_NP_DEVICE_TIMEOUT="60", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, str(SCRIPT), case], env=env, cwd=str(ROOT),
                        capture_output=True, text=True, timeout=timeout)
  out = proc.stdout
  assert proc.returncode == 0 and out.rstrip().endswith("done"), out[-4000:] + proc.stderr[-8000:]
  assert "FAILED" not in out, out
  return out


@pytest.mark.parametrize("devices", [2, 4])
def test_jax_collective_kernels_match_lax(devices):
  out = run_case("ops", devices)
  assert out.count("ok all_gather") == 3
  assert out.count("ok reduce_scatter") == 2 + 6
  assert "ok all-reduce" in out
  assert out.count("ok collective_matmul") == 2


@pytest.mark.parametrize("devices", [2, 4])
def test_constructs_across_devices(devices):
  out = run_case("constructs", devices)
  assert out.count("ok remote_ref TMA store") == 2
  assert "ok multimem_store + semaphore_signal_multicast" in out
  assert "ok semaphore_signal_parallel" in out
  assert "ok stores and loads through remote_ref" in out
  assert "ok atomic_add through remote_ref" in out
  assert out.count("ok multimem_load_reduce") == 1 + 3 + 6


def test_wait_never_signalled_across_devices_raises():
  out = run_case("broken", 4)
  assert "raised deadlock" in out
  assert "ok the deadlock names the kernel line and the devices" in out
  assert "ok multimem_store after errors" in out


# -- one device: blocks that wait for each other -------------------------------------
def _blocks_handshake(x, broken=False):
  """Block 1 writes its rows and signals a pl.get_global semaphore; block 0
  waits for it, then copies block 1's rows next to its own. Block 0 runs
  first, so this needs blocks that wait for each other."""
  rows = x.shape[0] // 2

  def body(x_ref, o_ref):
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    b = jax.lax.axis_index("b")

    @pl.when(b == 1)
    def _():
      o_ref[pl.ds(rows, rows)] = x_ref[pl.ds(rows, rows)] + 1.0
      if not broken:
        pl.semaphore_signal(sem)

    @pl.when(b == 0)
    def _():
      pl.semaphore_wait(sem)
      o_ref[pl.ds(0, rows)] = o_ref[pl.ds(rows, rows)] * 2.0
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                      grid_names=("b",))(x)


def _forced(fn, *args, **kw):
  """In the thread ``_run_with_timeout`` starts (the force switch is per thread)."""
  with pallas_np.force_numpy_interpret():
    return jax.block_until_ready(fn(*args, **kw))


@pytest.mark.parametrize("path", ["eager", "jit"])
def test_blocks_wait_for_each_other_through_a_global_semaphore(path):
  x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)
  fn = _blocks_handshake if path == "eager" else jax.jit(_blocks_handshake)
  out = np.asarray(_run_with_timeout(lambda: _forced(fn, x)))
  xs = np.asarray(x)
  want = np.concatenate([(xs[8:] + 1) * 2, xs[8:] + 1])  # NumPy, from the semantics
  np.testing.assert_array_equal(out, want)


def test_wait_between_blocks_never_signalled_raises():
  x = jnp.ones((16, 128), jnp.float32)
  with pytest.raises(KernelError) as info:
    _run_with_timeout(lambda: _forced(_blocks_handshake, x, broken=True))
  msg = str(info.value)
  assert "deadlock" in msg and "semaphore_wait" in msg
  assert "test_mosaic_gpu_devices.py" in msg and "block (0,)" in msg


def test_remote_ref_outside_shard_map():
  """Device 0 is the only device: a remote ref to it is the ref itself; to
  device 1, UnsupportedError."""
  def kernel(x, target):
    def body(x_ref, o_ref, smem, bar):
      plgpu.copy_gmem_to_smem(x_ref, smem, bar)
      plgpu.barrier_wait(bar)
      plgpu.copy_smem_to_gmem(smem, plgpu.remote_ref(o_ref, target))
      plgpu.wait_smem_to_gmem(0)
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        scratch_types=[plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier()])(x)
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  with pallas_np.force_numpy_interpret():
    np.testing.assert_array_equal(np.asarray(kernel(x, 0)), np.asarray(x))
    with pytest.raises((UnsupportedError, KernelError), match="remote_ref to device 1"):
      kernel(x, 1)


def test_multimem_outside_shard_map_is_unsupported():
  def body(x_ref, o_ref):
    plgpu.multimem_store(x_ref[...], o_ref, "x")
  x = jnp.ones((8, 128), jnp.float32)
  with pallas_np.force_numpy_interpret(), pytest.raises((UnsupportedError, KernelError),
                                                        match="multi-device run"):
    plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
