"""A loop eqn (``while``, or a ``scan`` without xs/ys) as the Python source of
one ``numba.njit`` function that runs the whole loop.

Every value of the loop's jaxprs gets a local variable of the generated
function: a 0-d value is a scalar of its exact dtype, an array a flat
C-contiguous 1-d array (its shape is known here, statically), a ref the
N-d array the kernel passed. Each eqn is its primitive's emitter, the
``native`` field of its rule in the registry (attached per primitive
family by ``elementwise``, ``shapes``, ``refs``, ``control`` and
``transcendental``; ``refusals`` marks the rest), writing explicit
per-element loops into a fresh array;
every scalar result is cast to its dtype right away (numba widens int32
arithmetic to int64, and float32 must stay float32), and never with
``fastmath``. Values are never written after they are computed (a
``reshape`` may alias), only refs are.

Anything outside the table, a dtype numba cannot hold exactly (bf16, f16,
fp8, sub-byte ints, complex) or a ref access it cannot check raises
``Refused`` here: the loop then keeps running on the NumPy path.

Nothing here imports numba: this only writes text (``tier`` compiles it).
"""
from __future__ import annotations

import contextlib
import math
import re

import ml_dtypes
import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.compiler import INLINE_CALLS
from pallas_np.dtypes import np_dtype
from pallas_np.native import buffer_reuse, loop_fusion
from pallas_np.native.contract import SUPPORTED, Refused  # noqa: F401 - (re-exported: lite reads them without JAX)

# bfloat16 values are held exactly in float32 (their bits << 16), and only
# where that is exact: the data movement of these primitives, a float32
# conversion, and the dots and conversions of ``native/narrow.py`` (whose
# conversion emitter is ``narrow_convert[0]``); nowhere else, and never
# as a loop operand.
NARROW = np.dtype(ml_dtypes.bfloat16)
NARROW_OK = frozenset(("reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims",
                       "dot_general", "convert_element_type", *INLINE_CALLS))
narrow_convert: list = []

FUSE_MAX = loop_fusion.FUSE_MAX  # (values one fused elementwise loop holds)
# Generated lines a loop may have: numba's compile time grows with them
# (~2.5 s plus ~0.02 s a line on the 2-core machine: 101 lines 4.7 s, 600
# lines 14.8 s; faster than linearly beyond: tpu_paged_quantized's 822
# lines took 157 s at load ~2.5, PERF_LOG 143). The build runs in the
# compile process (no GIL of the caller's) once the cost rule says so; a
# bigger loop keeps its NumPy path rather than hold a core for many minutes.
MAX_LINES = 1000
# Elements each buffer's slice of a scratch array is rounded up to (64
# bytes of float32: the next buffer starts on its own cache line).
SCRATCH_ALIGN = 16
# Values a bounds-check site can report in the status array (dynamic index
# values, or a masked access's lane and coordinates: native/refs.py, masked.py).
MAX_LEAVES = 8


def register(*prims):
  """Attach ``fn`` as the native emitter of ``prims`` (primitives, or
  names for every primitive of that name) to their rules in the registry."""
  def deco(fn):
    for p in prims:
      registry.attach_native(p, fn)
    return fn
  return deco


def emitter(prim):
  """The native emitter of ``prim``'s rule; ``Refused`` if it has none or
  is marked ``native_refused``."""
  rule = registry.lookup(prim)
  native = rule.native if rule is not None else None
  if native is None or isinstance(native, registry.native_refused):
    why = f": {native.why}" if native is not None else ""
    raise Refused(f"primitive {prim.name}{why}")
  return native


def dtype_of(aval) -> np.dtype:
  if jc.is_semaphore_dtype(aval.dtype):  # (int64 cells, memory.allocate: only native/dma.py's calls touch them)
    return np.dtype(np.int64)
  dt = np_dtype(jc.physical_dtype(aval.dtype))
  if dt == NARROW:  # (held in float32: NARROW_OK)
    return np.dtype(np.float32)
  if dt not in SUPPORTED:
    raise Refused(f"dtype {dt}")
  return dt


def is_narrow(aval) -> bool:
  """A bfloat16 value (held in float32, see ``NARROW``)."""
  return str(getattr(aval, "dtype", None)) == "bfloat16"


def np_name(dt: np.dtype) -> str:
  """The dtype's constructor in generated code."""
  return "np.bool_" if dt == np.bool_ else f"np.{dt.name}"


class Val:
  """A value of the generated function: ``kind`` is 's' (scalar), 'a'
  (flat array of ``shape``), 'r' (a ref: the caller's N-d array); ``glob``:
  a module constant (read-only: copied before it is merged into a carry);
  ``temp``: an eqn's buffer, allocated once at the function's entry and
  rewritten by its eqn in every iteration (a carry copies it); ``lazy``: a
  ``loop_fusion.Lazy`` where the array has no buffer (``name`` then names
  none: only elementwise loops read it, ``Gen.materialize`` for others)."""
  __slots__ = ("name", "shape", "dtype", "kind", "glob", "temp", "roll", "lazy")

  def __init__(self, name, shape, dtype, kind, glob=False, temp=False):
    self.name, self.shape, self.dtype, self.kind = name, tuple(shape), dtype, kind
    self.glob, self.temp = glob, temp
    self.roll = None  # (w, dim): ``concatenate([w, w], dim)``, never materialised
    self.lazy = None

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  def at(self, index: str) -> str:
    """Element ``index`` (flat) of an array, or the scalar itself."""
    return f"{self.name}[{index}]" if self.kind == "a" else self.name


class Gen:
  """The generated function being written."""

  def __init__(self, clamp: bool, uninitialized: str = "nan"):
    self.clamp = clamp
    self.uninitialized = uninitialized  # InterpretParams.uninitialized (memory.fill_value)
    self.lines: list[str] = []
    self.prologue: list[str] = []  # lines at the function's entry (addresses read from _st)
    self.temps: list = []  # (name, elements, dtype) of each buffer (``finish`` places them)
    self.depth = 1
    self.globals: dict = {}
    self.count = 0
    self.sites: list = []  # bounds-check sites: (eqn, RefAccess, ref position, chain)
    self.ref_positions: dict = {}  # ref variable name -> argument position
    # ref variables that share memory with no other ref (TPU VMEM: scratch
    # buffers and block copies; loop_fusion's stores)
    self.private: set = set()
    self.written: set = set()  # argument positions of the refs written
    self.stack: list = []  # the control-flow eqns being emitted (inside the loop's own)
    self.consumers: dict = {}  # var -> [(eqn reading it, operand position)]
    self.producers: dict = {}  # var -> the eqn computing it (see reductions.numpy_layout)
    self.scanned: dict = {}  # id -> the jaxprs whose consumers are recorded (kept alive)
    self.position: dict = {}  # id(eqn) -> (its jaxpr, its index there)
    self.layouts: dict = {}  # var -> its layout on the NumPy path (reductions.numpy_layout)
    self.aliases: dict = {}  # an inlined callee's parameter var -> the caller's atom
    # Functions the code calls that are linked in from LLVM IR (XLA's float
    # formulas, transcendental.py): their symbol -> IR.
    self.externals: dict = {}
    # Module-level source the function needs (``blas_calls.header``, the
    # pairwise sum's leaf), by name; an empty entry marks an address local
    # already read in the prologue (``_fp_<routine>``).
    self.headers: dict = {}
    # ``blas_calls.transposed_key`` of each dot site that may read an
    # operand in place (``dots._transposed_word``), in site order
    self.transposed: list = []
    # The elementwise loop still open for fusion (``loop_fusion.Loop``);
    # valid while it is the last thing emitted.
    self.fuse = None

  @contextlib.contextmanager
  def inside(self, eqn):
    """Emitting the body of a nested control-flow ``eqn`` (for the chain
    of eqns an error names)."""
    self.stack.append(eqn)
    try:
      yield
    finally:
      self.stack.pop()

  def fresh(self, prefix="v") -> str:
    self.count += 1
    return f"{prefix}{self.count}"

  def emit(self, line: str) -> None:
    self.lines.append("    " * self.depth + line)

  def elementwise(self, out: "Val", expr, operands=()) -> None:
    """``out[_i] = expr(*operand elements)`` for every element;
    consecutive elementwise eqns of one size share one loop, and an
    element computed or loaded earlier in it is reused from its local (no
    reload; LLVM then sees selects, not branches around loads); a lazy
    operand's element is computed there (``loop_fusion``)."""
    loop_fusion.elementwise(self, out, expr, operands)

  def store(self, at, shape, ref: str, val: "Val", combine=None) -> bool:
    """A ref block set to an array value as statements of an elementwise
    loop (``loop_fusion.store``); False where it is not done so."""
    return loop_fusion.store(self, at, shape, ref, val, combine)

  def lazy(self, shape, dt, expr) -> "Val":
    """An array value without a buffer whose element at per-axis indices
    ``dims`` is ``expr(dims)`` -> (text, ref accesses) (``loop_fusion``)."""
    v = Val(self.fresh("lz"), shape, dt, "a")
    v.lazy = loop_fusion.Lazy(expr)
    return v

  def materialize(self, v: "Val") -> "Val":
    """``v`` with a buffer (a lazy value's elements written out here)."""
    if v is None or v.lazy is None:
      return v
    out = self.array(v.shape, v.dtype)
    js = self.nest(v.shape)
    flat = " + ".join(f"{j} * {math.prod(v.shape[k + 1:])}" for k, j in enumerate(js))
    self.emit(f"{out.name}[{flat}] = {v.lazy.expr(js)[0]}")
    self.close(v.shape)
    return out

  def scalar_line(self, line: str) -> None:
    """A scalar eqn's line: before an open elementwise loop (it reads only
    scalars, all defined before that loop), which stays open."""
    loop = self.fuse
    if loop is None or loop.depth != self.depth or loop.end != len(self.lines):
      self.emit(line)
      return
    self.lines.insert(loop.head, "    " * self.depth + line)
    loop.head += 1
    loop.end += 1

  def nest(self, shape) -> list[str]:
    """Open nested ``for`` loops over ``shape``; return their variables
    (close with ``close``)."""
    names = []
    for n in shape:
      v = self.fresh("j")
      names.append(v)
      self.emit(f"for {v} in range({n}):")
      self.depth += 1
    return names

  def close(self, shape) -> None:
    self.depth -= len(shape)

  @contextlib.contextmanager
  def block(self, header: str):
    self.emit(header)
    start = len(self.lines)
    self.depth += 1
    try:
      yield
      if len(self.lines) == start:  # (an empty branch: a pl.when's other side)
        self.emit("pass")
    finally:
      self.depth -= 1

  def external(self, symbol: str, ir: str) -> str:
    """The name by which the generated code calls ``symbol``, a float32
    function defined by ``ir`` (linked into the compiled loop)."""
    self.externals[symbol] = ir
    return f"_ext_{symbol}"

  def constant(self, value, dt: np.dtype) -> Val:
    name = self.fresh("K")
    value = np.asarray(value, dt)
    if value.ndim == 0:
      self.globals[name] = dt.type(value)
      return Val(name, (), dt, "s", glob=True)
    self.globals[name] = np.ascontiguousarray(value).reshape(-1)
    return Val(name, value.shape, dt, "a", glob=True)

  def array(self, shape, dt: np.dtype) -> Val:
    """The buffer of an eqn's array result (allocated once, at the entry:
    an allocation per eqn and iteration would cost more than its loop)."""
    v = Val(self.fresh(), shape, dt, "a", temp=True)
    self.temps.append((v.name, max(v.size, 1), dt))
    return v

  def scalar(self, expr: str, dt: np.dtype) -> Val:
    v = Val(self.fresh(), (), dt, "s")
    self.emit(f"{v.name} = {expr}")
    return v

  def copy_into(self, dst: str, src: str, size: int) -> None:
    """``dst[:] = src`` for flat arrays of ``size`` elements, as an explicit
    loop: numba's slice assignment compiles its shape-mismatch error path
    (a formatted message: ~4 s of the first build in a compile process)."""
    self.emit(f"for _c in range({size}):")
    self.emit(f"    {dst}[_c] = {src}[_c]")

  def flat_copy(self, arg: str, shape, dt: np.dtype) -> Val:
    """A flat C-contiguous copy of the caller's N-d array ``arg`` (any
    layout), element by element (``np.ascontiguousarray`` and ``reshape``
    are numba overloads compiled per type: up to ~1 s of a build)."""
    v = self.array(shape, dt)
    v.temp = False
    js = self.nest(shape)
    flat = " + ".join(f"{j} * {math.prod(shape[k + 1:])}" for k, j in enumerate(js))
    self.emit(f"{v.name}[{flat}] = {arg}[{', '.join(js)}]")
    self.close(shape)
    return v

  def owned(self, v: Val) -> Val:
    """``v`` as a value that can be merged into a loop carry or a cond
    output (a module constant array is read-only to numba: copied)."""
    if v.kind == "a" and v.glob:
      c = Val(self.fresh(), v.shape, v.dtype, "a")
      self.emit(f"{c.name} = {v.name}.copy()")
      return c
    return v

  def atom(self, a, env) -> Val:
    if isinstance(a, jc.Literal):
      return self.constant(a.val, dtype_of(a.aval))
    return env[a]

  def run_jaxpr(self, jaxpr, consts, ins: list) -> list:
    """Emit ``jaxpr``'s eqns on ``ins``; its output values."""
    env = {}
    if id(jaxpr) not in self.scanned:  # (who reads each value: see shapes' lazy roll)
      # once per jaxpr: a jitted callee emitted twice (jnp.roll's, called
      # twice with one trace) has the same vars, read by the same eqns
      self.scanned[id(jaxpr)] = jaxpr
      for k, eqn in enumerate(jaxpr.eqns):
        self.position[id(eqn)] = (jaxpr, k)
        for k, a in enumerate(eqn.invars):
          if isinstance(a, jc.Var):
            self.consumers.setdefault(a, []).append((eqn, k))
        for v in eqn.outvars:
          self.producers[v] = eqn
      for a in jaxpr.outvars:
        if isinstance(a, jc.Var):
          self.consumers.setdefault(a, []).append((None, 0))
    for v, c in zip(jaxpr.constvars, consts):
      env[v] = self.constant(np.asarray(c), dtype_of(v.aval))
    for v, x in zip(jaxpr.invars, ins):
      env[v] = x
    for eqn in jaxpr.eqns:
      ins_e = [self.atom(a, env) for a in eqn.invars]
      emit = emitter(eqn.primitive)
      if any(is_narrow(v.aval) for v in (*eqn.invars, *eqn.outvars)):
        if eqn.primitive.name not in NARROW_OK or not narrow_convert:
          raise Refused(f"dtype bfloat16 in {eqn.primitive.name}")
        if eqn.primitive.name == "convert_element_type":
          emit = narrow_convert[0]
      if eqn.primitive.name not in INLINE_CALLS:
        for v in eqn.outvars:
          if not isinstance(v.aval, jc.AbstractRef):
            dtype_of(v.aval)
      if not getattr(emit, "lazy_ok", False) and any(v.lazy is not None for v in ins_e):
        ins_e = [self._materialized(a, v, env) for a, v in zip(eqn.invars, ins_e)]
      outs = emit(self, eqn, ins_e)
      for v, o in zip(eqn.outvars, outs):
        if not isinstance(v, jc.DropVar):
          env[v] = o
    return [self._materialized(a, self.atom(a, env), env) for a in jaxpr.outvars]

  def _materialized(self, a, v: Val, env) -> Val:
    """``v`` (the value of atom ``a``) with a buffer, kept for its later
    readers (an eqn that reads arrays as buffers, a jaxpr's result)."""
    if v.lazy is None:
      return v
    m = self.materialize(v)
    if isinstance(a, jc.Var):
      env[a] = m
    return m


def inline_callee(eqn):
  """(jaxpr, consts) of a call primitive emitted inline (pjit & co.)."""
  param = INLINE_CALLS.get(eqn.primitive.name)
  if param is None:
    return None
  callee = eqn.params.get(param)
  if isinstance(callee, jc.ClosedJaxpr):
    return callee.jaxpr, callee.consts
  if isinstance(callee, jc.Jaxpr):
    return callee, ()
  raise Refused(f"call {eqn.primitive.name}")


_NAME = re.compile(r"[A-Za-z_]\w*")


def _dead_stores(prologue, lines) -> tuple[list, set]:
  """The function's lines without the buffers only their fused loop
  needed: an element value used only in the loop that computes it stays a
  local (a store per element and temporary would keep LLVM from
  vectorizing the loop: too many arrays that might alias)."""
  count: dict = {}
  for line in lines:
    for name in set(_NAME.findall(line)):
      count[name] = count.get(name, 0) + 1
  stores = {}  # buffer -> its fused store lines ``v[_i] = ev``
  for k, line in enumerate(lines):
    target, _, value = line.strip().partition("[_i] = ")
    if value == "e" + target:
      stores.setdefault(target, []).append(k)
  dead = {name for name, ks in stores.items() if count.get(name, 0) == len(ks)}
  drop = {k for name in dead for k in stores[name]}
  return ([a for a in prologue if a.split("=", 1)[0].strip() not in dead]
          + [l for k, l in enumerate(lines) if k not in drop]), dead


class Source:
  """What ``loop_source`` generated."""
  __slots__ = ("text", "globals", "sites", "kinds", "written", "outs", "externals", "calls",
               "scratch", "transposed")

  def __init__(self, text, gen, kinds, outs, scratch=()):
    self.text, self.globals, self.sites = text, gen.globals, gen.sites
    self.kinds, self.written, self.externals = kinds, gen.written, gen.externals
    self.outs = outs  # (kind 's' or 'a', dtype) of each result after the status
    self.calls = tuple(getattr(gen, "pycalls", ()))  # DMA/semaphore call sites (native/dma.py)
    # (dtype, elements) of each scratch array the function takes after its
    # operands (``finish``): the caller allocates them once and passes them
    self.scratch = tuple(scratch)
    # (the dot sites' keys: their status words, ``blas_calls.status``)
    self.transposed = tuple(gen.transposed)


def loop_source(eqn, clamp: bool, uninitialized: str) -> Source:
  """The source (and what it needs) of the njit function
  ``native_loop(_st, *eqn inputs) -> (0, *carries)`` running ``eqn`` (a
  ``while`` or a ``scan``) under ``bounds_check="clamp"`` or not and the
  kernel's ``InterpretParams.uninitialized`` (what a masked-off lane past
  the end reads: ``masked``); raises ``Refused``. An eqn that brings its own
  generator (``lanes.LanesEqn``: every lane of a vectorized pass in one
  call) is generated by it."""
  own = getattr(eqn, "loop_source", None)
  if own is not None:
    return own(clamp, uninitialized)
  gen = Gen(clamp, uninitialized)
  args, ins = [], []
  for k, aval in enumerate(v.aval for v in eqn.invars):
    name = f"a{k}"
    args.append(name)
    ins.append(operand(gen, name, k, aval))
  # (a kernel body, native/bodies.py, brings its own top-level emitter)
  outs = getattr(eqn, "native_top", None) or emitter(eqn.primitive)
  outs = outs(gen, eqn, ins, top=True)
  ret = "".join(f", {o.name}" for o in outs)
  gen.emit(f"return (0{ret},)")
  return finish(gen, args, [v.kind for v in ins], [(o.kind, o.dtype) for o in outs],
                shared=getattr(eqn, "shared_buffers", False))


def operand(gen, name: str, k: int, aval) -> Val:
  """Operand ``k`` of the generated function, the variable ``name`` of the
  caller's ``aval``: a ref (the N-d array), a scalar, or a flat copy of an
  array value."""
  why = operand_refusal(aval)
  if why:
    raise Refused(why)
  if isinstance(aval, jc.AbstractRef):
    inner = aval.inner_aval
    gen.ref_positions[name] = k
    if str(jc.memory_space_of(aval)).lower() == "vmem":
      gen.private.add(name)
    return Val(name, inner.shape, dtype_of(inner), "r")
  if aval.shape == ():
    return Val(name, (), dtype_of(aval), "s")
  return gen.flat_copy(name, aval.shape, dtype_of(aval))


def operand_refusal(aval) -> str | None:
  """Why no generated function takes an operand of ``aval`` (``operand``
  refuses it), else None: a bfloat16 operand (held in float32 only inside
  the function, ``NARROW``), or a dtype outside the table."""
  inner = getattr(aval, "inner_aval", aval)
  if is_narrow(inner):
    return "dtype bfloat16 (a loop operand)"
  try:
    dtype_of(inner)
  except Refused as e:
    return str(e)
  return None


def prerefusal(eqn) -> str | None:
  """Why ``loop_source`` would refuse ``eqn`` for its operands alone,
  known before any source is generated (the cost rule asks when it prices
  the loop: a loop refused at its build had started lite's process and
  paid the build's caller part first); None where the operands pass. An
  eqn that brings its own generator (``lanes.LanesEqn``) answers for
  itself at generation. Never raises: it runs in the caller's kernel run,
  where an aval this does not foresee is left to the generation (on the
  tier's thread, whose failures leave the NumPy path)."""
  if getattr(eqn, "loop_source", None) is not None:
    return None
  try:
    for v in eqn.invars:
      why = operand_refusal(v.aval)
      if why:
        return why
  except Exception:  # noqa: BLE001 - the generation decides
    return None
  return None


def finish(gen, args, kinds, outs, shared=False) -> Source:
  """The generated function ``native_loop(_st, *args, *scratch)`` of
  ``gen``'s lines (buffers only their fused loop needed dropped); ``kinds``
  of its operands, ``outs`` (kind, dtype) of its results after the status.

  Its buffers are allocated at its entry, or, where ``shared`` (a kernel
  body: ``bodies.BodyEqn``), are slices of scratch arrays, one per dtype,
  that the caller allocates once and passes at every call
  (``Source.scratch``): an allocation per buffer and call cost a compiled
  body about half its step (PERF_LOG 131). Sharing them across calls is
  safe: a call holds the GIL from its entry to its return (numba's
  ahead-of-time wrapper), and a body returns nothing. Not for loops: slices
  of one array may overlap as far as LLVM knows, which keeps it from
  vectorizing a loop's passes over its buffers (bitonic_fori 20% slower,
  while_collatz 15%), where separate allocations do not; nor for a
  function with DMA or semaphore call sites, which call back into Python
  (another thread's call may run in between)."""
  lines, dead = _dead_stores(gen.prologue, gen.lines)
  if len(lines) > MAX_LINES:
    raise Refused(f"a loop of {len(lines)} generated lines (more than {MAX_LINES}: compile time)")
  temps = [t for t in gen.temps if t[0] not in dead]
  scratch, head = [], []
  if not shared or getattr(gen, "pycalls", None):
    lines, temps = buffer_reuse.share(lines, temps)  # (buffers whose lives are apart: one)
    head = [f"    {name} = np.empty({n}, {np_name(dt)})" for name, n, dt in temps]
  else:
    groups: dict = {}
    for name, n, dt in temps:
      groups.setdefault(dt, []).append((name, n))
    for j, (dt, members) in enumerate(groups.items()):
      off = 0
      for name, n in members:
        head.append(f"    {name} = _s{j}[{off}:{off + n}]")
        off += -(-n // SCRATCH_ALIGN) * SCRATCH_ALIGN
      scratch.append((dt, off))
  params = ", ".join([*args, *(f"_s{j}" for j in range(len(scratch)))])
  text = ("".join(gen.headers.values())
          + f"def native_loop(_st, {params}):\n" + "\n".join(head + lines) + "\n")
  return Source(text, gen, kinds, outs, scratch)
