"""lite: the generated loop source (``codegen.loop_source``) translated to
LLVM IR in this process, with numba's typing (``lite_types``), so that a
loop's first build takes ~0.1 s instead of a compile process's seconds
(docs/native.md, "lite").

There is one code generator: the emitters write numba-subset Python; this
module reads that text (Python's ``ast``) and lowers each form the way
numba lowers it (the same LLVM instructions: ``fptosi``, ``sdiv``, ordered
and unordered compares, selects for ``min``/``max``, branches for
``a if c else b``). Any statement, expression, call, global or type
outside the subset raises ``Refused``: the loop is then built by numba as
before, never compiled differently.

The compiled function (``lite_jit`` runs it) is
``i32 native_loop(st, arena, outs, *args, *const_arrays)``: arrays are
passed as their ``PyObject*`` (the data pointer is read from the NumPy
array struct), scalars by value; ``arena`` is a byte array the caller
allocates per call holding every ``np.empty`` buffer (static offsets) and
every ``.copy()`` (bump-allocated: a copy inside a ``while`` is refused,
inside ``for`` loops of constant trip counts the arena has room for all);
``outs`` receives each returned scalar's bits, or an array's offset in the
arena (and, after those, each returned array's element count). It returns
0, or 1 where the source raises ``IndexError`` (its bounds-check site and
index values are in ``st``, as numba's would be).

Shapes known only at run time (the lane loop of a vectorized pass,
``native/lanes.py``): a static dimension 0 of an operand (a lane-stacked
operand's lane axis) is read from its array struct (``dimensions``), as
are ``a.shape[k]``; ``a[i]`` of an N-d array is a view (pointer and
stride arithmetic, no Python object); an ``np.empty`` of a run-time size at
the function's top level (before any store to an operand) is placed after
the static part of the arena: where the arena is too small the function
returns 2 with the bytes it needs in ``outs[0]``, and the caller runs it
again in a larger arena (nothing was written but the arena and ``st``); a
negative size returns 3 (numba's ``ValueError``).
"""
from __future__ import annotations

import ast
import math

import llvmlite.ir as ir
import numpy as np

from pallas_np.native import lite_types as lt
from pallas_np.native.codegen import SUPPORTED, Refused
from pallas_np.native.lite_expr import (I1, I8, I32, I64, PTR, DTYPE_NAMES, Arr, Expressions, literal_int,
                                        cast,
                                        const, lltype, memtype)

DATA_OFFSET = 16  # PyArrayObject's ``data`` field: after PyObject_HEAD
DIMS_OFFSET = 32  # ... its ``dimensions`` (after nd)
STRIDES_OFFSET = 40  # ... its ``strides``
ALIGN = 64
MAX_ARENA = 64 << 20




class Var:
  __slots__ = ("slot", "sig", "shape")

  def __init__(self, slot, sig):
    self.slot, self.sig = slot, sig


class Translator(Expressions):
  """One generated function lowered into an LLVM module."""

  def __init__(self, text, globals_, args, outs, externals=()):
    tree = ast.parse(text)
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if len(tree.body) != 1 or len(fns) != 1 or fns[0].name != "native_loop":
      first = next((n for n in tree.body if n is not fns[-1]), tree.body[0])
      raise Refused(f"lite: a module other than one function ({ast.dump(first)[:80]})")
    self.fn_ast = fns[0]
    self.text_lines = text.splitlines()
    self.globals = globals_
    self.args = args  # [(kind 's'|'a'|'r', dtype, shape)]
    self.outs = outs  # [(kind, dtype)]
    self.const_arrays = [k for k, v in globals_.items() if isinstance(v, np.ndarray)]
    self.module = ir.Module(name="lite")
    self.externals = dict(externals)
    self.arena_static = 0
    self.arena_dynamic = 0
    self.trips = [1]  # copies per iteration of the enclosing loops (None: unbounded)
    self.loops = []  # (continue block, break block)
    self.out_sizes = None  # each result's element count (the return's; None: run-time)
    self.branches_open = 0  # enclosing ``if`` statements
    self.effects = False  # whether a store to an operand was emitted

  # -- setup ----------------------------------------------------------------------
  def translate(self) -> str:
    params = [PTR, PTR, PTR]
    for kind, dt, *_ in self.args:
      params.append(PTR if kind != "s" else memtype(dt))
    params += [PTR] * len(self.const_arrays)
    fn = ir.Function(self.module, ir.FunctionType(I32, params), name="native_loop")
    self.fn = fn
    entry = fn.append_basic_block("entry")
    self.alloca_b = ir.IRBuilder(entry)
    body = fn.append_basic_block("body")
    self.b = ir.IRBuilder(body)
    self.vars = {}
    st, arena, outs = fn.args[:3]
    self.st = Arr(self.data(st), np.dtype(np.int64), (None,), False)
    self.arena = self.data(arena)
    self.outs_ptr = self.data(outs)
    self.top = self.alloca_b.alloca(I64, name="top")
    self.dtop = self.alloca_b.alloca(I64, name="dtop")  # (run-time sized buffers)
    names = [a.arg for a in self.fn_ast.args.args]
    if (len(names) != len(self.args) + 1 or self.fn_ast.args.vararg or self.fn_ast.args.kwonlyargs
        or self.fn_ast.args.defaults):
      raise Refused("lite: the function's arguments")
    self.st_name = names[0]
    for name, (kind, dt, shape, contiguous), p in zip(names[1:], self.args, fn.args[3:]):
      if kind == "s":
        val = p if dt != np.bool_ else self.b.trunc(p, I1)
        self.assign(name, val, dt)
      else:
        strides = None if contiguous else self.strides(p, len(shape))
        self.assign_arr(name, Arr(self.data(p), dt, self.arg_shape(p, shape), False, strides))
    self.gconsts = {}
    for name, p in zip(self.const_arrays, fn.args[3 + len(self.args):]):
      v = self.globals[name]
      if v.dtype not in SUPPORTED:
        raise Refused(f"lite: constant of dtype {v.dtype}")
      self.gconsts[name] = Arr(self.data(p), v.dtype, (v.size,), False)
    self.block(self.fn_ast.body)
    if not self.b.block.is_terminated:
      raise Refused("lite: the function does not end with its return")
    # the static buffers first in the arena, the ``.copy()``s after them
    self.alloca_b.store(I64(self.arena_static), self.top)
    self.alloca_b.store(I64(self.arena_size), self.dtop)
    self.alloca_b.branch(body)
    self.fastcall_entry(fn)
    return str(self.module)

  def fastcall_entry(self, loop) -> None:
    """``lite_entry(self, args, nargs)``: ``native_loop`` as a CPython
    METH_FASTCALL function (a builtin's call costs ~0.1 us, a ctypes
    call several): each argument is an array's ``PyObject*`` or a NumPy
    scalar whose value follows its header (``lite_jit`` checks both
    layouts once per process). It returns ``args[0]`` (the status array)
    when the loop ran, ``args[1]`` (the arena) where it raised IndexError,
    ``args[2]`` (the slots) where the arena is too small, ``args[3]`` where
    an ``np.empty`` size is negative, with a new reference."""
    fn = ir.Function(self.module, ir.FunctionType(PTR, [PTR, PTR.as_pointer(), I64]),
                     name="lite_entry")
    b = ir.IRBuilder(fn.append_basic_block())
    objs = fn.args[1]
    vals = []
    for k, t in enumerate(loop.function_type.args):
      obj = b.load(b.gep(objs, [I64(k)]))
      if t == PTR:
        vals.append(obj)
      else:
        vals.append(b.load(b.bitcast(b.gep(obj, [I64(DATA_OFFSET)]), t.as_pointer())))
    rc = b.call(loop, vals)
    # (return code k: the k-th argument, the status array where the loop ran)
    res = b.load(b.gep(objs, [b.sext(rc, I64)]))
    refcnt = b.bitcast(res, I64.as_pointer())
    b.store(b.add(b.load(refcnt), I64(1)), refcnt)  # (Py_INCREF of a mortal object)
    b.ret(res)

  @property
  def arena_size(self) -> int:
    return self.arena_static + self.arena_dynamic

  def arg_shape(self, obj, shape) -> tuple:
    """An operand's static shape, its dimensions 0 (a lane-stacked
    operand's lane axis, or an empty one) read from its array struct."""
    if all(shape):
      return tuple(shape)
    b = self.b
    ptr = b.load(b.bitcast(b.gep(obj, [I64(DIMS_OFFSET)]), I64.as_pointer().as_pointer()))
    return tuple(d if d else b.load(b.gep(ptr, [I64(k)])) for k, d in enumerate(shape))

  def extent(self, dims):
    """The product of ``dims`` (ints, or i64 values read at run time): an
    int where all are static, else an i64 value."""
    static, dyn = 1, None
    for d in dims:
      if d is None:
        raise Refused("lite: the extent of the status array")
      if isinstance(d, int):
        static *= d
      else:
        dyn = d if dyn is None else self.b.mul(dyn, d)
    if dyn is None:
      return static
    return dyn if static == 1 else self.b.mul(dyn, I64(static))

  def strides(self, obj, ndim) -> tuple:
    """The byte strides of the NumPy array whose ``PyObject*`` is ``obj``
    (its ``strides`` field: a pointer to ``ndim`` intp)."""
    b = self.b
    ptr = b.load(b.bitcast(b.gep(obj, [I64(STRIDES_OFFSET)]), I64.as_pointer().as_pointer()))
    return tuple(b.load(b.gep(ptr, [I64(k)])) for k in range(ndim))

  def data(self, obj):
    """The data pointer of the NumPy array whose ``PyObject*`` is ``obj``."""
    b = self.b if hasattr(self, "b") else self.alloca_b
    slot = b.gep(obj, [I64(DATA_OFFSET)])
    return b.load(b.bitcast(slot, PTR.as_pointer()))

  # -- variables ------------------------------------------------------------------------
  def assign(self, name, val, dt):
    var = self.vars.get(name)
    sig = ("s", dt)
    if var is None:
      var = self.vars[name] = Var(self.alloca_b.alloca(lltype(dt), name=name), sig)
    elif var.sig != sig:
      raise Refused(f"lite: {name} holds values of two types")
    self.b.store(val, var.slot)

  def assign_arr(self, name, arr: Arr):
    var = self.vars.get(name)
    if var is None:
      var = self.vars[name] = Var(self.alloca_b.alloca(PTR, name=name), arr.sig())
    elif var.sig != arr.sig():
      raise Refused(f"lite: {name} holds arrays of two kinds")
    self.b.store(arr.ptr, var.slot)

  def load_name(self, name):
    var = self.vars.get(name)
    if var is not None:
      if var.sig[0] == "s":
        return self.b.load(var.slot), var.sig[1]
      _, dt, shape, arena, strides = var.sig
      return Arr(self.b.load(var.slot), dt, shape, arena, strides), None
    if name == self.st_name:
      return self.st, None
    if name in self.gconsts:
      return self.gconsts[name], None
    if name in self.globals:
      v = self.globals[name]
      if isinstance(v, np.generic) and v.dtype in SUPPORTED:
        return const(v.dtype, v), v.dtype
    raise Refused(f"lite: name {name}")

  # -- statements --------------------------------------------------------------------------
  def block(self, stmts):
    for s in stmts:
      if self.b.block.is_terminated:
        return  # (unreachable code after break/return/raise)
      self.stmt(s)

  def stmt(self, s):
    try:
      meth = getattr(self, "s_" + type(s).__name__, None)
      if meth is None:
        raise Refused(f"lite: statement {type(s).__name__}")
      meth(s)
    except Refused as e:
      if getattr(e, "line", None) is None:  # (the innermost statement's line)
        e.line = self.text_lines[s.lineno - 1].strip()
        e.args = (f"{e.args[0]} (at: {e.line[:120]})",)
      raise

  def s_Pass(self, s):
    pass

  def s_Assign(self, s):
    if len(s.targets) != 1:
      raise Refused("lite: chained assignment")
    t = s.targets[0]
    if isinstance(t, ast.Tuple):
      if not isinstance(s.value, ast.Tuple) or len(s.value.elts) != len(t.elts):
        raise Refused("lite: tuple assignment")
      vals = [self.expr(v) for v in s.value.elts]
      for tt, v in zip(t.elts, vals):
        self.store_target(tt, v)
      return
    if isinstance(s.value, ast.Call) and self.is_np(s.value.func, "empty"):
      return self.store_target(t, self.empty(s.value))
    self.store_target(t, self.expr(s.value))

  def store_target(self, t, v):
    val, dt = v
    if isinstance(t, ast.Name):
      if isinstance(val, Arr):
        self.assign_arr(t.id, val)
      else:
        self.assign(t.id, val, dt)
      return
    if isinstance(t, ast.Subscript):
      if isinstance(val, Arr):
        raise Refused("lite: an array stored into an element")
      arr, ptr = self.element(t)
      self.effects = self.effects or not arr.arena and arr.shape != (None,)  # (not the status)
      self.b.store(self.to_mem(cast(self.b, val, dt, arr.dtype), arr.dtype), ptr)
      return
    raise Refused(f"lite: assignment to {type(t).__name__}")

  def to_mem(self, val, dt):
    return self.b.zext(val, I8) if dt == np.bool_ else val

  def s_If(self, s):
    cond = self.truth(self.expr(s.test))
    then = self.fn.append_basic_block("then")
    other = self.fn.append_basic_block("else")
    after = self.fn.append_basic_block("endif")
    self.b.cbranch(cond, then, other)
    self.branches_open += 1
    for blk, body in ((then, s.body), (other, s.orelse)):
      self.b.position_at_end(blk)
      self.block(body)
      if not self.b.block.is_terminated:
        self.b.branch(after)
    self.branches_open -= 1
    self.b.position_at_end(after)

  def s_While(self, s):
    if s.orelse:
      raise Refused("lite: while/else")
    head = self.fn.append_basic_block("while")
    body = self.fn.append_basic_block("wbody")
    after = self.fn.append_basic_block("wend")
    self.b.branch(head)
    self.b.position_at_end(head)
    cond = self.truth(self.expr(s.test))
    self.b.cbranch(cond, body, after)
    self.b.position_at_end(body)
    self.loops.append((head, after))
    self.trips.append(None)
    self.block(s.body)
    self.trips.pop()
    self.loops.pop()
    if not self.b.block.is_terminated:
      self.b.branch(head)
    self.b.position_at_end(after)

  def s_Break(self, s):
    if not self.loops:
      raise Refused("lite: break outside a loop")
    self.b.branch(self.loops[-1][1])

  def s_Continue(self, s):
    if not self.loops:
      raise Refused("lite: continue outside a loop")
    self.b.branch(self.loops[-1][0])

  def s_For(self, s):
    it = s.iter
    if (s.orelse or not isinstance(s.target, ast.Name) or not isinstance(it, ast.Call)
        or not isinstance(it.func, ast.Name) or it.func.id != "range" or it.keywords
        or not 1 <= len(it.args) <= 3 or "range" in self.vars):
      raise Refused("lite: a for loop other than over range()")
    bounds = []
    for a in it.args:
      val, dt = self.expr(a)
      if isinstance(val, Arr) or dt != lt.I64:
        # (numba iterates a range of int32 bounds in int32, of uint64 in uint64)
        raise Refused("lite: range() of bounds other than int64")
      bounds.append(cast(self.b, val, dt, lt.I64))
    consts = [literal_int(a) for a in it.args]
    start, stop, step = (I64(0), bounds[0], I64(1)) if len(bounds) == 1 else (
        bounds[0], bounds[1], bounds[2] if len(bounds) == 3 else I64(1))
    if len(bounds) == 3 and (consts[2] is None or consts[2] <= 0):
      raise Refused("lite: range() with a step that is not a positive constant")
    trips = None
    if all(c is not None for c in consts):
      trips = len(range(*consts))
    outer = self.trips[-1]
    # (an unknown trip count: each iteration's copies in the same part of the arena, from where
    # ``top`` was at the loop's entry; only where no array copied in one iteration is read in the
    # next, checked below)
    reuse = trips is None and outer is not None
    if reuse:
      mark = self.alloca_b.alloca(I64, name="mark")
      self.b.store(self.b.load(self.top), mark)
    counter = self.alloca_b.alloca(I64, name="i")
    self.b.store(start, counter)
    head = self.fn.append_basic_block("for")
    body = self.fn.append_basic_block("fbody")
    incr = self.fn.append_basic_block("fnext")
    after = self.fn.append_basic_block("fend")
    self.b.branch(head)
    self.b.position_at_end(head)
    i = self.b.load(counter)
    self.b.cbranch(self.b.icmp_signed("<", i, stop), body, after)
    self.b.position_at_end(body)
    self.assign(s.target.id, i, lt.I64)
    self.loops.append((incr, after))
    if reuse:
      self.b.store(self.b.load(mark), self.top)
      self.trips.append(outer)
    else:
      self.trips.append(None if outer is None or trips is None else outer * trips)
    self.block(s.body)
    if reuse:
      for name in _read_before_set(s.body, {s.target.id}) & _assigned(s.body):
        var = self.vars.get(name)
        if var is not None and var.sig[0] == "a" and var.sig[3]:
          raise Refused(f"lite: {name}, an array of the arena, carried across the iterations "
                        "of a loop of unknown trip count")
    self.trips.pop()
    self.loops.pop()
    if not self.b.block.is_terminated:
      self.b.branch(incr)
    self.b.position_at_end(incr)
    self.b.store(self.b.add(self.b.load(counter), step), counter)
    self.b.branch(head)
    self.b.position_at_end(after)

  def s_Raise(self, s):
    exc = s.exc
    if not (isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name)
            and exc.func.id == "IndexError" and s.cause is None):
      raise Refused("lite: a raise other than IndexError")
    self.b.ret(I32(1))

  def s_Return(self, s):
    v = s.value
    if not isinstance(v, ast.Tuple) or len(v.elts) != len(self.outs) + 1 or literal_int(v.elts[0]) != 0:
      raise Refused("lite: the return")
    vals = [self.expr(e) for e in v.elts[1:]]
    counts = [self.extent(val.shape) if isinstance(val, Arr) else 1 for val, _ in vals]
    sizes = [n if isinstance(n, int) else None for n in counts]
    if self.out_sizes is not None and (self.out_sizes != sizes or None in sizes):
      raise Refused("lite: returns of different or run-time sizes")
    self.out_sizes = sizes
    base = self.b.ptrtoint(self.arena, I64)
    for k, ((val, dt), (kind, want)) in enumerate(zip(vals, self.outs)):
      slot = self.b.gep(self.outs_ptr, [I64(8 * k)])
      if kind == "s":
        if isinstance(val, Arr) or dt != want:
          raise Refused("lite: a returned scalar of another type")
        self.b.store(self.to_mem(val, dt), self.b.bitcast(slot, memtype(dt).as_pointer()))
      else:
        if not isinstance(val, Arr) or not val.arena or val.dtype != want or len(val.shape) != 1:
          raise Refused("lite: a returned array not allocated by the loop")
        off = self.b.sub(self.b.ptrtoint(val.ptr, I64), base)
        self.b.store(off, self.b.bitcast(slot, I64.as_pointer()))
        if not isinstance(counts[k], int):  # (its element count, after the offsets)
          count = self.b.gep(self.outs_ptr, [I64(8 * (len(self.outs) + k))])
          self.b.store(counts[k], self.b.bitcast(count, I64.as_pointer()))
    self.b.ret(I32(0))

  # -- arrays -------------------------------------------------------------------------------
  def is_np(self, f, name):
    return (isinstance(f, ast.Attribute) and f.attr == name and isinstance(f.value, ast.Name)
            and f.value.id == "np" and "np" not in self.vars)

  def np_dtype(self, node):
    if isinstance(node, ast.Attribute) and self.is_np(node, node.attr) and node.attr in DTYPE_NAMES:
      return DTYPE_NAMES[node.attr]
    return None

  def empty(self, call):
    """``np.empty(n, np.<dtype>)``: a static buffer of the arena (only
    outside loops: each runs once)."""
    if len(call.args) != 2 or call.keywords or len(self.loops):
      raise Refused("lite: np.empty other than (n, dtype) at the top")
    n, dt = literal_int(call.args[0]), self.np_dtype(call.args[1])
    if dt is None:
      raise Refused("lite: np.empty of a non-constant dtype")
    if n is None:
      return self.empty_at_run_time(call.args[0], dt)
    if n < 0:
      raise Refused("lite: np.empty of a negative size")
    off = self.arena_static
    self.arena_static += _aligned(n * dt.itemsize)
    ptr = self.alloc(I64(off))
    return Arr(ptr, dt, (n,), True), None

  def empty_at_run_time(self, size, dt):
    """``np.empty(n, dtype)`` of a size computed at run time, placed after
    the arena's static part (``dtop``): the function returns 2 (the bytes
    it needs in ``outs[0]``) where the arena is too small, 3 where ``n``
    is negative (numba's ValueError). Only where running the function
    again changes nothing: at the top level, before any store to an
    operand."""
    if self.branches_open or self.effects or not self.args:
      raise Refused("lite: np.empty of a run-time size after a branch or a store")
    val, vdt = self.scalar(size)
    if vdt.kind not in "iu" or vdt == lt.U64:
      raise Refused("lite: np.empty of a size other than a signed integer")
    b = self.b
    n = cast(b, val, vdt, lt.I64)
    self.exit_if(b.icmp_signed("<", n, I64(0)), 3)
    limit = (1 << 48) // dt.itemsize  # (past it: a size no arena holds; MemoryError)
    nbytes = b.mul(b.select(b.icmp_signed(">", n, I64(limit)), I64(limit), n), I64(dt.itemsize))
    off = b.load(self.dtop)
    end = b.add(off, b.and_(b.add(nbytes, I64(ALIGN - 1)), I64(-ALIGN)))
    arena_obj = self.fn.args[1]
    dims = b.load(b.bitcast(b.gep(arena_obj, [I64(DIMS_OFFSET)]), I64.as_pointer().as_pointer()))
    short = b.icmp_signed(">", end, b.load(dims))
    with b.if_then(short, likely=False):
      b.store(end, b.bitcast(self.outs_ptr, I64.as_pointer()))
      b.ret(I32(2))
    b.store(end, self.dtop)
    return Arr(self.alloc(off), dt, (n,), True), None

  def exit_if(self, cond, rc):
    with self.b.if_then(cond, likely=False):
      self.b.ret(I32(rc))

  def alloc(self, offset):
    """A buffer of the arena at ``offset``, through a call LLVM sees as
    an allocation (``noalias``, not inlined): as numba's NRT allocations,
    the buffers are known to be distinct from each other and from the
    arguments, which keeps runtime alias checks out of the loops."""
    fn = self.module.globals.get("lite_alloc")
    if fn is None:
      fn = ir.Function(self.module, ir.FunctionType(PTR, [PTR, I64]), "lite_alloc")
      fn.linkage = "internal"
      fn.attributes.add("noinline")
      fn.return_value.attributes.add("noalias")
      b = ir.IRBuilder(fn.append_basic_block())
      b.ret(b.gep(fn.args[0], [fn.args[1]]))
    return self.b.call(fn, [self.arena, offset])

  def copy(self, arr: Arr):
    """``arr.copy()``: a fresh flat buffer bump-allocated in the arena."""
    trips = self.trips[-1]
    if trips is None:
      raise Refused("lite: .copy() inside a while loop or a loop of unknown trip count")
    if any(not isinstance(d, int) for d in arr.shape):
      raise Refused("lite: .copy() of an array of unknown shape")
    n = math.prod(arr.shape)
    nbytes = _aligned(n * arr.dtype.itemsize)
    self.arena_dynamic += nbytes * trips
    if self.arena_size > MAX_ARENA:
      raise Refused("lite: the loop's buffers exceed the arena")
    top = self.b.load(self.top)
    ptr = self.alloc(top)
    self.b.store(self.b.add(top, I64(nbytes)), self.top)
    # an element loop (LLVM turns it into memcpy)
    counter = self.alloca_b.alloca(I64, name="c")
    self.b.store(I64(0), counter)
    head, body, after = (self.fn.append_basic_block(n_) for n_ in ("cp", "cpbody", "cpend"))
    self.b.branch(head)
    self.b.position_at_end(head)
    i = self.b.load(counter)
    self.b.cbranch(self.b.icmp_signed("<", i, I64(n * arr.dtype.itemsize)), body, after)
    self.b.position_at_end(body)
    self.b.store(self.b.load(self.b.gep(arr.ptr, [i])), self.b.gep(ptr, [i]))
    self.b.store(self.b.add(i, I64(1)), counter)
    self.b.branch(head)
    self.b.position_at_end(after)
    return Arr(ptr, arr.dtype, (n,), True), None

  def element(self, node, view=False):
    """(array, element pointer) of ``a[i]`` / ``a[i, j, ...]`` (numba's
    basic indexing: a negative index counts from the end, no check);
    where ``view``, fewer indices than the array's rank give (None, the
    sub-array ``Arr``): numba's view, its pointer moved by the indices'
    strides, the trailing dimensions and strides kept."""
    arr, _ = self.expr(node.value)
    if not isinstance(arr, Arr):
      raise Refused("lite: indexing a scalar")
    idx = node.slice
    idxs = idx.elts if isinstance(idx, ast.Tuple) else [idx]
    if len(idxs) > len(arr.shape) or len(idxs) < len(arr.shape) and not view:
      raise Refused("lite: an index of another rank")
    flat = None
    for k, e in enumerate(idxs):
      if isinstance(e, ast.Slice):
        raise Refused("lite: a slice")
      val, dt = self.expr(e)
      if isinstance(val, Arr) or dt.kind not in "iu" and dt != np.bool_:
        raise Refused("lite: a non-integer index")
      if dt == np.bool_:
        raise Refused("lite: a bool index")
      i = cast(self.b, val, dt, lt.I64)
      dim = arr.shape[k]
      if dim is None:  # (the status array: constant indices only)
        c = literal_int(e)
        if c is None or c < 0:
          raise Refused("lite: a non-constant status index")
      elif dt.kind == "i":
        dim = I64(dim) if isinstance(dim, int) else dim
        i = self.b.select(self.b.icmp_signed("<", i, I64(0)), self.b.add(i, dim), i)
      if arr.strides is not None:  # (bytes)
        term = self.b.mul(i, arr.strides[k])
      else:
        stride = self.extent(arr.shape[k + 1:]) if dim is not None else 1
        term = i if stride == 1 else self.b.mul(i, I64(stride) if isinstance(stride, int) else stride)
      flat = term if flat is None else self.b.add(flat, term)
    mt = memtype(arr.dtype)
    if arr.strides is not None:
      ptr = self.b.gep(arr.ptr, [flat])
      if len(idxs) < len(arr.shape):
        rest = arr.strides[len(idxs):]
        return None, Arr(ptr, arr.dtype, arr.shape[len(idxs):], False, rest)
      return arr, self.b.bitcast(ptr, mt.as_pointer())
    ptr = self.b.gep(self.b.bitcast(arr.ptr, mt.as_pointer()), [flat])
    if len(idxs) < len(arr.shape):  # (a C-contiguous view of a C-contiguous array)
      return None, Arr(self.b.bitcast(ptr, PTR), arr.dtype, arr.shape[len(idxs):], False)
    return arr, ptr

  def const_slice(self, node) -> Arr:
    """``a[lo:hi]`` of constant bounds within a 1-d C-contiguous array (a
    kernel body's buffer in its scratch array, ``codegen.finish``): the
    view numba makes, its pointer moved by ``lo``; of an arena buffer, a
    part of the arena."""
    arr, _ = self.expr(node.value)
    sl = node.slice
    lo, hi = literal_int(sl.lower), literal_int(sl.upper)
    if (not isinstance(arr, Arr) or len(arr.shape) != 1 or not isinstance(arr.shape[0], int)
        or arr.strides is not None or sl.step is not None or lo is None or hi is None
        or not 0 <= lo <= hi <= arr.shape[0]):
      raise Refused("lite: a slice other than a[lo:hi] of constants within a 1-d array")
    ptr = self.b.gep(arr.ptr, [I64(lo * arr.dtype.itemsize)])
    return Arr(ptr, arr.dtype, (hi - lo,), arr.arena)

  def shape_item(self, node):
    """``a.shape[k]`` (numba's intp: int64): a static dimension, or the
    one read from the operand's array struct."""
    arr, _ = self.expr(node.value.value)
    k = literal_int(node.slice)
    if not isinstance(arr, Arr) or k is None or not -len(arr.shape) <= k < len(arr.shape):
      raise Refused("lite: .shape[k] other than of an array at a constant k")
    dim = arr.shape[k]
    if dim is None:
      raise Refused("lite: the status array's shape")
    return (I64(dim) if isinstance(dim, int) else dim), lt.I64

def _loads(node) -> set:
  return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _assigned(stmts) -> set:
  return {n.id for s in stmts for n in ast.walk(s)
          if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _read_before_set(stmts, defined) -> set:
  """The names ``stmts`` may read before they assign them (a name set in
  a nested block counts as set only within it)."""
  early: set = set()

  def walk(stmts, defined):
    for s in stmts:
      if isinstance(s, ast.Assign):
        early.update(_loads(s.value) - defined)
        for t in s.targets:
          early.update(_loads(t) - defined)
          defined |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)
                      and isinstance(n.ctx, ast.Store)}
      elif isinstance(s, ast.For):
        early.update(_loads(s.iter) - defined)
        walk(s.body, defined | _loads(s.target) | {n.id for n in ast.walk(s.target)
                                                    if isinstance(n, ast.Name)})
      elif isinstance(s, (ast.While, ast.If)):
        early.update(_loads(s.test) - defined)
        walk(s.body, set(defined))
        walk(s.orelse, set(defined))
      else:
        early.update(_loads(s) - defined)
  walk(stmts, set(defined))
  return early


def _aligned(n: int) -> int:
  return (n + ALIGN - 1) // ALIGN * ALIGN


def translate(src, args) -> tuple:
  """(LLVM IR text, meta, constant arrays) of a ``codegen.Source``;
  ``args``: each loop operand's (kind 's'/'a'/'r', dtype, static shape,
  C-contiguous).
  Raises ``Refused`` outside the subset."""
  # (a kernel body's scratch arrays, after its operands: codegen.finish)
  args = [*args, *(("a", np.dtype(dt), (n,), True) for dt, n in getattr(src, "scratch", ()))]
  try:
    tr = Translator(src.text, src.globals, args, src.outs, src.externals)
    text = tr.translate()
  except (RecursionError, SyntaxError) as e:
    raise Refused(f"lite: {type(e).__name__}") from None
  meta = {"args": [None if kind != "s" else dt.str for kind, dt, *_ in args],
          "arena": tr.arena_size,
          "outs": [[kind, dt.str, n] for (kind, dt), n in zip(src.outs, tr.out_sizes)]}
  return text, meta, [src.globals[k] for k in tr.const_arrays]
