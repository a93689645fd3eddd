"""A compiled loop's call as one generated function (the per-call floor of
small kernels with native loops: docs/native.md, docs/performance.md).

Once a loop's library is swapped in, every run of the loop went through
``tier.NativeLoop``'s entry, ``__call__``, ``run``, ``_fits`` and the
checker, then ``_run`` (or ``lanes.run``): five Python frames, the
operands packed into a tuple at each, a loop over the scalar operands and
a comprehension over the results, ~10 µs a run in situ (PERF_LOG
``[floor]``: cumsum_fori's two grid steps spent 25 of their 50 µs there,
around 25 µs of the compiled call itself). ``build`` writes the same steps
as one function of the loop's operands: the operand checks unrolled
(``guards.check_expr``), each scalar operand converted to its exact type,
the compiled call with the loop's status and scratch arrays, each result
reshaped or typed, the counter. Where the checks fail, or the loop's
library is no longer ``fn``, it calls the loop itself (``__call__``: the
NumPy path where the types are not those compiled for); an out-of-bounds
error reaches the loop's own reporting (``_raise_oob``) exactly as from
``_run`` / ``lanes.run``.

Not built for loops whose calls go back into Python (DMA and semaphore
call sites: ``dma_calls``' runner needs the run context).
"""
from __future__ import annotations

import math

from pallas_np.native import guards, lanes, scheduler


def build(loop, fn):
  """``step(ctx, *args)``, the loop's run on its operands through ``fn`` (its
  swapped-in library), or None where the loop's calls need more than the
  compiled call (``pycalls``)."""
  if loop.pycalls is not None:
    return None
  nargs = len(loop.invars)
  names = [f"a{k}" for k in range(nargs)]
  batched = loop.in_batched is not None
  # (names: guards' _nd and _dt<pos>; _t<pos> scalar types, _s<j> scratch, _os/_ot<k> results;
  # _fn the library the step was built for, _call what it calls: fn, a test's counting wrapper)
  scope = {**guards.constants(loop.guard), "_loop": loop, "_fn": fn, "_call": fn, "_state": scheduler.state,
           "_oob": _lanes_oob if batched else _oob}
  for pos, t in loop.scalars:
    scope[f"_t{pos}"] = t
  for j, a in enumerate(loop.scratch):
    scope[f"_s{j}"] = a
  ops = ", ".join(names)
  scratch = [f"_s{j}" for j in range(len(loop.scratch))]
  lines = [f"def native_step(ctx{''.join(', ' + a for a in names)}):",
           f"    if _loop.native is _fn and {guards.check_expr(loop.guard, names)}:"]
  for pos, _t in loop.scalars:  # (a scalar operand: its exact type, as _run)
    a = names[pos]
    lines.append(f"        if {a}.__class__ is not _t{pos}: {a} = _t{pos}({a})")
  lines += ["        st = _loop.status",
            "        try:",
            f"            res = _call(st, {', '.join(names + scratch)})",
            "        except IndexError:",
            f"            _oob(_loop, st, ({ops}{',' if nargs == 1 else ''}))"]
  results = []
  if batched:
    lines.append("        n = ctx.batch_size")
    lines.append("        _state['native_calls'] += n")
    for k, ((shape, dt), b) in enumerate(zip(loop.outs, loop.eqn.out_batched)):
      if b:
        results.append(f"res[{k + 1}].reshape((n, *_os{k}))")
      elif shape:
        results.append(f"res[{k + 1}][:{math.prod(shape)}].reshape(_os{k})")
      else:
        results.append(f"_ot{k}(res[{k + 1}][0])")
      scope[f"_os{k}"], scope[f"_ot{k}"] = shape, dt.type
  else:
    lines.append("        _state['native_calls'] += 1")
    for k, (shape, dt) in enumerate(loop.outs):
      results.append(f"res[{k + 1}].reshape(_os{k})" if shape else f"_ot{k}(res[{k + 1}])")
      scope[f"_os{k}"], scope[f"_ot{k}"] = shape, dt.type
  lines.append(f"        return ({''.join(r + ', ' for r in results)})")
  lines.append(f"    return _loop(ctx{''.join(', ' + a for a in names)})")
  exec(compile("\n".join(lines) + "\n", "<native loop step>", "exec"), scope)  # noqa: S102
  return scope["native_step"]


def _oob(loop, st, args):
  """``NativeLoop._run``'s handling of an IndexError from the call."""
  loop.status = loop.new_status()  # (the next call's: this one holds the error)
  if not st[0]:  # (no bounds-check site's)
    raise  # noqa: PLE0704 - the IndexError being handled
  loop._raise_oob(st, args)  # noqa: SLF001


def _lanes_oob(loop, st, args):
  """``lanes.run``'s handling of an IndexError from the call."""
  loop.status = loop.new_status()
  if not st[0]:
    raise  # noqa: PLE0704
  lane = int(st[lanes.LANE])
  loop._raise_oob(st, [a[lane] if b else a  # noqa: SLF001
                       for a, b in zip(args, loop.eqn.in_batched)])
