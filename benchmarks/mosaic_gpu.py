"""JAX's Mosaic GPU kernels (jax.experimental.pallas.ops.gpu.*_mgpu) on a CPU:
numpy mode vs JAX's GPU interpret mode (``InterpretGPUParams``), cold and warm.

    python benchmarks/mosaic_gpu.py                      # every kernel, both modes
    python benchmarks/mosaic_gpu.py --kernels matmul,attention --warm 5
    python benchmarks/mosaic_gpu.py --modes numpy,races   # detect_races's cost

Every (kernel, mode) runs in a fresh process. *cold* is the first call
(tracing, compiling, running; imports excluded), *warm* the median of the
following calls. The kernels are called as a user would, unmodified, under a
scope that routes every Mosaic GPU kernel to one interpreter:
``pallas_np.force_numpy_interpret()`` or JAX's GPU interpret mode. Their
trace-time hardware queries (SM count, CUDA version) are stubbed (2 SMs).
Each result is checked against the kernel's reference function (max abs
difference). A run past ``--timeout`` seconds is reported as TIMEOUT (JAX
0.10's GPU interpret mode hung on the mixed-type matmul). Target: warm numpy
>= 10x faster than GPU interpret mode.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = ("numpy", "gpu")  # also "races": numpy mode with detect_races=True


def _normal(seed, shape, dtype):
  import jax
  import jax.numpy as jnp
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _stub_hardware():
  import jax
  from jax.experimental.pallas.ops.gpu import (attention_mgpu, hopper_matmul_mgpu,
                                               hopper_mixed_type_matmul_mgpu,
                                               transposed_ragged_dot_mgpu)

  class Device:
    core_count = 2

  class Backend:
    get_default_device = staticmethod(lambda: Device())

  class Cuda:
    cuda_runtime_get_version = staticmethod(lambda: 12100)

  class Jax:
    def __getattr__(self, name):
      return getattr(jax, name)
    devices = staticmethod(lambda: [Device()])
    local_devices = staticmethod(lambda: [Device()])
  hopper_matmul_mgpu.get_num_sms = lambda: 2
  hopper_mixed_type_matmul_mgpu.backend = Backend
  attention_mgpu.cuda_versions = Cuda
  transposed_ragged_dot_mgpu.jax = Jax()
  from jax.experimental.pallas.ops.gpu import blackwell_ragged_dot_mgpu
  blackwell_ragged_dot_mgpu.jax = Jax()


# -- cases: name -> () -> (fn, args, reference) ------------------------------------
def case_matmul():
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
  a, b = _normal(0, (512, 256), jnp.float16), _normal(1, (256, 512), jnp.float16)
  cfg = hm.TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)
  ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
  return (lambda a, b: hm.matmul(a, b, None, cfg)), (a, b), ref


def case_mixed_matmul():
  import jax
  import jax.numpy as jnp
  from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mm
  a = jax.random.randint(jax.random.key(0), (256, 256), -128, 127, jnp.int8)
  b = _normal(1, (256, 512), jnp.bfloat16)
  cfg = mm.TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)
  return ((lambda a, b: mm.mixed_matmul_kernel(a, b, out_dtype=jnp.bfloat16, config=cfg)),
          (a, b), mm.reference(a, b, out_dtype=jnp.bfloat16))


def _qkv():
  import jax.numpy as jnp
  return tuple(_normal(i, (1, 256, 2, 64), jnp.float16) for i in range(3))


def case_attention():
  from jax.experimental.pallas.ops.gpu import attention_mgpu as am
  cfg = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=True)
  q, k, v = _qkv()
  return ((lambda q, k, v: am.attention(q, k, v, cfg)), (q, k, v),
          am.attention_reference(q, k, v, causal=True))


def case_attention_bwd():
  import jax
  import jax.numpy as jnp
  from jax.experimental.pallas.ops.gpu import attention_mgpu as am
  cfg = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, block_q_dkv=64,
                        block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)

  def grads(attn):
    loss = lambda q, k, v: (attn(q, k, v).astype(jnp.float32) ** 2).sum()
    return jax.grad(loss, argnums=(0, 1, 2))
  q, k, v = _qkv()
  return (grads(lambda q, k, v: am.attention(q, k, v, cfg)), (q, k, v),
          grads(am.attention_reference)(q, k, v))


def _groups():
  import jax.numpy as jnp
  return jnp.array([128, 0, 200, 184], jnp.int32)


def case_ragged_dot():
  import jax
  import jax.numpy as jnp
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rd
  lhs, rhs, gs = _normal(0, (512, 256), jnp.float16), _normal(1, (4, 256, 256), jnp.float16), _groups()
  fn = lambda lhs, rhs: rd.ragged_dot(lhs, rhs, group_sizes=gs, block_m=64, block_n=64,
                                      block_k=64, max_concurrent_steps=2, grid_block_n=1)
  return fn, (lhs, rhs), jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32)


def case_transposed_ragged_dot():
  import jax.numpy as jnp
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as trd
  lhs, rhs, gs = _normal(0, (512, 256), jnp.float16), _normal(1, (512, 256), jnp.float16), _groups()
  fn = lambda lhs, rhs: trd.transposed_ragged_dot(lhs, rhs, group_sizes=gs, block_m=64,
                                                  block_n=64, block_k=64,
                                                  max_concurrent_steps=2, grid_block_n=1)
  return fn, (lhs, rhs), trd.ref_transposed_ragged_dot(lhs, rhs, gs)


def case_tcgen05_matmul():
  """A Blackwell-style matmul written for this benchmark (before JAX's own
  blackwell_matmul_mgpu ran in numpy mode, below): per
  128x128 output tile, a K loop of TMA copies into 2 SMEM slots and
  tcgen05_mma into TMEM, completion through tcgen05_commit_arrive."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  m, k, n, tile, tk, slots = 512, 256, 512, 128, 64, 2
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def body(a_ref, b_ref, o_ref):
    mi, ni = jax.lax.axis_index("m"), jax.lax.axis_index("n")

    def scoped(a_smem, b_smem, acc, loaded, consumed, done):
      def load(ki):
        slot = ki % slots
        plgpu.copy_gmem_to_smem(a_ref.at[pl.ds(mi * tile, tile), pl.ds(ki * tk, tk)],
                                a_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(b_ref.at[pl.ds(ki * tk, tk), pl.ds(ni * tile, tile)],
                                b_smem.at[slot], loaded.at[slot])
      for ki in range(slots):
        load(ki)

      @pl.loop(0, k // tk)
      def _(ki):
        slot = ki % slots
        plgpu.barrier_wait(loaded.at[slot])
        plgpu.tcgen05_mma(acc, a_smem.at[slot], b_smem.at[slot], consumed.at[slot],
                          accumulate=ki > 0)

        @pl.when(ki + slots < k // tk)
        def _():
          plgpu.barrier_wait(consumed.at[slot])
          load(ki + slots)
      plgpu.tcgen05_commit_arrive(done)
      plgpu.barrier_wait(done)
      o_ref[pl.ds(mi * tile, tile), pl.ds(ni * tile, tile)] = (
          plgpu.async_load_tmem(acc).astype(o_ref.dtype))
      plgpu.wait_load_tmem()
    pl.run_scoped(scoped, plgpu.SMEM((slots, tile, tk), jnp.float16, transforms=tiled),
                  plgpu.SMEM((slots, tk, tile), jnp.float16, transforms=tiled),
                  plgpu.TMEM((tile, tile), jnp.float32),
                  plgpu.Barrier(num_arrivals=2, num_barriers=slots),
                  plgpu.Barrier(num_arrivals=1, num_barriers=slots, orders_tensor_core=True),
                  plgpu.Barrier(num_arrivals=1, orders_tensor_core=True))
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
                   grid=(m // tile, n // tile), grid_names=("m", "n"))
  a, b = _normal(0, (m, k), jnp.float16), _normal(1, (k, n), jnp.float16)
  return f, (a, b), np.asarray(a, np.float32) @ np.asarray(b, np.float32)


def _blackwell_matmul(collective):
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental.pallas.ops.gpu import blackwell_matmul_mgpu as bm
  a, b = _normal(0, (512, 256), jnp.float16), _normal(1, (256, 512), jnp.float16)
  cfg = bm.TuningConfig(tile_m=128, tile_n=64 if collective else 128, tile_k=64,
                        max_concurrent_steps=2, collective=collective, epilogue_tile_n=64)
  ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
  return (lambda a, b: bm.matmul_kernel(a, b, cfg)), (a, b), ref


def case_blackwell_matmul():
  """JAX's blackwell_matmul_mgpu: warp_map, dynamic_scheduling_loop, TMEM."""
  return _blackwell_matmul(False)


def case_blackwell_matmul_2cta():
  """The same with collective=True: 2-block clusters, partitioned TMA
  copies, 2-block tcgen05_mma (GPU interpret mode has none of these)."""
  return _blackwell_matmul(True)


def case_blackwell_ragged_dot():
  """JAX's blackwell_ragged_dot_mgpu (it only traces with collective=True)."""
  import jax.numpy as jnp
  from jax.experimental.pallas.ops.gpu import blackwell_matmul_mgpu as bm
  from jax.experimental.pallas.ops.gpu import blackwell_ragged_dot_mgpu as rd
  lhs, rhs, gs = _normal(0, (512, 256), jnp.float16), _normal(1, (4, 256, 256), jnp.float16), _groups()
  cfg = rd.TuningConfig(tile_m=128, tile_n=64, tile_k=64, max_concurrent_steps=2,
                        collective=True, grid_tile_width=1, grid_minor_dim=bm.MatmulDimension.N,
                        epilogue_tile_n=64)
  return ((lambda lhs, rhs: rd.ragged_dot_kernel(lhs, rhs, gs, cfg)), (lhs, rhs),
          rd.ragged_dot_reference(lhs, rhs, gs))


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


# -- one (kernel, mode) in this process ----------------------------------------------
def _scope(mode):
  import pallas_np
  if mode == "numpy":
    return pallas_np.force_numpy_interpret()
  if mode == "races":
    return pallas_np.force_numpy_interpret(pallas_np.InterpretParams(detect_races=True))
  import dataclasses

  from jax._src import config
  from jax._src.pallas.mosaic_gpu.interpret import params
  # JAX 0.12: skip inline_mgpu's PTX fences (dynamic_scheduling_loop) as we do.
  options = {"inline_mgpu": "ignore"} if "inline_mgpu" in {
      f.name for f in dataclasses.fields(params.InterpretGPUParams)} else {}

  class Gpu:
    def __enter__(self):
      self.prev = config.pallas_tpu_interpret_mode_context_manager.swap_local(
          params.InterpretGPUParams(**options))

    def __exit__(self, *exc):
      config.pallas_tpu_interpret_mode_context_manager.set_local(self.prev)
  return Gpu()


def run_one(kernel, mode, warm):
  import jax
  import numpy as np
  _stub_hardware()
  fn, args, ref = CASES[kernel]()
  jitted = jax.jit(fn)
  with _scope(mode):
    t0 = time.perf_counter()
    out = jax.block_until_ready(jitted(*args))
    cold = time.perf_counter() - t0
    times = []
    for _ in range(warm):
      t0 = time.perf_counter()
      jax.block_until_ready(jitted(*args))
      times.append(time.perf_counter() - t0)
  err = max(float(np.abs(np.asarray(o, np.float32) - np.asarray(r, np.float32)).max())
            for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
  return {"cold": cold, "warm": statistics.median(times), "err": err}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--kernels", default=",".join(CASES))
  ap.add_argument("--modes", default=",".join(MODES))
  ap.add_argument("--warm", type=int, default=3)
  ap.add_argument("--timeout", type=float, default=300, help="seconds per (kernel, mode) run")
  ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
  ns = ap.parse_args()
  if ns.one:
    print(json.dumps(run_one(ns.one[0], ns.one[1], ns.warm)))
    return
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu")
  print(f"{'kernel':26} {'mode':6} {'cold s':>8} {'warm s':>8} {'max err':>9}")
  rows = {}
  for kernel in ns.kernels.split(","):
    for mode in ns.modes.split(","):
      try:
        proc = subprocess.run([sys.executable, __file__, "--one", kernel, mode, "--warm",
                               str(ns.warm)], capture_output=True, text=True, env=env,
                              timeout=ns.timeout)
      except subprocess.TimeoutExpired:
        print(f"{kernel:26} {mode:6} TIMEOUT after {ns.timeout} s")
        continue
      if proc.returncode:
        errs = [ln for ln in proc.stderr.splitlines()
                if "Error" in ln and not ln.startswith((" ", "For simplicity"))]
        print(f"{kernel:26} {mode:6} FAILED: {(errs or ['?'])[-1][:110]}")
        continue
      r = rows[(kernel, mode)] = json.loads(proc.stdout.strip().splitlines()[-1])
      print(f"{kernel:26} {mode:6} {r['cold']:8.3f} {r['warm']:8.4f} {r['err']:9.2e}")
  print("\nratios GPU interpret / numpy (higher is better for numpy mode):")
  for kernel in ns.kernels.split(","):
    a, b = rows.get((kernel, "numpy")), rows.get((kernel, "gpu"))
    if a and b:
      print(f"  {kernel:26} cold {b['cold'] / a['cold']:6.1f}x   warm {b['warm'] / a['warm']:6.1f}x")


if __name__ == "__main__":
  main()
