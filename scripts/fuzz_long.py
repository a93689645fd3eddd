"""Long differential fuzz run: numpy mode vs interpret=True.

    PYTHONPATH=. nice -n 10 python scripts/fuzz_long.py --cases 10000 [--seed 0]

Runs random kernels (tests/fuzz_core.py) until at least ``--cases`` op
outputs have been compared; prints every mismatch and a summary line
``fuzz: N cases in K kernels, M mismatches``. Exit status 1 on a mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PALLAS_NP_CHECK_AVALS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hypothesis import HealthCheck, given, settings, seed as hyp_seed  # noqa: E402

import pallas_np  # noqa: E402,F401
from tests.fuzz_core import (alias_prefetch_cases, masked_view_cases,  # noqa: E402
                             negative_index_programs, programs, run_alias_case,
                             run_masked_view_case, run_program)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--cases", type=int, default=10000)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--max-ops", type=int, default=20)
  ap.add_argument("--json", default=None, help="write the summary here")
  ap.add_argument("--edge-cases", type=int, default=300,
                  help="cases of each edge family (aliases with scalar prefetch, masked "
                       "views crossing the edge, static negative indices) after the programs")
  args = ap.parse_args()
  stats = {"cases": 0, "kernels": 0, "mismatches": [], "errors": []}
  start = time.time()

  class Done(Exception):
    pass

  @hyp_seed(args.seed)
  @settings(max_examples=10 ** 9, deadline=None, database=None,
            suppress_health_check=list(HealthCheck))
  @given(programs(max_ops=args.max_ops))
  def fuzz(program):
    if stats["cases"] >= args.cases:
      raise Done
    dtype, shape, ops, seed = program
    try:
      results = run_program(dtype, shape, ops, seed)
    except Exception as e:  # a crash is a mismatch too
      stats["errors"].append(f"{dtype} {shape} seed={seed} {[o.name for o in ops]}: "
                             f"{type(e).__name__}: {str(e)[:300]}")
      print("ERROR", stats["errors"][-1], flush=True)
      stats["kernels"] += 1
      return
    stats["kernels"] += 1
    if results is None:
      stats["oracle_failed"] = stats.get("oracle_failed", 0) + 1
      return
    stats["cases"] += len(results)
    for name, err in results:
      if err:
        stats["mismatches"].append(f"{dtype} {shape} seed={seed} {name}: {err}")
        print("MISMATCH", stats["mismatches"][-1], flush=True)
    if stats["kernels"] % 50 == 0:
      print(f"... {stats['cases']} cases, {stats['kernels']} kernels, "
            f"{len(stats['mismatches'])} mismatches, {time.time() - start:.0f}s", flush=True)

  try:
    fuzz()
  except Done:
    pass

  def edge_family(name, strategy, run):
    count = [0]

    @hyp_seed(args.seed)
    @settings(max_examples=10 ** 9, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def family(case):
      if count[0] >= args.edge_cases:
        raise Done
      count[0] += 1
      stats["kernels"] += 1
      try:
        err = run(case)
      except Exception as e:  # a crash is a mismatch too
        stats["errors"].append(f"{name} {case}: {type(e).__name__}: {str(e)[:300]}")
        print("ERROR", stats["errors"][-1], flush=True)
        return
      stats["cases"] += 1
      if err:
        stats["mismatches"].append(f"{name} {case}: {err}")
        print("MISMATCH", stats["mismatches"][-1], flush=True)
    try:
      family()
    except Done:
      pass
    print(f"... {name}: {count[0]} cases", flush=True)

  def negative_index(program):
    results = run_program(*program)
    return None if results is None else "; ".join(e for _, e in results if e) or None

  if args.edge_cases:
    edge_family("aliases+prefetch", alias_prefetch_cases(), lambda c: run_alias_case(*c))
    edge_family("masked views", masked_view_cases(), lambda c: run_masked_view_case(*c))
    edge_family("negative indices", negative_index_programs(), negative_index)
  elapsed = time.time() - start
  n_bad = len(stats["mismatches"]) + len(stats["errors"])
  print(f"fuzz: {stats['cases']} cases in {stats['kernels']} kernels, {n_bad} mismatches "
        f"({len(stats['errors'])} crashes), {stats.get('oracle_failed', 0)} kernels skipped "
        f"because interpret=True failed on them, {elapsed:.0f}s")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(stats, elapsed_s=elapsed), f, indent=1)
  return 1 if n_bad else 0


if __name__ == "__main__":
  sys.exit(main())
