"""Library kernels with loops, warm, with the native tier (issue 41 item 2):
numpy mode with its loops compiled vs numpy mode with ``native_loops="off"``
vs interpret=True, in one process, plus a bit-for-bit check of the compiled
run against the NumPy path.

    python benchmarks/native_library.py                      # every case
    python benchmarks/native_library.py --cases gpu_attention,tpu_flash_fwd --budget 2
    python benchmarks/native_library.py --profile          # where the compiled calls' time goes
    python benchmarks/native_library.py --call-sites       # a DMA/semaphore call site's own cost
    python benchmarks/native_library.py --time-sources OLD.py NEW.py --operands SPEC
                                                           # two generated loops, interleaved

The compiled figures are the steady state after the switch: the loops are
built at the first call (``native_loops="sync"``; a default
``"background"`` run reaches the same code once its build finished), and
the warm median is taken after it. ``native`` counts the calls that ran
compiled loops (0: a loop was refused; see benchmarks/native_eligibility.py).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
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
import numpy as np  # noqa: E402

import pallas_np  # noqa: E402
from pallas_np import _compat as jc  # noqa: E402
from pallas_np import native  # noqa: E402

SYNC = pallas_np.InterpretParams(native_loops="sync")
OFF = pallas_np.InterpretParams(native_loops="off")


def _bench(name):
  """(make(interp) -> fn, args) of a benchmarks/kernels.py case."""
  from benchmarks import kernels
  builder = {**kernels.all_cases(), **kernels.GPU_OP_CASES}[name]
  case = builder()
  return case.make, case.args


@contextlib.contextmanager
def _interpret_true():
  prev = jc.interpret_mode_config.swap_local(True)
  try:
    yield
  finally:
    jc.interpret_mode_config.set_local(prev)


def _tpu(name):
  """A JAX TPU library kernel (benchmarks/tpu_kernels.py), routed by a
  force scope: make(interp) runs it in that mode."""
  from benchmarks import tpu_kernels
  fn, args = tpu_kernels.CASES[name]()
  jitted = jax.jit(fn)

  def make(interp):
    def run(*a):
      scope = (_interpret_true() if interp is True
               else pallas_np.force_numpy_interpret(interp))
      with scope:
        return jitted(*a)
    return run
  return make, args


CASES = {
    "gpu_attention": functools.partial(_bench, "gpu_attention"),
    "gpu_ops_decode_gqa": functools.partial(_bench, "gpu_ops_decode_gqa"),
    "gpu_ops_decode_mqa": functools.partial(_bench, "gpu_ops_decode_mqa"),
    "gpu_ops_paged_attention": functools.partial(_bench, "gpu_ops_paged_attention"),
    "gpu_ops_mha_fwd": functools.partial(_bench, "gpu_ops_mha_fwd"),
    "gpu_ops_layer_norm_fwd": functools.partial(_bench, "gpu_ops_layer_norm_fwd"),
    "tpu_flash_fwd": functools.partial(_tpu, "flash_fwd"),
    "tpu_splash_fwd": functools.partial(_tpu, "splash_fwd"),
    "tpu_paged": functools.partial(_tpu, "paged"),
    "tpu_paged_quantized": functools.partial(_tpu, "paged_quantized"),
}


def _warm(fn, args, budget):
  times = []
  start = time.perf_counter()
  while len(times) < 3 or (time.perf_counter() - start < budget and len(times) < 200):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


def _bits(a):
  a = np.asarray(a)
  if a.dtype.kind == "f":
    a = np.where(np.isnan(a), np.array(np.nan, a.dtype), a)
  return a.tobytes()


def run_case(name, budget):
  make, args = CASES[name]()
  args = jax.block_until_ready(args)
  fns = {"compiled": make(SYNC), "off": make(OFF), "interpret": make(True)}
  outs = {}
  before = native.stats()["native_calls"]
  for mode, fn in fns.items():
    outs[mode] = jax.block_until_ready(fn(*args))  # first calls (the build, for "compiled")
  native_calls = native.stats()["native_calls"] - before
  same = all(_bits(a) == _bits(b) for a, b in zip(jax.tree_util.tree_leaves(outs["compiled"]),
                                                  jax.tree_util.tree_leaves(outs["off"])))
  ms = {mode: _warm(fn, args, budget) for mode, fn in fns.items()}
  return ms, native_calls, same


def _is_loop_entry(func: str) -> bool:
  """A compiled loop's entry point in cProfile's names: numba's
  ``pallas_np_native_loop...`` or lite's ``lite_entry``."""
  return "pallas_np_native_loop" in func or "lite_entry" in func


def _built_loops():
  """The native tier's loops with a compiled function in this process."""
  import gc
  from pallas_np.native import tier
  return [o for o in gc.get_objects()
          if issubclass(type(o), tier.NativeLoop) and o.native is not None and hasattr(o, "status")]


def profile_case(name, calls=10):
  """Where a warm compiled call's time goes: ms per call, of which in
  compiled loops (cProfile: the libraries' own time), of which in BLAS
  products (each routine timed through a forwarding wrapper,
  ``blas_calls.timed_routines``; its Python cost is not counted), and the
  products per call."""
  import cProfile
  import pstats
  from pallas_np.native import blas_calls
  make, args = CASES[name]()
  args = jax.block_until_ready(args)
  fn = make(SYNC)
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  prof = cProfile.Profile()
  t0 = time.perf_counter()
  prof.enable()
  for _ in range(calls):
    jax.block_until_ready(fn(*args))
  prof.disable()
  total = (time.perf_counter() - t0) / calls * 1e3
  stats = pstats.Stats(prof).stats.items()
  loops = sum(tt for (_, _, func), (_, _, tt, _, _) in stats if _is_loop_entry(func))
  loop_calls = sum(nc for (_, _, func), (_, nc, _, _, _) in stats if _is_loop_entry(func))
  with blas_calls.timed_routines() as timed:
    built = _built_loops()
    kept = [loop.status for loop in built]
    for loop in built:  # (a loop keeps its status array: the timed routines' addresses now)
      loop.status = loop.new_status()
    try:
      for _ in range(calls):
        jax.block_until_ready(fn(*args))
    finally:
      for loop, st in zip(built, kept):
        loop.status = st
  gemm = sum(timed.seconds.values()) / calls * 1e3
  products = {k: v // calls for k, v in timed.calls.items() if v}
  return total, loops / calls * 1e3, gemm, loop_calls // calls, products


def _call_site_kernels():
  """(name, make(mode) -> fn, args, operations a call): a loop of 4-KiB DMAs
  started and waited at computed offsets, and a loop of nothing but a
  semaphore signal and wait (docs/native_dma.md)."""
  from jax import lax
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  import jax.numpy as jnp
  n_dma, n_sem = 256, 2000

  def dma_kernel(x_hbm, o_ref, buf, sem):
    def body(i, c):
      cp = pltpu.make_async_copy(x_hbm.at[pl.ds(i % 32 * 8, 8)], buf.at[i % 2], sem.at[i % 2])
      cp.start()
      cp.wait()
      return c
    lax.fori_loop(0, n_dma, body, 0)
    o_ref[...] = buf[0]

  def sem_kernel(o_ref, sem):
    def body(i, c):
      pl.semaphore_signal(sem, 1)
      pl.semaphore_wait(sem, 1)
      return c + 1
    o_ref[0] = lax.fori_loop(0, n_sem, body, jnp.int32(0))

  def make_dma(mode):
    return pl.pallas_call(
        dma_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((2, 8, 128), jnp.float32), pltpu.SemaphoreType.DMA((2,))],
        interpret=pallas_np.InterpretParams(native_loops=mode))

  def make_sem(mode):
    return pl.pallas_call(
        sem_kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
        out_specs=pl.BlockSpec(memory_space=pltpu.SMEM),
        scratch_shapes=[pltpu.SemaphoreType.REGULAR],
        interpret=pallas_np.InterpretParams(native_loops=mode))
  return [("DMA start + wait", make_dma, (jnp.ones((256, 128), jnp.float32),), n_dma),
          ("semaphore signal + wait", make_sem, (), n_sem)]


def main_call_sites(rounds=7):
  print("| loop of | compiled us / iteration | NumPy path us / iteration | compiled / NumPy |")
  print("|---|---|---|---|")
  for what, make, args, n in _call_site_kernels():
    fns = {m: make(m) for m in ("sync", "off")}
    for fn in fns.values():
      jax.block_until_ready(fn(*args))
      jax.block_until_ready(fn(*args))
    times = {m: [] for m in fns}
    for _ in range(rounds):
      for m, fn in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times[m].append((time.perf_counter() - t0) / n * 1e6)
    c, o = statistics.median(times["sync"]), statistics.median(times["off"])
    print(f"| {what} | {c:.1f} | {o:.1f} | {c / o:.2f} |", flush=True)


def main_profile(names):
  print("| case | ms / call | in compiled loops | of which BLAS | loop calls / call | "
        "BLAS calls / call |")
  print("|---|---|---|---|---|---|")
  for name in names:
    total, loops, gemm, loop_calls, products = profile_case(name)
    print(f"| {name} | {total:.2f} | {loops:.2f} ({loops / total:.0%}) | {gemm:.2f} "
          f"({gemm / max(loops, 1e-9):.0%} of the loops) | {loop_calls} | "
          f"{', '.join(f'{k} {v}' for k, v in products.items())} |", flush=True)


def _source_loop(path):
  """The ``native_loop`` of a generated source kept by the disk cache
  (``<key>.py`` and its constants ``<key>.npz``), compiled in this
  process with ``numba.njit`` (the compile process's flags: numpy error
  model, no fastmath). A linked external (XLA's float32 formulas for
  vectors under 64 elements) is replaced by NumPy's: timing only."""
  import numba
  text = open(path).read().replace("_ext_xla_expf(", "np.exp(")
  glb = {"np": np}
  with np.load(path[:-3] + ".npz") as consts:
    glb.update({k: consts[k][()] for k in consts.files})
  exec(compile(text, path, "exec"), glb)  # noqa: S102 - our own generated source
  return numba.njit(error_model="numpy")(glb["native_loop"])


def main_time_sources(paths, spec, rounds=40, calls=50):
  """Two (or more) generated sources of one loop, called alternately in
  this process on the same operands (``spec``: a Python list, an int a
  scalar int32, a tuple a float32 array of that shape from a normal
  distribution, ("i", shape) an int32 array of ``arange % 128``), BLAS on
  one thread as in a kernel run: µs per call, min and median of rounds."""
  from pallas_np import blas
  from pallas_np.native import blas_calls
  rng = np.random.default_rng(0)
  args = [np.int32(a) if isinstance(a, int)
          else (np.arange(int(np.prod(a[1])), dtype=np.int32).reshape(a[1]) % 128
                if a[0] == "i" else rng.standard_normal(a).astype(np.float32))
          for a in ast.literal_eval(spec)]
  st = blas_calls.status()
  fns = [_source_loop(p) for p in paths]
  times = [[] for _ in fns]
  with blas.kernel_run():
    for fn in fns:
      fn(st, *args)
    for _ in range(rounds):
      for fn, t in zip(fns, times):
        t0 = time.perf_counter()
        for _ in range(calls):
          fn(st, *args)
        t.append((time.perf_counter() - t0) / calls * 1e6)
  for p, t in zip(paths, times):
    print(f"{os.path.basename(p)}: min {min(t):.1f} us, median {statistics.median(t):.1f} us")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--cases", default="", help="comma-separated (default: all)")
  ap.add_argument("--budget", type=float, default=2.0, help="seconds of warm calls per mode")
  ap.add_argument("--profile", action="store_true",
                  help="where the compiled calls' time goes (compiled loops, BLAS products)")
  ap.add_argument("--call-sites", action="store_true",
                  help="a DMA/semaphore call site's own cost (compiled vs NumPy path loops)")
  ap.add_argument("--time-sources", nargs="+", default=None, metavar="SOURCE.py",
                  help="generated loop sources (disk cache) timed against each other")
  ap.add_argument("--operands", default="", help="the loop's operands for --time-sources")
  a = ap.parse_args()
  if a.time_sources:
    main_time_sources(a.time_sources, a.operands)
    return
  names = [n for n in a.cases.split(",") if n] or list(CASES)
  if a.call_sites:
    main_call_sites()
    return
  if a.profile:
    main_profile(names)
    return
  print("| case | compiled ms | off ms | interpret=True ms | compiled / interpret | "
        "off / interpret | native calls | bits = off |")
  print("|---|---|---|---|---|---|---|---|")
  for name in names:
    try:
      ms, calls, same = run_case(name, a.budget)
    except Exception as e:  # noqa: BLE001 - a case that fails here is reported
      print(f"| {name} | error: {type(e).__name__}: {str(e)[:100]} |")
      continue
    c, o, i = ms["compiled"], ms["off"], ms["interpret"]
    print(f"| {name} | {c:.3f} | {o:.3f} | {i:.3f} | {c / i:.2f}x | {o / i:.2f}x | {calls} | "
          f"{'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
  main()
