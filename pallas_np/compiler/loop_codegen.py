"""A loop written as one generated function: the ``while``/``for``
statement itself, with the condition's and body's plan lines inlined.

A loop rule used to call its body plan (and its condition plan) once per
iteration: a Python call, an argument tuple and a result tuple each, and the
carries splatted in and out. Here the lines of both plans (already emitted,
with their constants, folding, fusion and in-place passes) are rendered
again into one function, their names prefixed apart, the carries kept as
local variables::

    def while_loop(ctx, c0, b0, x0, x1):
        while True:
            C_v2 = C_f1(x0, C_k3)          # the condition's lines
            if not C_v2: break
            B_v4 = B_f5(x0, B_k6)          # the body's lines
            ...
            x0, x1 = B_v4, B_v9
        return (x0, x1)

Every line keeps its eqn in the source map (``sourcemap``), so an error in
an iteration still names the primitive and the kernel line. Only the
rendering is new: the lines are the plans' own ``Line`` objects.
"""
from __future__ import annotations

import copy
import re
import types

import numpy as np

from pallas_np.compiler import plan as plans
from pallas_np.compiler import sourcemap
from pallas_np.compiler.plan import Plan

_NAME = re.compile(r"[A-Za-z_]\w*")
_KEEP = frozenset(("ctx", "del", "or", "shape", "_", "if", "_first", "False"))


def _renamer(prefix: str, arg_map: dict[str, str]):
  """A function renaming one plan's names in rendered text: its arguments
  to the loop's (``arg_map``), its globals and locals with ``prefix``."""
  def rename(m):
    name = m.group(0)
    if name in _KEEP:
      return name
    mapped = arg_map.get(name)
    return mapped if mapped is not None else prefix + name
  return lambda text: _NAME.sub(rename, text)


def _invariant_lines(plan: Plan, invariant_args) -> tuple[set[int], set[int]]:
  """(the body lines computing a loop-invariant value, the lines to run
  without writing into their operand): a loop-invariant line is a plain
  ufunc call (a fresh array, no effect, no check that could raise) whose
  operands are all body constants (``invariant_args``), constants of the
  plan or values of such lines, never returned as a carry. A later line
  that ``passes.in_place`` made write into such a value runs as it was
  before (allocating its result), or the value would be overwritten after
  the first iteration. Bitonic's ``(idx & k) == 0`` in its inner loop is
  one."""
  _, _, body, ret, env_globals = plan._text
  invariant, hoisted, unwritten = set(invariant_args), set(), set()
  for k, line in enumerate(body):
    fn = env_globals.get(line.callee)
    if (not isinstance(fn, np.ufunc) or line.flags is not None or line.unpack
        or line.store is not None or line.wrote is not None or len(line.outs) != 1
        or line.outs[0] == "_" or line.outs[0] in ret
        or not all(isinstance(a, str) and (a in invariant or a in env_globals)
                   for a in line.args)):
      continue
    out = line.outs[0]
    writers = {j for j in range(k + 1, len(body))
               if body[j].wrote is not None and body[j].args[body[j].wrote[0]] == out}
    if any(body[j].flags is not None or body[j].wrote[1] not in env_globals for j in writers):
      continue
    invariant.add(out)
    hoisted.add(k)
    unwritten |= writers
  return hoisted, unwritten


def _inline(plan: Plan, prefix, arg_map, indent, lines, line_eqns, scope, invariant_args=None):
  """Append ``plan``'s lines (renamed) to ``lines``; return its results'
  names (renamed). With ``invariant_args`` (the plan's argument names that
  stay the same in every iteration), the loop-invariant lines
  (``_invariant_lines``) run in the first iteration only, under
  ``if _first:``, and their values are never deleted."""
  _, _, body, ret, env_globals = plan._text
  rename = _renamer(prefix, arg_map)
  hoisted, unwritten = _invariant_lines(plan, invariant_args) if invariant_args else ((), ())
  kept = {body[k].outs[0] for k in hoisted}

  def render(k):
    line = body[k]
    if k in unwritten or (kept and any(d in kept for d in line.dels)):
      line = copy.copy(line)
      line.dels = tuple(d for d in line.dels if d not in kept)
      if k in unwritten:
        line.callee = line.wrote[1]
    return rename(line.render())
  if hoisted:
    lines.append(indent + "if _first:")
    line_eqns.append(None)
    lines.append(indent + "    _first = False")
    line_eqns.append(None)
    for k in sorted(hoisted):
      lines.append(indent + "    " + render(k))
      line_eqns.append(plan.line_eqns[k + 1])
  for k, line in enumerate(body):
    if k not in hoisted:
      lines.append(indent + render(k))
      line_eqns.append(plan.line_eqns[k + 1])
  for name, value in env_globals.items():
    scope[prefix + name] = value
  return [rename(r) for r in ret]


def loop_function(name: str, kernel_name: str, *, body: Plan, n_body_consts: int, n_carry: int,
                  cond: Plan | None = None, n_cond_consts: int = 0,
                  order=None):
  """The loop as one function ``(ctx, *cond_consts, *body_consts, *carry)
  -> carry tuple``: a ``while`` over ``cond`` (with ``cond``), else a
  ``for _ in order`` (a scan without xs/ys). ``name`` is the function's
  (an identifier), ``kernel_name`` goes into its file name."""
  cc = [f"c{k}" for k in range(n_cond_consts)]
  bc = [f"b{k}" for k in range(n_body_consts)]
  carry = [f"x{k}" for k in range(n_carry)]
  scope = {}
  lines = [f"def {name}(ctx{''.join(', ' + a for a in cc + bc + carry)}):",
           "    _first = True"]
  line_eqns = [None, None]
  if cond is not None:
    lines.append("    while True:")
    line_eqns.append(None)
    cond_args = dict(zip(cond._text[1], cc + carry))
    (pred,) = _inline(cond, "C_", cond_args, "        ", lines, line_eqns, scope)
    lines.append(f"        if not {pred}: break")
    line_eqns.append(None)
  else:
    scope["_order"] = order
    lines.append("    for _ in _order:")
    line_eqns.append(None)
  body_args = dict(zip(body._text[1], bc + carry))
  outs = _inline(body, "B_", body_args, "        ", lines, line_eqns, scope,
                 invariant_args=body._text[1][:n_body_consts])
  if "        if _first:" not in lines:
    del lines[1], line_eqns[1]  # (nothing hoisted)
  if carry:
    lines.append(f"        {', '.join(carry)}, = {', '.join(outs)},")
  else:
    lines.append("        pass")
  line_eqns.append(None)
  lines.append(f"    return ({''.join(x + ', ' for x in carry)})")
  line_eqns.append(None)
  source = "\n".join(lines) + "\n"
  filename = sourcemap.new_filename(f"{name} in {kernel_name}")
  scope["_line_eqns"] = sourcemap.register(filename, line_eqns)
  # (plans.function_code through the module: benchmarks/first_call_phases wraps it)
  code = plans.function_code(source[source.index("("):]).replace(
      co_filename=filename, co_name=name, co_qualname=name)
  sourcemap.show(filename, source)
  return types.FunctionType(code, scope, name)
