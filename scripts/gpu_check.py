"""On a CUDA machine: real GPU lowering still works with pallas_np imported,
and numpy mode gives the GPU's results.

    python scripts/gpu_check.py [--kernels add,softmax,...] [--out report.md]

For each suite kernel that has a GPU (Triton) lowering, on the same inputs
(on the GPU):

- **gpu**: ``interpret=False``; the lowered module must hold a Triton call;
- **numpy**: ``interpret="numpy"`` called eagerly (the host evaluator);
- **numpy jit**: the numpy-mode call under ``jax.jit`` on GPU arrays, which
  reaches the host through ``io_callback``; its lowered module must hold a
  host callback and no Triton call;

each compared with the kernel's reference (float32 matmuls) and with the
GPU's result, as max |difference| / max |expected|. The suite's own kernels
are lowered with Triton (``jax_pallas_use_mosaic_gpu=False``: JAX 0.10's
default GPU backend for ``pl.pallas_call`` is Mosaic GPU, whose block-shape
limits these kernels do not meet); JAX's ``ops.gpu`` pick Triton themselves.
Exits 1 if any check fails. CI never runs this (it has no GPU).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Kernels with a GPU lowering (the TPU-style ones use VMEM scratch or scalar
# prefetch; JAX's Triton lowering has no rule for the bitonic sort's
# ``slice``). (name, suite builder args, GPU tolerance): the GPU's dots use
# TF32 and its exp/rsqrt differ in the last bits, so GPU comparisons get
# their own (relative) tolerance; numpy vs reference keeps the suite's.
CASES = {
    "add": ("add", {}, 1e-6),
    "matmul_relu_256": ("matmul_relu", {"n": 256}, 5e-2),
    "softmax": ("softmax", {}, 1e-5),
    "layer_norm": ("layer_norm", {}, 1e-4),
    "gpu_attention": ("gpu_attention", {}, 2e-2),
    "gpu_ops_mha_fwd": ("gpu_ops_mha_fwd", {}, 2e-2),
    "gpu_ops_mha_bwd": ("gpu_ops_mha_bwd", {}, 5e-2),
    "gpu_ops_layer_norm_fwd": ("gpu_ops_layer_norm_fwd", {}, 1e-3),
    "gpu_ops_layer_norm_bwd": ("gpu_ops_layer_norm_bwd", {}, 1e-2),
    "gpu_ops_rms_norm_fwd": ("gpu_ops_rms_norm_fwd", {}, 1e-3),
    "gpu_ops_rms_norm_bwd": ("gpu_ops_rms_norm_bwd", {}, 1e-2),
    "gpu_ops_softmax": ("gpu_ops_softmax", {}, 1e-5),
    "gpu_ops_decode_mqa": ("gpu_ops_decode_mqa", {}, 2e-2),
    "gpu_ops_decode_gqa": ("gpu_ops_decode_gqa", {}, 2e-2),
    "gpu_ops_paged_attention": ("gpu_ops_paged_attention", {}, 2e-2),
}


def _max_err(got, want):
  """max |got - want| over max |want| (gradients of attention reach ~10)."""
  import numpy as np
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.shape != want.shape:
    return float("inf")
  if not got.size:
    return 0.0
  return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def _timed(fn, args, reps=5):
  import jax
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  first = time.perf_counter() - t0
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return out, first * 1e3, min(times) * 1e3


def check(name):
  """One kernel: a row of the report and whether every check passed."""
  import functools
  import jax
  import pallas_np
  from benchmarks import kernels
  suite_name, kwargs, gpu_tol = CASES[name]
  builder = kernels.all_cases()[suite_name]
  if kwargs:
    builder = functools.partial(builder, **kwargs)
  case = builder()
  args = jax.block_until_ready(case.args)
  row = {"kernel": case.name, "device": str(args[0].devices().pop())}
  ok = True
  want = None
  if case.reference is not None:  # in float32, not the GPU's default TF32
    with jax.default_matmul_precision("highest"):
      want = case.reference(*args)

  gpu_fn = case.make(False)
  lowered = jax.jit(gpu_fn).lower(*args).as_text()
  row["gpu lowering"] = "triton" if "triton" in lowered else "NO TRITON CALL"
  ok &= "triton" in lowered
  gpu_out, row["gpu first ms"], row["gpu warm ms"] = _timed(gpu_fn, args)
  np_fn = case.make(pallas_np.InterpretParams())
  np_out, row["numpy first ms"], row["numpy warm ms"] = _timed(np_fn, args, reps=2)
  jit_fn = jax.jit(np_fn)
  jit_text = jit_fn.lower(*args).as_text()
  host_call = "callback" in jit_text and "triton" not in jit_text
  row["numpy jit lowering"] = "host callback" if host_call else "UNEXPECTED"
  ok &= host_call
  jit_out = jax.block_until_ready(jit_fn(*args))

  row["numpy-gpu err"] = _max_err(np_out, gpu_out)
  row["numpy jit-numpy err"] = _max_err(jit_out, np_out)
  ok &= row["numpy-gpu err"] <= gpu_tol and row["numpy jit-numpy err"] == 0.0
  if want is not None:
    row["gpu-ref err"] = _max_err(gpu_out, want)
    row["numpy-ref err"] = _max_err(np_out, want)
    ok &= row["gpu-ref err"] <= max(gpu_tol, case.tol) and row["numpy-ref err"] <= case.tol
  row["tol (gpu / ref)"] = f"{gpu_tol:g} / {case.tol:g}"
  return row, bool(ok)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--kernels", default=",".join(CASES))
  ap.add_argument("--out", help="write the report (markdown) here too")
  opts = ap.parse_args(argv)
  import jax
  import numpy as np
  import pallas_np  # noqa: F401 (installs the numpy-mode lowering: what is checked)
  head = [f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, numpy {np.__version__}, "
          f"Python {sys.version.split()[0]}; backend {jax.default_backend()}: "
          f"{[d.device_kind for d in jax.devices()]}"]
  print(head[0], flush=True)
  if jax.default_backend() != "gpu":
    sys.exit("no GPU backend: nothing to check")
  if hasattr(jax.config, "jax_pallas_use_mosaic_gpu"):  # JAX <= 0.11; 0.12 dropped it
    jax.config.update("jax_pallas_use_mosaic_gpu", False)
  os.environ.setdefault("PALLAS_NP_PROGRESS", "0")
  rows, failed = [], []
  for name in opts.kernels.split(","):
    try:
      row, ok = check(name)
    except Exception as e:  # noqa: BLE001 (report every kernel)
      row, ok = {"kernel": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}, False
      traceback.print_exc()
    row["ok"] = "ok" if ok else "FAIL"
    if not ok:
      failed.append(name)
    rows.append(row)
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
  cols = list(dict.fromkeys(k for r in rows for k in r))
  fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
  lines = [*head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
  lines += ["", f"failed: {', '.join(failed) or 'none'}"]
  report = "\n".join(lines)
  print(report)
  if opts.out:
    with open(opts.out, "w") as f:
      f.write(report + "\n")
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
