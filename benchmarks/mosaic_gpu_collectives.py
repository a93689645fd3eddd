"""JAX's multi-device Mosaic GPU kernels (``pallas.ops.gpu``: all_gather_mgpu,
reduce_scatter_mgpu, collective_matmul_mgpu) on host devices: numpy mode,
cold and warm, against the oracles that exist.

    python benchmarks/mosaic_gpu_collectives.py                 # 2 and 4 devices
    python benchmarks/mosaic_gpu_collectives.py --devices 4 --kernels collective_matmul --warm 5

JAX's GPU interpret mode (``InterpretGPUParams``) cannot run any of these
kernels (``NotImplementedError`` on their semaphores; each run here records
its error), so there is no direct ratio. Next to numpy mode each row shows:

* ``lax``: the jax.lax reference (XLA on the host devices), the result check;
* ``gpu-proxy`` (collective matmul only): GPU interpret mode running JAX's
  Hopper matmul kernel (the collective matmul's body, without its sends) on
  one device over the work all the devices do together (the all-gathered
  LHS times the whole RHS): a lower bound of what GPU interpret mode would
  take to simulate the N devices, had it semaphores.

Every (devices, kernel, mode) runs in a fresh process under
``--xla_force_host_platform_device_count=N``: *cold* is the first call
(tracing, lowering, XLA compile, running; imports excluded), *warm* the
median of the next ``--warm`` calls. Kernels: tests/mgpu_device_kernels.py
(2 SMs for all-gather/reduce-scatter, 1 for the collective matmul).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNELS = ("all_gather", "reduce_scatter", "collective_matmul")
MODES = ("numpy", "gpu", "lax", "gpu-proxy")


def worker(kernel: str, mode: str, warm: int, rows: int) -> dict:
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax

  sys.path.insert(0, str(ROOT))
  import pallas_np
  from tests import mgpu_device_kernels as k
  from tests.mgpu_helpers import gpu_interpret

  n = jax.device_count()
  P = k.P
  if kernel == "all_gather":
    args = (k.data((n * rows, 1024), jnp.float32, 0),)
    f = k.all_gather
    ref = k.shmap(lambda v: lax.all_gather(v, "x", axis=0, tiled=True))
  elif kernel == "reduce_scatter":
    args = (k.data((n * n * rows, 1024), jnp.float32, 1),)
    f = k.reduce_scatter
    ref = k.shmap(lambda v: lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True))
  else:
    m_shard, kk, n_shard = 8 * rows, 256, 128
    a, b = k.data((n * m_shard, kk), jnp.float16, 4), k.data((kk, n * n_shard), jnp.float16, 5)
    args = (a, b)
    f = functools.partial(k.collective_matmul, dtype=jnp.float16)
    ref = k.shmap(lambda u, v: (lax.all_gather(u, "x", axis=0, tiled=True) @ v),
                  in_specs=(P("x", None), P(None, "x")), out_specs=P(None, "x"))
    if mode == "gpu-proxy":  # the devices' work together: (n * m_shard, k) @ (k, n * n_shard)
      from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
      hm.get_num_sms = lambda: 1
      f = jax.jit(lambda u, v: hm.matmul(u, v, None, k.CONFIG))
  if mode == "lax":
    run = lambda: ref(*args)  # noqa: E731
  elif mode == "numpy":
    def run():
      with pallas_np.force_numpy_interpret():
        return f(*args)
  else:
    def run():
      with gpu_interpret():
        return f(*args)
  t0 = time.perf_counter()
  try:
    out = jax.block_until_ready(run())
  except Exception as e:  # noqa: BLE001 - GPU interpret mode cannot run these
    last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
    return {"error": f"{type(e).__name__}: {last[:160]}"}
  cold = time.perf_counter() - t0
  times = []
  for _ in range(warm):
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - t0)
  want = np.asarray(ref(*args), np.float32)
  got = np.asarray(out, np.float32)
  ok = bool(np.allclose(got, want, rtol=2e-2, atol=2e-2 * float(np.abs(want).max())))
  return {"cold": cold, "warm": statistics.median(times), "ok": ok}


def run_one(devices: int, kernel: str, mode: str, warm: int, rows: int) -> dict:
  if mode == "gpu-proxy" and kernel != "collective_matmul":
    return {"error": "n/a"}
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  cmd = [sys.executable, __file__, "--worker", kernel, mode, str(warm), str(rows)]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
  if proc.returncode:
    return {"error": proc.stderr[-300:]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _cell(r) -> str:
  if "error" in r:
    return r["error"] if r["error"] == "n/a" else "fails"
  return f"{r['cold']:.2f} / {r['warm'] * 1e3:.1f}" + ("" if r["ok"] else " (WRONG)")


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--worker":
    print(json.dumps(worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))
    return
  ap = argparse.ArgumentParser()
  ap.add_argument("--devices", default="2,4")
  ap.add_argument("--kernels", default=",".join(KERNELS))
  ap.add_argument("--warm", type=int, default=5)
  ap.add_argument("--rows", type=int, default=8, help="rows per device shard (x8 for the matmul)")
  a = ap.parse_args()
  print("cells: cold s / warm ms")
  print("| devices | kernel | numpy | GPU interpret | lax (XLA) | GPU interpret proxy | "
        "proxy warm / numpy warm |")
  print("|---|---|---|---|---|---|---|")
  errors = []
  for devices in map(int, a.devices.split(",")):
    for kernel in a.kernels.split(","):
      r = {m: run_one(devices, kernel, m, a.warm, a.rows) for m in MODES}
      ratio = ""
      if "error" not in r["numpy"] and "error" not in r["gpu-proxy"]:
        ratio = f"{r['gpu-proxy']['warm'] / r['numpy']['warm']:.1f}x"
      print(f"| {devices} | {kernel} | " + " | ".join(_cell(r[m]) for m in MODES) +
            f" | {ratio} |", flush=True)
      errors += [f"{devices} {kernel} {m}: {v['error']}" for m, v in r.items()
                 if "error" in v and v["error"] != "n/a"]
  for e in errors:
    print("  " + e.replace("\n", " "))


if __name__ == "__main__":
  main()
