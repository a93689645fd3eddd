"""benchmarks/suite.py's report: the cold floor (interpret=True's first call
over JAX's trace alone) and numpy mode's own share of a first call."""
import argparse
import math

from benchmarks import suite


def _run(name, cold_ms, warm_ms):
  return {"name": name, "cold": cold_ms / 1e3, "warm": None if warm_ms is None else warm_ms / 1e3,
          "reps": 3, "err": None, "tol": 0.0, "grid_mode": None}


def _table(path):
  rows = [l for l in open(path).read().splitlines() if l.startswith("| ")]
  head = [c.strip() for c in rows[0].strip("|").split("|")]
  return [dict(zip(head, (c.strip() for c in r.strip("|").split("|")))) for r in rows[1:]]


def test_trace_mode_gives_the_cold_floor_and_numpy_overhead(tmp_path):
  colds = {"a": (40.0, 800.0, 25.0), "b": (10.0, 300.0, 4.0)}  # numpy, interpret, trace
  results = {}
  for k, (n, i, t) in colds.items():
    results[k, "numpy"] = _run(k, n, 2.0)
    results[k, "interpret"] = _run(k, i, 1.0)
    results[k, "trace"] = _run(k, t, None)
  out = tmp_path / "r.md"
  args = argparse.Namespace(out=str(out), repeats=3)
  suite.write_results(args, list(colds), ["numpy", "interpret", "trace"], results, "test machine")
  rows = _table(out)
  assert [r["kernel"] for r in rows] == ["a (`a`)", "b (`b`)"]
  for r, (n, i, t) in zip(rows, colds.values()):
    assert "trace warm" not in r  # the trace mode has no warm calls
    assert float(r["trace cold"]) == t
    assert math.isclose(float(r["cold floor interpret/trace"]), round(i / t, 1))
    assert math.isclose(float(r["numpy cold - trace"]), n - t)
    assert math.isclose(float(r["cold interpret/numpy"]), round(i / n, 1))
  text = out.read_text()
  floor = math.sqrt((800 / 25) * (300 / 4))
  assert f"geometric mean **{floor:.1f}**" in text


def test_first_call_phases_wraps_every_phase_it_names():
  """benchmarks/first_call_phases.py wraps pallas_np functions by name: a
  rename must fail here, not silently drop a phase."""
  import importlib
  from benchmarks import first_call_phases
  for module, path, _ in first_call_phases.PHASES:
    owner = importlib.import_module(module)
    for part in path.split("."):
      owner = getattr(owner, part)
    assert callable(owner), path


def _gpu_check():
  import importlib.util
  import os
  path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "gpu_check.py")
  spec = importlib.util.spec_from_file_location("gpu_check", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_gpu_check_names_suite_kernels_and_stops_without_a_gpu():
  """scripts/gpu_check.py (run by hand on a CUDA machine) must not rot where
  CI can see it: every kernel it names builds, its error is relative, and
  without a GPU it stops before changing any JAX config or environment."""
  import os
  import functools
  import jax
  import numpy as np
  import pytest
  from benchmarks import kernels
  gpu_check = _gpu_check()
  cases = kernels.all_cases()
  built = {}
  for name, (suite_name, kwargs, tol) in gpu_check.CASES.items():
    builder = cases[suite_name]
    if kwargs:
      builder = functools.partial(builder, **kwargs)
    built[name] = builder()
    assert built[name].reference is not None and tol > 0, name
  assert built["matmul_relu_256"].args[0].shape == (256, 256)  # the builder's kwargs apply
  assert gpu_check._max_err(np.array([2.0, 3.0]), np.array([2.0, 4.0])) == 0.25
  assert gpu_check._max_err(np.zeros(3), np.zeros(2)) == float("inf")
  flag = lambda: getattr(jax.config, "jax_pallas_use_mosaic_gpu", None)  # gone in JAX 0.12
  before = flag(), dict(os.environ)
  with pytest.raises(SystemExit, match="no GPU backend"):
    gpu_check.main(["--kernels", "add"])
  assert (flag(), dict(os.environ)) == before


def test_plot_from_results_md(tmp_path):
  import pytest
  pytest.importorskip("matplotlib", reason="the viz extra (matplotlib) draws the chart")
  from benchmarks import plot_results
  results = {("a", "numpy"): _run("a", 40.0, 2.0), ("a", "interpret"): _run("a", 800.0, 1.0),
             ("b", "numpy"): _run("b", 10.0, 0.5), ("b", "interpret"): {"error": "boom"}}
  out = tmp_path / "RESULTS.md"
  suite.write_results(argparse.Namespace(out=str(out), repeats=1), ["a", "b"],
                      ["numpy", "interpret"], results, "test machine")
  labels, columns = plot_results.read_table(str(out))
  assert labels == ["a", "b"]
  assert columns["numpy cold"] == {"a": 40.0, "b": 10.0}
  assert columns["interpret cold"] == {"a": 800.0}  # the error cell is left out
  assert columns["numpy warm"] == {"a": 2.0, "b": 0.5}
  suite.plot_results(str(out))
  png = tmp_path / "results.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
  text = out.read_text()
  assert text.count("![benchmark chart](results.png)") == 1
  suite.plot_results(str(out))  # linked once, however often it is re-plotted
  assert out.read_text().count("![benchmark chart](results.png)") == 1


def test_small_kernels_build_and_match_interpret_true():
  """benchmarks/small_kernels.py: every kernel builds and its numpy-mode
  result (eager) matches interpret=True's and the reference (no timing)."""
  import jax
  import numpy as np
  from benchmarks import small_kernels
  cases = small_kernels.all_cases()
  assert len(cases) >= 11 and small_kernels.FLOOR in cases
  for name, builder in cases.items():
    case = builder()
    got = case.make("numpy")(*case.args)
    want = case.make(True)(*case.args)
    assert np.asarray(got).dtype == np.asarray(want).dtype, name
    assert small_kernels.max_err(got, want) <= case.tol, name
    assert small_kernels.max_err(got, case.reference(*case.args)) <= case.tol, name


def test_small_kernels_section_survives_suite_rewrite(tmp_path):
  """The small-kernels section of RESULTS.md is replaced in place by its
  script and kept by suite.py's rewrite; the chart reads the main table."""
  from benchmarks import plot_results, small_kernels
  out = tmp_path / "RESULTS.md"
  results = {("a", "numpy"): _run("a", 40.0, 2.0), ("a", "interpret"): _run("a", 800.0, 1.0)}
  args = argparse.Namespace(out=str(out), repeats=1)
  suite.write_results(args, ["a"], ["numpy", "interpret"], results, "test machine")
  w = {m: 1e-3 for m in small_kernels.MODES}
  r = {"name": "k", "first": w, "warm": w, "err": 0.0, "ok": True, "reps": 3}
  small_kernels.write_section(str(out), small_kernels.report({"k": r}, "cmd", "m1"))
  small_kernels.write_section(str(out), small_kernels.report({"k": r}, "cmd", "m2"))
  text = out.read_text()
  assert text.count(small_kernels.SECTION_START) == 1 and "m2" in text and "m1" not in text
  assert "eager **1.00**" in text
  suite.write_results(args, ["a"], ["numpy", "interpret"], results, "test machine 2")
  text = out.read_text()
  assert "test machine 2" in text and text.count(small_kernels.SECTION_START) == 1
  labels, columns = plot_results.read_table(str(out))
  assert labels == ["a"] and columns["numpy warm"] == {"a": 2.0}
