"""The one evaluator: compiles a jaxpr into a straight-line Python function.

Style of autodidax's ``eval_jaxpr`` (an env and a registry of rules), but the
env lookups happen once, at compile time: each eqn becomes one line of
generated Python, ``v7 = f3(v2, v5)``, where ``f3`` is the callable its
registry rule returned for that eqn. Literals become constants, pure eqns whose
inputs are all constant are folded, and eqns whose results nobody reads (and
that have no effects) are dropped. The generated function's "file" maps each
line back to its eqn, so an exception can name the primitive and the kernel's
source line without any bookkeeping on the hot path.
"""
from __future__ import annotations

import itertools
import linecache
import sys
import threading
from typing import Any, Callable, Sequence

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.errors import UnsupportedError
from pallas_np.params import InterpretParams


class RunContext:
  """Per-execution state that ctx-rules read: where in the grid we are."""
  __slots__ = ("program_ids", "num_programs", "kernel_name", "params",
               "grid_point", "extra")

  def __init__(self, kernel_name="kernel", params=None, program_ids=(),
               num_programs=()):
    self.kernel_name = kernel_name
    self.params = params
    self.program_ids = program_ids
    self.num_programs = num_programs
    self.grid_point = ()
    self.extra = {}


# filename of generated code -> list of eqns by line (line 1 is the `def`).
_PLAN_SOURCES: dict[str, list] = {}
_plan_counter = itertools.count()
_lock = threading.Lock()


def np_constant(val, aval) -> Any:
  """A literal/const as the NumPy value the plan will see."""
  dtype = getattr(aval, "dtype", None)
  if isinstance(val, np.ndarray) and val.ndim == 0:
    val = val[()]
  if dtype is not None and not jc.is_semaphore_dtype(dtype):
    if np.ndim(val) == 0:
      return np.dtype(dtype).type(val) if np.dtype(dtype).kind != "V" else np.asarray(val, dtype)
    return np.asarray(val, dtype=dtype)
  return np.asarray(val) if not isinstance(val, np.ndarray) else val


class Plan:
  """A compiled jaxpr: ``plan(ctx, *args) -> tuple of outputs``."""
  __slots__ = ("fn", "jaxpr", "filename", "num_eqns", "source")

  def __init__(self, fn, jaxpr, filename, num_eqns, source):
    self.fn = fn
    self.jaxpr = jaxpr
    self.filename = filename
    self.num_eqns = num_eqns
    self.source = source

  def __call__(self, ctx, *args):
    return self.fn(ctx, *args)


def _has_effects(eqn) -> bool:
  return bool(eqn.effects)


class Compiler:
  """Compiles jaxprs to Plans; sub-jaxprs (cond branches, loop bodies, pjit)
  go through the same compiler and are cached per jaxpr object."""

  def __init__(self, params: InterpretParams | None = None, name: str = "kernel"):
    self.params = params or InterpretParams()
    self.name = name
    self._cache: dict[int, tuple[Any, Plan]] = {}

  # -- public ---------------------------------------------------------------
  def compile(self, jaxpr, consts: Sequence[Any] | None = None, *,
              constvars_as_args: bool = False) -> Plan:
    """Compile a Jaxpr (with ``consts`` for its constvars) or a ClosedJaxpr.

    With ``constvars_as_args`` the plan takes the constvars as leading
    arguments instead (run_scoped bodies close over refs that way)."""
    if isinstance(jaxpr, jc.ClosedJaxpr):
      consts = jaxpr.consts
      jaxpr = jaxpr.jaxpr
    consts = tuple(consts or ())
    key = (id(jaxpr), constvars_as_args)
    hit = self._cache.get(key)
    if hit is not None and hit[0] is jaxpr and len(consts) == 0:
      return hit[1]
    if constvars_as_args:
      jaxpr = jaxpr.replace(invars=[*jaxpr.constvars, *jaxpr.invars], constvars=[])
    plan = self._codegen(jaxpr, consts)
    if not consts:
      self._cache[key] = (jaxpr, plan)
    return plan

  # -- codegen --------------------------------------------------------------
  def _codegen(self, jaxpr, consts) -> Plan:
    names: dict[Any, str] = {}
    env_globals: dict[str, Any] = {}
    const_values: dict[Any, Any] = {}  # var -> folded/const value
    counter = itertools.count()

    def fresh(prefix):
      return f"{prefix}{next(counter)}"

    for v, c in zip(jaxpr.constvars, consts):
      const_values[v] = c
    # Liveness: which vars are read by a kept eqn or the outputs.
    live = set(v for v in jaxpr.outvars if isinstance(v, jc.Var))
    keep = [False] * len(jaxpr.eqns)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
      eqn = jaxpr.eqns[i]
      if _has_effects(eqn) or any(o in live for o in eqn.outvars
                                   if not isinstance(o, jc.DropVar)):
        keep[i] = True
        for v in eqn.invars:
          if isinstance(v, jc.Var):
            live.add(v)

    arg_names = []
    for v in jaxpr.invars:
      n = fresh("a")
      names[v] = n
      arg_names.append(n)

    def atom(v) -> str:
      if isinstance(v, jc.Literal):
        g = fresh("k")
        env_globals[g] = np_constant(v.val, v.aval)
        return g
      if v in names:
        return names[v]
      if v in const_values:
        g = fresh("k")
        env_globals[g] = const_values[v]
        names[v] = g
        return g
      raise AssertionError(f"unbound var {v}")

    def value_of(v):
      if isinstance(v, jc.Literal):
        return True, np_constant(v.val, v.aval)
      if v in const_values:
        return True, const_values[v]
      return False, None

    # Free each intermediate after its last use (``; del v3`` on the same
    # line, keeping one line per eqn): otherwise every value of the kernel
    # stays alive until the plan returns, and each op writes to fresh,
    # cache-cold memory.
    last_use: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
      if keep[i]:
        for v in eqn.invars:
          if isinstance(v, jc.Var) and not isinstance(v, jc.Literal):
            last_use[v] = i
    returned = set(v for v in jaxpr.outvars if isinstance(v, jc.Var))

    body: list[str] = []
    line_eqns: list[Any] = [None]  # line 1 = def
    check = self.params.check_avals
    for i, eqn in enumerate(jaxpr.eqns):
      if not keep[i]:
        continue
      rule = registry.lookup(eqn.primitive)
      if rule is None:
        raise UnsupportedError(
            f"pallas_np: primitive '{eqn.primitive.name}' is not supported by "
            f"the NumPy interpreter (kernel '{self.name}', at "
            f"{jc.source_summary(eqn.source_info)}). See "
            f"`python -m pallas_np.coverage` for what is supported.")
      outvars_used = tuple(not isinstance(o, jc.DropVar) and o in live
                           for o in eqn.outvars)
      info = registry.EqnInfo(eqn, self, outvars_used)
      try:
        fn = rule.compile(info)
      except UnsupportedError:
        raise
      except NotImplementedError as e:
        raise UnsupportedError(
            f"pallas_np: {e} (primitive '{eqn.primitive.name}', kernel "
            f"'{self.name}', at {jc.source_summary(eqn.source_info)})") from e
      multiple = eqn.primitive.multiple_results
      # Constant folding.
      if rule.foldable and not _has_effects(eqn) and eqn.invars is not None:
        known = [value_of(v) for v in eqn.invars]
        if all(k for k, _ in known) and _foldable_size(eqn):
          try:
            out = fn(*[val for _, val in known])
          except Exception:
            out = None
          else:
            outs = list(out) if multiple else [out]
            for o, val in zip(eqn.outvars, outs):
              if not isinstance(o, jc.DropVar):
                const_values[o] = val
            continue
      if check:
        fn = _checked(fn, info, multiple)
      g = fresh("f")
      env_globals[g] = fn
      args = ", ".join(atom(v) for v in eqn.invars)
      if rule.needs_ctx:
        args = "ctx, " + args if args else "ctx"
      outs = []
      for o, used in zip(eqn.outvars, outvars_used):
        if used:
          n = fresh("v")
          names[o] = n
          outs.append(n)
        else:
          outs.append("_")
      call = f"{g}({args})"
      if multiple:
        if not outs:
          body.append(call)
        elif len(outs) == 1:
          body.append(f"{outs[0]}, = {call}")
        else:
          body.append(f"{', '.join(outs)} = {call}")
      else:
        body.append(f"{outs[0]} = {call}" if outs[0] != "_" else call)
      dead = []
      for v in eqn.invars:
        if (isinstance(v, jc.Var) and not isinstance(v, jc.Literal)
            and last_use.get(v) == i and v not in returned):
          n = names.get(v)
          if n is not None and n.startswith("v") and n not in dead:
            dead.append(n)
      if dead and not self.params.pdb:  # under pdb every value stays inspectable
        body[-1] += "; del " + ", ".join(dead)
      line_eqns.append(eqn)
    ret = [atom(v) for v in jaxpr.outvars]
    fname = f"plan_{_sanitize(self.name)}"
    src_lines = [f"def {fname}(ctx{''.join(', ' + a for a in arg_names)}):"]
    src_lines += ["    " + b for b in body]
    src_lines.append(f"    return ({', '.join(ret)}{',' if len(ret) == 1 else ''})")
    line_eqns.append(None)
    source = "\n".join(src_lines) + "\n"
    with _lock:
      filename = f"<pallas_np plan {next(_plan_counter)}: {self.name}>"
      _PLAN_SOURCES[filename] = line_eqns
    code = compile(source, filename, "exec")
    # Make the generated source visible to tracebacks, pdb and py-spy.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(code, env_globals)
    return Plan(env_globals[fname], jaxpr, filename, len(line_eqns) - 2, source)


def _sanitize(name: str) -> str:
  return "".join(c if c.isalnum() else "_" for c in name)[:60] or "kernel"


_FOLD_LIMIT = 1 << 16


def _foldable_size(eqn) -> bool:
  """Fold only modestly sized results: a folded constant lives in the plan."""
  for o in eqn.outvars:
    shape = getattr(o.aval, "shape", None)
    if shape is None:
      return False
    if int(np.prod(shape, dtype=np.int64)) > _FOLD_LIMIT:
      return False
    if isinstance(o.aval, jc.AbstractRef):
      return False
  return True


def _checked(fn, info: registry.EqnInfo, multiple: bool):
  avals = [a if used else None for a, used in zip(info.out_avals, info.outvars_used)]
  name = info.primitive.name

  def check(val, aval):
    if aval is None or isinstance(aval, jc.AbstractRef) or not hasattr(aval, "shape"):
      return
    shape = np.shape(val)
    dtype = getattr(val, "dtype", None)
    want = jc.physical_dtype(aval.dtype)
    if tuple(shape) != tuple(aval.shape) or (dtype is not None and np.dtype(dtype) != np.dtype(want)):
      raise AssertionError(
          f"pallas_np internal check: rule for '{name}' returned "
          f"{np.dtype(dtype) if dtype is not None else type(val).__name__}{list(shape)}, "
          f"expected {np.dtype(want)}{list(aval.shape)} (at {info.source})")
    if dtype is None:
      raise AssertionError(
          f"pallas_np internal check: rule for '{name}' returned a {type(val).__name__}, "
          f"not a NumPy value (at {info.source})")

  def wrapped(*args):
    out = fn(*args)
    if multiple:
      for val, aval in zip(out, avals):
        check(val, aval)
    else:
      check(out, avals[0])
    return out
  return wrapped


def failing_eqns(tb) -> list:
  """Eqns of generated plans on a traceback, outermost first."""
  found = []
  while tb is not None:
    fname = tb.tb_frame.f_code.co_filename
    eqns = _PLAN_SOURCES.get(fname)
    if eqns is not None:
      line = tb.tb_lineno
      if 0 < line - 1 < len(eqns) and eqns[line - 1] is not None:
        found.append(eqns[line - 1])
    tb = tb.tb_next
  return found
