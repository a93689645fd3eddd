"""Modern TPU kernels on a CPU (issue 30): numpy mode vs TPU interpret mode
(``pltpu.InterpretParams()``), cold and warm.

    python benchmarks/mesh_kernels.py                   # every case, both modes
    python benchmarks/mesh_kernels.py --cases megacore --modes numpy --warm 20

Cases:

* ``gmm``       megablox grouped matmul with dynamic group sizes (pallas_call,
                scalar-prefetched group offsets), 512x256 @ 4x256x256;
* ``megacore``  a pl.kernel over a 2-TensorCore mesh: each core pipelines its
                half of a 1024x512 array through VMEM (emit_pipeline), then a
                core barrier;
* ``sc_gather`` a SparseCore kernel over 2x4 vector subcores: indexed-DMA row
                gather (table.at[idx_vmem]), a scale in VMEM, an indexed-DMA
                scatter back (out.at[idx_vmem]);
* ``sc_sort``   SparseCore vector ops over 2x4 vector subcores: each subcore
                runs a parallel_loop over 8 vectors of 8 lanes: sort_key_val,
                scan_count, a masked cumsum and a compressed store.

Every (case, mode) runs in a fresh process. *cold* is the first call (trace,
compile, run; imports excluded), *warm* the median of the following calls,
both under ``jax.jit`` (numpy mode: ``interpret="numpy"`` kernels, run whole
by the NumPy evaluator). A mode that fails reports its error. Each result is
checked against numpy mode's (max abs difference).
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
MODES = ("numpy", "tpu")


def _interp(mode):
  from jax.experimental.pallas import tpu as pltpu
  return "numpy" if mode == "numpy" else pltpu.InterpretParams()


def case_gmm(mode):
  import jax
  import jax.numpy as jnp
  import pallas_np
  import importlib
  gmm_mod = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
  lhs = jax.random.normal(jax.random.key(0), (512, 256), jnp.float32)
  rhs = jax.random.normal(jax.random.key(1), (4, 256, 256), jnp.float32)
  sizes = jnp.array([100, 156, 128, 128], jnp.int32)
  jitted = jax.jit(lambda l, r, g: gmm_mod.gmm(l, r, g, tiling=(128, 128, 128)))

  def fn(*args):  # gmm has no interpret= for params: route it with a force scope
    from jax.experimental.pallas import tpu as pltpu
    scope = pallas_np.force_numpy_interpret() if mode == "numpy" else \
        pltpu.force_tpu_interpret_mode(pltpu.InterpretParams())
    with scope:
      return jitted(*args)
  return fn, (lhs, rhs, sizes)


def case_megacore(mode):
  import jax
  import jax.numpy as jnp
  import pallas_np
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  pallas_np.assume_tpu_chip("v5e")
  mesh = pltpu.create_tensorcore_mesh("core", num_cores=2)
  x = jax.random.normal(jax.random.key(0), (1024, 512), jnp.float32)

  def body(x_hbm, o_hbm, sem):
    core = jax.lax.axis_index("core")

    def inner(x_ref, o_ref):
      o_ref[...] = jnp.tanh(x_ref[...]) * 2.0 + core.astype(jnp.float32)
    pltpu.emit_pipeline(
        inner, grid=(4, 4),
        in_specs=[pl.BlockSpec((128, 128), lambda i, j: (core * 4 + i, j))],
        out_specs=[pl.BlockSpec((128, 128), lambda i, j: (core * 4 + i, j))])(x_hbm, o_hbm)
    pltpu.core_barrier(sem, core_axis_name="core")
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh,
                scratch_types=[pltpu.SemaphoreType.REGULAR], interpret=_interp(mode))
  return jax.jit(k), (x,)


def case_sc_gather(mode):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import pallas_np
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  from jax.experimental.pallas import tpu_sc as plsc
  pallas_np.assume_tpu_chip("v5p")
  nc, ns, rows = 2, 4, 16
  mesh = plsc.VectorSubcoreMesh(core_axis_name="core", subcore_axis_name="subcore",
                                num_cores=nc, num_subcores=ns)
  n = nc * ns * rows
  table = jax.random.normal(jax.random.key(0), (4 * n, 128), jnp.float32)
  idx = jnp.array(np.random.RandomState(0).permutation(4 * n)[:n], jnp.int32)

  def body(t_hbm, i_hbm, o_hbm, idx_v, buf):
    w = jax.lax.axis_index("core") * ns + jax.lax.axis_index("subcore")
    pltpu.sync_copy(i_hbm.at[pl.ds(w * rows, rows)], idx_v)
    pltpu.sync_copy(t_hbm.at[idx_v], buf)          # gather rows
    buf[...] = buf[...] * 0.5
    pltpu.sync_copy(buf, o_hbm.at[idx_v])          # scatter them back
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct(table.shape, table.dtype), mesh=mesh,
                scratch_types=[pltpu.VMEM((rows,), jnp.int32),
                               pltpu.VMEM((rows, 128), jnp.float32)],
                interpret=_interp(mode))
  # rows not gathered stay uninitialized (NaN): compare the scattered rows only
  return jax.jit(lambda t, i: k(t, i)[i]), (table, idx)


def case_sc_sort(mode):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import pallas_np
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  from jax.experimental.pallas import tpu_sc as plsc
  pallas_np.assume_tpu_chip("v5p")
  nc, ns, lanes, vectors = 2, 4, 8, 8
  mesh = plsc.VectorSubcoreMesh(core_axis_name="core", subcore_axis_name="subcore",
                                num_cores=nc, num_subcores=ns)
  n = lanes * vectors
  keys = jnp.array(np.random.RandomState(0).randint(0, 6, size=(nc * ns, n)), jnp.int32)

  def body(k_hbm, o_hbm, k_v, o_v):
    w = jax.lax.axis_index("core") * ns + jax.lax.axis_index("subcore")
    pltpu.sync_copy(k_hbm.at[w], k_v)
    o_v[...] = jnp.zeros_like(o_v)

    @plsc.parallel_loop(0, n, lanes)
    def _(i):
      sk, sv = plsc.sort_key_val(k_v[pl.ds(i, lanes)], jnp.arange(lanes, dtype=jnp.int32))
      counts, last = plsc.scan_count(sk)
      sums = plsc.cumsum(counts, mask=last)
      plsc.store_compressed(o_v.at[pl.ds(i, lanes)], sums + sv, mask=last)
    pltpu.sync_copy(o_v, o_hbm.at[w])
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct(keys.shape, jnp.int32), mesh=mesh,
                scratch_types=[pltpu.VMEM((n,), jnp.int32), pltpu.VMEM((n,), jnp.int32)],
                interpret=_interp(mode))
  return jax.jit(k), (keys,)


CASES = {"gmm": case_gmm, "megacore": case_megacore, "sc_gather": case_sc_gather,
         "sc_sort": case_sc_sort}


def run_one(case, mode, warm):
  """In a fresh process: cold/warm times and the result (as a list)."""
  import jax
  import numpy as np
  fn, args = CASES[case](mode)
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  cold = time.perf_counter() - t0
  times = []
  for _ in range(warm):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return {"cold": cold, "warm": statistics.median(times) if times else None,
          "out": np.asarray(out, np.float64).ravel()[:4096].tolist()}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--cases", default=",".join(CASES))
  ap.add_argument("--modes", default=",".join(MODES))
  ap.add_argument("--warm", type=int, default=5)
  ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.child:
    try:
      print(json.dumps(run_one(a.child[0], a.child[1], a.warm)))
    except Exception as e:  # noqa: BLE001 (reported by the parent)
      msg = (str(e).strip().splitlines() or [""])[0][:160]
      print(json.dumps({"error": f"{type(e).__name__}: {msg}"}))
    return
  import numpy as np
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  print(f"{'case':10} {'mode':6} {'cold s':>8} {'warm ms':>9} {'max|diff|':>10}  note")
  for case in a.cases.split(","):
    results = {}
    for mode in a.modes.split(","):
      p = subprocess.run([sys.executable, __file__, "--child", case, mode, "--warm",
                          str(a.warm)], capture_output=True, text=True, env=env, timeout=1800)
      lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
      results[mode] = json.loads(lines[-1]) if lines else {
          "error": (p.stderr.strip().splitlines() or ["no output"])[-1][:160]}
    base = results.get("numpy", {})
    for mode, r in results.items():
      if "error" in r:
        print(f"{case:10} {mode:6} {'-':>8} {'-':>9} {'-':>10}  {r['error']}")
        continue
      diff = "-"
      if mode != "numpy" and "out" in base:
        diff = f"{np.nanmax(np.abs(np.array(r['out']) - np.array(base['out']))):.1e}"
      ratio = ""
      if mode != "numpy" and base.get("warm") and r.get("warm"):
        ratio = f"warm {r['warm'] / base['warm']:.1f}x, cold {r['cold'] / base['cold']:.1f}x " \
                "slower than numpy"
      warm = f"{r['warm'] * 1e3:.2f}" if r.get("warm") else "-"
      print(f"{case:10} {mode:6} {r['cold']:8.2f} {warm:>9} {diff:>10}  {ratio}")


if __name__ == "__main__":
  main()
