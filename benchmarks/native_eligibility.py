"""Which outermost loops of the benchmark and library kernels the native tier
can compile (issue 41 item 2): every kernel's outermost ``while``/``scan``
(the loops ``control_flow/loops.py`` hands to the tier) with the verdict of
``native.codegen.loop_source`` — compiled, or the refusal's reason.

    python benchmarks/native_eligibility.py            # table + counts
    python benchmarks/native_eligibility.py --cases gpu_attention,tpu_flash_fwd

Nothing runs and nothing is compiled: each case's program is traced
(``jax.make_jaxpr``), its kernels' jaxprs walked. A loop whose source is
generated is *eligible*; at run time it may still keep its NumPy path for
reasons only the operands show (a read-only ref it writes, an operand that
is not an array), which the real kernels here do not have.
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402

from pallas_np import _compat as jc  # noqa: E402
from pallas_np.native import codegen  # noqa: E402

LOOPS = ("while", "scan")
KERNELS = ("pallas_call", "core_map", "mpmd_map")


def kernel_jaxprs(jaxpr):
  """The kernel jaxprs of every kernel eqn in ``jaxpr`` (at any depth)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in KERNELS:
      yield eqn.params.get("name_and_src_info", eqn.primitive.name), eqn.params["jaxpr"]
    else:
      for sub in jc.eqn_subjaxprs(eqn):
        yield from kernel_jaxprs(sub)


def outermost_loops(jaxpr):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in LOOPS:
      yield eqn
    else:
      for sub in jc.eqn_subjaxprs(eqn):
        yield from outermost_loops(sub)


def verdict(eqn) -> str:
  try:
    codegen.loop_source(eqn, False, "nan")
  except codegen.Refused as e:
    return f"refused: {e}"
  return "eligible"


# -- cases: name -> () -> (fn, args) ----------------------------------------------------
def _bench_case(builder):
  case = builder()
  return case.make(True), case.args


def _tpu_case(name):
  from benchmarks import tpu_kernels
  return tpu_kernels.CASES[name]()


def cases():
  from benchmarks import kernels, small_kernels
  out = {}
  for name, b in {**kernels.all_cases(), **small_kernels.all_cases()}.items():
    out[name] = functools.partial(_bench_case, b)
  for name, b in kernels.GPU_OP_CASES.items():
    out.setdefault(name, functools.partial(_bench_case, b))
  from benchmarks import tpu_kernels
  for name in tpu_kernels.CASES:
    out[f"tpu_{name}"] = functools.partial(_tpu_case, name)
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
  a = ap.parse_args()
  table = cases()
  names = [n for n in a.cases.split(",") if n] or list(table)
  reasons = collections.Counter()
  total = eligible = 0
  print("| case | kernel | loop | verdict |\n|---|---|---|---|")
  for name in names:
    try:
      fn, args = table[name]()
      closed = jax.make_jaxpr(fn)(*args)
    except Exception as e:  # noqa: BLE001 - a case that does not trace here
      print(f"| {name} | - | - | not traced: {type(e).__name__}: {str(e)[:80]} |")
      continue
    seen = set()
    for kname, kjaxpr in kernel_jaxprs(closed.jaxpr):
      if id(kjaxpr) in seen:
        continue
      seen.add(id(kjaxpr))
      for eqn in outermost_loops(kjaxpr):
        v = verdict(eqn)
        total += 1
        eligible += v == "eligible"
        if v != "eligible":
          reasons[v.split(":", 2)[1].strip() if v.count(":") >= 2 else v] += 1
        where = jc.source_summary(eqn.source_info).rsplit("/", 1)[-1]
        print(f"| {name} | {str(kname)[:40]} | {eqn.primitive.name} {where} | {v[:140]} |")
  print(f"\n{eligible} of {total} outermost loops eligible")
  for why, n in reasons.most_common():
    print(f"  {n:3d}  {why}")


if __name__ == "__main__":
  main()
