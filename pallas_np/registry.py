"""The one registry: JAX primitive -> NumPy rule.

A rule is a *compile* function: it sees one eqn (params and avals) once, when
the kernel is compiled into a plan, and returns the callable that the plan
calls on every evaluation. Specialising at compile time keeps param parsing,
dtype decisions and isinstance checks off the hot path.

Three ways to register, from the simplest:

* ``register_numpy(prim, fn)``: ``fn(*inputs)`` is the whole rule (``np.add``).
* ``register_impl(prim, params=(...))``: decorates ``fn(*inputs, **params)``;
  only the named params are bound.
* ``register(prim)``: decorates ``compile(e: EqnInfo) -> callable``.

``needs_ctx=True`` makes the plan pass the run context (program ids, grid,
options) as the first argument.

Every per-primitive property is given in the same call, so a primitive's
sequential rule, batched rule and properties sit together:

* ``batch``: how a vectorized grid (``pallas_np.batching``) evaluates the
  primitive on values with a leading lane axis: a batched rule
  ``rule(bc, seq_rule, info, in_batched) -> (fn, needs_ctx, out_batched)``,
  a standard kind (``ELEMENTWISE``, ``IDENTITY``), or ``unbatched(why)``:
  run lane by lane (or, for a context-dependent primitive, refuse to batch
  the grid), with the reason.
* ``context_free``: a ``needs_ctx`` rule that keeps no state across grid
  points (grid position, control flow, calls, scoped allocation, no-ops), so
  the grid may still run on threads.
* ``gemm``: a matrix product (BLAS already uses every core; batched passes
  keep lanes first for it).
* ``data_movement``: float outputs only hold bitwise copies of elements of
  float operands (an output can hold a zero only if an operand does).
* ``native``: the primitive in a loop compiled by the native tier
  (``pallas_np.native``): its emitter ``emit(gen, eqn, ins) -> outs``
  (``native/codegen.py``), or ``native_refused(why)``: never compiled (a
  loop holding it keeps its NumPy path), with the reason. The native
  package attaches its emitters with ``attach_native`` (its modules are
  imported before most rules are registered); every registered rule has
  one or the other (``tests/test_native_registry.py``).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Sequence

from pallas_np import _compat as jc
from pallas_np.errors import UnsupportedError


@dataclasses.dataclass(frozen=True)
class Rule:
  compile: Callable[["EqnInfo"], Callable]
  needs_ctx: bool = False
  # Pure rules with constant inputs may be evaluated at compile time.
  foldable: bool = True
  # The properties (see the module docstring).
  batch: Any = None
  context_free: bool = False
  gemm: bool = False
  data_movement: bool = False
  native: Any = None


class native_refused:
  """``native=native_refused(why)``: the native tier never compiles this
  primitive (a loop holding it runs its NumPy path), for the reason ``why``."""
  __slots__ = ("why",)

  def __init__(self, why: str):
    self.why = why

  def __repr__(self):
    return f"native_refused({self.why!r})"


class BatchKind:
  """A standard batched rule, named at registration (``batch=ELEMENTWISE``)
  and implemented by the batch compiler (``pallas_np.batching``)."""
  __slots__ = ("name",)

  def __init__(self, name):
    self.name = name

  def __repr__(self):
    return f"registry.{self.name}"


# Elementwise with numpy broadcasting: the unbatched rule runs on lane-stacked
# operands as is (a batched lower-rank operand is aligned on the lane axis).
ELEMENTWISE = BatchKind("ELEMENTWISE")
# An identity on its operand(s): the lanes pass through.
IDENTITY = BatchKind("IDENTITY")


class unbatched:
  """``batch=unbatched(why)``: no batched rule, on purpose. The batch
  compiler runs the sequential rule once per lane when that is correct (a
  pure primitive, or one touching only its own ref operands); otherwise (it
  needs the run context, has sub-jaxprs or other effects) the grid runs
  sequentially. ``why`` says why a batched rule is not worth having."""
  __slots__ = ("why",)

  def __init__(self, why: str):
    self.why = why

  def __repr__(self):
    return f"unbatched({self.why!r})"


_RULES: dict[Any, Rule] = {}


class EqnInfo:
  """What a compile rule may look at: one eqn and the compiler."""
  __slots__ = ("eqn", "primitive", "params", "in_avals", "out_avals",
               "compiler", "outvars_used", "folded")

  def __init__(self, eqn, compiler, outvars_used, folded=None):
    # folded: {invar: value} for the invars the compiler knows as constants
    # (computed from literals only), e.g. the broadcast -1 of x_ref[idx, -1].
    self.folded = folded or {}
    self.eqn = eqn
    self.primitive = eqn.primitive
    self.params = eqn.params
    self.in_avals = tuple([v.aval for v in eqn.invars])
    self.out_avals = tuple([v.aval for v in eqn.outvars])
    self.compiler = compiler
    self.outvars_used = outvars_used

  @property
  def out_aval(self):
    return self.out_avals[0]

  @property
  def source(self) -> str:
    return jc.source_summary(self.eqn.source_info)

  def unsupported(self, what: str) -> Exception:
    return UnsupportedError(
        f"pallas_np: {what} (primitive '{self.primitive.name}') is not "
        f"supported by the NumPy interpreter, at {self.source}")


class NeedsCtx:
  """What a compile rule returns, wrapping its callable, to get the run
  context for *this* eqn only (e.g. jax.random on pltpu's stateful key, whose
  bits come from the kernel's PRNG state); the plan then calls ``fn(ctx,
  *inputs)``, never folds it and the grid is not vectorized."""
  __slots__ = ("fn",)

  def __init__(self, fn):
    self.fn = fn


def zero_sensitive(exact: Callable, if_no_zeros: Callable) -> Callable:
  """Marks a rule's callable whose exact result differs from the cheaper
  ``if_no_zeros`` only when an operand holds a (signed) zero, like XLA's
  float max/min (+0.0 > -0.0; NumPy returns either zero). The evaluator
  proves zero-freeness per run from the values the operands were moved
  from (see ``compiler.zeros.ZeroTracker``) and then calls ``if_no_zeros``."""
  exact.if_no_zeros = if_no_zeros
  return exact


def const_specialised(fn: Callable, specialise: Callable) -> Callable:
  """Marks a rule's callable that has a cheaper exact form when some operands
  are constants: ``specialise(consts)`` gets each operand's constant value
  (None where not constant) and returns a callable with the same signature,
  or None. Asked once per eqn at compile time (e.g. ``max(x, 0.0)``, a
  ReLU, needs no zero check: adding +0.0 turns its -0.0 into XLA's +0.0)."""
  fn.specialise = specialise
  return fn


def register(prim, *, needs_ctx: bool = False, foldable: bool = True, batch=None,
             context_free: bool = False, gemm: bool = False, data_movement: bool = False,
             native=None):
  """Decorates ``compile(e: EqnInfo) -> callable``: the primitive's rule,
  registered with its properties (see the module docstring)."""
  def deco(compile_fn):
    _store(prim, Rule(compile_fn, needs_ctx, foldable and not needs_ctx, batch,
                      context_free, gemm, data_movement, native))
    return compile_fn
  return deco


def register_numpy(prim, fn: Callable, *, foldable: bool = True, batch=None,
                   data_movement: bool = False, native=None):
  _store(prim, Rule(lambda e: fn, False, foldable, batch, data_movement=data_movement,
                    native=native))
  return fn


def register_impl(prim, params: Sequence[str] = (), *, needs_ctx: bool = False,
                  foldable: bool = True, batch=None, context_free: bool = False,
                  gemm: bool = False, data_movement: bool = False, native=None):
  params = tuple(params)

  def deco(fn):
    if not params:
      compile_fn = lambda e: fn
    else:
      def compile_fn(e):
        bound = {p: e.params[p] for p in params}
        return lambda *args: fn(*args, **bound)
    _store(prim, Rule(compile_fn, needs_ctx, foldable and not needs_ctx, batch,
                      context_free, gemm, data_movement, native))
    return fn
  return deco


def _put(prim, rule: Rule) -> None:
  """Store ``rule``, with the native emitter attached to ``prim`` (or its
  name) when the rule does not name one itself."""
  if rule.native is None:
    native = _NATIVE.get(prim, _NATIVE.get(getattr(prim, "name", None)))
    if native is not None:
      rule = dataclasses.replace(rule, native=native)
  _RULES[prim] = rule


def attach_native(prim, native) -> None:
  """Set the ``native`` field (an emitter or ``native_refused``) of the
  rule of ``prim`` — a primitive, or a primitive's name for every primitive
  of that name — registered now or later (the native package's modules
  are imported before most rules are registered)."""
  if _NATIVE.get(prim, native) is not native:
    raise ValueError(f"a second native emitter or refusal for {prim!r}")
  _NATIVE[prim] = native
  for p, rule in list(_RULES.items()):
    if (p is prim or p.name == prim) and rule.native is None:
      _RULES[p] = dataclasses.replace(rule, native=native)


_NATIVE: dict = {}  # primitive or name -> native emitter / native_refused


def _store(prim, rule: Rule) -> None:
  """Register ``rule``; a ``LazyPrimitive`` key (a Triton primitive named
  before JAX's module is imported) waits until that module is imported."""
  if not isinstance(prim, jc.LazyPrimitive):
    _put(prim, rule)
    return
  real = prim.resolve()
  if real is not None:
    _put(real, rule)
    return
  if not any(p.module == prim.module for p, _ in _LAZY):
    jc.on_first_use(prim.module, _resolve_lazy)
  _LAZY.append((prim, rule))


_LAZY: list = []  # (LazyPrimitive, Rule) whose module is not imported yet


def _resolve_lazy() -> None:
  for entry in list(_LAZY):
    real = entry[0].resolve()
    if real is not None or entry[0].module in sys.modules:
      _LAZY.remove(entry)
      if real is not None:
        _put(real, entry[1])


def lookup(prim) -> Rule | None:
  rule = _RULES.get(prim)
  if rule is None and jc.load_imported_families():  # a family registered on first use
    rule = _RULES.get(prim)
  return rule


_NO_RULE = Rule(lambda e: None, foldable=False)


def properties(prim) -> Rule:
  """The registered rule of ``prim`` (properties all off when it has none),
  for analyses that ask about a property: ``properties(p).gemm``."""
  return lookup(prim) or _NO_RULE


def registered_primitives() -> dict[str, Any]:
  jc.load_imported_families()
  return {p.name: p for p in _RULES}
