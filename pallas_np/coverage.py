"""Which JAX primitives the NumPy interpreter supports.

    python -m pallas_np.coverage              # text report
    python -m pallas_np.coverage --markdown   # the table in docs/coverage.md
    python -m pallas_np.coverage --no-ops     # skip tracing the ops kernels

Two questions, answered from what is registered at run time (so rules other
modules add, TPU DMA or semaphores say, show up without editing this file):

1. Of all primitives that can reach a kernel body (every lax primitive, the
   Pallas/state primitives, and the TPU (Mosaic) and GPU (Triton, Mosaic GPU)
   Pallas primitives), which have a rule?
2. Which primitives do the kernels under ``jax.experimental.pallas.ops``
   actually use, and are they all supported? Each op is traced on CPU with
   small shapes (forward and, where it has one, backward), and every
   ``pallas_call`` kernel jaxpr and index map in the result is walked,
   sub-jaxprs included. Ops that cannot be traced here (Mosaic GPU kernels
   query the GPU at trace time) fall back to a source scan for ``lax.*``/``jnp.*``
   names that are primitives, marked as such. Mosaic GPU (``plgpu.kernel``)
   kernel bodies are walked like ``pallas_call`` kernels.

Exit status 1 if a lax/Pallas primitive used by an ops kernel is unsupported.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from typing import Any, Callable

# Tracing only: no accelerator needed.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_np  # noqa: E402,F401  (registers every rule)
from pallas_np import _compat as jc  # noqa: E402
from pallas_np import conformance, registry  # noqa: E402

CATEGORIES: list[tuple[str, list[str]]] = [
    ("lax", [
        "lax.lax", "lax.slicing", "lax.special",
        "lax.control_flow.loops", "lax.control_flow.conditionals",
        "lax.control_flow.solves", "lax.windowed_reductions",
        "lax.convolution", "lax.linalg", "lax.fft",
        "lax.ann", "lax.parallel", "random.prng",
        "random.threefry2x32", "random", "ad_util",
        "ad_checkpoint", "custom_derivatives", "pjit",
        "debugging", "callback", "core",
    ]),
    ("pallas/state", [
        "pallas.primitives", "state.primitives",
        "pallas.pallas_call", "pallas.core",
    ]),
    ("pallas TPU (Mosaic)", ["pallas.mosaic.primitives"]),
    ("pallas TPU SparseCore", ["pallas.mosaic.sc_primitives"]),
    ("mesh kernels", ["pallas.mpmd", "state.discharge"]),
    ("pallas GPU (Triton)", ["pallas.triton.primitives"]),
    ("pallas GPU (Mosaic GPU)", ["pallas.mosaic_gpu.primitives", "pallas.mosaic_gpu.core"]),
]

# Primitives that never reach a kernel body as such (tracing machinery,
# sharding annotations, autodiff-only helpers); listed apart, not as gaps.
_NOT_KERNEL = {
    "pallas_call", "core_map", "device_put", "stage", "tie", "dce_sink", "create_token",
    "after_all", "custom_lin", "mutable_array", "empty_ref", "free_ref", "freeze",
    "accum_grad_in_ref", "new_ref", "layout_constraint", "inspect_sharding",
    "unreachable", "call_hi_primitive", "name", "remat_opt", "linear_call",
    "with_memory_space_constraint", "reduced_vary_cast_p", "vary_unreduced_cast_p",
    "pin", "unpin", "create_linear", "from_edtype", "to_edtype",
}


def all_primitives() -> dict[str, list[Any]]:
  """Category -> primitives defined in that category's modules."""
  seen: set[int] = set()
  out: dict[str, list[Any]] = {}
  for label, modules in CATEGORIES:
    prims = []
    for m in modules:
      try:
        mod = jc.internal_module(m)
      except Exception as e:  # e.g. Mosaic GPU needs a GPU toolchain
        label = f"{label} (not importable here: {type(e).__name__}: {e})"
        continue
      for v in vars(mod).values():
        if isinstance(v, jc.Primitive) and id(v) not in seen:
          seen.add(id(v))
          prims.append(v)
    out[label] = sorted(prims, key=lambda p: p.name)
  return out


def is_supported(prim) -> bool:
  return registry.lookup(prim) is not None


# -- primitives used by the ops kernels ----------------------------------------
_MESH_PRIMITIVES = jc.mesh_kernel_primitives()


def _walk(jaxpr, found: set, inside_kernel: bool):
  for eqn in jaxpr.eqns:
    if eqn.primitive is jc.pallas_call_p:
      _walk(eqn.params["jaxpr"], found, True)
      gm = eqn.params["grid_mapping"]
      for bm in gm.block_mappings:
        _walk(bm.index_map_jaxpr.jaxpr, found, True)
      continue
    if eqn.primitive in _MESH_PRIMITIVES and "jaxprs" in eqn.params:  # plgpu.kernel & co.
      for body in eqn.params["jaxprs"]:
        _walk(getattr(body, "jaxpr", body), found, True)
      continue
    if inside_kernel:
      found.add(eqn.primitive)
    for sub in jc.eqn_subjaxprs(eqn):
      _walk(sub, found, inside_kernel)


def kernel_primitives(closed) -> set:
  found: set = set()
  _walk(closed.jaxpr if isinstance(closed, jc.ClosedJaxpr) else closed, found, False)
  return found


def _sds(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _ops_entries() -> list[tuple[str, Callable[[], Any]]]:
  """(name, thunk returning a ClosedJaxpr) for each op under pallas.ops."""
  f32, bf16, i32, u32 = jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint32
  f16 = jnp.float16
  mj = jax.make_jaxpr

  def gpu(name):
    return importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")

  def tpu(name):
    return importlib.import_module(f"jax.experimental.pallas.ops.tpu.{name}")

  def grad_of(fn, n):
    return jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=tuple(range(n)))

  qkv = [_sds((1, 64, 2, 32))] * 3
  entries = [
      ("gpu.attention.mha", lambda: mj(lambda q, k, v: gpu("attention").mha(q, k, v, None))(*qkv)),
      ("gpu.attention.mha (causal, backward)", lambda: mj(grad_of(
          lambda q, k, v: gpu("attention").mha(q, k, v, None, causal=True), 3))(*qkv)),
      ("gpu.layer_norm (forward, backward)", lambda: mj(grad_of(
          gpu("layer_norm").layer_norm, 3))(_sds((2, 4, 64)), _sds((64,)), _sds((64,)))),
      ("gpu.rms_norm (forward, backward)", lambda: mj(grad_of(
          gpu("rms_norm").rms_norm, 3))(_sds((2, 4, 64)), _sds((64,)), _sds((64,)))),
      ("gpu.softmax", lambda: mj(gpu("softmax").softmax)(_sds((4, 64)))),
      ("gpu.decode_attention.mqa", lambda: mj(lambda q, k, v: gpu("decode_attention").mqa(
          q, k, v, block_k=32, k_splits=2))(_sds((2, 16, 32)), _sds((2, 64, 32)), _sds((2, 64, 32)))),
      ("gpu.decode_attention.gqa", lambda: mj(lambda q, k, v: gpu("decode_attention").gqa(
          q, k, v, block_k=32, k_splits=2))(_sds((2, 16, 32)), _sds((2, 64, 2, 32)),
                                             _sds((2, 64, 2, 32)))),
      ("gpu.paged_attention", lambda: mj(lambda q, k, v, bt, ln: gpu("paged_attention").paged_attention(
          q, k, v, bt, ln, pages_per_compute_block=2, k_splits=2))(
          _sds((2, 16, 32)), _sds((2, 8, 16, 32)), _sds((2, 8, 16, 32)), _sds((2, 4), i32),
          _sds((2,), i32))),
      # Mosaic GPU kernels that query no GPU at trace time (the others ask for
      # the SM count or the CUDA version; tests/test_mosaic_gpu_kernels.py runs
      # them all with those queries stubbed).
      ("gpu.ragged_dot_mgpu", lambda: mj(lambda x, y, g: gpu("ragged_dot_mgpu").ragged_dot(
          x, y, group_sizes=g, block_m=64, block_n=64, block_k=64, max_concurrent_steps=2,
          grid_block_n=1))(_sds((256, 128), f16), _sds((4, 128, 128), f16), _sds((4,), i32))),
      ("tpu.flash_attention (forward, backward)", lambda: mj(grad_of(
          lambda q, k, v: tpu("flash_attention").flash_attention(q, k, v, causal=True), 3))(
          *[_sds((1, 2, 128, 128))] * 3)),
      ("tpu.matmul", lambda: mj(lambda x, y: tpu("matmul").matmul(
          x, y, block_shape=(128, 128), block_k=128))(_sds((256, 256)), _sds((256, 256)))),
      ("tpu.example_kernel.double", lambda: mj(tpu("example_kernel").double)(_sds((8, 128)))),
      ("tpu.megablox.gmm", lambda: mj(lambda l, r, g: tpu("megablox.gmm").gmm(l, r, g))(
          _sds((256, 128), bf16), _sds((2, 128, 128), bf16), _sds((2,), i32))),
      ("tpu.megablox.tgmm", lambda: mj(lambda l, r, g: tpu("megablox.gmm").tgmm(l, r, g))(
          _sds((128, 256), bf16), _sds((256, 128), bf16), _sds((2,), i32))),
      ("tpu.paged_attention", lambda: mj(lambda q, k, v, ln, pi: tpu(
          "paged_attention.paged_attention_kernel").paged_attention(
          q, k, v, ln, pi, pages_per_compute_block=2))(
          _sds((2, 8, 128)), _sds((4, 8, 128, 128)), _sds((4, 8, 128, 128)), _sds((2,), i32),
          _sds((2, 4), i32))),
      ("tpu.ragged_paged_attention", lambda: mj(lambda q, kv, kl, pi, cu, ns: tpu(
          "ragged_paged_attention.kernel").ragged_paged_attention(
          q, kv, kl, pi, cu, ns, num_kv_pages_per_block=2, num_queries_per_block=8))(
          _sds((16, 4, 128)), _sds((8, 16, 4, 128)), _sds((2,), i32), _sds((2, 4), i32),
          _sds((3,), i32), _sds((1,), i32))),
      ("tpu.splash_attention", _splash_entry),
      ("tpu.random.threefry", lambda: mj(lambda k: tpu("random.threefry").plthreefry_random_bits(
          k, 32, (16, 256)))(_sds((2,), u32))),
      ("tpu.random.philox", lambda: mj(lambda k: tpu("random.philox").philox_random_bits(
          k, 32, (16, 256)))(_sds((2,), u32))),
  ]
  return entries


def _splash_entry():
  sa = importlib.import_module("jax.experimental.pallas.ops.tpu.splash_attention")
  mask = sa.MultiHeadMask([sa.CausalMask((256, 256))] * 2)
  kernel = sa.make_splash_mha_single_device(mask)
  q = _sds((2, 256, 128))
  return jax.make_jaxpr(lambda q, k, v: kernel(q, k, v))(q, q, q)


_OPS_DIR = os.path.join(os.path.dirname(jax.__file__), "experimental", "pallas", "ops")


def _scan_source(path: str, by_name: dict[str, Any]) -> set:
  """Heuristic: ``lax.NAME``/``jnp.NAME`` references whose NAME (or
  NAME + '_p') names a primitive."""
  with open(path) as f:
    src = f.read()
  found = set()
  for m in re.finditer(r"\b(?:lax|jnp|jax\.lax|jax\.numpy)\.([a-z_0-9]+)\b", src):
    prim = by_name.get(m.group(1))
    if prim is not None:
      found.add(prim)
  return found


def ops_report(prims_by_cat) -> tuple[dict[str, set], dict[str, str], dict[str, set]]:
  """(traced op -> primitives, op -> trace failure, scanned file -> primitives)."""
  traced, failed, scanned = {}, {}, {}
  for name, thunk in _ops_entries():
    try:
      traced[name] = kernel_primitives(thunk())
    except Exception as e:  # noqa: BLE001 - reported, not fatal
      failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
  lax_by_name = {p.name: p for p in prims_by_cat.get("lax", [])}
  for fname in sorted(os.listdir(os.path.join(_OPS_DIR, "gpu"))):
    if fname.endswith("_mgpu.py"):
      scanned[f"gpu/{fname}"] = _scan_source(os.path.join(_OPS_DIR, "gpu", fname), lax_by_name)
  return traced, failed, scanned


# -- report -------------------------------------------------------------------
def _category_of(prim, prims_by_cat) -> str:
  for cat, prims in prims_by_cat.items():
    if any(p is prim for p in prims):
      return cat
  return "other"


def build_report(with_ops: bool = True) -> dict:
  prims_by_cat = all_primitives()
  rows = {}
  for cat, prims in prims_by_cat.items():
    kernel_prims = [p for p in prims if p.name not in _NOT_KERNEL]
    rows[cat] = ([p.name for p in kernel_prims if is_supported(p)],
                 [p.name for p in kernel_prims if not is_supported(p)])
  report = {"categories": rows}
  if with_ops:
    traced, failed, scanned = ops_report(prims_by_cat)
    used = set().union(*traced.values()) if traced else set()
    report["ops_traced"] = {k: sorted(p.name for p in v) for k, v in traced.items()}
    report["ops_failed"] = failed
    report["ops_scanned"] = {k: sorted(p.name for p in v) for k, v in scanned.items()}
    report["ops_used_unsupported"] = sorted(
        f"{p.name} [{_category_of(p, prims_by_cat)}]" for p in used if not is_supported(p))
    report["ops_scanned_unsupported"] = sorted(
        {p.name for v in scanned.values() for p in v if not is_supported(p)})
    report["ops_used_supported"] = sorted(p.name for p in used if is_supported(p))
  return report


def format_markdown(report) -> str:
  lines = ["| primitive family | supported | unsupported |", "| --- | --- | --- |"]
  for cat, (sup, unsup) in report["categories"].items():
    lines.append(f"| {cat} | {len(sup)}: {', '.join(f'`{n}`' for n in sup) or '-'} | "
                 f"{len(unsup)}: {', '.join(f'`{n}`' for n in unsup) or '-'} |")
  if "ops_traced" in report:
    lines += ["", "Kernels under `jax.experimental.pallas.ops`, traced on CPU "
              "(primitives inside `pallas_call` kernels and index maps):", "",
              "| op | primitives used | unsupported |", "| --- | --- | --- |"]
    for name, prims in report["ops_traced"].items():
      unsup = [p for p in prims if p in {u.split(" [")[0] for u in report["ops_used_unsupported"]}]
      lines.append(f"| {name} | {len(prims)} | {', '.join(f'`{u}`' for u in unsup) or 'none'} |")
    for name, why in report["ops_failed"].items():
      lines.append(f"| {name} | not traceable here ({why}) | - |")
    scanned_unsup = report["ops_scanned_unsupported"]
    lines += ["", f"Mosaic GPU kernels (`gpu/*_mgpu.py`) also by source scan (most query the "
              f"GPU at trace time): lax primitives named there that are unsupported: "
              f"{', '.join(f'`{u}`' for u in scanned_unsup) or 'none'}."]
  return "\n".join(lines)


def format_text(report) -> str:
  out = []
  for cat, (sup, unsup) in report["categories"].items():
    out.append(f"== {cat}: {len(sup)} supported, {len(unsup)} unsupported")
    out.append("  supported:   " + " ".join(sup))
    out.append("  unsupported: " + (" ".join(unsup) or "-"))
  if "ops_traced" in report:
    out.append("")
    out.append(f"== kernels under jax.experimental.pallas.ops: {len(report['ops_traced'])} "
               f"traced, {len(report['ops_failed'])} not traceable here")
    for name, prims in report["ops_traced"].items():
      out.append(f"  {name}: {' '.join(prims)}")
    for name, why in report["ops_failed"].items():
      out.append(f"  {name}: NOT TRACED ({why})")
    out.append(f"  primitives used by traced ops kernels: {len(report['ops_used_supported'])} "
               f"supported; unsupported: {' '.join(report['ops_used_unsupported']) or 'none'}")
    out.append(f"  Mosaic GPU kernels by source scan, unsupported lax names: "
               f"{' '.join(report['ops_scanned_unsupported']) or 'none'}")
  return "\n".join(out)


def format_conformance(markdown: bool) -> str:
  """Per float primitive, bit-exact with XLA CPU (and how) or the measured
  ulp bound (pallas_np/conformance.py; tests/test_conformance.py measures
  both against XLA on the machine it runs on)."""
  names = sorted(set(conformance.BIT_EXACT) | set(conformance.ULP))
  dts = ("float32", "bfloat16", "float16")
  if markdown:
    lines = ["", "Conformance with XLA on CPU (max ulp over 10^6 samples; exact = bit-exact on "
             "every CPU, by construction; 0 = bit-exact over the sample):", "",
             "| primitive | float32 | bfloat16 | float16 | how |", "| --- | --- | --- | --- | --- |"]
    for n in names:
      vals = ["exact" if n in conformance.BIT_EXACT else str(conformance.bound(n, d))
              for d in dts]
      how = conformance.BIT_EXACT.get(n, "NumPy (float64) / SciPy vs XLA's approximation")
      lines.append(f"| `{n}` | " + " | ".join(vals) + f" | {how} |")
    return "\n".join(lines)
  return "\n".join(["", "== conformance with XLA CPU (max ulp; integer, comparison, data "
                     "movement, rounding and conversion primitives are bit-exact)"] +
                    [f"  {n}: {conformance.describe(n)}" for n in names])


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m pallas_np.coverage", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--markdown", action="store_true", help="print the docs/coverage.md table")
  ap.add_argument("--no-ops", action="store_true", help="skip tracing the ops kernels")
  args = ap.parse_args(argv)
  report = build_report(with_ops=not args.no_ops)
  print(format_markdown(report) if args.markdown else format_text(report))
  print(format_conformance(args.markdown))
  lax_gaps = [u for u in report.get("ops_used_unsupported", [])
              if "[lax]" in u or "[pallas/state]" in u]
  return 1 if lax_gaps else 0


if __name__ == "__main__":
  sys.exit(main())
