"""Run the Pallas kernel tests of public kernel libraries (tokamax,
vllm-project/tpu-inference) under ``pallas_np.force_numpy_interpret()``.

The libraries are read from the local git mirrors (``--mirrors``, default
``/work/.mirror``) at a commit (``--commit``, default HEAD; ``--before DATE``
picks the last commit before DATE, e.g. 2026-08-01 for a JAX 0.10 era
checkout), extracted with ``git archive`` into a temporary directory, never
into this repository. Each test file runs in its own subprocess (a hang or a
crash cannot stop the run) with a per-test alarm (``--timeout``) and a
per-file wall limit; a file whose process dies is resumed after the test it
died in. Prints pass/fail counts per library and per kernel, and the first
line of each failure.

Modes (``--mode``): ``numpy`` (pallas_np, the default), ``interpret``
(JAX's ``interpret=True`` through ``force_interpret_mode`` where the JAX
version has it, for comparison) or ``both``. ``--oob-reads fill`` runs
pallas_np with ``InterpretParams(oob_reads="fill")`` (loads past a ref read
the fill, as a TPU reads past it); ``--buffer-bounds padded`` with
``InterpretParams(buffer_bounds="padded")`` (DMAs may run into the buffer's
tile padding past the array's end, as on a TPU). Each kernel runs under a device persona
(``pallas_np.emulate_device``; the table's ``devices``, else ``--device``,
default tpu-v6e): the tests' gates and the ops' ``supported_on`` checks
(``jax.default_backend()`` and ``device.platform``, both patched in the test
process, the latter for the library's own modules only; ``device_kind``,
``pltpu.get_tpu_info()``) see that device, while XLA runs on the CPU.

Library dependencies (PyPI): tokamax needs Python >= 3.12 (PEP 695 syntax)
and absl-py, einshape, jaxtyping, pydantic, qwix, immutabledict,
typeguard==2.13.3, chex, tqdm, flax, tensorboardX (xprof, which its
benchmarking module imports for one profiler tool, is stubbed by ``--stub-xprof``,
default on); tpu-inference's kernel tests need absl-py, requests,
parameterized, torchax (ragged_kv_cache_update_v2) and import ``vllm.logger`` only for a logger: ``--stub-vllm`` (default on)
puts a two-line stand-in for that module on the path, nothing else.

Example:
  python scripts/run_kernel_libraries.py --before 2026-08-01 --libs tpu-inference \\
      --kernels causal_conv1d,csa_gather --max-tests 4
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LIBRARIES = {
    "tokamax": {
        "mirror": "openxla+tokamax",
        "paths": ["tokamax"],
        "packages": ["tokamax"],  # the library's modules (and its tests')
        "kernels": {  # kernel -> test files (the first that exists at the commit)
            "conv1d_gdn": ["tokamax/_src/ops/causal_conv1d_gated_delta_rule/pallas_mosaic_tpu_test.py",
                           "tokamax/_src/ops/experimental/causal_conv1d_gated_delta_rule/gdn_attention_test.py"],
            "gmm_v2": ["tokamax/_src/ops/experimental/gmm_v2/gmm_v2_test.py",
                       "tokamax/_src/ops/ragged_dot/gmm_v2_kernel_tests/pallas_mosaic_tpu_v2_kernel_test.py"],
            "ragged_dot_tpu": ["tokamax/_src/ops/ragged_dot/pallas_mosaic_tpu_test.py"],
            "ragged_dot_tpu_v2": ["tokamax/_src/ops/ragged_dot/pallas_mosaic_tpu_v2_test.py"],
            "ragged_dot_triton": ["tokamax/_src/ops/ragged_dot/pallas_triton_test.py"],
            "ragged_dot_mgpu": ["tokamax/_src/ops/ragged_dot/pallas_mosaic_gpu_test.py"],
            "linear_softmax_ce": ["tokamax/_src/ops/linear_softmax_cross_entropy_loss/pallas_mosaic_tpu_kernel_test.py"],
            "top_k_sparsecore": ["tokamax/_src/ops/experimental/tpu/topk/pallas_mosaic_tpu_test.py"],
            "attention_tpu": ["tokamax/_src/ops/attention/pallas_mosaic_tpu_test.py"],
            "attention_triton": ["tokamax/_src/ops/attention/pallas_triton_test.py"],
            "attention_mgpu": ["tokamax/_src/ops/attention/pallas_mosaic_gpu_test.py"],
            "splash_attention": ["tokamax/_src/ops/experimental/tpu/splash_attention/splash_attention_kernel_test.py"],
            "mla_tpu": ["tokamax/_src/ops/experimental/mla/pallas_mosaic_tpu_kernel_test.py"],
            "flex_attention_triton": ["tokamax/_src/ops/flex_attention/pallas_triton_test.py"],
            "glu_triton": ["tokamax/_src/ops/gated_linear_unit/pallas_triton_test.py"],
            "glu_mgpu": ["tokamax/_src/ops/gated_linear_unit/pallas_mosaic_gpu_test.py"],
            "normalization_triton": ["tokamax/_src/ops/normalization/pallas_triton_test.py"],
            "ragged_gather_tpu": ["tokamax/_src/ops/ragged_gather/pallas_mosaic_tpu_test.py"],
            "ragged_gather_tpu_v2": ["tokamax/_src/ops/ragged_gather/pallas_mosaic_v2_tpu_test.py"],
        },
        # The device each kernel's tests gate on (a pallas_np persona name);
        # unlisted: --device. Tests asking for a TPU7x name it in device_kind.
        "devices": {
            "ragged_dot_triton": "h100", "ragged_dot_mgpu": "h100", "attention_triton": "h100",
            "attention_mgpu": "h100", "flex_attention_triton": "h100", "glu_triton": "h100",
            "glu_mgpu": "h100", "normalization_triton": "h100",
            "mla_tpu": "tpu-v7x", "ragged_gather_tpu": "tpu-v7x", "ragged_gather_tpu_v2": "tpu-v7x",
        },
    },
    "tpu-inference": {
        "mirror": "vllm-project+tpu-inference",
        "paths": ["tpu_inference", "tests"],
        "packages": ["tpu_inference", "tests"],
        "kernels": {
            "causal_conv1d": ["tests/kernels/causal_conv1d_test.py"],
            "gmm_v2": ["tests/kernels/gmm_test.py"],
            "fused_moe_v1": ["tests/kernels/fused_moe_v1_test.py"],
            "mla_v2": ["tests/kernels/mla_v2_test.py"],
            "ragged_kv_cache_update_v2": ["tests/kernels/ragged_kv_cache_update_v2_test.py"],
            "dsv4_mla": ["tests/kernels/deepseek_v4/mla_test.py"],
            "dsv4_csa_gather": ["tests/kernels/deepseek_v4/csa_gather_test.py"],
            "dsv4_sparse_mla": ["tests/kernels/deepseek_v4/sparse_mla_test.py"],
            "dsv4_compress_and_store": ["tests/kernels/deepseek_v4/compress_store_test.py"],
        },
        "devices": {},
    },
}

# Loaded by every test process (-p): enters the interpret mode for the whole
# session, arms a per-test alarm, and appends one JSON line per test outcome.
PLUGIN = textwrap.dedent('''
    import json, os, signal, time
    import pytest

    _OUT = os.environ["KL_RESULTS"]
    _TIMEOUT = int(os.environ.get("KL_TIMEOUT", "300"))
    _ctx = None


    def pytest_configure(config):
      global _ctx
      mode = os.environ.get("KL_MODE", "numpy")
      device = os.environ.get("KL_DEVICE", "tpu-v6e")
      if mode == "numpy":
        import pallas_np
        if device.startswith("tpu-"):
          pallas_np.assume_tpu_chip({"tpu-v7x": "7x"}.get(device, device[4:]))
        if hasattr(pallas_np, "emulate_device"):  # the persona: gates and device queries
          _ctx = pallas_np.emulate_device(device, **_options())
        else:
          _ctx = pallas_np.force_numpy_interpret(pallas_np.InterpretParams(**_options()))
        # The libraries gate their TPU/GPU tests on jax.default_backend(); the
        # persona keeps XLA on the CPU (JAX's own code calls xla_bridge's).
        import jax
        platform = "tpu" if device.startswith("tpu") else "gpu"
        jax.default_backend = lambda: platform
        _device_platform_for_library(type(jax.devices()[0]), platform)
      else:
        from jax.experimental import pallas as pl
        force = getattr(pl, "force_interpret_mode", None)
        if force is None:
          raise SystemExit("this JAX has no pl.force_interpret_mode")
        _ctx = force(True)
      _ctx.__enter__()


    def _options():
      opts = dict(oob_reads=os.environ.get("KL_OOB", "raise"))
      if os.environ.get("KL_BUFFER_BOUNDS", "logical") != "logical":
        opts["buffer_bounds"] = os.environ["KL_BUFFER_BOUNDS"]
      return opts


    def _device_platform_for_library(cls, platform):
      """``device.platform`` answers ``platform`` to the library's own code
      (its ``supported_on`` checks and test gates read it) and ``cpu`` to
      everything else: JAX lowers and runs the code around the kernels for
      the CPU. The caller is told apart by its module's name."""
      import sys
      prefixes = tuple(os.environ["KL_PACKAGES"].split(","))
      orig = next(c.__dict__["platform"] for c in cls.__mro__ if "platform" in c.__dict__)

      def get(self):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith(prefixes):
          return platform
        return orig.__get__(self, cls)
      cls.platform = property(get)


    class _Timeout(Exception):
      pass


    def _alarm(signum, frame):
      raise _Timeout(f"test took longer than {_TIMEOUT} s")


    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
      with open(_OUT + ".current", "w") as f:
        f.write(item.nodeid)
      signal.signal(signal.SIGALRM, _alarm)
      signal.alarm(_TIMEOUT)
      try:
        yield
      finally:
        signal.alarm(0)


    def pytest_runtest_logreport(report):
      if report.when != "call" and not (report.failed or report.skipped):
        return
      msg = ""
      if report.failed:
        text = str(report.longrepr)
        # (an exception group, e.g. hypothesis's, has no "E " lines and
        # frames its members with | and +---)
        every = [l for l in text.splitlines() if l.strip(" |+-")]
        lines = [l for l in every if l.startswith("E ")] or every
        lines = [l for l in lines if "For simplicity, JAX" not in l]
        errs = [l for l in lines if "Error:" in l or "Mismatch" in l or "Not equal" in l
                or "took longer than" in l]
        msg = ((errs or lines)[-1].strip(" |") if lines else "")[:300]
      elif report.skipped:
        msg = str(report.longrepr)[-200:]
      with open(_OUT, "a") as f:
        f.write(json.dumps(dict(id=report.nodeid, outcome=report.outcome, when=report.when,
                                secs=round(report.duration, 1), msg=msg)) + "\\n")
''')

VLLM_LOGGER_STUB = ("import logging\n_VllmLogger = logging.Logger\n"
                    "def init_logger(name):\n  return logging.getLogger(name)\n")
# tokamax's benchmarking module imports one profiler tool at import time (only
# its xprof timing method calls it); xprof itself pulls in a cloud SDK.
XPROF_TOOLS_STUB = ("def get_kernel_stats_tool(*args, **kwargs):\n"
                    "  raise RuntimeError('xprof is stubbed by run_kernel_libraries.py')\n")


def resolve_commit(mirror: str, commit: str, before: str | None) -> str:
  if before:
    commit = subprocess.check_output(
        ["git", "-C", mirror, "rev-list", "-1", f"--before={before}", commit], text=True).strip()
  return subprocess.check_output(["git", "-C", mirror, "rev-parse", commit], text=True).strip()


def extract(mirror: str, commit: str, paths, dest: str):
  os.makedirs(dest, exist_ok=True)
  archive = subprocess.run(["git", "-C", mirror, "archive", commit, *paths],
                           check=True, capture_output=True).stdout
  subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)


def collect(python, root, test_file, env, limit_s) -> list[str]:
  try:
    out = subprocess.run([python, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", test_file],
                         cwd=root, env=env, capture_output=True, text=True, timeout=limit_s)
  except subprocess.TimeoutExpired:
    return []
  ids = [l.strip() for l in out.stdout.splitlines() if "::" in l and not l.startswith(" ")]
  if not ids:
    tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
    raise RuntimeError("collection failed: " + " | ".join(tail))
  return ids


def pick(ids, k):
  """Up to ``k`` tests spread over the file (parametrizations vary sizes)."""
  if k <= 0 or len(ids) <= k:
    return list(ids)
  step = len(ids) / k
  return [ids[int(i * step)] for i in range(k)]


def run_tests(python, root, ids, env, per_test_s, results_path) -> list[dict]:
  """Run ``ids`` in one process; resume after a test that hangs or crashes it."""
  done: dict[str, dict] = {}
  todo = list(ids)
  while todo:
    if os.path.exists(results_path):
      os.remove(results_path)
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kl_plugin", *todo]
    limit = per_test_s * len(todo) + 120
    try:
      subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=limit)
      died = None
    except subprocess.TimeoutExpired:
      died = "timeout (process killed)"
    for line in open(results_path) if os.path.exists(results_path) else ():
      r = json.loads(line)
      if r["id"] not in done or r["outcome"] == "failed":
        done[r["id"]] = r
    current = None
    if os.path.exists(results_path + ".current"):
      current = open(results_path + ".current").read().strip()
      os.remove(results_path + ".current")
    rest = [t for t in todo if t not in done]
    if not rest:
      break
    stuck = current if current in rest else rest[0]
    done[stuck] = dict(id=stuck, outcome="failed", secs=None,
                       msg=died or "the test process exited without a result (crash?)")
    todo = [t for t in rest if t != stuck]
  return [done[t] for t in ids if t in done]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--mirrors", default="/work/.mirror")
  ap.add_argument("--libs", default="tokamax,tpu-inference")
  ap.add_argument("--kernels", default="", help="comma-separated kernel names (default: all)")
  ap.add_argument("--commit", default="HEAD")
  ap.add_argument("--before", default=None, help="last commit before this date (e.g. 2026-08-01)")
  ap.add_argument("--mode", choices=("numpy", "interpret", "both"), default="numpy")
  ap.add_argument("--oob-reads", choices=("raise", "fill"), default="raise")
  ap.add_argument("--buffer-bounds", choices=("logical", "padded"), default="logical",
                  help="InterpretParams.buffer_bounds: 'padded' lets DMAs run into the tile padding")
  ap.add_argument("--device", default="tpu-v6e",
                  help="persona for kernels the table does not place (tpu-v6e, tpu-v7x, h100, ...)")
  ap.add_argument("--timeout", type=int, default=300, help="seconds per test")
  ap.add_argument("--max-tests", type=int, default=6, help="tests per kernel (0: all)")
  ap.add_argument("--python", default=sys.executable)
  ap.add_argument("--pallas-np", default=REPO_ROOT,
                  help="the directory whose pallas_np package is tested (default: this checkout)")
  ap.add_argument("--stub-vllm", action=argparse.BooleanOptionalAction, default=True)
  ap.add_argument("--stub-xprof", action=argparse.BooleanOptionalAction, default=True)
  ap.add_argument("--json", default=None, help="write all results here")
  args = ap.parse_args(argv)
  wanted = {k for k in args.kernels.split(",") if k}
  modes = ("numpy", "interpret") if args.mode == "both" else (args.mode,)
  all_results = []
  with tempfile.TemporaryDirectory(prefix="kernel_libs_") as tmp:
    plugin_dir = os.path.join(tmp, "plugin")
    os.makedirs(plugin_dir)
    with open(os.path.join(plugin_dir, "kl_plugin.py"), "w") as f:
      f.write(PLUGIN)
    if args.stub_vllm:
      os.makedirs(os.path.join(plugin_dir, "vllm"))
      open(os.path.join(plugin_dir, "vllm", "__init__.py"), "w").close()
      with open(os.path.join(plugin_dir, "vllm", "logger.py"), "w") as f:
        f.write(VLLM_LOGGER_STUB)
    if args.stub_xprof:
      os.makedirs(os.path.join(plugin_dir, "xprof", "cli"))
      open(os.path.join(plugin_dir, "xprof", "__init__.py"), "w").close()
      open(os.path.join(plugin_dir, "xprof", "cli", "__init__.py"), "w").close()
      with open(os.path.join(plugin_dir, "xprof", "cli", "tools.py"), "w") as f:
        f.write(XPROF_TOOLS_STUB)
    for lib in args.libs.split(","):
      spec = LIBRARIES[lib]
      mirror = os.path.join(args.mirrors, spec["mirror"], "repo")
      commit = resolve_commit(mirror, args.commit, args.before)
      root = os.path.join(tmp, lib)
      extract(mirror, commit, spec["paths"], root)
      print(f"== {lib} at {commit[:12]} ({args.python})", flush=True)
      for kernel, files in spec["kernels"].items():
        if wanted and kernel not in wanted:
          continue
        test_file = next((p for p in files if os.path.exists(os.path.join(root, p))), None)
        if test_file is None:
          print(f"  {kernel}: no test file at this commit")
          continue
        for mode in modes:
          env = dict(os.environ, KL_MODE=mode, KL_OOB=args.oob_reads,
                     KL_BUFFER_BOUNDS=args.buffer_bounds,
                     KL_DEVICE=spec["devices"].get(kernel, args.device),
                     KL_PACKAGES=",".join(spec["packages"]),
                     KL_TIMEOUT=str(args.timeout), JAX_PLATFORMS="cpu",
                     KL_RESULTS=os.path.join(tmp, f"{lib}-{kernel}-{mode}.jsonl"),
                     PYTHONPATH=os.pathsep.join([args.pallas_np, plugin_dir, root]))
          t0 = time.time()
          try:
            ids = pick(collect(args.python, root, test_file, env, 600), args.max_tests)
            results = run_tests(args.python, root, ids, env, args.timeout, env["KL_RESULTS"])
          except (RuntimeError, OSError) as err:
            results = [dict(id=test_file, outcome="failed", secs=None, msg=str(err)[:300])]
          counts = collections.Counter(r["outcome"] for r in results)
          print(f"  {kernel} [{mode}]: {counts.get('passed', 0)} passed, "
                f"{counts.get('failed', 0)} failed, {counts.get('skipped', 0)} skipped "
                f"({time.time() - t0:.0f} s)", flush=True)
          for r in results:
            if r["outcome"] != "passed":
              print(f"    {r['outcome']}: {r['id'].split('::')[-1]}: {r['msg']}", flush=True)
            all_results.append(dict(r, lib=lib, kernel=kernel, mode=mode, commit=commit))
  print("== totals")
  for lib in sorted({r["lib"] for r in all_results}):
    for mode in modes:
      c = collections.Counter(r["outcome"] for r in all_results if r["lib"] == lib and r["mode"] == mode)
      print(f"  {lib} [{mode}]: {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, "
            f"{c.get('skipped', 0)} skipped")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(all_results, f, indent=1)


if __name__ == "__main__":
  main()
