"""The one evaluator: compiles a jaxpr into a straight-line Python function.

Style of autodidax's ``eval_jaxpr`` (an env and a registry of rules), but the
env lookups happen once, at compile time: each eqn becomes one line of
generated Python, ``v7 = f3(v2, v5)``, where ``f3`` is the callable its
registry rule returned for that eqn. Literals become constants, pure eqns whose
inputs are all constant are folded, and eqns whose results nobody reads (and
that have no effects) are dropped. The generated function's "file" maps each
line back to its eqn (``sourcemap``), so an exception can name the primitive
and the kernel's source line without any bookkeeping on the hot path.
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import operator

import jax
import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.compiler import idioms, passes, sourcemap
from pallas_np.compiler.emitter import Const, Emitter, Line, np_constant
from pallas_np.compiler.fusion import Fusion
from pallas_np.compiler.plan import Plan
from pallas_np.compiler.zeros import ZeroTracker, zero_select
from pallas_np.errors import UnsupportedError
from pallas_np.params import InterpretParams


def _host_const(val, aval):
  """A jaxpr const as NumPy: a jax.Array const left as is would make every
  rule that folds or reads it dispatch (and XLA-compile) a JAX op."""
  if isinstance(val, jax.Array) and not jc.is_extended_dtype(val.dtype):
    return np_constant(np.asarray(val), aval)
  return val


# Python's operators on NumPy scalars run NumPy's scalar math (~30 ns)
# where a ufunc call costs ~0.9 us: the same result and dtype (wrapping
# integers, IEEE floats), so an eqn on 0-d values takes the operator
# (``_scalar_form``). Loop counters and index arithmetic are such eqns. A
# form must also be right on arrays: a sub-jaxpr of 0-d avals may run on
# arrays (a generic reduce's body), where an operator calls the ufunc.
_SCALAR_FORMS = {
    np.add: operator.add, np.subtract: operator.sub, np.multiply: operator.mul,
    np.bitwise_and: operator.and_, np.bitwise_or: operator.or_,
    np.bitwise_xor: operator.xor, np.invert: operator.invert, np.negative: operator.neg,
    np.equal: operator.eq, np.not_equal: operator.ne, np.less: operator.lt,
    np.less_equal: operator.le, np.greater: operator.gt, np.greater_equal: operator.ge,
}


def _scalar_form(fn, info, in_atoms_e, out_batched):
  """``fn``'s form for NumPy scalars (``_SCALAR_FORMS``, or a rule's
  ``scalar_form`` attribute) when every operand and result is a 0-d value of
  a bool, integer, float32 or float64 type and none carries a lane axis;
  else ``fn``."""
  if fn.__class__ is np.ufunc:
    form = _SCALAR_FORMS.get(fn)
  else:
    form = getattr(fn, "scalar_form", None)
  if form is None or any(out_batched):
    return fn
  for a in in_atoms_e:
    if a.__class__ is not Const and a[1]:
      return fn
  for aval in (*info.in_avals, *info.out_avals):
    if getattr(aval, "shape", None) != ():
      return fn
    dt = np.dtype(jc.physical_dtype(aval.dtype))
    if not (dt.kind in "biu" or dt in (np.float32, np.float64)):
      return fn
  return form


def _zero_d(value):
  """A NumPy scalar operand of a ufunc on arrays as a 0-d array: NumPy
  converts a scalar to an array on every call (~0.25 us of a ~0.7 us
  ufunc call on a small block); the dtype and result are the same."""
  if isinstance(value, np.generic) and value.dtype.kind != "V":
    return np.asarray(value)
  return value


# Call-like primitives whose body is emitted inline into the caller's code
# (no plan call, no tuple packing): name -> param holding the callee jaxpr.
INLINE_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
                "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
                "custom_vjp_call": "call_jaxpr", "remat2": "jaxpr",
                "checkpoint": "jaxpr", "eval_jaxpr": "call_jaxpr",
                "custom_vmap_call": "call"}  # plgpu.kernel wraps its mpmd_map in one


class Compiler:
  """Compiles jaxprs to Plans; sub-jaxprs (cond branches, loop bodies)
  go through the same compiler and are cached per jaxpr object; the bodies
  of jit/closed_call/custom_jvp/custom_vjp/remat calls are inlined."""

  batched = False  # see pallas_np.batching.BatchCompiler
  lanes_last = False  # ditto

  def __init__(self, params: InterpretParams | None = None, name: str = "kernel", *,
               kernel_params_from_eqns: bool = False):
    self.params = params or InterpretParams()
    self.name = name
    self.loop_depth = 0  # > 0 while compiling a loop's body or condition
    # Whole programs run outside a force scope: each pallas_call eqn keeps
    # the options of its own ``interpret=`` instead of ``params``.
    self.kernel_params_from_eqns = kernel_params_from_eqns
    self._cache: dict[Any, tuple[Any, Plan]] = {}

  # -- public ---------------------------------------------------------------
  @contextlib.contextmanager
  def loop_body(self):
    """Compiling a loop's body or condition: code that runs once per
    iteration, where idioms (which trace a jnp reference once per operand
    type, a few ms) pay off; elsewhere they would only slow first calls."""
    self.loop_depth += 1
    try:
      yield
    finally:
      self.loop_depth -= 1

  def compile(self, jaxpr, consts: Sequence[Any] | None = None, *,
              constvars_as_args: bool = False, in_batched=None,
              first_calls: bool = False, lazy: bool = False) -> Plan:
    """Compile a Jaxpr (with ``consts`` for its constvars) or a ClosedJaxpr.

    With ``constvars_as_args`` the plan takes the constvars as leading
    arguments instead (run_scoped bodies close over refs that way).
    ``in_batched`` (batch compilers only) says which arguments carry a
    leading batch axis. ``first_calls``: the plan runs its lines without
    compiling them for its first calls (see ``plan.FIRST_CALLS``); for plans a
    caller fetches ``fn`` from per run (kernels, whole programs), not for
    sub-plans whose ``fn`` a rule keeps. ``lazy``: ``fn`` compiles on its
    first call (a plan whose lines a loop inlines may never be called)."""
    if isinstance(jaxpr, jc.ClosedJaxpr) and consts is None:
      consts = jaxpr.consts
      jaxpr = jaxpr.jaxpr
    consts = tuple(consts or ())
    in_batched = tuple(bool(b) for b in in_batched) if in_batched is not None else None
    key = (id(jaxpr), constvars_as_args, in_batched)
    hit = self._cache.get(key)
    if hit is not None and hit[0] is jaxpr and len(consts) == 0:
      return hit[1]
    orig = jaxpr
    if constvars_as_args:
      jaxpr = jaxpr.replace(invars=[*jaxpr.constvars, *jaxpr.invars], constvars=[])
    if in_batched is None:
      in_batched = (False,) * len(jaxpr.invars)
    plan = self._codegen(jaxpr, consts, in_batched)
    if first_calls and not self.params.pdb:
      plan.run_lines_first()
    elif lazy:
      plan.compile_on_call()
    else:
      plan.compiled()
    if not consts:
      self._cache[key] = (orig, plan)
    return plan

  # -- per-eqn lowering (overridden by the batch compiler) --------------------
  def lower_eqn(self, rule, info, in_batched):
    """(callable, needs_ctx, out_batched) of one eqn."""
    fn = rule.compile(info)
    if isinstance(fn, registry.NeedsCtx):
      return fn.fn, True, (False,) * len(info.out_avals)
    return fn, rule.needs_ctx, (False,) * len(info.out_avals)

  def check_wrapper(self, fn, info, multiple, out_batched):
    return _checked(fn, info, multiple)

  # -- codegen --------------------------------------------------------------
  def _codegen(self, jaxpr, consts, in_batched) -> Plan:
    em = Emitter(ZeroTracker())
    arg_names = [em.fresh("a") for _ in jaxpr.invars]
    for n, v in zip(arg_names, jaxpr.invars):
      em.zeros.note_size(n, v.aval)
    outs = self._emit(em, jaxpr, consts, list(zip(arg_names, in_batched)),
                      [True] * len(jaxpr.outvars))
    ret = []
    out_batched = []
    const_outputs = set()
    for k, a in enumerate(outs):
      if isinstance(a, Const):
        ret.append(em.const(a.value))
        out_batched.append(False)
        const_outputs.add(k)
      else:
        ret.append(a[0])
        out_batched.append(a[1])
    if not self.params.pdb:  # under pdb every value stays inspectable
      passes.free_dead_values(em, set(ret))
      passes.in_place(em, set(ret))
      passes.into_refs(em, set(ret))
    fname = f"plan_{_sanitize(self.name)}"
    filename = sourcemap.new_filename(self.name)
    line_eqns = sourcemap.register(filename, em.line_eqns + [None])
    # The generated function's frames keep the source map entry alive.
    em.env_globals["_line_eqns"] = line_eqns
    plan = Plan(jaxpr, filename, line_eqns,
                (fname, arg_names, em.body, ret, em.env_globals))
    plan.out_batched = tuple(out_batched)
    plan.const_outputs = frozenset(const_outputs)
    return plan

  def _emit(self, em: Emitter, jaxpr, consts, in_atoms, live_out):
    """Emit ``jaxpr``'s eqns into ``em``; ``in_atoms`` are (name, batched)
    pairs or Const for its invars. Returns the atoms of its outvars."""
    env: dict[Any, Any] = {}  # var -> (name, batched) | Const
    for v, c in zip(jaxpr.constvars, consts):
      env[v] = Const(_host_const(c, v.aval))
    for v, a in zip(jaxpr.invars, in_atoms):
      env[v] = a
    # Liveness: which vars are read by a kept eqn or the live outputs.
    live = set(v for v, l in zip(jaxpr.outvars, live_out)
               if l and isinstance(v, jc.Var))
    eqns = jaxpr.eqns
    keep = [False] * len(eqns)
    Var = jc.Var
    for i in range(len(eqns) - 1, -1, -1):
      eqn = eqns[i]
      if jc.has_effects(eqn) or any([o in live for o in eqn.outvars]):  # (a DropVar is never live)
        keep[i] = True
        for v in eqn.invars:
          if isinstance(v, Var):
            live.add(v)

    fusion = None
    if not self.params.pdb and any(e.primitive.name in Fusion.ROOTS for e in jaxpr.eqns):
      fusion = Fusion(jaxpr, keep, batched=self.batched, lanes_last=self.lanes_last)

    def atom_of(v):
      if isinstance(v, jc.Literal):
        return Const(np_constant(v.val, v.aval))
      a = env.get(v)
      if a is None:
        raise AssertionError(f"unbound var {v}")
      return a

    def text(a) -> str:
      if isinstance(a, Const):
        return em.const(a.value)
      return a[0]

    check = self.params.check_avals
    DropVar = jc.DropVar
    absorbed = fusion.absorbed if fusion is not None else ()
    squeezed = fusion.squeeze_of if fusion is not None else ()
    concats = fusion.concat_buffer if fusion is not None else {}
    fused_into = fusion.into if fusion is not None else ()
    # jnp's x // c and x % c traced inline: one ufunc for the run (see idioms).
    use_idioms = self.loop_depth > 0 and not self.params.pdb
    idiom_runs = idioms.find(jaxpr) if use_idioms and fusion is None else {}
    run_end = 0
    for i, eqn in enumerate(jaxpr.eqns):
      if i < run_end or not keep[i]:
        continue
      if i in idiom_runs:  # (only without fusion: no bookkeeping to keep in step)
        end, ufunc, x, divisor, out = idiom_runs[i]
        if out not in live:
          run_end = end
          continue
        if atom_of(x).__class__ is not Const:  # (constants fold as usual)
          run_end = end
          self._emit_idiom(em, env, eqn.replace(invars=[x, x], outvars=[out]), ufunc,
                           [atom_of(x), Const(divisor)], text, check)
          continue
      if i in absorbed:
        if fusion.absorb(i, em, env):
          continue
      outvars_used = tuple([not isinstance(o, DropVar) and o in live for o in eqn.outvars])
      if i in squeezed:
        # squeeze(slice(x)): one indexing op on x.
        operand, index = fusion.squeeze_of[i]
        in_atoms_e = [atom_of(operand)]
        info = registry.EqnInfo(eqn, self, outvars_used)
        lanes = not isinstance(in_atoms_e[0], Const) and in_atoms_e[0][1]
        if lanes:  # a batched operand: its lane axis comes first
          index = (slice(None), *index)
        fn, needs_ctx, out_batched = (lambda x, _i=index: x[_i]), False, (lanes,)
        if isinstance(in_atoms_e[0], Const):
          env[eqn.outvars[0]] = Const(fn(in_atoms_e[0].value))
          continue
        self._emit_call(em, env, eqn, info, fn, False, out_batched, in_atoms_e,
                        outvars_used, text, check)
        continue
      in_atoms_e = [atom_of(v) for v in eqn.invars]
      if concats.get(i) is not None:
        fusion.emit_concat(i, em, env, in_atoms_e, text)
        continue
      if (use_idioms and in_atoms_e and in_atoms_e[0].__class__ is not Const
          and len(in_atoms_e) == 2):
        divisor = in_atoms_e[1].value if in_atoms_e[1].__class__ is Const else None
        idiom = idioms.integer_division(eqn, divisor)
        if idiom is not None:  # a jnp x // c, x % c call: one ufunc (see idioms)
          self._emit_idiom(em, env, eqn, idiom[0], [in_atoms_e[0], Const(idiom[1])], text,
                           check)
          continue
      if (use_idioms and len(in_atoms_e) == 2 and in_atoms_e[0].__class__ is not Const
          and (in_atoms_e[1].__class__ is Const or not in_atoms_e[1][1])):
        axis = idioms.roll_axis(eqn)
        if axis is not None:  # jnp.roll by a traced shift: one line (see idioms)
          self._emit_roll(em, env, eqn, axis, in_atoms_e, text, check)
          continue
      callee = self._inline_callee(eqn)
      if callee is not None:
        sub_jaxpr, sub_consts = callee
        outs = self._emit(em, sub_jaxpr, sub_consts, in_atoms_e, list(outvars_used))
        for o, a, used in zip(eqn.outvars, outs, outvars_used):
          if used:
            env[o] = a
        continue
      rule = registry.lookup(eqn.primitive)
      if rule is None:
        raise UnsupportedError(
            f"pallas_np: primitive '{eqn.primitive.name}' is not supported by "
            f"the NumPy interpreter (kernel '{self.name}', at "
            f"{jc.source_summary(eqn.source_info)}). See "
            f"`python -m pallas_np.coverage` for what is supported.")
      folded = {v: a.value for v, a in zip(eqn.invars, in_atoms_e)
                if a.__class__ is Const and isinstance(v, jc.Var)}
      info = registry.EqnInfo(eqn, self, outvars_used, folded)
      in_batched = tuple(not isinstance(a, Const) and a[1] for a in in_atoms_e)
      try:
        fn, needs_ctx, out_batched = self.lower_eqn(rule, info, in_batched)
      except UnsupportedError:
        raise
      except NotImplementedError as e:
        raise UnsupportedError(
            f"pallas_np: {e} (primitive '{eqn.primitive.name}', kernel "
            f"'{self.name}', at {jc.source_summary(eqn.source_info)})") from e
      outs = passes.fold(rule, eqn, fn, needs_ctx, in_atoms_e)
      if outs is not None:
        for o, val in zip(eqn.outvars, outs):
          if not isinstance(o, jc.DropVar):
            env[o] = Const(val)
        continue
      if (getattr(fn, "is_identity", False) and not needs_ctx and len(in_atoms_e) == 1
          and len(eqn.outvars) == 1 and out_batched[0] == in_batched[0]):
        env[eqn.outvars[0]] = in_atoms_e[0]  # (its value, unchanged: no line)
        continue
      if (i in fused_into and not needs_ctx
          and fusion.emit_into(i, em, env, fn, in_atoms_e, info, text)):
        continue
      self._emit_call(em, env, eqn, info, fn, needs_ctx, out_batched, in_atoms_e,
                      outvars_used, text, check)
    # Outputs nobody reads may be unbound: their eqns were dropped, or JAX
    # left a DropVar there (a jit whose caller ignores an output).
    return [atom_of(v) if live_out[k] and not isinstance(v, jc.DropVar) else None
            for k, v in enumerate(jaxpr.outvars)]

  def _emit_call(self, em, env, eqn, info, fn, needs_ctx, out_batched, in_atoms_e,
                 outvars_used, text, check, multiple=None):
    """One line ``outs = fN(args)`` for an eqn (with its zero guard)."""
    if multiple is None:
      multiple = eqn.primitive.multiple_results
    specialise = getattr(fn, "specialise", None)
    if specialise is not None and any(isinstance(a, Const) for a in in_atoms_e):
      better = specialise([a.value if isinstance(a, Const) else None for a in in_atoms_e])
      if better is not None:
        fn = better
    if not needs_ctx:
      fn = _scalar_form(fn, info, in_atoms_e, out_batched)
    fast = getattr(fn, "if_no_zeros", None)
    zero_srcs = None
    if fast is not None and not needs_ctx:
      zero_srcs = em.zeros.guard_sources(in_atoms_e, info.in_avals, info.out_avals[0])
      if zero_srcs is None:
        fast = None
    # A ufunc, or a rule's callable that acts as one (``ufunc_like``: takes
    # ``out=``, has ``nin``/``nout``; XLA's formulas in primitives/xla_math.py).
    ufunc = fn if (fn.__class__ is np.ufunc or getattr(fn, "ufunc_like", False)) \
        and fast is None and fn.nout == 1 else None
    if ufunc is None and fast is None and getattr(fn, "into_operand", None) is not None:
      ufunc = fn  # (allocates its result and can write into an operand: see in_place)
    with_out = None if ufunc is not None or fast is not None else getattr(fn, "with_out", None)
    store = getattr(fn, "store_target", None)
    checked = None
    fn_unchecked = fn
    if check:
      checked = lambda f: self.check_wrapper(f, info, multiple, out_batched)
      fn = checked(fn)
      if fast is not None:
        fast = self.check_wrapper(fast, info, multiple, out_batched)
    g = em.fresh("f")
    em.env_globals[g] = fn
    if fn_unchecked.__class__ is np.ufunc and getattr(info.out_avals[0], "shape", ()):
      args = [em.const(_zero_d(a.value)) if a.__class__ is Const else a[0] for a in in_atoms_e]
    else:
      args = [text(a) for a in in_atoms_e]
    flags = None
    if fast is not None:
      flags = em.zeros.guard(em, zero_srcs, eqn)
      g = zero_select(em, g, fast, fn)
    if needs_ctx:
      args.insert(0, "ctx")
    outs = []
    for o, used, b in zip(eqn.outvars, outvars_used, out_batched):
      if used:
        n = em.fresh("v")
        env[o] = (n, b)
        outs.append(n)
        em.zeros.note_size(n, o.aval)
      else:
        outs.append("_")
    em.reads.append([a[0] for a in in_atoms_e if not isinstance(a, Const)])
    if registry.properties(eqn.primitive).data_movement:
      em.zeros.moved(eqn, in_atoms_e, outs)
    line = Line(g, tuple(args), tuple(outs), unpack=multiple, flags=flags)
    if (store is not None and flags is None and not needs_ctx and len(in_atoms_e) >= 2
        and in_atoms_e[1].__class__ is not Const
        and in_atoms_e[0].__class__ is not Const and in_atoms_e[0][1] == in_atoms_e[1][1]):
      # A whole-value store whose value has the ref's lane axis (see passes.into_refs).
      line.store = (store, fn_unchecked, checked)
    if fast is not None and outs[0] != "_" and getattr(eqn.outvars[0].aval, "shape", ()):
      # A zero-guarded max/min: both its forms allocate the result (the
      # exact one fixes zeros in a fresh np.where), so a later line may
      # write into it (passes.in_place), though it writes into no operand.
      em.fresh_values.add(outs[0])
    if ufunc is not None and outs[0] != "_":
      # A ufunc allocates its result: it may write into a dying operand
      # (passes.in_place) and its own result may be written into later.
      out = eqn.outvars[0].aval
      shape = getattr(out, "shape", ())
      if shape:
        em.fresh_values.add(outs[0])
        line.into = (ufunc, tuple(
            k for k, (a, v) in enumerate(zip(in_atoms_e, eqn.invars))
            if a.__class__ is not Const and a[1] == out_batched[0]
            and v.aval.shape == shape and v.aval.dtype == out.dtype), checked)
    elif with_out is not None and outs[0] != "_" and not multiple:
      # A rule that allocates its result and can write it into ``out=`` (a
      # 2-D dot): fresh, and may be computed in a ref block (into_refs).
      if getattr(eqn.outvars[0].aval, "shape", ()):
        em.fresh_values.add(outs[0])
        line.into = (with_out, (), checked)
    em.body.append(line)
    em.line_eqns.append(eqn)

  def _emit_idiom(self, em, env, eqn, ufunc, in_atoms_e, text, check):
    """One ufunc line for ``eqn`` (x, constant divisor) -> one output."""
    ufunc, divisor = idioms.by_power_of_two(ufunc, in_atoms_e[1].value)
    in_atoms_e = [in_atoms_e[0], Const(divisor)]
    info = registry.EqnInfo(eqn, self, (True,))
    self._emit_call(em, env, eqn, info, ufunc, False, (in_atoms_e[0][1],), in_atoms_e,
                    (True,), text, check, multiple=False)

  def _emit_roll(self, em, env, eqn, axis, in_atoms_e, text, check):
    """One line for a jnp ``roll(x, shift, axis)`` call (``idioms.roll_axis``);
    ``x`` may carry a lane axis, ``shift`` may not."""
    lanes = in_atoms_e[0][1]
    fn = idioms.roll_fn(eqn.invars[0].aval.shape, axis, lanes)
    info = registry.EqnInfo(eqn, self, (True,))
    self._emit_call(em, env, eqn, info, fn, False, (lanes,), in_atoms_e, (True,), text, check,
                    multiple=False)
    out = env[eqn.outvars[0]][0]
    em.zeros.moved(eqn, in_atoms_e[:1], [out])
    em.fresh_values.add(out)  # (a new array, even for a shift of 0: see roll_fn)

  @staticmethod
  def _inline_callee(eqn):
    """(jaxpr, consts) of a call whose body can be emitted inline, else None."""
    if eqn.primitive is jc.call_hi_primitive_p:
      callee = jc.hi_primitive_expansion(eqn)
    else:
      param = INLINE_CALLS.get(eqn.primitive.name)
      if param is None:
        return None
      callee = eqn.params.get(param)
    if isinstance(callee, jc.ClosedJaxpr):
      sub, consts = callee.jaxpr, callee.consts
    elif isinstance(callee, jc.Jaxpr):
      sub, consts = callee, ()
    else:
      return None
    if len(sub.invars) != len(eqn.invars) or len(sub.outvars) != len(eqn.outvars):
      return None
    return sub, consts


def _sanitize(name: str) -> str:
  return "".join(c if c.isalnum() else "_" for c in name)[:60] or "kernel"


def _checked(fn, info: registry.EqnInfo, multiple: bool):
  avals = [jc.physical_aval(a) if used else None
           for a, used in zip(info.out_avals, info.outvars_used)]
  name = info.primitive.name

  def check(val, aval):
    if aval is None or isinstance(aval, jc.AbstractRef) or not hasattr(aval, "shape"):
      return
    shape = np.shape(val)
    dtype = getattr(val, "dtype", None)
    # Semaphores are int64 byte counters here (memory.allocate), also as outputs.
    want = np.int64 if jc.is_semaphore_dtype(aval.dtype) else jc.physical_dtype(aval.dtype)
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
