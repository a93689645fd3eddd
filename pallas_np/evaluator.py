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
import math
import linecache
import sys
import threading
import types
from typing import Any, Callable, Sequence

import jax
import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import is_low_precision_float
from pallas_np.errors import UnsupportedError
from pallas_np.params import InterpretParams


class RunContext:
  """Per-execution state that ctx-rules read: where in the grid we are."""
  __slots__ = ("program_ids", "num_programs", "kernel_name", "params",
               "grid_point", "extra", "batch_size")

  def __init__(self, kernel_name="kernel", params=None, program_ids=(),
               num_programs=()):
    self.kernel_name = kernel_name
    self.params = params
    self.program_ids = program_ids
    self.num_programs = num_programs
    self.grid_point = ()
    self.extra = {}
    # Lanes of a vectorized pass (pallas_np.vectorize); None when sequential.
    self.batch_size = None


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


# Code objects by generated source (without the function name): index maps,
# cond branches and loop bodies often generate the same text, and Python's
# compile() is ~50 us per call plus ~5-8 us per line.
_CODE_CACHE: dict[str, types.CodeType] = {}
_CODE_CACHE_SIZE = 2048


def _function_code(signature_and_body: str) -> types.CodeType:
  code = _CODE_CACHE.get(signature_and_body)
  if code is None:
    module = compile("def plan" + signature_and_body, "<pallas_np plan>", "exec")
    code = next(c for c in module.co_consts if isinstance(c, types.CodeType))
    if len(_CODE_CACHE) >= _CODE_CACHE_SIZE:
      _CODE_CACHE.clear()
    _CODE_CACHE[signature_and_body] = code
  return code


def _host_const(val, aval):
  """A jaxpr const as NumPy: a jax.Array const left as is would make every
  rule that folds or reads it dispatch (and XLA-compile) a JAX op."""
  if isinstance(val, jax.Array) and not jc.is_extended_dtype(val.dtype):
    return np_constant(np.asarray(val), aval)
  return val


# A plan built with ``first_calls=True`` runs its lines without compiling
# them (``_line_runner``) until this many calls, or until a later kernel run
# (``new_run``) calls it: Python's compile() costs ~10 us per generated line,
# the runner ~0.5 us per line per call more than compiled code, and a first
# call is often the only call (one grid point, a few batched slabs).
FIRST_CALLS = 8
_run_epoch = [0]


def new_run():
  """A kernel run starts: plans that ran lines for an earlier run compile."""
  _run_epoch[0] += 1


class Plan:
  """A compiled jaxpr: ``plan(ctx, *args) -> tuple of outputs``.

  ``fn`` is the generated Python function, or, for the first calls of a
  ``first_calls`` plan, the line runner (which swaps ``fn`` for the compiled
  function when it is done)."""
  __slots__ = ("fn", "jaxpr", "filename", "num_eqns", "out_batched",
               "const_outputs", "lane_access_bytes", "_text", "_source",
               "_compiled", "_calls", "_epoch")

  def __init__(self, jaxpr, filename, num_eqns, text):
    self.out_batched = ()
    self.lane_access_bytes = 0  # batched plans: see vectorize._count_lane_bytes
    # Outputs that are constants of the plan (the same array every call).
    self.const_outputs = frozenset()
    self.jaxpr = jaxpr
    self.filename = filename
    self.num_eqns = num_eqns
    self._text = text  # (function name, arg names, body lines, returned names, globals)
    self._source = None
    self._compiled = None
    self._calls = 0
    self._epoch = None  # the run of its first call
    self.fn = None

  def __call__(self, ctx, *args):
    return self.fn(ctx, *args)

  @property
  def source(self) -> str:
    if self._source is None:
      fname, arg_names, body, ret, _ = self._text
      lines = [f"def {fname}(ctx{''.join(', ' + a for a in arg_names)}):"]
      lines += ["    " + b.render() for b in body]
      lines.append(f"    return ({', '.join(ret)}{',' if len(ret) == 1 else ''})")
      self._source = "\n".join(lines) + "\n"
    return self._source

  def compiled(self):
    """The generated function (compiled on first use); from now on ``fn``."""
    fn = self._compiled
    if fn is None:
      source = self.source
      fname, _, _, _, env_globals = self._text
      code = _function_code(source[source.index("("):]).replace(
          co_filename=self.filename, co_name=fname, co_qualname=fname)
      # Make the generated source visible to tracebacks, pdb and py-spy.
      linecache.cache[self.filename] = (len(source), None, source.splitlines(True),
                                        self.filename)
      fn = self._compiled = types.FunctionType(code, env_globals, fname)
    self.fn = fn
    return fn

  def run_lines_first(self):
    """``fn`` runs the lines uncompiled for the first calls (see FIRST_CALLS)."""
    runner = _line_runner(self)

    def first_calls(ctx, *args):
      if self._epoch is None:
        self._epoch = _run_epoch[0]
      if self._calls >= FIRST_CALLS or self._epoch != _run_epoch[0]:
        return self.compiled()(ctx, *args)
      self._calls += 1
      return runner(ctx, *args)
    self.fn = first_calls


def _run_lines(ctx, *args):
  """The body of every line runner; its globals are one plan's steps, and
  ``i`` is the running line (see ``failing_eqns``)."""
  regs = _template.copy()
  regs[0] = ctx
  regs[1:_num_args] = args
  for i, (fn, ins, flags, out, dels) in enumerate(_steps):
    if flags:
      fn = fn[any([regs[k] for k in flags])]
    value = fn(*[regs[k] for k in ins])
    if out.__class__ is int:
      regs[out] = value
    elif out is not None:
      for k, v in zip(out, value):
        regs[k] = v
    for k in dels:
      regs[k] = None
  return tuple([regs[k] for k in _returned])


def _line_runner(plan):
  """A function running a plan's lines as data: registers instead of
  locals, the same callables, no compile()."""
  _, arg_names, body, ret, env_globals = plan._text
  slots = {"ctx": 0}
  for a in arg_names:
    slots[a] = len(slots)
  slot = slots.setdefault  # slot(name, len(slots)): a name's register, new ones appended

  steps = []
  for line in body:
    fn = env_globals[line.callee]
    args = line.args
    if len(args) == 1 and args[0].__class__ is tuple:
      # ``name.shape[0]``: only a lane-stacked buffer's allocation
      ins = (slot(args[0][0], len(slots)),)
      fn = (lambda alloc: lambda x: alloc(x.shape[0]))(fn)
    else:
      ins = tuple([slot(a, len(slots)) for a in args])
    flags = tuple([slot(f, len(slots)) for f in line.flags]) if line.flags else ()
    outs = line.outs
    if not outs or (not line.unpack and outs[0] == "_"):
      out = None
    elif line.unpack:
      out = tuple([slot(o, len(slots)) for o in outs])
    else:
      out = slot(outs[0], len(slots))
    steps.append((fn, ins, flags, out, tuple([slot(d, len(slots)) for d in line.dels])))
  returned = tuple([slot(r, len(slots)) for r in ret])
  template = [None] * len(slots)
  for name, k in slots.items():
    if name in env_globals:  # constants: names of the generated function's globals
      template[k] = env_globals[name]
  scope = {"__builtins__": __builtins__, "_template": template, "_steps": steps,
           "_num_args": 1 + len(arg_names), "_returned": returned,
           "_filename": plan.filename}
  return types.FunctionType(_run_lines.__code__, scope, "_run_lines")


def lanes_last_empty(n, shape, dtype) -> np.ndarray:
  """An uninitialised (n, *shape) array laid out lane-minor: the lane axis
  is the contiguous one (see vectorize: the lanes-last layout)."""
  return np.moveaxis(np.empty((*shape, n), dtype), -1, 0)


def _has_effects(eqn) -> bool:
  return bool(eqn.effects)


class _Line:
  """One line of a generated function, ``outs = callee(args)``, kept
  structured: rendered to source for compile(), or run as it is by the
  first-calls runner (see ``Plan``). ``flags``: the callee is a (fast,
  exact) pair indexed by whether any of these zero flags is set (see
  ``_zero_select``). An arg that is a 1-tuple ``(name,)`` stands for
  ``name.shape[0]`` (a batched value's lane count)."""
  __slots__ = ("outs", "unpack", "callee", "flags", "args", "dels", "into", "store")

  def __init__(self, callee, args=(), outs=(), *, unpack=False, flags=None):
    self.callee = callee
    self.args = args
    self.outs = outs  # names; "_" for an output nobody reads
    self.unpack = unpack  # the callee returns a sequence (multiple results)
    self.flags = flags
    self.dels = ()  # values that die here (see _Emitter.free_dead_values)
    self.into = None  # (ufunc or with_out, arg positions it may write into, check wrapper): see in_place
    self.store = None  # a ref store's (target, plain store, check wrapper): see into_refs

  def render(self) -> str:
    callee = self.callee if self.flags is None else f"{self.callee}[{' or '.join(self.flags)}]"
    args = ", ".join(a if isinstance(a, str) else f"{a[0]}.shape[0]" for a in self.args)
    call = f"{callee}({args})"
    outs = self.outs
    if not outs:
      line = call
    elif self.unpack:
      line = f"{outs[0]}, = {call}" if len(outs) == 1 else f"{', '.join(outs)} = {call}"
    else:
      line = f"{outs[0]} = {call}" if outs[0] != "_" else call
    if self.dels:
      line += "; del " + ", ".join(self.dels)
    return line


class _Emitter:
  """Mutable state of one generated function: globals, names, lines."""
  __slots__ = ("env_globals", "counter", "body", "line_eqns", "reads", "zeros", "fresh_values",
               "wrote_into")

  def __init__(self):
    self.env_globals: dict[str, Any] = {}
    self.counter = itertools.count()
    self.body: list[_Line] = []
    self.line_eqns: list[Any] = [None]  # line 1 = def
    self.reads: list[list[str]] = []  # per body line: the value names it reads
    self.zeros = _ZeroTracker()
    self.fresh_values: set[str] = set()  # arrays a ufunc (or with_out) line allocated (see in_place)
    self.wrote_into: dict[int, int] = {}  # line -> the operand in_place made it write into

  def in_place(self, returned):
    """Let a ufunc line write its result into an operand that dies there
    (``ufunc(x, y, out=x)``) instead of a fresh array: a chain such as
    softmax's ``exp(x - m) / s`` then reuses one buffer, so a first call
    page-faults less fresh memory and warm calls stay in cache. The operand
    must be an array a ufunc line allocated (no other owner), of the
    result's shape, dtype and lane axis (checked when the line was emitted),
    and nothing derived from it by the lines that read it before may
    outlive this line (a view of it would see the overwrite): outputs of
    ufunc lines are fresh arrays; any other reader's outputs must die here
    or earlier, as must theirs. Readers with effects (callbacks may keep
    their arguments) rule it out."""
    fresh, body = self.fresh_values, self.body
    last, outlives = self._lifetimes(returned)
    for i, line in enumerate(body):
      if line.into is None:
        continue
      ufunc, positions, checked = line.into
      for k in positions:
        name = line.args[k]
        if name in fresh and last[name] == i and name in line.dels \
            and not outlives(name, i):
          g = self.fresh("f")
          into = _ufunc_into(ufunc, k)
          self.env_globals[g] = into if checked is None else checked(into)
          line.callee = g
          self.wrote_into[i] = k
          break

  def _lifetimes(self, returned):
    """(the last line reading each value, ``outlives(name, i)``: whether
    something derived from ``name`` by its readers other than line ``i``
    stays alive after line ``i``)."""
    last: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    for i, names in enumerate(self.reads):
      for n in names:
        last[n] = i
        readers.setdefault(n, []).append(i)
    fresh, body, eqns = self.fresh_values, self.body, self.line_eqns

    def outlives(name, i) -> bool:
      for j in readers[name]:
        if j == i:
          continue
        eqn = eqns[j + 1]
        if eqn is not None and (eqn.effects or "callback" in eqn.primitive.name):
          return True
        for o in body[j].outs:
          if not o.startswith("v") or o in fresh:
            continue
          if o in returned or last.get(o, len(body)) > i or outlives(o, i):
            return True
      return False
    return last, outlives

  def into_refs(self, returned):
    """Compute a value stored whole into a ref (``o_ref[...] = exp(x - m)
    / s``) in the ref's block itself: the ufunc line that allocated its
    buffer (before ``in_place`` chained the later lines into it) writes
    into the block instead, and the store finds the value already there.
    Saves the temporary and the copy; on a first call the temporary is
    fresh memory (page faults, ~0.7 ms per MiB on the 2-core machine).
    Legal when the stored value dies at the store with nothing derived
    from it alive (as in ``in_place``), and no line from the allocation
    up to the store reads or passes the ref, or takes the run context
    (a DMA could land in it): the block's earlier contents are then
    never observed between the two lines."""
    body = self.body
    stores = [s for s, line in enumerate(body) if line.store is not None]
    if not stores:
      return
    fresh, reads = self.fresh_values, self.reads
    last, outlives = self._lifetimes(returned)
    producer = {o: i for i, line in enumerate(body) for o in line.outs}
    for s in stores:
      line = body[s]
      target, store, checked = line.store
      ref, val = line.args[0], line.args[1]
      if (val not in fresh or val in returned or last.get(val) != s
          or val not in line.dels or outlives(val, s)):
        continue
      i = producer.get(val)
      while i in self.wrote_into:  # back along the in-place chain to its allocation
        i = producer.get(body[i].args[self.wrote_into[i]])
      if i is None or body[i].into is None or producer.get(ref, -1) >= i:
        continue
      if any(ref in reads[j] or "ctx" in body[j].args for j in range(i, s)):
        continue
      alloc = body[i]
      ufunc, _, alloc_checked = alloc.into
      g = self.fresh("f")
      into = _into_ref(ufunc, target)
      self.env_globals[g] = into if alloc_checked is None else alloc_checked(into)
      alloc.callee = g
      alloc.args = (*alloc.args, ref)
      reads[i].append(ref)
      g = self.fresh("f")
      unless = _store_unless_there(target, store)
      self.env_globals[g] = unless if checked is None else checked(unless)
      line.callee = g

  def free_dead_values(self, returned):
    """Free each intermediate after its last use (``; del v3`` on the same
    line, keeping one line per eqn): otherwise every value of the kernel
    stays alive until the plan returns, and each op writes to fresh,
    cache-cold memory. By name, after inlining, so a value shared by an
    inlined body and its caller lives until the caller is done with it."""
    last: dict[str, int] = {}
    for i, names in enumerate(self.reads):
      for n in names:
        last[n] = i
    dead: dict[int, list[str]] = {}
    for n, i in last.items():
      if n.startswith("v") and n not in returned:
        dead.setdefault(i, []).append(n)
    for i, names in dead.items():
      self.body[i].dels = tuple(sorted(set(names)))

  def fresh(self, prefix):
    return f"{prefix}{next(self.counter)}"

  def const(self, value) -> str:
    g = self.fresh("k")
    self.env_globals[g] = value
    return g


def _per_dtype(test):
  """``test(dtype)`` as a test of an aval, memoised per dtype: the emitter
  asks it of every operand of every eqn."""
  memo: dict = {}

  def of_aval(aval) -> bool:
    dt = getattr(aval, "dtype", None)
    found = memo.get(dt)
    if found is None:
      found = memo[dt] = test(dt)
    return found
  return of_aval


def _is_float_dtype(dt) -> bool:
  if dt is None or jc.is_semaphore_dtype(dt):
    return False
  try:
    dt = np.dtype(dt)
  except TypeError:  # extended dtypes (PRNG keys)
    return False
  return dt.kind == "f" or is_low_precision_float(dt)


_is_float = _per_dtype(_is_float_dtype)


def _has_zero(x) -> bool:
  # all() is one reduction (-0.0 is falsy, NaN truthy); np.any(x == 0)
  # makes a mask first and costs ~2x on the small blocks of a grid step.
  return not x.all()


def _zero_select(em, g, if_no_zeros, exact) -> str:
  """The callee of a zero-guarded line: ``g_nz``, a (fast, exact) pair the
  line indexes by its (Python bool) zero flags, ``g_nz[z3 or z7](...)``.
  Python compiles a subscript ~2x faster than ``(g if cond else g_nz)``,
  and plans have hundreds."""
  em.env_globals[g] = exact
  em.env_globals[g + "_nz"] = (if_no_zeros, exact)
  return g + "_nz"


class _ZeroTracker:
  """Which values of a generated function are, element for element, copies
  of which *source* values (through reshapes, slices, concatenates, max/min,
  ... registered with ``data_movement=True``). A zero-sensitive op (float max/min)
  whose operands come from a few sources checks those sources for zeros once
  per run and takes its fast path when there are none: a bitonic sort's
  hundreds of compare-exchanges share one check of the input block. Not
  when the sources are much bigger than the op (a max of a small slice of a
  big block): its own check is then cheaper."""
  __slots__ = ("sources", "flags", "sizes")
  MAX_SOURCES = 8
  MAX_SOURCE_RATIO = 4

  def __init__(self):
    self.sources: dict[str, frozenset] = {}  # value name -> source names
    self.flags: dict[str, str] = {}  # source name -> its has-zero flag
    self.sizes: dict[str, int] = {}  # value name -> element count

  def note_size(self, name, aval):
    shape = getattr(aval, "shape", None)
    if shape is not None:
      self.sizes[name] = math.prod(shape)

  def guard_sources(self, atoms, avals, out_aval):
    """Sources whose zero check can stand in for a zero-sensitive op's own,
    or None: unknown, all-constant operands, or much bigger than the op."""
    srcs = self.union(atoms, avals)
    if not srcs:
      return None
    if any(s in self.flags for s in srcs):
      return srcs  # some are checked anyway
    total = sum(self.sizes.get(s, 0) for s in srcs)
    if total > self.MAX_SOURCE_RATIO * max(1, math.prod(getattr(out_aval, "shape", ()))):
      return None
    return srcs

  def of_name(self, name) -> frozenset:
    return self.sources.get(name) or frozenset((name,))

  def of(self, atom, aval):
    """Source names of a float operand; None if it may hold a zero that no
    run-time check can rule out (a constant with a zero)."""
    if isinstance(atom, _Const):
      return None if _has_zero(atom.value) else frozenset()
    return self.of_name(atom[0])

  def union(self, atoms, avals):
    found = frozenset()
    for a, aval in zip(atoms, avals):
      if not _is_float(aval):
        continue
      s = self.of(a, aval)
      if s is None:
        return None
      found |= s
    return found if len(found) <= self.MAX_SOURCES else None

  def moved(self, eqn, atoms, out_names):
    a = atoms[0]
    if len(atoms) == 1 and not isinstance(a, _Const):  # reshape, slice, ...
      srcs = self.of_name(a[0])
    else:
      srcs = self.union(atoms, [v.aval for v in eqn.invars])
      if srcs is None:
        return
    for o, n in zip(eqn.outvars, out_names):
      if n != "_" and _is_float(o.aval):
        self.sources[n] = srcs

  def guard(self, em, srcs, eqn) -> tuple:
    """Flags, one of them set when some source holds a zero; emits the flag
    of each source not checked yet (once per run, where first needed)."""
    conds = []
    for s in sorted(srcs):
      flag = self.flags.get(s)
      if flag is None:
        flag = self.flags[s] = em.fresh("z")
        em.env_globals["_has_zero"] = _has_zero
        em.body.append(_Line("_has_zero", (s,), (flag,)))
        em.reads.append([s])
        em.line_eqns.append(eqn)
      conds.append(flag)
    return tuple(conds)


class _Fusion:
  """Peepholes planned on one jaxpr before it is emitted (sequential plans
  only; a batched value has a lane axis the indices below do not know):

  * ``squeeze(slice(x))`` (what ``y[:, 0]`` traces to) becomes one indexing
    op on ``x``.
  * A ``concatenate`` whose operands are results of elementwise ufuncs read
    nowhere else (possibly through a ``rev``, as in ``jnp.flip``) gets its
    buffer allocated first, and each ufunc writes its slot with ``out=``: no
    temporaries and no copy for the concatenate (a bitonic sort's
    compare-exchange is min + max + concatenate).

  Whether an operand really fuses is decided when its producer is emitted
  (its rule must be a plain NumPy ufunc on native dtypes); the rest is
  copied in by the concatenate's own line."""
  ROOTS = frozenset(("squeeze", "concatenate"))  # eqns a fusion starts from

  def __init__(self, jaxpr, keep, batched=False, lanes_last=False):
    eqns = jaxpr.eqns
    self.batched = batched  # a batch compiler's plan: values may carry a lane axis
    self.lanes_last = lanes_last  # lane-stacked buffers laid out lane-minor
    self.lane_buffer: dict[int, bool] = {}  # concat eqn -> its buffer has a lane axis
    uses: dict = {}
    for e in eqns:
      for v in e.invars:
        if isinstance(v, jc.Var):
          uses[v] = uses.get(v, 0) + 1
    for v in jaxpr.outvars:
      if isinstance(v, jc.Var):
        uses[v] = uses.get(v, 0) + 2  # never absorb an output
    producer = {o: i for i, e in enumerate(eqns) for o in e.outvars}
    self.squeeze_of: dict[int, tuple] = {}  # squeeze eqn -> (operand var, index)
    self.into: dict[int, tuple] = {}  # producer eqn -> (concat eqn, slot index)
    self.rev_of: dict[int, int] = {}  # absorbed rev eqn -> its producer eqn
    self.absorbed: set[int] = set()  # eqns emitted as part of another
    self.concat_buffer: dict[int, str | None] = {}  # concat eqn -> buffer name
    self.declined: set[int] = set()  # concat eqns left unfused (batched plans)
    self.fused: dict[int, set] = {}  # concat eqn -> operand positions written
    self.eqns = eqns

    def single_use_producer(v):
      if not isinstance(v, jc.Var) or uses.get(v) != 1:
        return None
      j = producer.get(v)
      return j if j is not None and keep[j] else None

    for i, e in enumerate(eqns):
      if not keep[i]:
        continue
      name = e.primitive.name
      if name == "squeeze":
        j = single_use_producer(e.invars[0])
        if j is not None and eqns[j].primitive.name == "slice":
          s = eqns[j].params
          strides = s["strides"] or (1,) * len(s["start_indices"])
          dims = set(e.params["dimensions"])
          index = tuple(int(st) if d in dims else slice(st, lim, step)
                        for d, (st, lim, step) in enumerate(
                            zip(s["start_indices"], s["limit_indices"], strides)))
          self.squeeze_of[i] = (eqns[j].invars[0], index)
          self.absorbed.add(j)
      elif name == "concatenate" and _native(e.outvars[0].aval):
        d = e.params["dimension"]
        rank = len(e.outvars[0].aval.shape)
        off = 0
        for pos, x in enumerate(e.invars):
          size = x.aval.shape[d]
          slot = (slice(None),) * d + (slice(off, off + size),)
          off += size
          j = single_use_producer(x)
          if j is None:
            continue
          rev = _rev_dims(eqns[j])
          if rev is not None:
            k = single_use_producer(eqns[j].invars[0])
            if k is None:
              continue
            view = tuple(slice(None, None, -1) if a in rev else slice(None)
                         for a in range(rank))
            self.rev_of[j] = k
            self.absorbed.add(j)
            j, slot = k, (slot, view)
          else:
            slot = (slot,)
          if len(eqns[j].outvars) == 1 and j not in self.absorbed:
            self.into[j] = (i, pos, slot)
            self.concat_buffer[i] = None

  def emit_into(self, j, em, env, fn, in_atoms, info, text) -> bool:
    """Emit producer ``j`` writing into its concatenate slot (False: not
    fusable after all; emit it normally)."""
    ufunc = getattr(fn, "if_no_zeros", fn)
    eqn = self.eqns[j]
    out_dtype = info.out_aval.dtype
    if (not isinstance(ufunc, np.ufunc) or all(isinstance(a, _Const) for a in in_atoms)
        or not all(_native(a) and a.dtype == out_dtype for a in info.in_avals)
        or out_dtype != self.eqns[self.into[j][0]].outvars[0].aval.dtype):
      self.into.pop(j)
      return False
    ci, pos, slot = self.into[j]
    concat = self.eqns[ci]
    buf = self.concat_buffer.get(ci)
    lane_atom = next((a for a in in_atoms if not isinstance(a, _Const) and a[1]), None)
    if buf is None:
      if self.batched and lane_atom is None:
        # An unbatched first operand: a later one may be batched and would
        # not fit an unbatched buffer. The concatenate runs unfused.
        self.declined.add(ci)
      if ci in self.declined:
        self.into.pop(j)
        return False
      buf = self.concat_buffer[ci] = em.fresh("v")
      aval = concat.outvars[0].aval
      em.zeros.note_size(buf, aval)
      alloc = em.fresh("f")
      shape, dtype = tuple(aval.shape), np.dtype(aval.dtype)
      if lane_atom is not None:  # lanes first; their count is known when run
        self.lane_buffer[ci] = True
        if self.lanes_last:
          em.env_globals[alloc] = lambda n: lanes_last_empty(n, shape, dtype)
        else:
          em.env_globals[alloc] = lambda n: np.empty((n, *shape), dtype)
        em.body.append(_Line(alloc, ((lane_atom[0],),), (buf,)))
      else:
        em.env_globals[alloc] = lambda: np.empty(shape, dtype)
        em.body.append(_Line(alloc, (), (buf,)))
      em.reads.append([] if lane_atom is None else [lane_atom[0]])
      em.line_eqns.append(concat)
    self.fused.setdefault(ci, set()).add(pos)
    if self.lane_buffer.get(ci):  # slots and views skip the lane axis
      slot = ((slice(None), *slot[0]),) + tuple((slice(None), *v) for v in slot[1:])
    if len(slot) == 1:
      (s,) = slot
      into = lambda out, *xs: ufunc(*xs, out=out[s])
      exact = lambda out, *xs: np.copyto(out[s], fn(*xs))
    else:
      s, view = slot
      into = lambda out, *xs: ufunc(*xs, out=out[s][view])
      exact = lambda out, *xs: np.copyto(out[s][view], fn(*xs))
    g = em.fresh("f")
    args = (buf, *[text(a) for a in in_atoms])
    flags = None
    if fn is not ufunc:  # zero-sensitive (float max/min)
      srcs = em.zeros.guard_sources(in_atoms, info.in_avals, info.out_aval)
      em.env_globals[g] = exact
      if srcs:
        flags = em.zeros.guard(em, srcs, eqn)
        g = _zero_select(em, g, into, exact)
    else:
      em.env_globals[g] = into
    placeholder = em.fresh("_fused")
    env[eqn.outvars[0]] = (placeholder, bool(self.lane_buffer.get(ci)))
    if registry.properties(eqn.primitive).data_movement:
      em.zeros.moved(eqn, in_atoms, [placeholder])
    else:  # a source with no name of its own: checked as part of the buffer
      em.zeros.sources[placeholder] = frozenset((buf,))
    em.body.append(_Line(g, args, flags=flags))
    em.reads.append([buf] + [a[0] for a in in_atoms if not isinstance(a, _Const)])
    em.line_eqns.append(eqn)
    return True

  def absorb(self, i, em, env) -> bool:
    """An absorbed slice/rev: bind its output to a placeholder (its reader
    handles it). False when its fusion fell through: emit it normally."""
    if i in self.rev_of:
      j = self.rev_of[i]
      if j in self.into:
        eqn = self.eqns[i]
        producer_atom = env[self.eqns[j].outvars[0]]
        placeholder = em.fresh("_fused")
        env[eqn.outvars[0]] = (placeholder, False)
        em.zeros.sources[placeholder] = em.zeros.of_name(producer_atom[0])
        return True
      return False
    return True  # the slice of a squeeze(slice(x))

  def emit_concat(self, ci, em, env, in_atoms, text):
    """A concatenate with fused operands: copy in the others, if any."""
    eqn = self.eqns[ci]
    buf = self.concat_buffer[ci]
    rest = [p for p in range(len(in_atoms)) if p not in self.fused[ci]]
    if rest:
      d = eqn.params["dimension"]
      offsets = np.cumsum([0] + [v.aval.shape[d] for v in eqn.invars])
      d += 1 if self.lane_buffer.get(ci) else 0
      slots = [(slice(None),) * d + (slice(int(offsets[p]), int(offsets[p + 1])),)
               for p in rest]

      def fill(out, *xs):
        for s, x in zip(slots, xs):
          out[s] = x
      g = em.fresh("f")
      em.env_globals[g] = fill
      em.body.append(_Line(g, (buf, *[text(in_atoms[p]) for p in rest])))
      em.reads.append([buf] + [in_atoms[p][0] for p in rest
                               if not isinstance(in_atoms[p], _Const)])
      em.line_eqns.append(eqn)
    env[eqn.outvars[0]] = (buf, bool(self.lane_buffer.get(ci)))
    em.zeros.moved(eqn, in_atoms, [buf])


def _native_dtype(dt) -> bool:
  """A dtype NumPy ufuncs compute in natively (no bf16/fp8 round trip)."""
  try:
    return dt is not None and np.dtype(dt).kind in "fiub" and not is_low_precision_float(dt)
  except TypeError:
    return False


_native = _per_dtype(_native_dtype)


def _rev_dims(eqn):
  """Dims reversed by a ``rev`` eqn or a ``jit`` wrapping one (jnp.flip)."""
  if eqn.primitive.name == "rev":
    return set(eqn.params["dimensions"])
  callee = eqn.params.get("jaxpr") if eqn.primitive.name in ("jit", "pjit") else None
  if callee is None:
    return None
  body = getattr(callee, "jaxpr", callee)
  if (len(body.eqns) == 1 and body.eqns[0].primitive.name == "rev"
      and body.eqns[0].invars[0] is body.invars[0]
      and body.outvars[0] is body.eqns[0].outvars[0]):
    return set(body.eqns[0].params["dimensions"])
  return None


class _Const:
  """A value known at compile time (literal, closed-over const, folded)."""
  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value


# Call-like primitives whose body is emitted inline into the caller's code
# (no plan call, no tuple packing): name -> param holding the callee jaxpr.
INLINE_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
                 "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
                 "custom_vjp_call": "call_jaxpr", "remat2": "jaxpr",
                 "checkpoint": "jaxpr", "eval_jaxpr": "call_jaxpr"}


class Compiler:
  """Compiles jaxprs to Plans; sub-jaxprs (cond branches, loop bodies)
  go through the same compiler and are cached per jaxpr object; the bodies
  of jit/closed_call/custom_jvp/custom_vjp/remat calls are inlined."""

  batched = False  # see pallas_np.vectorize.BatchCompiler
  lanes_last = False  # ditto

  def __init__(self, params: InterpretParams | None = None, name: str = "kernel", *,
               kernel_params_from_eqns: bool = False):
    self.params = params or InterpretParams()
    self.name = name
    # Whole programs run outside a force scope: each pallas_call eqn keeps
    # the options of its own ``interpret=`` instead of ``params``.
    self.kernel_params_from_eqns = kernel_params_from_eqns
    self._cache: dict[Any, tuple[Any, Plan]] = {}

  # -- public ---------------------------------------------------------------
  def compile(self, jaxpr, consts: Sequence[Any] | None = None, *,
              constvars_as_args: bool = False, in_batched=None,
              first_calls: bool = False) -> Plan:
    """Compile a Jaxpr (with ``consts`` for its constvars) or a ClosedJaxpr.

    With ``constvars_as_args`` the plan takes the constvars as leading
    arguments instead (run_scoped bodies close over refs that way).
    ``in_batched`` (batch compilers only) says which arguments carry a
    leading batch axis. ``first_calls``: the plan runs its lines without
    compiling them for its first calls (see ``FIRST_CALLS``); for plans a
    caller fetches ``fn`` from per run (kernels, whole programs), not for
    sub-plans whose ``fn`` a rule keeps."""
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
    em = _Emitter()
    arg_names = [em.fresh("a") for _ in jaxpr.invars]
    for n, v in zip(arg_names, jaxpr.invars):
      em.zeros.note_size(n, v.aval)
    outs = self._emit(em, jaxpr, consts, list(zip(arg_names, in_batched)),
                      [True] * len(jaxpr.outvars))
    ret = []
    out_batched = []
    const_outputs = set()
    for k, a in enumerate(outs):
      if isinstance(a, _Const):
        ret.append(em.const(a.value))
        out_batched.append(False)
        const_outputs.add(k)
      else:
        ret.append(a[0])
        out_batched.append(a[1])
    if not self.params.pdb:  # under pdb every value stays inspectable
      em.free_dead_values(set(ret))
      em.in_place(set(ret))
      em.into_refs(set(ret))
    fname = f"plan_{_sanitize(self.name)}"
    line_eqns = em.line_eqns + [None]
    with _lock:
      filename = f"<pallas_np plan {next(_plan_counter)}: {self.name}>"
      _PLAN_SOURCES[filename] = line_eqns
    plan = Plan(jaxpr, filename, len(line_eqns) - 2,
                (fname, arg_names, em.body, ret, em.env_globals))
    plan.out_batched = tuple(out_batched)
    plan.const_outputs = frozenset(const_outputs)
    return plan

  def _emit(self, em: _Emitter, jaxpr, consts, in_atoms, live_out):
    """Emit ``jaxpr``'s eqns into ``em``; ``in_atoms`` are (name, batched)
    pairs or _Const for its invars. Returns the atoms of its outvars."""
    env: dict[Any, Any] = {}  # var -> (name, batched) | _Const
    for v, c in zip(jaxpr.constvars, consts):
      env[v] = _Const(_host_const(c, v.aval))
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
      if eqn.effects or any([o in live for o in eqn.outvars]):  # (a DropVar is never live)
        keep[i] = True
        for v in eqn.invars:
          if isinstance(v, Var):
            live.add(v)

    fusion = None
    if not self.params.pdb and any(e.primitive.name in _Fusion.ROOTS for e in jaxpr.eqns):
      fusion = _Fusion(jaxpr, keep, batched=self.batched, lanes_last=self.lanes_last)

    def atom_of(v):
      if isinstance(v, jc.Literal):
        return _Const(np_constant(v.val, v.aval))
      a = env.get(v)
      if a is None:
        raise AssertionError(f"unbound var {v}")
      return a

    def text(a) -> str:
      if isinstance(a, _Const):
        return em.const(a.value)
      return a[0]

    check = self.params.check_avals
    DropVar = jc.DropVar
    absorbed = fusion.absorbed if fusion is not None else ()
    squeezed = fusion.squeeze_of if fusion is not None else ()
    concats = fusion.concat_buffer if fusion is not None else {}
    fused_into = fusion.into if fusion is not None else ()
    for i, eqn in enumerate(jaxpr.eqns):
      if not keep[i]:
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
        lanes = not isinstance(in_atoms_e[0], _Const) and in_atoms_e[0][1]
        if lanes:  # a batched operand: its lane axis comes first
          index = (slice(None), *index)
        fn, needs_ctx, out_batched = (lambda x, _i=index: x[_i]), False, (lanes,)
        if isinstance(in_atoms_e[0], _Const):
          env[eqn.outvars[0]] = _Const(fn(in_atoms_e[0].value))
          continue
        self._emit_call(em, env, eqn, info, fn, False, out_batched, in_atoms_e,
                        outvars_used, text, check)
        continue
      in_atoms_e = [atom_of(v) for v in eqn.invars]
      if concats.get(i) is not None:
        fusion.emit_concat(i, em, env, in_atoms_e, text)
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
                if a.__class__ is _Const and isinstance(v, jc.Var)}
      info = registry.EqnInfo(eqn, self, outvars_used, folded)
      in_batched = tuple(not isinstance(a, _Const) and a[1] for a in in_atoms_e)
      try:
        fn, needs_ctx, out_batched = self.lower_eqn(rule, info, in_batched)
      except UnsupportedError:
        raise
      except NotImplementedError as e:
        raise UnsupportedError(
            f"pallas_np: {e} (primitive '{eqn.primitive.name}', kernel "
            f"'{self.name}', at {jc.source_summary(eqn.source_info)})") from e
      multiple = eqn.primitive.multiple_results
      # Constant folding.
      if (rule.foldable and not needs_ctx
          and all(a.__class__ is _Const for a in in_atoms_e)
          and not _has_effects(eqn) and _foldable_size(eqn)):
        try:
          out = fn(*[a.value for a in in_atoms_e])
        except Exception:
          out = None
        else:
          outs = list(out) if multiple else [out]
          for o, val in zip(eqn.outvars, outs):
            if not isinstance(o, jc.DropVar):
              env[o] = _Const(val)
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
                 outvars_used, text, check):
    """One line ``outs = fN(args)`` for an eqn (with its zero guard)."""
    multiple = eqn.primitive.multiple_results
    specialise = getattr(fn, "specialise", None)
    if specialise is not None and any(isinstance(a, _Const) for a in in_atoms_e):
      better = specialise([a.value if isinstance(a, _Const) else None for a in in_atoms_e])
      if better is not None:
        fn = better
    fast = getattr(fn, "if_no_zeros", None)
    zero_srcs = None
    if fast is not None and not needs_ctx:
      zero_srcs = em.zeros.guard_sources(in_atoms_e, info.in_avals, info.out_avals[0])
      if zero_srcs is None:
        fast = None
    ufunc = fn if fn.__class__ is np.ufunc and fast is None and fn.nout == 1 else None
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
    args = [text(a) for a in in_atoms_e]
    flags = None
    if fast is not None:
      flags = em.zeros.guard(em, zero_srcs, eqn)
      g = _zero_select(em, g, fast, fn)
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
    em.reads.append([a[0] for a in in_atoms_e if not isinstance(a, _Const)])
    if registry.properties(eqn.primitive).data_movement:
      em.zeros.moved(eqn, in_atoms_e, outs)
    line = _Line(g, tuple(args), tuple(outs), unpack=multiple, flags=flags)
    if (store is not None and flags is None and not needs_ctx and len(in_atoms_e) >= 2
        and in_atoms_e[1].__class__ is not _Const
        and in_atoms_e[0].__class__ is not _Const and in_atoms_e[0][1] == in_atoms_e[1][1]):
      # A whole-value store whose value has the ref's lane axis (see into_refs).
      line.store = (store, fn_unchecked, checked)
    if ufunc is not None and outs[0] != "_":
      # A ufunc allocates its result: it may write into a dying operand
      # (Emitter.in_place) and its own result may be written into later.
      out = eqn.outvars[0].aval
      shape = getattr(out, "shape", ())
      if shape:
        em.fresh_values.add(outs[0])
        line.into = (ufunc, tuple(
            k for k, (a, v) in enumerate(zip(in_atoms_e, eqn.invars))
            if a.__class__ is not _Const and a[1] == out_batched[0]
            and v.aval.shape == shape and v.aval.dtype == out.dtype), checked)
    elif with_out is not None and outs[0] != "_" and not multiple:
      # A rule that allocates its result and can write it into ``out=`` (a
      # 2-D dot): fresh, and may be computed in a ref block (into_refs).
      if getattr(eqn.outvars[0].aval, "shape", ()):
        em.fresh_values.add(outs[0])
        line.into = (with_out, (), checked)
    em.body.append(line)
    em.line_eqns.append(eqn)

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


def _ufunc_into(ufunc, k):
  """``ufunc`` writing its result into its operand ``k``."""
  if ufunc.nin == 1:
    return lambda x: ufunc(x, out=x)
  if k == 0:
    return lambda x, y: ufunc(x, y, out=x)
  if k == 1 and ufunc.nin == 2:
    return lambda x, y: ufunc(x, y, out=y)
  return lambda *xs: ufunc(*xs, out=xs[k])


def _into_ref(ufunc, target):
  """``ufunc`` (or a rule's ``with_out``) writing its result into
  ``target(ref)``, the ref being its last argument (a fresh result where
  the target is unavailable: the store then copies, and raises where it
  should)."""
  def into_ref(*args):
    out = target(args[-1])
    if out is None:
      return ufunc(*args[:-1])
    return ufunc(*args[:-1], out=out)
  return into_ref


def _store_unless_there(target, store):
  """The store of a value ``_into_ref`` computed in place: nothing to
  do when the value is the target block itself."""
  def store_unless_there(ref, val, *leaves):
    out = target(ref)
    if out is not None and val.base is out.base and val.strides == out.strides \
        and val.shape == out.shape:  # (the same view: into_ref returned ``out``)
      return None
    return store(ref, val, *leaves)
  return store_unless_there


def _sanitize(name: str) -> str:
  return "".join(c if c.isalnum() else "_" for c in name)[:60] or "kernel"


_FOLD_LIMIT = 1 << 16


def _foldable_size(eqn) -> bool:
  """Fold only modestly sized results: a folded constant lives in the plan."""
  for o in eqn.outvars:
    shape = getattr(o.aval, "shape", None)
    if shape is None:
      return False
    if math.prod(shape) > _FOLD_LIMIT:
      return False
    if isinstance(o.aval, jc.AbstractRef):
      return False
  return True


def _checked(fn, info: registry.EqnInfo, multiple: bool):
  avals = [jc.physical_aval(a) if used else None
           for a, used in zip(info.out_avals, info.outvars_used)]
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


def plan_filename(frame) -> str:
  """The plan a traceback frame runs (compiled or its line runner): the
  ``filename`` of its Plan, or the frame's own file name."""
  if frame.f_code is _run_lines.__code__:
    return frame.f_globals["_filename"]
  return frame.f_code.co_filename


def failing_eqns(tb) -> list:
  """Eqns of generated plans on a traceback, outermost first."""
  found = []
  while tb is not None:
    frame = tb.tb_frame
    line = tb.tb_lineno
    if frame.f_code is _run_lines.__code__:  # a line runner: its running line
      line = frame.f_locals.get("i", -2) + 2
    eqns = _PLAN_SOURCES.get(plan_filename(frame))
    if eqns is not None:
      if 0 < line - 1 < len(eqns) and eqns[line - 1] is not None:
        found.append(eqns[line - 1])
    tb = tb.tb_next
  return found
