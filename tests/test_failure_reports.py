"""pytest's report of a test failing inside a kernel (pallas_np.pytest_plugin):
the kernel error's line and grid point on top, pallas_np's own frames hidden,
the user's frames kept, and pytest's full report back with --full-trace.
Run in a subprocess pytest on a small test file."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_DIR = str(ROOT / "pallas_np")

FAILING_TESTS = '''
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl


def shifted_copy_kernel(x_ref, o_ref):
  i = pl.program_id(0)
  o_ref[...] = x_ref[pl.ds(i * 8 + 4, 8)]  # the last grid point reads past the end


def users_helper(x):
  return pl.pallas_call(
      shifted_copy_kernel, out_shape=jax.ShapeDtypeStruct((32,), jnp.float32), grid=(4,),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((8,), lambda i: (i,)), interpret=True)(x)


def test_out_of_bounds_kernel():
  users_helper(jnp.arange(32.0))


def test_plain_failure():
  assert 1 + 1 == 3
'''


def _pytest(tmp_path, *args):
  (tmp_path / "test_kernels.py").write_text(FAILING_TESTS)
  # (an empty config of its own, not the project's: pytest 9.2 refuses ``-c /dev/null``)
  (tmp_path / "pytest.ini").write_text("[pytest]\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PALLAS_NP_PROGRESS="0")
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  out = subprocess.run(
      [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
       "-c", str(tmp_path / "pytest.ini"), "--pallas-numpy", "-q", *args, str(tmp_path / "test_kernels.py")],
      env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
  assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
  return out.stdout


def _section(report: str, test_name: str) -> list[str]:
  """The lines of one test's failure report (after its ``____ name ____`` header)."""
  lines = report.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith("_") and f" {test_name} " in l)
  end = next((i for i in range(start + 1, len(lines))
              if lines[i].startswith(("_", "=")) and lines[i].endswith(("_", "="))), len(lines))
  return lines[start + 1:end]


def test_kernel_failure_report_is_short_with_the_kernel_line_on_top(tmp_path):
  section = _section(_pytest(tmp_path), "test_out_of_bounds_kernel")
  assert len(section) < 80, "\n".join(section)
  first = section[0]
  assert first.startswith("pallas_np: KernelIndexError: IndexError in Pallas kernel "
                          "'shifted_copy_kernel' at grid point (3,)")
  kernel_line = next(n for n, line in enumerate(FAILING_TESTS.splitlines(), 1)
                     if "o_ref[...] =" in line)
  assert f"test_kernels.py:{kernel_line}:" in first  # the kernel's line
  assert section[1].startswith("  kernel line (grid point (3,)): ")
  assert section[1].endswith("o_ref[...] = x_ref[pl.ds(i * 8 + 4, 8)]  "
                             "# the last grid point reads past the end")
  text = "\n".join(section)
  # The user's frames stay (the test and its helper), pallas_np's are gone.
  assert "def test_out_of_bounds_kernel" in text and "def users_helper" in text
  assert PACKAGE_DIR not in text and "pallas_np/grid" not in text
  assert "<pallas_np plan" not in text
  assert "E     pallas_np.errors.KernelIndexError" in text  # pytest's own E lines


def test_other_failures_and_full_trace_are_pytests_own(tmp_path):
  report = _pytest(tmp_path, "--full-trace")
  section = _section(report, "test_out_of_bounds_kernel")
  assert not section[0].startswith("pallas_np:")
  assert any("pallas_np/grid/" in line for line in section)  # every frame shown
  plain = _section(report, "test_plain_failure")
  assert not any(line.startswith("pallas_np:") for line in plain)
  assert any("assert 1 + 1 == 3" in line for line in plain)
