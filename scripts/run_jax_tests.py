"""Run JAX's own Pallas test files with pallas_np standing in for a device.

    python scripts/run_jax_tests.py --device h100 mosaic_gpu_test.py
    python scripts/run_jax_tests.py --device tpu-v5e tpu_pallas_state_test.py tpu_pallas_random_test.py
    python scripts/run_jax_tests.py --device cpu gpu_pallas_interpret_test.py
    python scripts/run_jax_tests.py --device h100 --sample 300 --timeout 1500 mosaic_gpu_test.py

JAX's ``tests/`` directory at the installed JAX's tag (``jax-v<version>``,
or ``--tag``) is extracted from the local mirror of JAX's repository
(``--mirror``; ``git archive``, into a temporary directory) and each named
file runs in its own ``pytest --pallas-device=NAME`` subprocess (the
``pallas_np`` of this checkout) with a wall-clock limit. A small reporting
plugin writes one JSON line per test as it finishes, so a file that runs
past its limit still reports what it ran. Per file: pass/fail/skip counts
and the failure reasons grouped by their first line (the reason a skipped
test gives is grouped too, with ``--skips``).

Without the mirror (a GPU machine, say): ``--tests-dir DIR`` runs the test
files of an already-extracted JAX ``tests/`` directory (DIR, or DIR/tests),
e.g. made by ``git -C <jax repo> archive jax-v0.11.0 tests | tar -x -C DIR``;
test helpers the wheel lacks are then looked for in DIR/_shims.
``--log FILE`` writes every test's JSON line (``file``, ``id``, ``outcome``,
``reason``, ``seconds``, ``device``) to FILE. ``--device none`` runs the files
with no persona and no platform forced: on a machine with the device, the
hardware's own results, in the same format. ``--compare BASELINE.jsonl``
then says how many of the tests that passed in the baseline log pass now,
and lists the others.

    python scripts/run_jax_tests.py --tests-dir /tmp/jaxtests --device none \
        --log h100.jsonl mosaic_gpu_test.py               # on the H100
    python scripts/run_jax_tests.py --tests-dir /tmp/jaxtests --device h100 \
        --log numpy.jsonl --compare h100.jsonl mosaic_gpu_test.py

Nothing here runs in CI: it needs the mirror or an extracted ``tests/``
(no network is used).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tarfile
import io
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MIRROR = "/work/.mirror/jax-ml+jax/repo"

# Written next to the extracted tests and loaded with ``-p``: one JSON line per
# test report (the call phase, or setup when it failed or skipped).
REPORTER = '''
import importlib.util, json, os, sys
_OUT = os.environ["RUN_JAX_TESTS_LOG"]

# JAX's test helpers that its wheel does not ship (jax._src.hypothesis_test_util),
# extracted from the mirror at the same tag: loaded under their module names.
_SHIMS = os.environ.get("RUN_JAX_TESTS_SHIMS", "")
if _SHIMS:
  import jax._src
  for _file in sorted(os.listdir(_SHIMS)):
    _name = "jax._src." + _file[:-3]
    _spec = importlib.util.spec_from_file_location(_name, os.path.join(_SHIMS, _file))
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[_name] = _mod
    _spec.loader.exec_module(_mod)
    _parent, _, _leaf = _name.rpartition(".")
    setattr(importlib.import_module(_parent), _leaf, _mod)

def _first_line(report):
  if report.passed:
    return ""
  lr = report.longrepr
  if isinstance(lr, tuple) and len(lr) == 3:  # a skip: (file, line, reason)
    return str(lr[2])
  crash = getattr(lr, "reprcrash", None)
  if crash is not None and getattr(crash, "message", None):
    return crash.message
  return str(lr).strip().splitlines()[-1] if lr else ""

def pytest_runtest_logreport(report):
  if report.when == "call" or (report.when == "setup" and not report.passed) or (
      report.when == "teardown" and report.failed):
    outcome = report.outcome
    if report.when != "call" and report.failed:
      outcome = "error"
    with open(_OUT, "a") as f:
      f.write(json.dumps({"id": report.nodeid, "outcome": outcome,
                          "reason": _first_line(report)[:400],
                          "seconds": round(report.duration, 3)}) + "\\n")
'''


def _version(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in re.findall(r"\d+", text))


def installed_jax_tag(python: str, mirror: str) -> str:
  """``jax-v<installed version>``, or the mirror's newest tag below it (a
  newer JAX than the mirror knows: said on stdout)."""
  out = subprocess.run([python, "-c", "import jax; print(jax.__version__)"],
                       capture_output=True, text=True, check=True)
  version = out.stdout.strip()
  tags = subprocess.run(["git", "-C", mirror, "tag", "-l", "jax-v*"], capture_output=True,
                        text=True, check=True).stdout.split()
  if "jax-v" + version in tags:
    return "jax-v" + version
  older = [t for t in tags if _version(t) <= _version(version)]
  if not older:
    raise SystemExit(f"run_jax_tests: no jax-v* tag at or below JAX {version} in {mirror}")
  tag = max(older, key=_version)
  print(f"note: JAX {version} has no tag in the mirror; using {tag}'s tests")
  return tag


def extract_tests(mirror: str, tag: str, dest: str) -> str:
  """``tests/`` of JAX at ``tag`` into ``dest``; returns ``dest/tests``."""
  data = subprocess.run(["git", "-C", mirror, "archive", "--format=tar", tag, "tests"],
                        capture_output=True, check=True).stdout
  with tarfile.open(fileobj=io.BytesIO(data)) as tar:
    tar.extractall(dest, filter="data")
  return os.path.join(dest, "tests")


# jax._src modules JAX's tests import that the wheel may lack.
TEST_HELPERS = ("hypothesis_test_util", "pallas.pallas_test_util")


def extract_helpers(python: str, mirror: str, tag: str, dest: str) -> str:
  """The missing ``TEST_HELPERS`` at ``tag`` into ``dest`` (for the reporter
  plugin to load); returns ``dest``."""
  os.makedirs(dest, exist_ok=True)
  for name in TEST_HELPERS:
    probe = subprocess.run([python, "-c", f"import jax._src.{name}"], capture_output=True)
    if probe.returncode == 0:
      continue
    src = subprocess.run(["git", "-C", mirror, "show",
                          f"{tag}:jax/_src/{name.replace('.', '/')}.py"],
                         capture_output=True)
    if src.returncode == 0:
      with open(os.path.join(dest, name + ".py"), "wb") as f:
        f.write(src.stdout)
  return dest


def find_file(tests_dir: str, name: str) -> str:
  for candidate in (os.path.join(tests_dir, name), os.path.join(tests_dir, "pallas", name)):
    if os.path.isfile(candidate):
      return candidate
  raise SystemExit(f"run_jax_tests: no {name} under {tests_dir} (or its pallas/)")


def sample_ids(python, path, env, n, cwd):
  """Every k-th test id of the file (deterministic), about ``n`` of them."""
  out = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-p", "run_jax_tests_report", path], capture_output=True, text=True, env=env, cwd=cwd, timeout=900)
  ids = [l.strip() for l in out.stdout.splitlines() if "::" in l]
  if not ids:
    raise SystemExit(f"run_jax_tests: collecting {path} found no tests:\n{out.stdout[-2000:]}"
                     f"\n{out.stderr[-2000:]}")
  step = max(1, len(ids) // n)
  return ids[::step][:n], len(ids)


def _reason_key(reason: str) -> str:
  """A failure reason with numbers and quoted values folded, for grouping."""
  line = reason.strip().splitlines()[0] if reason.strip() else "(no message)"
  line = re.sub(r"0x[0-9a-f]+", "0x…", line)
  line = re.sub(r"\d+(\.\d+)?", "N", line)
  return line[:160]


def run_file(args, tests_dir, path, log_dir) -> dict:
  name = os.path.basename(path)
  log = os.path.join(log_dir, name + ".jsonl")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, log_dir]), RUN_JAX_TESTS_LOG=log,
             RUN_JAX_TESTS_SHIMS=args.shims, PALLAS_NP_PROGRESS="0")
  if args.device != "none":  # the persona: XLA on the CPU, kernels in numpy mode
    env["JAX_PLATFORMS"] = "cpu"
  env.pop("PALLAS_NP_FORCE", None)
  cwd = os.path.dirname(tests_dir)
  targets, total = [path], None
  if args.sample:
    ids, total = sample_ids(args.python, path, env, args.sample, cwd)
    argfile = os.path.join(log_dir, name + ".ids")
    with open(argfile, "w") as f:
      f.write("\n".join(ids) + "\n")
    targets = ["@" + argfile]
  persona = [] if args.device == "none" else [f"--pallas-device={args.device}"]
  cmd = [args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "run_jax_tests_report",
         *persona, *args.pytest_args, *targets]
  if args.k:
    cmd += ["-k", args.k]
  start = time.time()
  timed_out = False
  with open(os.path.join(log_dir, name + ".out"), "w") as out:
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                            start_new_session=True)
    try:
      rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
      timed_out = True
      os.killpg(proc.pid, 9)
      rc = proc.wait()
  rows = []
  if os.path.exists(log):
    with open(log) as f:
      rows = [json.loads(l) for l in f if l.strip()]
    # Under pytest-xdist the controller receives each worker's reports and
    # the plugin, loaded in both, writes every test twice: one row per id.
    rows = list({r["id"]: r for r in rows}.values())
  with open(os.path.join(log_dir, name + ".out")) as f:
    tail = f.read()[-3000:]
  return {"file": name, "rows": rows, "rc": rc, "timed_out": timed_out, "tail": tail,
          "seconds": time.time() - start, "collected": total}


def summarize(result, show_skips: bool, top: int) -> None:
  rows = result["rows"]
  counts = collections.Counter(r["outcome"] for r in rows)
  extra = " (TIMED OUT: counts are of the tests that finished)" if result["timed_out"] else ""
  sample = (f", a sample of {len(rows)} of {result['collected']} collected"
            if result["collected"] else "")
  print(f"== {result['file']}: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['error']} errors, {counts['skipped']} skipped in {result['seconds']:.0f} s"
        f"{sample}{extra}")
  if not rows:
    print("   no test reported; pytest's output ends with:\n" + result["tail"])
  groups = collections.Counter(_reason_key(r["reason"]) for r in rows
                               if r["outcome"] in ("failed", "error"))
  for reason, n in groups.most_common(top):
    print(f"   {n:5d} x {reason}")
  if show_skips:
    skips = collections.Counter(_reason_key(r["reason"]) for r in rows if r["outcome"] == "skipped")
    for reason, n in skips.most_common(top):
      print(f"   skip {n:5d} x {reason}")
  if rows and result["rc"] not in (0, 1) and not result["timed_out"]:
    print(f"   pytest exited with {result['rc']} (a crash?); its output ends with:\n"
          + result["tail"][-1500:])


def write_log(path: str, result, device: str) -> None:
  """Append the file's per-test rows to ``path`` (JSON lines)."""
  with open(path, "a") as f:
    for r in result["rows"]:
      f.write(json.dumps({"file": result["file"], **r, "device": device}) + "\n")


def compare(baseline_path: str, results) -> None:
  """Of the tests that passed in the baseline log, how many passed now."""
  with open(baseline_path) as f:
    base = [json.loads(l) for l in f if l.strip()]
  now = {(res["file"], r["id"]): r for res in results for r in res["rows"]}
  ran = {res["file"] for res in results}
  passed = [r for r in base if r["outcome"] == "passed" and r.get("file") in ran]
  missing = [r for r in passed if (r["file"], r["id"]) not in now]
  counted = [r for r in passed if (r["file"], r["id"]) in now]
  ok = [r for r in counted if now[(r["file"], r["id"])]["outcome"] == "passed"]
  share = 100.0 * len(ok) / len(counted) if counted else 0.0
  print(f"== compared with {baseline_path}: of {len(counted)} tests that passed there and ran "
        f"here, {len(ok)} pass here ({share:.1f}%); {len(missing)} that passed there did not "
        "run here")
  for r in counted:
    got = now[(r["file"], r["id"])]
    if got["outcome"] != "passed":
      print(f"   {got['outcome']:8s} {r['id']}: {got['reason'].splitlines()[0][:160] if got['reason'] else ''}")


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("files", nargs="+", help="test files under JAX's tests/ or tests/pallas/")
  ap.add_argument("--device", default="h100",
                  help="the persona (pallas_np.emulate_device); none: no persona (the hardware)")
  ap.add_argument("--tag", default=None, help="JAX git tag (default: the installed JAX's)")
  ap.add_argument("--mirror", default=DEFAULT_MIRROR)
  ap.add_argument("--python", default=sys.executable)
  ap.add_argument("--timeout", type=float, default=1200, help="seconds per file")
  ap.add_argument("--sample", type=int, default=0,
                  help="run about N tests per file (every k-th collected id)")
  ap.add_argument("-k", default=None, help="pytest -k expression")
  ap.add_argument("--skips", action="store_true", help="group skip reasons too")
  ap.add_argument("--top", type=int, default=12, help="reason groups shown per file")
  ap.add_argument("--keep", default=None, help="extract into (and keep) this directory")
  ap.add_argument("--pytest-args", default="", help="more pytest arguments (one string)")
  ap.add_argument("--tests-dir", default=None,
                  help="an extracted JAX tests/ directory (or its parent): no mirror needed")
  ap.add_argument("--log", default=None, help="write every test's JSON line to this file")
  ap.add_argument("--compare", default=None,
                  help="a --log file of a baseline run (e.g. --device none on the hardware)")
  args = ap.parse_args(argv)
  args.pytest_args = args.pytest_args.split()
  if args.tests_dir:
    tests_dir = os.path.abspath(args.tests_dir)
    if os.path.isdir(os.path.join(tests_dir, "tests")):
      tests_dir = os.path.join(tests_dir, "tests")
    if not os.path.isdir(tests_dir):
      raise SystemExit(f"run_jax_tests: no directory {tests_dir}")
    work = args.keep or tempfile.mkdtemp(prefix="run_jax_tests_")
    shims = os.path.join(os.path.dirname(tests_dir), "_shims")
    args.shims = shims if os.path.isdir(shims) else ""
    where = f"JAX tests in {tests_dir} (extracted: no tag check)"
  else:
    tag = args.tag or installed_jax_tag(args.python, args.mirror)
    work = args.keep or tempfile.mkdtemp(prefix="run_jax_tests_")
    tests_dir = os.path.join(work, "tests")
    if not os.path.isdir(tests_dir):
      tests_dir = extract_tests(args.mirror, tag, work)
    args.shims = extract_helpers(args.python, args.mirror, tag, os.path.join(work, "_shims"))
    where = f"JAX tests at {tag} in {tests_dir}"
  log_dir = os.path.join(work, "_logs")
  os.makedirs(log_dir, exist_ok=True)
  with open(os.path.join(log_dir, "run_jax_tests_report.py"), "w") as f:
    f.write(REPORTER)
  if args.log and os.path.exists(args.log):
    os.remove(args.log)
  jax_version = subprocess.run([args.python, "-c", "import jax; print(jax.__version__)"],
                               capture_output=True, text=True).stdout.strip()
  print(f"{where}; device persona {args.device}; JAX {jax_version}; python {args.python}",
        flush=True)
  results = []
  for name in args.files:
    path = find_file(tests_dir, name)
    log = os.path.join(log_dir, os.path.basename(path) + ".jsonl")
    if os.path.exists(log):
      os.remove(log)
    result = run_file(args, tests_dir, path, log_dir)
    results.append(result)
    summarize(result, args.skips, args.top)
    if args.log:
      write_log(args.log, result, args.device)
    sys.stdout.flush()
  if args.compare:
    compare(args.compare, results)
  print(f"logs: {log_dir}" + (f"; per-test lines: {args.log}" if args.log else ""))


if __name__ == "__main__":
  main()
