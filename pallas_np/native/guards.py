"""A compiled function's operand checks, unrolled into generated Python.

The AOT wrapper numba builds does not check its arguments' types (a wrong
one would crash), so every call first checks each array operand against
the compiled signature: its class, dtype, rank, and C-contiguity and
writeability where the signature needs them (``tier._signature``'s
*guard*: ``(position, dtype, ndim, contiguous, written)`` per array
operand). A loop over the guard costs ~1 µs an operand; JAX's TPU paged
attention passes 18 to its loop at each of its grid steps. Unrolled, with
the dtypes bound as constants, the same checks cost a few attribute reads
each. Used by ``tier.NativeLoop`` (a loop's call) and ``bodies``' step
function (a compiled body's grid step).
"""
from __future__ import annotations

import numpy as np


def check_expr(guard, names) -> str:
  """The checks of ``guard`` as one boolean expression over the operand
  variables ``names`` (by position); dtype ``k``'s constant is ``_dt{k}``."""
  checks = []
  for pos, _dt, ndim, contiguous, written in guard:
    a = names[pos]
    checks.append(f"{a}.__class__ is _nd and {a}.dtype == _dt{pos} and {a}.ndim == {ndim}")
    if contiguous or written:
      checks.append(f"(_f := {a}.flags)" + (".c_contiguous" if contiguous else ".writeable")
                    + (" and _f.writeable" if contiguous and written else ""))
  return " and ".join(checks) or "True"


def constants(guard) -> dict:
  """The names ``check_expr`` reads: ``_nd`` and each ``_dt{pos}``."""
  scope = {"_nd": np.ndarray}
  for pos, dt, *_ in guard:
    scope[f"_dt{pos}"] = dt
  return scope


def checker(guard):
  """``fits(args) -> bool``: every array operand in ``args`` (a sequence,
  by position) as ``guard`` needs it."""
  names = {pos: f"a{pos}" for pos, *_ in guard}
  lines = ["def fits(args):"]
  lines += [f"    {name} = args[{pos}]" for pos, name in sorted(names.items())]
  lines.append(f"    return bool({check_expr(guard, names)})")
  scope = constants(guard)
  exec(compile("\n".join(lines) + "\n", "<native operand checks>", "exec"), scope)  # noqa: S102
  return scope["fits"]
