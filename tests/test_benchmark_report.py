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
