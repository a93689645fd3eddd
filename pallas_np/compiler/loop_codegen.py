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

import re
import types

from pallas_np.compiler import plan as plans
from pallas_np.compiler import sourcemap
from pallas_np.compiler.plan import Plan

_NAME = re.compile(r"[A-Za-z_]\w*")
_KEEP = frozenset(("ctx", "del", "or", "shape", "_"))


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


def _inline(plan: Plan, prefix, arg_map, indent, lines, line_eqns, scope):
  """Append ``plan``'s lines (renamed) to ``lines``; return its results'
  names (renamed)."""
  _, _, body, ret, env_globals = plan._text
  rename = _renamer(prefix, arg_map)
  for k, line in enumerate(body):
    lines.append(indent + rename(line.render()))
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
  lines = [f"def {name}(ctx{''.join(', ' + a for a in cc + bc + carry)}):"]
  line_eqns = [None]
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
  outs = _inline(body, "B_", body_args, "        ", lines, line_eqns, scope)
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
