"""Small kernels suite: warm speed of the kernels people actually run (tiny
grids, ragged edges, scalar prefetch, fori/while-loop bodies, bf16, int8 and
quantized matmuls, single blocks), interpret="numpy" vs interpret=True, eager
and under ``jax.jit`` (issue 33).

    python benchmarks/small_kernels.py            # every kernel, ~3 s of warm calls each
    python benchmarks/small_kernels.py --quick    # fewer warm calls
    python benchmarks/small_kernels.py --kernels int8_matmul,quant_matmul

All four callables of a kernel (numpy/interpret=True x eager/jit) live in one
process: their first calls are timed, the numpy results checked against
interpret=True's (and the kernel's reference), then warm calls run round-robin
(modes interleaved, so a slow spell of the machine hits all of them) and the
medians are reported. The section it writes into benchmarks/RESULTS.md is
delimited by markers; suite.py keeps it when it rewrites its own table.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

import pallas_np  # noqa: E402
from benchmarks import suite  # noqa: E402
from benchmarks.kernels import Case, pallas_call  # noqa: E402

SECTION_START, SECTION_END = suite.SMALL_KERNELS_START, suite.SMALL_KERNELS_END
FLOOR = "copy_8x128"  # the per-call floor: reported in us, left out of the geomeans
MODES = (("numpy", "eager"), ("interpret", "eager"), ("numpy", "jit"), ("interpret", "jit"))

_rng = np.random.default_rng(33)


def _f32(*shape):
  return jnp.asarray(_rng.standard_normal(shape).astype(np.float32))


def _i8(*shape):
  return jnp.asarray(_rng.integers(-128, 128, size=shape).astype(np.int8))


# -- kernels ------------------------------------------------------------------------
def copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def case_copy():
  """One (8,128) block copied: what a call costs beyond its work."""
  x = _f32(8, 128)
  make = lambda interp: pallas_call(copy_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    interpret=interp)
  return Case("copy (8,128), one block", make, (x,), lambda x: x, tol=0)


def fma_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] * y_ref[...] + 1.0


def case_elementwise_ragged():
  x, y = _f32(100, 70), _f32(100, 70)
  spec = pl.BlockSpec((32, 32), lambda i, j: (i, j))

  def make(interp):
    return pallas_call(fma_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4, 3),
                       in_specs=[spec, spec], out_specs=spec, interpret=interp)
  return Case("x*y+1 100x70 in 32x32 blocks (12 steps, ragged)", make, (x, y),
              lambda x, y: x * y + 1.0, tol=1e-6)  # XLA may fuse an FMA


def gather_kernel(idx_ref, x_ref, o_ref):
  o_ref[...] = x_ref[...] * 2.0


def case_gather_prefetch():
  idx = jnp.asarray(_rng.integers(0, 64, 24), jnp.int32)
  x = _f32(64, 256)

  def make(interp):
    return pallas_call(
        gather_kernel, jax.ShapeDtypeStruct((24, 256), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(24,),
            in_specs=[pl.BlockSpec((1, 256), lambda i, idx: (idx[i], 0))],
            out_specs=pl.BlockSpec((1, 256), lambda i, idx: (i, 0))),
        interpret=interp)
  return Case("row gather by scalar prefetch (24 steps)", make, (idx, x),
              lambda idx, x: x[idx] * 2.0, tol=0)


def softmax_bf16_kernel(x_ref, o_ref):
  x = x_ref[...].astype(jnp.float32)
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  o_ref[...] = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(o_ref.dtype)


def case_softmax_bf16():
  x = _f32(32, 512).astype(jnp.bfloat16)
  spec = pl.BlockSpec((8, 512), lambda i: (i, 0))

  def make(interp):
    return pallas_call(softmax_bf16_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                       grid=(4,), in_specs=[spec], out_specs=spec, interpret=interp)
  return Case("bf16 softmax 32x512 in 8-row blocks (4 steps)", make, (x,),
              lambda x: jax.nn.softmax(x.astype(jnp.float32), axis=-1), tol=1e-2)


def cumsum_fori_kernel(x_ref, o_ref):
  def body(r, acc):
    acc = acc + x_ref[pl.ds(r, 1), :]
    o_ref[pl.ds(r, 1), :] = acc
    return acc
  lax.fori_loop(0, x_ref.shape[0], body, jnp.zeros((1, x_ref.shape[1]), jnp.float32))


def case_cumsum_fori(rows=128, block=64):
  x = _f32(rows, 128)
  spec = pl.BlockSpec((block, 128), lambda i: (i, 0))

  def make(interp):
    return pallas_call(cumsum_fori_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                       grid=(rows // block,), in_specs=[spec], out_specs=spec,
                       interpret=interp)
  ref = lambda x: jnp.cumsum(x.reshape(-1, block, 128), axis=1).reshape(x.shape)
  return Case(f"row running sum, fori_loop over {block} rows (2 steps)", make, (x,), ref,
              tol=1e-4)


def bitonic_fori_kernel(x_ref, o_ref):
  """Sort each row: the bitonic network's stages as two nested fori_loops
  (the inner trip count depends on the outer index: a while loop)."""
  x = x_ref[...]
  n = x.shape[-1]
  idx = lax.broadcasted_iota(jnp.int32, x.shape, 1)

  def stage(p, x):
    k = jnp.left_shift(1, p)

    def step(q, x):
      j = jnp.right_shift(k, q + 1)
      lower = (idx & j) == 0
      partner = jnp.where(lower, jnp.roll(x, -j, axis=1), jnp.roll(x, j, axis=1))
      take_min = lower == ((idx & k) == 0)
      return jnp.where(take_min, jnp.minimum(x, partner), jnp.maximum(x, partner))
    return lax.fori_loop(0, p, step, x)
  o_ref[...] = lax.fori_loop(1, n.bit_length(), stage, x)


def case_bitonic_fori(rows=32, n=128):
  x = _f32(rows, n)
  spec = pl.BlockSpec((8, n), lambda i: (i, 0))

  def make(interp):
    return pallas_call(bitonic_fori_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                       grid=(rows // 8,), in_specs=[spec], out_specs=spec, interpret=interp)
  return Case(f"bitonic {rows}x{n}, fori_loop stages, (8,{n}) blocks", make, (x,),
              lambda x: jnp.sort(x, axis=-1), tol=0)


def collatz_kernel(x_ref, o_ref):
  """Steps to reach 1 (data-dependent while_loop on one int32 block)."""
  def cond(c):
    return jnp.any(c[0] != 1)

  def body(c):
    x, steps = c
    done = x == 1
    nxt = jnp.where(x % 2 == 0, x // 2, 3 * x + 1)
    return jnp.where(done, x, nxt), steps + jnp.where(done, 0, 1)
  x = x_ref[...]
  o_ref[...] = lax.while_loop(cond, body, (x, jnp.zeros_like(x)))[1]


def _collatz_ref(x):
  x = np.asarray(x).astype(np.int64)
  steps = np.zeros_like(x)
  while (x != 1).any():
    steps += x != 1
    x = np.where(x == 1, 1, np.where(x % 2 == 0, x // 2, 3 * x + 1))
  return steps


def case_while_collatz():
  x = jnp.asarray(_rng.integers(1, 60, (2, 128)), jnp.int32)
  make = lambda interp: pallas_call(collatz_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    interpret=interp)
  return Case("while_loop (Collatz steps) on one (2,128) int32 block", make, (x,),
              _collatz_ref, tol=0)


def int8_matmul_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.int32)


def case_int8_matmul(m=128, k=256, n=128, block=64):
  x, y = _i8(m, k), _i8(k, n)

  def make(interp):
    return pallas_call(
        int8_matmul_kernel, jax.ShapeDtypeStruct((m, n), jnp.int32),
        grid=(m // block, n // block),
        in_specs=[pl.BlockSpec((block, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k, block), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((block, block), lambda i, j: (i, j)), interpret=interp)
  ref = lambda x, y: (np.asarray(x, np.int64) @ np.asarray(y, np.int64)).astype(np.int32)
  return Case(f"int8 x int8 -> int32 matmul {m}x{k}x{n}, {block}x{block} out blocks", make,
              (x, y), ref, tol=0)


def quant_matmul_kernel(x_ref, xs_ref, w_ref, ws_ref, o_ref, acc_ref):
  """int8 activations (per-row scales) x int8 weights (per-channel scales),
  int32 accumulation over the K grid axis, float32 out."""
  kk = pl.program_id(2)

  @pl.when(kk == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  acc_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.int32)

  @pl.when(kk == pl.num_programs(2) - 1)
  def _():
    o_ref[...] = acc_ref[...].astype(jnp.float32) * xs_ref[...] * ws_ref[...]


def case_quant_matmul(m=128, k=512, n=256, bm=64, bk=256, bn=128):
  x, w = _i8(m, k), _i8(k, n)
  xs = jnp.asarray(_rng.uniform(0.005, 0.02, (m, 1)).astype(np.float32))
  ws = jnp.asarray(_rng.uniform(0.005, 0.02, (1, n)).astype(np.float32))

  def make(interp):
    return pallas_call(
        quant_matmul_kernel, jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(m // bm, n // bn, k // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec((bm, 1), lambda i, j, kk: (i, 0)),
                  pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
                  pl.BlockSpec((1, bn), lambda i, j, kk: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.int32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interp)

  def ref(x, xs, w, ws):
    acc = (np.asarray(x, np.int64) @ np.asarray(w, np.int64)).astype(np.float32)
    return acc * np.asarray(xs) * np.asarray(ws)
  return Case(f"int8 quantized matmul {m}x{k}x{n}, per-channel scales, K grid axis", make,
              (x, xs, w, ws), ref, tol=1e-4)


def w8_bf16_kernel(x_ref, w_ref, ws_ref, o_ref):
  """Weight-only int8: weights widened to bf16 for a bf16 x bf16 -> f32 dot."""
  w = w_ref[...].astype(jnp.bfloat16)
  o_ref[...] = jnp.dot(x_ref[...], w, preferred_element_type=jnp.float32) * ws_ref[...]


def case_w8_bf16(m=64, k=256, n=256, bn=128):
  x = _f32(m, k).astype(jnp.bfloat16)
  w = _i8(k, n)
  ws = jnp.asarray(_rng.uniform(0.005, 0.02, (1, n)).astype(np.float32))

  def make(interp):
    return pallas_call(
        w8_bf16_kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), grid=(n // bn,),
        in_specs=[pl.BlockSpec((m, k), lambda j: (0, 0)),
                  pl.BlockSpec((k, bn), lambda j: (0, j)),
                  pl.BlockSpec((1, bn), lambda j: (0, j))],
        out_specs=pl.BlockSpec((m, bn), lambda j: (0, j)), interpret=interp)

  def ref(x, w, ws):
    return (np.asarray(x, np.float64) @ np.asarray(w, np.float64)) * np.asarray(ws)
  return Case(f"int8 weights x bf16 activations {m}x{k}x{n} (2 steps)", make, (x, w, ws), ref,
              tol=1e-3)


def layer_norm_kernel(x_ref, w_ref, o_ref):
  x = x_ref[...]
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  o_ref[...] = (x - mean) * lax.rsqrt(var + 1e-5) * w_ref[...]


def case_layer_norm_block():
  x, w = _f32(8, 128), _f32(1, 128)
  make = lambda interp: pallas_call(layer_norm_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    interpret=interp)

  def ref(x, w):
    m = x.mean(-1, keepdims=True)
    return (x - m) / jnp.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * w
  return Case("layer norm, one (8,128) block", make, (x, w), ref, tol=1e-4)


def matmul_acc_kernel(x_ref, y_ref, o_ref, acc_ref):
  @pl.when(pl.program_id(2) == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

  @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
  def _():
    o_ref[...] = acc_ref[...]


def case_matmul_acc(n=128, b=64):
  x, y = _f32(n, n), _f32(n, n)

  def make(interp):
    return pallas_call(
        matmul_acc_kernel, jax.ShapeDtypeStruct((n, n), jnp.float32), grid=(n // b,) * 3,
        in_specs=[pl.BlockSpec((b, b), lambda i, j, k: (i, k)),
                  pl.BlockSpec((b, b), lambda i, j, k: (k, j))],
        out_specs=pl.BlockSpec((b, b), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((b, b), jnp.float32)], interpret=interp)
  return Case(f"f32 matmul {n}^3 in {b}^3 blocks, scratch accumulator (8 steps)", make, (x, y),
              lambda x, y: x @ y, tol=1e-3)


def all_cases(quick=False):
  """The small-kernel suite as zero-argument builders (``quick``: the same
  kernels; --quick only shortens the warm runs)."""
  return {
      FLOOR: case_copy,
      "elementwise_ragged": case_elementwise_ragged,
      "gather_prefetch": case_gather_prefetch,
      "softmax_bf16": case_softmax_bf16,
      "cumsum_fori": case_cumsum_fori,
      "bitonic_fori": case_bitonic_fori,
      "while_collatz": case_while_collatz,
      "int8_matmul": case_int8_matmul,
      "quant_matmul": case_quant_matmul,
      "w8_bf16": case_w8_bf16,
      "layer_norm_block": case_layer_norm_block,
      "matmul_acc": case_matmul_acc,
  }


# -- checking and timing ---------------------------------------------------------------
def max_err(got, want):
  """Largest absolute difference (float64), inf on a shape mismatch."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.shape != want.shape:
    return float("inf")
  return float(np.max(np.abs(got - want))) if got.size else 0.0


def check(case, outs, args):
  """Every numpy-mode output against interpret=True's and the reference:
  the worst error, and whether it is within the case's tolerance."""
  want = outs["interpret", "eager"]
  errs = [max_err(outs[m], want) for m in MODES if m[0] == "numpy"]
  if case.reference is not None:
    ref = case.reference(*args)
    errs += [max_err(outs[m], ref) for m in MODES]
  err = max(errs)
  return err, err <= case.tol


NATIVE_LOOPS = ["background"]  # --native-loops: InterpretParams(native_loops=...)


def callables(case):
  """{(mode, how): fn}: interpret="numpy" / interpret=True, eager / jax.jit."""
  fns = {}
  for mode, how in MODES:
    fn = case.make(pallas_np.InterpretParams(native_loops=NATIVE_LOOPS[0]) if mode == "numpy"
                   else True)
    fns[mode, how] = jax.jit(fn) if how == "jit" else fn
  return fns


def measure(name, builder, rounds, budget):
  """First call, check and interleaved warm medians of one kernel: first
  as a user meets it (the native tier doing whatever it does meanwhile,
  nothing waited for), then, if the tier switched a loop to compiled code,
  again after the switch."""
  case = builder()
  args = jax.block_until_ready(case.args)
  fns = callables(case)
  first, outs = {}, {}
  for key, fn in fns.items():
    t0 = time.perf_counter()
    outs[key] = jax.block_until_ready(fn(*args))
    first[key] = time.perf_counter() - t0
  err, ok = check(case, outs, args)
  warm = warm_medians(fns, args, rounds, budget)
  switch = warm_native(fns, args)
  post = None
  if switch is not None:
    for key, fn in fns.items():  # (checked again: after the native tier switched)
      if key[0] == "numpy":
        outs[key] = jax.block_until_ready(fn(*args))
    err2, ok2 = check(case, outs, args)
    err, ok = max(err, err2), ok and ok2
    post = warm_medians({k: f for k, f in fns.items() if k[0] == "numpy"}, args, rounds, budget)
  return {"name": case.name, "first": first, "err": err, "ok": ok, "switch": switch,
          "warm": warm, "post": post, "reps": warm.pop("reps")}


def warm_medians(fns, args, rounds, budget):
  """Median call time of each callable, the callables interleaved."""
  times = {key: [] for key in fns}
  start = time.perf_counter()
  for r in range(rounds):
    for key, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[key].append(time.perf_counter() - t0)
    if r >= 4 and time.perf_counter() - start > budget:
      break
  out = {key: statistics.median(t) for key, t in times.items()}
  out["reps"] = len(next(iter(times.values())))
  return out


def warm_native(fns, args, timeout=120.0, idle=10.0):
  """Call the numpy callables until the native tier (pallas_np.native)
  switched their hot loops: a loop was compiled (built, or loaded from the
  disk cache) and nothing is queued or compiling; or ``idle`` seconds
  passed with nothing ever queued (no loop, or none worth a build: the
  tier starts one once a loop's NumPy path has cost enough,
  docs/performance.md). Returns (calls made, seconds until the switch),
  or None if no loop was compiled."""
  numpy_fns = [fn for key, fn in fns.items() if key[0] == "numpy"]
  before = pallas_np.native.stats()
  t0 = time.perf_counter()
  calls, busy = 0, False
  while True:
    for fn in numpy_fns:
      jax.block_until_ready(fn(*args))
      calls += 1
    s = pallas_np.native.stats()
    pending = s["queued"] + s["compiling"]
    busy = busy or pending > 0
    elapsed = time.perf_counter() - t0
    if s["compiled"] > before["compiled"] and not pending:
      return calls, elapsed
    if elapsed > timeout or (not busy and elapsed > idle):
      return None


def ratio(r, how):
  return r["warm"]["numpy", how] / r["warm"]["interpret", how]


def _post(r) -> str:
  p = r.get("post")
  return "" if p is None else f"{p['numpy', 'eager'] * 1e3:.3f} / {p['numpy', 'jit'] * 1e3:.3f}"


def report(results, command, info):
  """The RESULTS.md section (markdown, between the markers)."""
  lines = [SECTION_START, "", "## Small kernels (warm, eager and under jax.jit)", "",
           f"Machine: {info}.", "",
           f"Command: `{command}` "
           f"({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC).", "",
           "All four callables of a kernel in one process; *warm* = median of repeated calls, "
           "the four interleaved, as a user meets them (the native tier's work, if any, "
           "under way: nothing waited for); *after switch* = the numpy medians again once the "
           "native tier compiled the kernel's hot loops (eager / jit, blank where it compiled "
           "none); *first* = the first call (trace + compile + run). numpy = "
           "interpret=\"numpy\" (`pallas_np.pallas_call`), interpret = `pl.pallas_call(..., "
           "interpret=True)`; jit = the same wrapped in `jax.jit`. Ratio = numpy / interpret "
           "(lower is better, < 1 = numpy faster). Times in ms. Every numpy result is checked "
           "against interpret=True's and the reference.", "",
           "| kernel | numpy eager | interpret eager | eager ratio | numpy jit | interpret jit "
           "| jit ratio | after switch | numpy first | interpret first | reps | check |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for key, r in results.items():
    w, f = r["warm"], r["first"]
    lines.append(
        f"| {r['name']} (`{key}`) | {w['numpy', 'eager'] * 1e3:.3f} | "
        f"{w['interpret', 'eager'] * 1e3:.3f} | {ratio(r, 'eager'):.2f} | "
        f"{w['numpy', 'jit'] * 1e3:.3f} | {w['interpret', 'jit'] * 1e3:.3f} | "
        f"{ratio(r, 'jit'):.2f} | {_post(r)} | {f['numpy', 'eager'] * 1e3:.0f} | "
        f"{f['interpret', 'eager'] * 1e3:.0f} | {r['reps']} | "
        + ("ok" if r["ok"] else f"**err {r['err']:.1e}**") + " |")
  lines.append("")
  kernels = [r for k, r in results.items() if k != FLOOR]
  if kernels:
    lines.append(
        f"- Small kernels, warm geometric mean numpy / interpret=True: eager "
        f"**{suite.geomean([ratio(r, 'eager') for r in kernels]):.2f}**, under jax.jit "
        f"**{suite.geomean([ratio(r, 'jit') for r in kernels]):.2f}** ({len(kernels)} kernels, "
        f"the floor kernel left out; target <= 2.0).")
  if FLOOR in results:
    w = results[FLOOR]["warm"]
    lines.append(
        f"- Per-call floor (one (8,128) block copy): eager numpy "
        f"**{w['numpy', 'eager'] * 1e6:.0f} us** vs interpret=True "
        f"{w['interpret', 'eager'] * 1e6:.0f} us; under jax.jit numpy "
        f"**{w['numpy', 'jit'] * 1e6:.0f} us** vs interpret=True "
        f"{w['interpret', 'jit'] * 1e6:.0f} us.")
  switched = [f"`{k}` {r['switch'][0]} calls / {r['switch'][1]:.1f} s" for k, r in results.items()
              if r.get("switch")]
  if switched:
    lines.append("- Native tier (hot loops built in a compile process, docs/performance.md): "
                 "after the warm runs, calls of the numpy callables until the switch and their "
                 "seconds (a build, or a load from the disk cache): " + ", ".join(switched) + ".")
  lines += ["", SECTION_END]
  return "\n".join(lines)


def write_section(path, section):
  """Put ``section`` into ``path`` in place of the old one (or at the end),
  leaving the rest of the file as it was."""
  text = open(path).read() if os.path.exists(path) else ""
  rest, _ = suite.split_section(text)
  with open(path, "w") as f:
    f.write(rest.rstrip("\n") + "\n\n" + section + "\n")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="fewer warm calls per kernel")
  ap.add_argument("--kernels", help="comma-separated names (default: all)")
  ap.add_argument("--rounds", type=int, help="max warm rounds (default 200, --quick 30)")
  ap.add_argument("--budget", type=float, help="warm seconds per kernel (default 3, --quick 0.7)")
  ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
  ap.add_argument("--native-loops", default="background", choices=("background", "off"),
                  help="InterpretParams(native_loops=...) of the numpy callables")
  args = ap.parse_args(argv)
  NATIVE_LOOPS[0] = args.native_loops
  # Set here, not at import (the tests import this module); both are read
  # when first needed (JAX's backends start on the first computation).
  if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")
  os.environ.setdefault("PALLAS_NP_PROGRESS", "0")
  rounds = args.rounds or (30 if args.quick else 200)
  budget = args.budget if args.budget is not None else (0.7 if args.quick else 3.0)
  cases = all_cases(args.quick)
  names = [n.strip() for n in args.kernels.split(",")] if args.kernels else list(cases)
  info = suite.machine()
  print(info, flush=True)
  results = {}
  for name in names:
    r = results[name] = measure(name, cases[name], rounds, budget)
    w = r["warm"]
    print(f"{name:20s} eager {w['numpy', 'eager'] * 1e3:8.3f} / {w['interpret', 'eager'] * 1e3:8.3f}"
          f" = {ratio(r, 'eager'):6.2f}   jit {w['numpy', 'jit'] * 1e3:8.3f} / "
          f"{w['interpret', 'jit'] * 1e3:8.3f} = {ratio(r, 'jit'):6.2f}   "
          + ("ok" if r["ok"] else f"ERR {r['err']:.1e}")
          + (f"   native after {r['switch'][0]} more calls, {r['switch'][1]:.1f} s: "
             f"{_post(r)} ms" if r["switch"] else ""), flush=True)
  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
  section = report(results, " ".join(["python benchmarks/small_kernels.py", *sys.argv[1:]]),
                   info + f"; load average {load:.1f} at the end")
  write_section(args.out, section)
  print("\n".join(l for l in section.splitlines() if l.startswith("- ")))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
