"""JAX's built-in TPU kernels (jax.experimental.pallas.ops.tpu) on a CPU:
numpy mode vs interpret=True vs pltpu.InterpretParams(), cold and warm.

    python benchmarks/tpu_kernels.py                    # every kernel, all modes
    python benchmarks/tpu_kernels.py --kernels flash_fwd,paged --modes numpy,tpu
    python benchmarks/tpu_kernels.py --repeats 3        # medians of 3 fresh processes

Every (kernel, mode) runs in a fresh process. *cold* is the first call
(tracing, compiling — XLA for JAX's interpreters —, running; imports
excluded), *warm* the median of the following calls. The kernels are called
as a user would (under ``jax.jit``), unmodified, under a scope that routes
every pallas_call to one interpreter: ``pallas_np.force_numpy_interpret()``,
JAX's interpret-mode config set to ``True`` (the HLO interpreter), or
``pltpu.force_tpu_interpret_mode()``. In numpy mode the eagerly called jit
then runs whole in the NumPy evaluator, XLA ops around the kernels included
(``InterpretParams.whole_program``): no XLA compilation. Each result is
checked against the numpy-mode result of the same kernel (max abs
difference reported). Mode ``numpy-jit`` calls ``pallas_np.jit(fn)``
instead of ``jax.jit(fn)`` (the same evaluation, explicitly); opt in with
``--modes numpy,numpy-jit``. Mode ``trace`` (opt-in, ``--modes
numpy,interpret,trace``) times JAX's trace of the program alone
(``jax.jit(fn).trace(*args)`` under the numpy force scope) in a fresh
process: the part of every first call that no interpreter can avoid, so
interpret=True's first call / trace is the best first-call ratio any
interpreter starting from JAX's trace could reach (the "floor" column).
Targets: warm numpy >= 10x faster than TPU interpret mode, first call >= 10x
faster than interpret=True.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = ("numpy", "interpret", "tpu")
ALL_MODES = MODES + ("numpy-jit", "trace")  # opt-in (--modes)


# -- cases: name -> () -> (fn, args) at "small laptop" shapes ---------------------
def _normal(seed, shape, dtype=None):
  import jax
  import jax.numpy as jnp
  return jax.random.normal(jax.random.key(seed), shape, dtype or jnp.float32)


def case_example():
  from jax.experimental.pallas.ops.tpu import example_kernel
  return example_kernel.double, (_normal(0, (512, 512)),)


def case_matmul():
  from jax.experimental.pallas.ops.tpu import matmul
  fn = lambda x, y: matmul.matmul(x, y, block_shape=(128, 128))
  return fn, (_normal(0, (512, 512)), _normal(1, (512, 512)))


def _flash_blocks():
  from jax.experimental.pallas.ops.tpu import flash_attention as fa
  return fa.BlockSizes(block_q=128, block_k_major=128, block_k=128, block_b=1,
                       block_q_major_dkv=128, block_k_major_dkv=128, block_k_dkv=128,
                       block_q_dkv=128, block_k_major_dq=128, block_k_dq=128, block_q_dq=128)


def _flash_args():
  B, H, S, D = 1, 4, 512, 128
  return _normal(0, (B, H, S, D)), _normal(1, (B, H, S, D)), _normal(2, (B, H, S, D))


def case_flash_fwd():
  import jax
  from jax.experimental.pallas.ops.tpu import flash_attention as fa
  bs = _flash_blocks()
  fn = jax.jit(lambda q, k, v: fa.flash_attention(q, k, v, causal=True, block_sizes=bs))
  return fn, _flash_args()


def case_flash_bwd():
  import jax
  from jax.experimental.pallas.ops.tpu import flash_attention as fa
  bs = _flash_blocks()
  loss = lambda q, k, v: fa.flash_attention(q, k, v, causal=True, block_sizes=bs).sum()
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), _flash_args()


def _paged_args(quantized=False):
  import jax
  import jax.numpy as jnp
  from jax.experimental.pallas.ops.tpu.paged_attention import quantization_utils as qu
  nkv, nq, hd, page, ppseq, total_pages, bsz = 2, 8, 128, 16, 32, 128, 4
  q = _normal(0, (bsz, nq, hd))
  kp, vp = _normal(1, (nkv, total_pages, page, hd)), _normal(2, (nkv, total_pages, page, hd))
  if quantized:
    kp, vp = qu.quantize_to_int8(kp), qu.quantize_to_int8(vp)
  lengths = jnp.array([100, 512, 37, 300], jnp.int32)
  pidx = jax.random.permutation(jax.random.key(3), total_pages)[:bsz * ppseq]
  return q, kp, vp, lengths, pidx.reshape(bsz, ppseq).astype(jnp.int32)


def case_paged():
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as pak
  fn = lambda *a: pak.paged_attention(*a, pages_per_compute_block=4)
  return fn, _paged_args()


def case_paged_quantized():
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as pak
  fn = lambda *a: pak.paged_attention(*a, pages_per_compute_block=4)
  return fn, _paged_args(quantized=True)


def case_ragged_paged():
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
  nq, nkv, hd, page, pps, tp = 8, 2, 128, 16, 16, 128
  q_lens, kv_lens = [64, 1, 100, 1, 1, 30, 1, 1], [200, 17, 256, 90, 33, 64, 250, 8]
  T = 256
  args = (_normal(0, (T, nq, hd)), _normal(1, (tp, page, 2 * nkv, hd)),
          jnp.array(kv_lens, jnp.int32),
          jnp.array(np.random.default_rng(0).permutation(tp)[:8 * pps].reshape(8, pps), jnp.int32),
          jnp.array(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
          jnp.array([8], jnp.int32))
  fn = lambda *a: rpa.ragged_paged_attention(*a, sm_scale=0.1, num_kv_pages_per_block=4,
                                             num_queries_per_block=32)
  return fn, args


def case_splash_fwd():
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  H, S, D = 4, 512, 128
  bs = sa.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128)
  kernel = sa.make_splash_mha(sa.MultiHeadMask([sa.CausalMask((S, S))] * H), block_sizes=bs,
                              head_shards=1, q_seq_shards=1)
  return kernel, (_normal(0, (H, S, D)), _normal(1, (H, S, D)), _normal(2, (H, S, D)))


def _groups():
  import jax.numpy as jnp
  return jnp.array([128, 0, 384, 256, 256], jnp.int32)


def case_gmm():
  gmm_mod = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
  fn = lambda lhs, rhs, gs: gmm_mod.gmm(lhs, rhs, gs, tiling=(128, 128, 128))
  return fn, (_normal(0, (1024, 256)), _normal(1, (5, 256, 256)), _groups())


def case_tgmm():
  gmm_mod = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
  fn = lambda lhs_t, grad, gs: gmm_mod.tgmm(lhs_t, grad, gs, tiling=(128, 128, 128))
  return fn, (_normal(0, (256, 1024)), _normal(1, (1024, 256)), _groups())


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


@contextlib.contextmanager
def _mode(mode):
  if mode == "numpy-jit":  # pallas_np.jit forces numpy mode itself
    yield
  elif mode == "numpy":
    import pallas_np
    with pallas_np.force_numpy_interpret():
      yield
  elif mode == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
      yield
  else:
    from pallas_np import _compat as jc
    prev = jc.interpret_mode_config.swap_local(True)
    try:
      yield
    finally:
      jc.interpret_mode_config.set_local(prev)


def child(kernel, mode, warm_budget, max_reps, out_path):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("PALLAS_NP_PROGRESS", "0")
  sys.path.insert(0, ROOT)
  import jax
  import numpy as np
  import pallas_np  # noqa: F401
  fn, args = CASES[kernel]()
  # as a serving/training loop would call it
  fn = pallas_np.jit(fn) if mode == "numpy-jit" else jax.jit(fn)
  args = jax.block_until_ready(args)
  if mode == "trace":  # JAX's trace alone: no run, no warm calls
    with _mode("numpy"):
      t0 = time.perf_counter()
      fn.trace(*args)
      print(json.dumps({"cold": time.perf_counter() - t0, "warm": None, "reps": 0}))
    return
  with _mode(mode):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    cold = time.perf_counter() - t0
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (not times or time.perf_counter() - start < warm_budget):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - t0)
  leaves = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(out)]
  np.savez(out_path, *leaves)
  print(json.dumps({"cold": cold, "warm": statistics.median(times), "reps": len(times)}))


def _run_child(kernel, mode, args, out_path):
  cmd = [sys.executable, os.path.abspath(__file__), "--child", kernel, mode,
         "--warm-budget", str(args.warm_budget), "--max-reps", str(args.max_reps),
         "--out", out_path]
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
  except subprocess.TimeoutExpired:
    return {"error": f"timeout > {args.timeout}s"}
  if proc.returncode != 0:
    lines = [l for l in proc.stderr.strip().splitlines() if "Error" in l and ":" in l]
    return {"error": (lines or ["?"])[-1].strip()[:160]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _print_table(head, rows):
  """A markdown table after a blank line."""
  print()
  print("| " + " | ".join(head) + " |")
  print("|---" * len(head) + "|")
  for row in rows:
    print("| " + " | ".join(row) + " |")


def _max_diff(a_path, b_path):
  import numpy as np
  a, b = np.load(a_path), np.load(b_path)
  return max(float(np.max(np.abs(a[k] - b[k]), initial=0.0)) for k in a.files)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--kernels", default=",".join(CASES))
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--warm-budget", type=float, default=10.0, help="seconds of warm calls")
  p.add_argument("--max-reps", type=int, default=10)
  p.add_argument("--timeout", type=float, default=600)
  p.add_argument("--child", nargs=2, metavar=("KERNEL", "MODE"))
  p.add_argument("--out")
  p.add_argument("--repeats", type=int, default=1,
                 help="fresh processes per (kernel, mode), medians reported; modes "
                 "interleaved (TPU interpret mode, the slowest, runs once)")
  args = p.parse_args()
  if args.child:
    return child(*args.child, args.warm_budget, args.max_reps, args.out)
  import tempfile
  tmp = tempfile.mkdtemp(prefix="tpu_kernels_")
  kernels, modes = args.kernels.split(","), args.modes.split(",")
  results = {}
  for k in kernels:
    runs = {m: [] for m in modes}
    for rep in range(max(1, args.repeats)):  # interleaved: a slow spell hits every mode
      for m in modes:
        if rep and (m == "tpu" or "error" in runs[m][0]):
          continue
        r = _run_child(k, m, args, os.path.join(tmp, f"{k}_{m}.npz"))
        runs[m].append(r)
        print(f"# {k:16s} {m:9s} {r}", file=sys.stderr, flush=True)
    for m in modes:
      bad = [r for r in runs[m] if "error" in r]
      results[k, m] = bad[0] if bad else {
          key: statistics.median(r[key] for r in runs[m])
          for key in ("cold", "warm") if runs[m][0][key] is not None}
  fmt = lambda r, key: f"{r[key]:.3f}" if key in r else ("err" if "error" in r else "-")
  ratio = lambda a, b, key: (f"{b[key] / a[key]:.0f}x" if key in a and key in b else "-")
  print("| kernel | numpy cold s | numpy warm s | interpret=True cold s | interpret=True warm s "
        "| TPU interpret cold s | TPU interpret warm s | warm: TPU interp / numpy "
        "| cold: interpret=True / numpy | max abs diff vs numpy |")
  print("|---" * 10 + "|")
  for k in kernels:
    n, h, t = (results.get((k, m), {}) for m in ("numpy", "interpret", "tpu"))
    diffs = []
    for m in ("interpret", "tpu"):
      a, b = os.path.join(tmp, f"{k}_numpy.npz"), os.path.join(tmp, f"{k}_{m}.npz")
      if os.path.exists(a) and os.path.exists(b):
        diffs.append(f"{m}: {_max_diff(a, b):.1e}")
    print(f"| {k} | {fmt(n, 'cold')} | {fmt(n, 'warm')} | {fmt(h, 'cold')} | {fmt(h, 'warm')} "
          f"| {fmt(t, 'cold')} | {fmt(t, 'warm')} | {ratio(n, t, 'warm')} "
          f"| {ratio(n, h, 'cold')} | {'; '.join(diffs) or '-'} |")
  if "trace" in modes:
    rows = []
    for k in kernels:
      n, h, tr = (results.get((k, m), {}) for m in ("numpy", "interpret", "trace"))
      own = f"{n['cold'] - tr['cold']:.3f}" if "cold" in n and "cold" in tr else "-"
      rows.append([k, fmt(tr, "cold"), own, fmt(h, "cold"), ratio(n, h, "cold"),
                   ratio(tr, h, "cold")])
    _print_table(["kernel", "JAX trace alone s", "numpy cold - trace s", "interpret=True cold s",
                  "cold: interpret=True / numpy", "floor: interpret=True / trace"], rows)
  if "numpy-jit" in modes:
    rows = []
    for k in kernels:
      n, h, j = (results.get((k, m), {}) for m in ("numpy", "interpret", "numpy-jit"))
      a, b = os.path.join(tmp, f"{k}_numpy.npz"), os.path.join(tmp, f"{k}_numpy-jit.npz")
      diff = f"{_max_diff(a, b):.1e}" if os.path.exists(a) and os.path.exists(b) else "-"
      rows.append([k, fmt(j, "cold"), fmt(j, "warm"), ratio(j, n, "cold"), ratio(j, h, "cold"),
                   diff])
    _print_table(["kernel", "numpy-jit cold s", "numpy-jit warm s", "cold: numpy / numpy-jit",
                  "cold: interpret=True / numpy-jit", "max abs diff vs numpy"], rows)
  if args.repeats > 1:
    print(f"\nEach cell: median of {args.repeats} fresh processes, modes interleaved "
          "(TPU interpret: one).")
  errors = {f"{k}/{m}": r["error"] for (k, m), r in results.items() if "error" in r}
  for where, err in errors.items():
    print(f"- {where}: {err}")


if __name__ == "__main__":
  main()
