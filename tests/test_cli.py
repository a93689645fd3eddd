"""``python -m pallas_np``'s own flags: ``--help`` and ``--version`` answer on
stdout with status 0 before JAX is imported (so in the time Python takes to
start), malformed command lines exit 2 with the usage on stderr, and the
version is the one the package metadata has."""
import importlib.metadata
import os
import subprocess
import sys
import time

import pytest

import pallas_np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, python_flags=()):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  t0 = time.perf_counter()
  out = subprocess.run([sys.executable, *python_flags, "-m", "pallas_np", *args], env=env,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
  return out, time.perf_counter() - t0


def _imported_modules(importtime_stderr: str) -> set[str]:
  """Module names from ``python -X importtime``'s report on stderr."""
  names = set()
  for line in importtime_stderr.splitlines():
    if line.startswith("import time:") and "|" in line:
      names.add(line.rsplit("|", 1)[1].strip())
  return names


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_on_stdout_exit_0_without_jax(flag):
  out, seconds = _run(flag, python_flags=("-X", "importtime"))
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.startswith("usage: python -m pallas_np")
  assert "--version" in out.stdout and "--detect-races" in out.stdout
  imported = _imported_modules(out.stderr)
  assert "pallas_np.cli_args" in imported  # the report is read right
  assert not any(n == "jax" or n.startswith("jax.") for n in imported), "JAX was imported"
  assert seconds < 2.0


def test_version_without_jax():
  out, seconds = _run("--version", python_flags=("-X", "importtime"))
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == f"pallas_np {pallas_np.__version__}"
  assert not any(n == "jax" or n.startswith("jax.") for n in _imported_modules(out.stderr))
  assert seconds < 2.0


def test_help_after_other_flags_and_python_options():
  out, _ = _run("--no-progress", "--clamp", "--help", python_flags=("-W", "ignore"))
  assert out.returncode == 0 and out.stdout.startswith("usage:")


@pytest.mark.parametrize("args,message", [
    ((), "no program to run"),
    (("-m",), "-m needs a module name"),
    (("--explain",), "--explain needs an output directory"),
    (("--bogus", "x.py"), "unknown option --bogus"),
])
def test_malformed_command_lines_exit_2_with_usage_on_stderr(args, message):
  out, _ = _run(*args)
  assert out.returncode == 2
  assert out.stdout == ""
  assert out.stderr.startswith("usage: python -m pallas_np") and message in out.stderr


def test_parse_keeps_the_programs_own_flags():
  from pallas_np import cli_args
  command = cli_args.parse(["--clamp", "--grid-report", "prog.py", "--help", "-x"], "0")
  assert command.options == {"bounds_check": "clamp"} and command.grid_report
  assert command.program == ["prog.py", "--help", "-x"]  # the program's flags are its own
  command = cli_args.parse(["--explain", "out", "-m", "pkg.mod", "--version"], "0")
  assert command.explain_dir == "out" and command.program == ["-m", "pkg.mod", "--version"]


def test_a_script_still_runs(tmp_path):
  script = tmp_path / "probe.py"
  script.write_text("import sys\nprint('ran', sys.argv[1:])\n")
  out, _ = _run("--no-progress", str(script), "--help")
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "ran ['--help']"


def test_version_is_the_installed_metadata_version():
  try:
    installed = importlib.metadata.version("pallas-np")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("pallas-np is not installed (only on sys.path)")
  assert installed == pallas_np.__version__
