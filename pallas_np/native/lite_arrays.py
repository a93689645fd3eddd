"""lite's arrays (a mixin of ``lite.Translator``): NumPy array structs read
at run time (data pointer, dimensions, strides), element pointers with
numba's basic indexing, views (``a[i]`` of an N-d array, ``a[lo:hi]`` of a
1-d one), ``a.shape[k]``, and the per-call arena that holds ``np.empty``
buffers (static offsets, or placed at run time) and ``.copy()``s
(docs/native.md, "lite")."""
from __future__ import annotations

import ast
import math

import llvmlite.ir as ir

from pallas_np.native import lite_types as lt
from pallas_np.native.contract import Refused
from pallas_np.native.lite_expr import I32, I64, PTR, DTYPE_NAMES, Arr, cast, literal_int, memtype

DATA_OFFSET = 16  # PyArrayObject's ``data`` field: after PyObject_HEAD
DIMS_OFFSET = 32  # ... its ``dimensions`` (after nd)
STRIDES_OFFSET = 40  # ... its ``strides``
ALIGN = 64
MAX_ARENA = 64 << 20


class Arrays:
  """The array rules of ``lite.Translator`` (they read its builder ``b``,
  its function, arena and variables)."""

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
    self.arena_static += aligned(n * dt.itemsize)
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
    """``arr.copy()``: a fresh C-contiguous buffer of ``arr``'s shape,
    bump-allocated in the arena (a byte copy: a strided array is refused)."""
    trips = self.trips[-1]
    if trips is None:
      raise Refused("lite: .copy() inside a while loop or a loop of unknown trip count")
    if any(not isinstance(d, int) for d in arr.shape):
      raise Refused("lite: .copy() of an array of unknown shape")
    if arr.strides is not None:
      raise Refused("lite: .copy() of a strided array")
    n = math.prod(arr.shape)
    nbytes = aligned(n * arr.dtype.itemsize)
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
    return Arr(ptr, arr.dtype, arr.shape, True), None

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
      if isinstance(val, Arr) or dt.kind not in "iu" and dt is not lt.BOOL:
        raise Refused("lite: a non-integer index")
      if dt is lt.BOOL:
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

  def same_size_view(self, value, dtype_node) -> Arr:
    """``a.view(np.<dtype>)`` of a dtype of ``a``'s item size (the
    bfloat16 rounding's bits, ``native/narrow.py``): numba's view, the same
    memory, shape and strides read as the other type (a bool, or another
    item size, is refused)."""
    arr, _ = self.expr(value)
    dt = self.np_dtype(dtype_node)
    if (not isinstance(arr, Arr) or dt is None or dt is lt.BOOL or arr.dtype is lt.BOOL
        or dt.itemsize != arr.dtype.itemsize or arr.shape == (None,)):
      raise Refused("lite: a .view() other than of a same-size non-bool dtype")
    return Arr(arr.ptr, dt, arr.shape, arr.arena, arr.strides)

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


def assigned_names(stmts) -> set:
  return {n.id for s in stmts for n in ast.walk(s)
          if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def read_before_set(stmts, defined) -> set:
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


def aligned(n: int) -> int:
  return (n + ALIGN - 1) // ALIGN * ALIGN
