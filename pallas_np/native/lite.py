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

import llvmlite.ir as ir

from pallas_np.native import lite_types as lt
from pallas_np.native.contract import Refused
from pallas_np.native.lite_dtype import SUPPORTED, ConstArray, Scalar, constant, dtype
from pallas_np.native.lite_arrays import DATA_OFFSET, Arrays, assigned_names, read_before_set
from pallas_np.native.lite_expr import (I1, I8, I32, I64, PTR, Arr, Expressions, cast, const, literal_int,
                                        lltype, memtype)
from pallas_np.native.lite_headers import Headers


class Var:
  __slots__ = ("slot", "sig", "shape")

  def __init__(self, slot, sig):
    self.slot, self.sig = slot, sig


class Translator(Headers, Arrays, Expressions):
  """One generated function lowered into an LLVM module."""

  def __init__(self, text, globals_, args, outs, externals=()):
    self.fn_ast = self.module_function(text)  # (its headers: lite_headers)
    self.text_lines = text.splitlines()
    self.globals = globals_
    self.args = args  # [(kind 's'|'a'|'r', dtype, shape)]
    self.outs = outs  # [(kind, dtype)]
    self.const_arrays = [k for k, v in globals_.items() if isinstance(v, ConstArray)]
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
    self.st = Arr(self.data(st), lt.I64, (None,), False)
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
        val = p if dt is not lt.BOOL else self.b.trunc(p, I1)
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
      if isinstance(v, Scalar) and v.dtype in SUPPORTED:
        return const(v.dtype, v.value), v.dtype
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
    return self.b.zext(val, I8) if dt is lt.BOOL else val

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
      for name in read_before_set(s.body, {s.target.id}) & assigned_names(s.body):
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

def translate(src, args) -> tuple:
  """(LLVM IR text, meta, constant arrays) of a ``codegen.Source``;
  ``args``: each loop operand's (kind 's'/'a'/'r', dtype, static shape,
  C-contiguous).
  Raises ``Refused`` outside the subset."""
  # (a kernel body's scratch arrays, after its operands: codegen.finish; dtypes and constants as
  # lite reads them: lite_dtype, NumPy's or the compile process's own)
  args = [(kind, dtype(dt), *rest) for kind, dt, *rest in args]
  args += [("a", dtype(dt), (n,), True) for dt, n in getattr(src, "scratch", ())]
  outs = [(kind, dtype(dt)) for kind, dt in src.outs]
  consts = {name: constant(v) for name, v in src.globals.items()}
  try:
    tr = Translator(src.text, consts, args, outs, src.externals)
    text = tr.translate()
  except (RecursionError, SyntaxError) as e:
    raise Refused(f"lite: {type(e).__name__}") from None
  meta = {"args": [None if kind != "s" else dt.str for kind, dt, *_ in args],
          "arena": tr.arena_size,
          "outs": [[kind, dt.str, n] for (kind, dt), n in zip(outs, tr.out_sizes)]}
  return text, meta, [src.globals[k] for k in tr.const_arrays]
