"""Multi-device kernels (issue 31): jax.lax.axis_index, remote DMAs and
semaphores, the barrier semaphore, under jax.jit(jax.shard_map) over host
devices. Multi-device cases run tests/multi_device_kernels.py in a
subprocess (XLA_FLAGS must be set before JAX starts) with a hard timeout;
the 1-device mesh runs in-process."""
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import pallas_np

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "multi_device_kernels.py"
DeviceIdType = getattr(pl, "DeviceIdType", None) or pltpu.DeviceIdType


def run_case(case: str, devices: int, timeout=240):
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  env["PALLAS_NP_DEVICE_TIMEOUT"] = "60"  # backstop only; deadlocks raise at once
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, str(SCRIPT), case], env=env, cwd=str(ROOT),
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0 and proc.stdout.rstrip().endswith("done"), (
      proc.stdout[-4000:] + proc.stderr[-8000:])
  return proc.stdout


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_correct_kernels_match_lax_collectives(devices):
  out = run_case("correct", devices)
  assert "ok right_permute vs ppermute" in out
  assert "ok pallas.ops.tpu.all_gather" in out
  assert "ok right_permute twice in one program" in out
  for name in ("all_reduce vs lax.psum", "reduce_scatter vs lax.psum_scatter",
               "all_gather_matmul vs lax.all_gather + matmul"):
    assert out.count("ok " + name) == 2, name


@pytest.mark.parametrize("devices", [2, 4])
def test_remote_dma_futures_across_kernels(devices):
  """A remote copy started in one kernel lands in the peer's output and
  semaphore outputs, which later kernels wait on (JAX's async remote copies);
  it failed with a deadlock (the receiver returned before the copy landed)."""
  out = run_case("futures", devices)
  assert "ok remote DMA futures in a loop" in out


def test_semaphore_input_signalled_by_every_device():
  out = run_case("semaphore_input", 2)
  assert "ok a semaphore input signalled by every device" in out


@pytest.mark.parametrize("devices", [4])
def test_concurrent_calls_from_two_threads_pair_by_call(devices):
  out = run_case("threads", devices)
  assert "ok two threads, one compiled kernel, paired by call" in out


def test_detect_races_across_devices():
  """Unordered remote writes to one element raise RaceError; disjoint writes,
  semaphore-ordered writes and the ring collectives run clean."""
  out = run_case("races", 4)
  assert out.count("raised data race across devices") == 1 + 3  # + 3 rings without handshake
  assert out.count("no race reported") == 5


def test_pmap_and_axis_index_only_kernels():
  out = run_case("pmap", 4)
  assert out.count("ok ") == 3


def test_jax_distributed_two_processes():
  """Two processes on this machine (jax.distributed with a local
  coordinator), 2 CPU devices each: axis_index kernels run over the global
  mesh; remote-DMA kernels raise UnsupportedError (no hang)."""
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = str(s.getsockname()[1])
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu", PALLAS_NP_DEVICE_TIMEOUT="30")
  procs = [subprocess.Popen([sys.executable, str(SCRIPT), "distributed", str(i), port],
                            env=env, cwd=str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=180)
      outs.append((p.returncode, out, err))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for rc, out, err in outs:
    assert rc == 0 and out.rstrip().endswith("done"), out[-2000:] + err[-4000:]
    assert out.count("ok axis_index-only kernel across processes") == 2
    assert "raised spans several processes" in out


def test_matches_tpu_interpret_mode():
  out = run_case("oracle", 4)
  assert "ok all_gather vs TPU interpret mode" in out
  for name in ("all_reduce", "reduce_scatter", "all_gather_matmul"):
    assert f"ok {name} vs TPU interpret mode" in out


@pytest.mark.parametrize("devices", [4, 8])
def test_broken_kernels_raise_never_hang(devices):
  out = run_case("broken", devices)
  assert out.count("raised") == 4 + 9  # 3 broken variants x 3 collectives
  assert "ok right_permute after errors" in out
  assert out.count("after errors") == 4


# -- one device: in-process ---------------------------------------------------------
MESH1 = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("ep",))


def _moe_kernel(x_ref, o_ref):
  # expert parallelism over a 1-device mesh: this device's expert offset
  expert = jax.lax.axis_index("ep")
  o_ref[...] = x_ref[...] + (expert * 100 + pl.program_id(0)).astype(jnp.float32)


def _moe(x):
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  return pl.pallas_call(_moe_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(2,), in_specs=[spec], out_specs=spec, interpret="numpy")(x)


def test_axis_index_one_device_mesh():
  x = jnp.ones((16, 128), jnp.float32)
  f = jax.shard_map(_moe, mesh=MESH1, in_specs=P("ep"), out_specs=P("ep"), check_vma=False)
  want = np.concatenate([np.full((8, 128), 1.0), np.full((8, 128), 2.0)]).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), want)
  np.testing.assert_array_equal(np.asarray(f(x)), want)  # eager shard_map


def test_remote_copy_to_self_one_device_mesh():
  def kernel(x_ref, o_ref, send, recv):
    me = jax.lax.axis_index("ep")
    barrier = pltpu.get_barrier_semaphore()
    pl.semaphore_signal(barrier, device_id=(me,), device_id_type=DeviceIdType.MESH)
    pl.semaphore_wait(barrier, 1)
    copy = pltpu.make_async_remote_copy(x_ref, o_ref, send, recv, device_id=(me,),
                                        device_id_type=DeviceIdType.MESH)
    copy.start()
    copy.wait()

  def call(x):
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0, in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA] * 2)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid_spec=spec, interpret="numpy",
                          compiler_params=pltpu.CompilerParams(collective_id=0))(x)
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  f = jax.jit(jax.shard_map(call, mesh=MESH1, in_specs=P("ep"), out_specs=P("ep"),
                            check_vma=False))
  np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))


def test_one_device_deadlock_raises():
  def kernel(x_ref, o_ref):
    pl.semaphore_wait(pltpu.get_barrier_semaphore(), 1)  # nobody signals
    o_ref[...] = x_ref[...]

  def call(x):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret="numpy")(x)
  f = jax.jit(jax.shard_map(call, mesh=MESH1, in_specs=P("ep"), out_specs=P("ep"),
                            check_vma=False))
  with pytest.raises(Exception, match="deadlock across devices"):
    jax.block_until_ready(f(jnp.ones((8, 128), jnp.float32)))


def test_axis_index_without_a_device_raises_unsupported():
  """pallas_np.jit evaluates programs itself: a shard_map (no NumPy rule)
  is refused with UnsupportedError, never run with a made-up device id."""
  f = jax.shard_map(_moe, mesh=MESH1, in_specs=P("ep"), out_specs=P("ep"), check_vma=False)
  with pytest.raises(pallas_np.UnsupportedError):
    pallas_np.jit(f)(jnp.ones((16, 128), jnp.float32))


def test_instances_pair_by_call_not_by_arrival():
  """A runtime that interleaves two calls of one kernel (call A's device 0,
  then call B's devices 0 and 1, then A's device 1) must still pair A with
  A: sessions are keyed by the call's ticket. Arrival-order pairing would put
  A's device 0 with B's device 1 (the hole this guards)."""
  import threading
  import time

  from pallas_np import devices
  key = ("test_pairing", object())
  joined, errors = {}, []

  def run(call, dev):
    try:
      me = devices.enter(devices.Placement(key, ("x",), (2,), (dev,), call=call), [])
      joined[(call, dev)] = me.session
      devices.leave(me)
    except BaseException as e:  # noqa: BLE001 (checked below)
      errors.append(e)
  order = [(101, 0), (202, 0), (202, 1), (101, 1)]
  threads = []
  for call, dev in order:
    th = threading.Thread(target=run, args=(call, dev))
    th.start()
    threads.append(th)
    time.sleep(0.05)  # arrive in this order
  for th in threads:
    th.join(timeout=30)
  assert not any(th.is_alive() for th in threads) and not errors, errors
  assert joined[(101, 0)] is joined[(101, 1)]
  assert joined[(202, 0)] is joined[(202, 1)]
  assert joined[(101, 0)] is not joined[(202, 0)]


def test_missing_device_times_out_and_forgets_the_session(monkeypatch):
  """The backstop: a device whose instance never starts makes the others
  raise after PALLAS_NP_DEVICE_TIMEOUT, and the failed session is dropped
  (a later call with the same id meets afresh)."""
  import threading

  from pallas_np import devices
  monkeypatch.setenv("PALLAS_NP_DEVICE_TIMEOUT", "0.3")
  key = ("test_timeout", object())
  with pytest.raises(devices.DeviceError, match=r"devices \[1\] did not start"):
    devices.enter(devices.Placement(key, ("x",), (2,), (0,), call=7), [])
  monkeypatch.setenv("PALLAS_NP_DEVICE_TIMEOUT", "30")
  sessions = {}

  def run(dev):
    me = devices.enter(devices.Placement(key, ("x",), (2,), (dev,), call=7), [])
    sessions[dev] = me.session
    devices.leave(me)
  threads = [threading.Thread(target=run, args=(d,)) for d in range(2)]
  for th in threads:
    th.start()
  for th in threads:
    th.join(timeout=30)
  assert sessions[0] is sessions[1] and sessions[0].failed is None


def test_device_id_dict_keyed_by_an_axis_tuple():
  """``device_id={("x", "y"): i}`` names one logical axis over two mesh axes:
  ``i`` is row-major over them, each coordinate modulo its size (JAX's
  ``_device_id_dict_to_mesh``); it raised UnsupportedError before."""
  from pallas_np import devices as devices_mod
  placement = devices_mod.Placement("k", ("z", "x", "y"), (2, 2, 3), (1, 0, 2))
  me = devices_mod.DeviceContext(placement, [])
  mesh = DeviceIdType.MESH
  for i in range(2 * 3 + 2):  # past the end wraps, as the modulo does on a TPU
    x, y = i // 3 % 2, i % 3
    assert me.target_id({("x", "y"): i}, mesh) == placement.to_logical((1, x, y))
  assert me.target_id({("x", "y"): 4, "z": 0}, mesh) == placement.to_logical((0, 1, 1))
  with pytest.raises(pallas_np.UnsupportedError, match="'w', not a mesh axis"):
    me.target_id({("x", "w"): 1}, mesh)
