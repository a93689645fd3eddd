"""JAX's Pallas test files on the accelerator itself and in numpy mode, side by side.

Run on a machine with the GPU (and JAX's CUDA plugin) from this checkout's root:

    python scripts/device_compare.py --tests-dir DIR --out OUT mosaic_gpu_test.py
    python scripts/device_compare.py --tests-dir DIR --out OUT --only numpy --device h100 \\
        --hardware-log OUT/mosaic_gpu_test.py.hw.jsonl mosaic_gpu_test.py

``DIR`` is JAX's ``tests/`` (or ``tests/pallas/``) at the installed JAX's tag, extracted
beforehand (``git archive jax-vX.Y.Z tests/pallas | tar -x``): the GPU machine has no
mirror and no network. Per file, two pytest runs, in parallel (``pytest-xdist``):

- **hardware**: the file as JAX's CI runs it, with nothing of pallas_np imported;
- **numpy**: the same file under ``--pallas-device=NAME`` with no GPU visible
  (``CUDA_VISIBLE_DEVICES=`` and ``JAX_PLATFORMS=cpu``): what a CPU-only machine sees.

One JSON line per test goes to ``OUT/<file>.hw.jsonl`` / ``OUT/<file>.np.jsonl`` (the
reporter of ``scripts/run_jax_tests.py``), and the summary says how many of the tests that
pass on the hardware pass in numpy mode, listing the others with their first line. A
persona skip of such a test (profiler, lowering text) counts as not passing. Nothing here
runs in CI.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from run_jax_tests import REPORTER  # noqa: E402  (the one per-test JSON reporter)


def _find(tests_dir: str, name: str) -> str:
  for candidate in (os.path.join(tests_dir, name), os.path.join(tests_dir, "pallas", name)):
    if os.path.isfile(candidate):
      return candidate
  raise SystemExit(f"device_compare: no {name} under {tests_dir}")


def _plugin_installed(python: str) -> bool:
  """Whether ``python`` loads pallas_np's pytest plugin by its entry point."""
  probe = ("import importlib.metadata as m; print(any(e.value == 'pallas_np.pytest_plugin' "
           "for e in m.entry_points(group='pytest11')))")
  out = subprocess.run([python, "-c", probe], capture_output=True, text=True)
  return out.stdout.strip() == "True"


def _pytest(args, path, log, numpy_mode: bool, workers: int, timeout: float):
  """Starts one pytest run of ``path`` writing its JSON lines to ``log``."""
  work = os.path.dirname(os.path.abspath(log))
  with open(os.path.join(work, "pytest.ini"), "w") as f:
    f.write("[pytest]\n")  # the test ids stay relative to OUT, not to this checkout
  env = dict(os.environ, RUN_JAX_TESTS_LOG=log, PALLAS_NP_PROGRESS="0",
             PYTHONPATH=os.pathsep.join(([ROOT] if numpy_mode else []) + [work]))
  env.pop("PALLAS_NP_FORCE", None)
  cmd = [args.python, "-m", "pytest", "-q", "-c", os.path.join(work, "pytest.ini"),
         "-p", "no:cacheprovider", "-p", "run_jax_tests_report", os.path.abspath(path)]
  if workers > 1:
    cmd[3:3] = ["-n", str(workers)]
  if numpy_mode:
    env.update(CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
    if not _plugin_installed(args.python):  # a checkout on PYTHONPATH, not pip-installed
      cmd += ["-p", "pallas_np.pytest_plugin"]
    cmd += [f"--pallas-device={args.device}"]
  else:
    env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false")  # several workers share one GPU
  if os.path.exists(log):
    os.remove(log)
  out = open(log[:-len(".jsonl")] + ".out", "w")
  return subprocess.Popen(["timeout", str(int(timeout)), *cmd], stdout=out,
                          stderr=subprocess.STDOUT, env=env, cwd=work)


def _load(log: str) -> dict:
  """Test id -> its last report (xdist may report a test twice)."""
  rows = {}
  if os.path.exists(log):
    with open(log) as f:
      for line in f:
        if line.strip():
          row = json.loads(line)
          rows[row["id"].split("::", 1)[-1]] = row
  return rows


def compare(name: str, hw: dict, npm: dict) -> str:
  lines = []
  for label, rows in (("hardware", hw), ("numpy", npm)):
    counts = collections.Counter(r["outcome"] for r in rows.values())
    lines.append(f"{name} {label}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
  passing = [i for i, r in hw.items() if r["outcome"] == "passed" and i in npm]
  ok = [i for i in passing if npm[i]["outcome"] == "passed"]
  missing = sum(1 for i, r in hw.items() if r["outcome"] == "passed" and i not in npm)
  if passing:
    lines.append(f"{name}: numpy mode passes {len(ok)} of the {len(passing)} tests that pass on "
                 f"the hardware ({100 * len(ok) / len(passing):.1f}%)"
                 + (f"; {missing} hardware passes did not run in numpy mode" if missing else ""))
  for i in passing:
    if npm[i]["outcome"] != "passed":
      lines.append(f"   {npm[i]['outcome']:7s} {i} | {npm[i]['reason'][:200]}")
  extra = [i for i, r in npm.items() if r["outcome"] == "passed" and i in hw
           and hw[i]["outcome"] != "passed"]
  if extra:
    lines.append(f"{name}: {len(extra)} tests pass in numpy mode but not on the hardware")
  return "\n".join(lines)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("files", nargs="+")
  ap.add_argument("--tests-dir", required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--device", default="h100", help="the persona of the numpy-mode run")
  ap.add_argument("--only", choices=("hardware", "numpy"), default=None)
  ap.add_argument("--hardware-log", default=None,
                  help="compare with this earlier hardware run's JSON lines (one file)")
  ap.add_argument("--hw-workers", type=int, default=8)
  ap.add_argument("--np-workers", type=int, default=8)
  ap.add_argument("--timeout", type=float, default=420, help="seconds per pytest run")
  ap.add_argument("--python", default=sys.executable)
  args = ap.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "run_jax_tests_report.py"), "w") as f:
    f.write(REPORTER)
  runs = []
  for name in args.files:
    path = _find(args.tests_dir, name)
    base = os.path.join(args.out, os.path.basename(path))
    if args.only != "numpy":
      runs.append(_pytest(args, path, base + ".hw.jsonl", False, args.hw_workers, args.timeout))
    if args.only != "hardware":
      runs.append(_pytest(args, path, base + ".np.jsonl", True, args.np_workers, args.timeout))
  for proc in runs:
    proc.wait()
  for name in args.files:
    base = os.path.join(args.out, os.path.basename(_find(args.tests_dir, name)))
    hw = _load(args.hardware_log if args.hardware_log else base + ".hw.jsonl")
    print(compare(os.path.basename(name), hw, _load(base + ".np.jsonl")), flush=True)


if __name__ == "__main__":
  main()
