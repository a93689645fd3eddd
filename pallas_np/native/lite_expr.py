"""lite's values and expressions: how each scalar expression of the
generated loop source is lowered to LLVM IR as numba lowers it (numba's
types from ``lite_types``; ``lite`` holds the statements, arrays and the
function). Anything without a rule raises ``Refused``."""
from __future__ import annotations

import ast

import llvmlite.ir as ir

from pallas_np.native import lite_types as lt
from pallas_np.native.contract import Refused
from pallas_np.native.lite_dtype import SUPPORTED, DType

I1, I8, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64)
PTR = I8.as_pointer()
DTYPE_NAMES = {dt.name if dt is not lt.BOOL else "bool_": dt for dt in SUPPORTED}


def lltype(dt: DType):
  if dt is lt.BOOL:
    return I1
  if dt.kind == "f":
    return ir.FloatType() if dt.itemsize == 4 else ir.DoubleType()
  return ir.IntType(dt.itemsize * 8)


def memtype(dt: DType):
  return I8 if dt is lt.BOOL else lltype(dt)


class Arr:
  """An array value: a data pointer (i8*), its dtype and static shape;
  ``arena``: a buffer of the call's arena (may be returned); ``strides``:
  an operand that is not C-contiguous, its byte strides (read at the
  entry from the array; C order otherwise)."""
  __slots__ = ("ptr", "dtype", "shape", "arena", "strides")

  def __init__(self, ptr, dtype, shape, arena, strides=None):
    self.ptr, self.dtype, self.shape, self.arena = ptr, dtype, tuple(shape), arena
    self.strides = strides

  def sig(self):
    return ("a", self.dtype, self.shape, self.arena, self.strides)


def cast(b, val, src: DType, dst: DType):
  """numba's ``context.cast`` between number types."""
  if src == dst:
    return val
  if dst is lt.BOOL:
    if src.kind == "f":
      return b.fcmp_unordered("!=", val, ir.Constant(val.type, 0.0))
    return b.icmp_unsigned("!=", val, ir.Constant(val.type, 0))
  t = lltype(dst)
  if src.kind == "f":
    if dst.kind == "f":
      return b.fpext(val, t) if dst.itemsize > src.itemsize else b.fptrunc(val, t)
    return b.fptosi(val, t) if dst.kind == "i" else b.fptoui(val, t)
  if dst.kind == "f":
    return b.sitofp(val, t) if src.kind == "i" else b.uitofp(val, t)
  sw, dw = val.type.width, t.width
  if dw < sw:
    return b.trunc(val, t)
  if dw == sw:
    return val
  return b.sext(val, t) if src.kind == "i" else b.zext(val, t)


def const(dt: DType, value):
  t = lltype(dt)
  if dt is lt.BOOL:
    return ir.Constant(I1, int(bool(value)))
  if dt.kind == "f":
    return ir.Constant(t, float(value))
  v = int(value)  # (as NumPy converts it to ``dt``: a value out of its range is refused)
  bits = 8 * dt.itemsize
  lo, hi = (0, 1 << bits) if dt.kind == "u" else (-(1 << (bits - 1)), 1 << (bits - 1))
  if not lo <= v < hi:
    raise Refused(f"lite: {value!r} out of the range of {dt.name}")
  return ir.Constant(t, v)


_INTRINSICS = {"sqrt": "llvm.sqrt", "floor": "llvm.floor", "ceil": "llvm.ceil",
               "trunc": "llvm.trunc"}
_CMP = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}


class Expressions:
  """The expression rules of ``lite.Translator`` (a mixin: they read its
  builder ``b``, variables and module)."""

  # -- expressions -------------------------------------------------------------------------
  def expr(self, e):
    meth = getattr(self, "e_" + type(e).__name__, None)
    if meth is None:
      raise Refused(f"lite: expression {type(e).__name__}")
    return meth(e)

  def scalar(self, e):
    val, dt = self.expr(e)
    if isinstance(val, Arr):
      raise Refused("lite: an array where a scalar was expected")
    return val, dt

  def e_Constant(self, e):
    v = e.value
    if isinstance(v, bool):
      return const(lt.BOOL, v), lt.BOOL
    if isinstance(v, int):
      if 2**63 <= v < 2**64:  # (numba types it uint64)
        return const(lt.U64, v), lt.U64
      if not -2**63 <= v < 2**63:
        raise Refused("lite: an int literal beyond 64 bits")
      return const(lt.I64, v), lt.I64
    if isinstance(v, float):
      return const(lt.F64, v), lt.F64
    raise Refused(f"lite: constant {type(v).__name__}")

  def e_Name(self, e):
    return self.load_name(e.id)

  def e_Subscript(self, e):
    if isinstance(e.value, ast.Attribute) and e.value.attr == "shape":
      return self.shape_item(e)
    if isinstance(e.slice, ast.Slice):
      return self.const_slice(e), None
    arr, ptr = self.element(e, view=True)
    if arr is None:  # (a view: fewer indices than the rank)
      return ptr, None
    v = self.b.load(ptr)
    return (self.b.trunc(v, I1) if arr.dtype is lt.BOOL else v), arr.dtype

  def truth(self, v):
    val, dt = v
    if isinstance(val, Arr):
      raise Refused("lite: the truth of an array")
    return cast(self.b, val, dt, lt.BOOL)

  def e_BinOp(self, e):
    a, da = self.scalar(e.left)
    c, dc = self.scalar(e.right)
    op, b = type(e.op), self.b
    if op in (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.Div):
      t = lt.arith(da, dc)
      if op is ast.Div and t.kind != "f":
        raise Refused("lite: / of integers")
      x, y = cast(b, a, da, t), cast(b, c, dc, t)
      if t.kind == "f":
        fn = {ast.Add: b.fadd, ast.Sub: b.fsub, ast.Mult: b.fmul, ast.Div: b.fdiv}.get(op)
        if fn is None:
          raise Refused("lite: // or % of floats")
        return fn(x, y), t
      if op in (ast.FloorDiv, ast.Mod):
        return self.floor_divmod(x, y, t, op is ast.FloorDiv), t
      return {ast.Add: b.add, ast.Sub: b.sub, ast.Mult: b.mul}[op](x, y), t
    if op in (ast.BitAnd, ast.BitOr, ast.BitXor):
      t = lt.bitwise(da, dc)
      if t is None:
        raise Refused("lite: a bitwise op of floats")
      x, y = cast(b, a, da, t), cast(b, c, dc, t)
      return {ast.BitAnd: b.and_, ast.BitOr: b.or_, ast.BitXor: b.xor}[op](x, y), t
    if op in (ast.LShift, ast.RShift):
      t = lt.shift(da, dc)
      if t is None:
        raise Refused("lite: a shift of floats")
      x, y = cast(b, a, da, t), cast(b, c, dc, t)
      if op is ast.LShift:
        return b.shl(x, y), t
      return (b.ashr(x, y) if t.kind == "i" else b.lshr(x, y)), t
    raise Refused(f"lite: operator {op.__name__}")

  def e_UnaryOp(self, e):
    a, da = self.scalar(e.operand)
    op, b = type(e.op), self.b
    if op is ast.Not:
      return b.xor(self.truth((a, da)), I1(1)), lt.BOOL
    if op is ast.Invert:
      if da is lt.BOOL:
        return b.xor(a, I1(1)), lt.BOOL
      if da.kind == "f":
        raise Refused("lite: ~ of a float")
      t = lt.negate(da)
      return b.xor(cast(b, a, da, t), ir.Constant(lltype(t), -1)), t
    if op is ast.USub:
      t = lt.negate(da)
      x = cast(b, a, da, t)
      return (b.fneg(x) if t.kind == "f" else b.neg(x)), t
    raise Refused(f"lite: unary {op.__name__}")

  def compare(self, a, da, c, dc, opname):
    t = lt.compare(da, dc)
    if t is None:
      raise Refused("lite: a comparison")
    b = self.b
    x, y = cast(b, a, da, t), cast(b, c, dc, t)
    if t.kind == "f":
      if opname == "!=":
        return b.fcmp_unordered("!=", x, y)
      return b.fcmp_ordered(opname, x, y)
    if t.kind == "i":
      return b.icmp_signed(opname, x, y)
    return b.icmp_unsigned(opname, x, y)

  def floor_divmod(self, x, y, t, div: bool):
    """numba's integer ``//`` or ``%`` (``_int_divmod_impl``): Python's
    floor semantics; 0 for a divisor 0 (the NumPy error model) and for
    INT_MIN // -1 (both results), as selects around a divisor that
    cannot trap."""
    b = self.b
    bad = b.icmp_unsigned("==", y, I64(0))
    if t.kind == "u":
      safe = b.select(bad, I64(1), y)
      return b.select(bad, I64(0), (b.udiv if div else b.urem)(x, safe))
    bad = b.or_(bad, b.and_(b.icmp_signed("==", x, I64(-2**63)), b.icmp_signed("==", y, I64(-1))))
    safe = b.select(bad, I64(1), y)
    q, r = b.sdiv(x, safe), b.srem(x, safe)
    fix = b.and_(b.icmp_signed("!=", r, I64(0)), b.icmp_signed("<", b.xor(safe, r), I64(0)))
    res = b.select(fix, b.sub(q, I64(1)), q) if div else b.select(fix, b.add(r, safe), r)
    return b.select(bad, I64(0), res)

  def e_Compare(self, e):
    """``a < b``; a chain ``a <= b < c`` as Python (and numba) evaluate
    it: each operand once, the next comparison only where this one holds."""
    if any(type(op) not in _CMP for op in e.ops):
      raise Refused("lite: an identity or membership comparison")
    left = self.scalar(e.left)

    def chain(left, k):
      right = self.scalar(e.comparators[k])
      c = self.compare(*left, *right, _CMP[type(e.ops[k])])
      if k == len(e.ops) - 1:
        return c, lt.BOOL
      return self.branches(c, lambda: chain(right, k + 1), lambda: (I1(0), lt.BOOL))
    return chain(left, 0)

  def branches(self, cond, make_a, make_b):
    """``a if cond else b`` as numba lowers it: two blocks and a phi of
    the unified type."""
    ba = self.fn.append_basic_block("ifa")
    bb = self.fn.append_basic_block("ifb")
    after = self.fn.append_basic_block("ifend")
    self.b.cbranch(cond, ba, bb)
    self.b.position_at_end(ba)
    a, da = make_a()
    ea = self.b.block
    self.b.position_at_end(bb)
    c, dc = make_b()
    eb = self.b.block
    t = lt.unify(da, dc)
    if t is None:
      raise Refused("lite: a conditional of two types numba does not unify")
    self.b.position_at_end(ea)
    a = cast(self.b, a, da, t)
    self.b.branch(after)
    ea = self.b.block
    self.b.position_at_end(eb)
    c = cast(self.b, c, dc, t)
    self.b.branch(after)
    eb = self.b.block
    self.b.position_at_end(after)
    phi = self.b.phi(lltype(t))
    phi.add_incoming(a, ea)
    phi.add_incoming(c, eb)
    return phi, t

  def e_IfExp(self, e):
    cond = self.truth(self.expr(e.test))
    return self.branches(cond, lambda: self.scalar(e.body), lambda: self.scalar(e.orelse))

  def e_BoolOp(self, e):
    vals = e.values
    if len(vals) != 2:
      raise Refused("lite: a boolean op of more than two operands")
    a, da = self.scalar(vals[0])
    if da is not lt.BOOL:
      raise Refused("lite: and/or of a non-bool")

    def second():
      c, dc = self.scalar(vals[1])
      if dc is not lt.BOOL:
        raise Refused("lite: and/or of a non-bool")
      return c, dc
    if isinstance(e.op, ast.And):
      return self.branches(a, second, lambda: (a, lt.BOOL))
    return self.branches(a, lambda: (a, lt.BOOL), second)

  def e_Attribute(self, e):
    raise Refused(f"lite: attribute {e.attr}")

  def e_Call(self, e):
    if e.keywords:
      raise Refused("lite: a call with keywords")
    f = e.func
    if isinstance(f, ast.Attribute) and f.attr == "copy" and not e.args:
      arr, _ = self.expr(f.value)
      if not isinstance(arr, Arr):
        raise Refused("lite: .copy() of a scalar")
      return self.copy(arr)
    if isinstance(f, ast.Attribute) and f.attr == "view" and len(e.args) == 1:
      return self.same_size_view(f.value, e.args[0]), None
    dt = self.np_dtype(f)
    if dt is not None:
      if len(e.args) != 1:
        raise Refused("lite: a dtype call")
      a, da = self.scalar(e.args[0])
      return cast(self.b, a, da, dt), dt
    args = [self.scalar(a) for a in e.args]
    b = self.b
    if isinstance(f, ast.Attribute) and self.is_np(f, f.attr):
      name = f.attr
      if name in _INTRINSICS and len(args) == 1 and args[0][1].kind == "f":
        (a, da), = args
        return self.intrinsic(_INTRINSICS[name], a), da
      if name == "fmod" and len(args) == 2 and args[0][1] == args[1][1] and args[0][1].kind == "f":
        return b.frem(args[0][0], args[1][0]), args[0][1]
      raise Refused(f"lite: np.{name}")
    if not isinstance(f, ast.Name) or f.id in self.vars:
      raise Refused("lite: a call")
    name = f.id
    if name == "abs" and len(args) == 1:
      (a, da), = args
      if da.kind == "f":
        return self.intrinsic("llvm.fabs", a), da
      if da.kind == "i":
        return b.select(b.icmp_signed("<", a, ir.Constant(a.type, 0)), b.neg(a), a), da
      raise Refused("lite: abs of an unsigned or bool")
    if name in ("min", "max") and len(args) >= 2:
      acc, dacc = args[0]
      for v, dv in args[1:]:
        t = lt.unify(dacc, dv)
        if t is None:
          raise Refused("lite: min/max of two types numba does not unify")
        acc, v = cast(b, acc, dacc, t), cast(b, v, dv, t)
        pred = self.compare(v, t, acc, t, ">" if name == "max" else "<")
        acc, dacc = b.select(pred, v, acc), t
      return acc, dacc
    if name in ("_sdiv", "_srem") and len(args) == 2:
      (a, da), (c, dc) = args
      if da.kind != "i" or dc.kind not in "iu":
        raise Refused(f"lite: {name} of these types")
      c = cast(b, c, dc, da)
      return (b.sdiv(a, c) if name == "_sdiv" else b.srem(a, c)), da
    if name.startswith("_ext_") and name[5:] in self.externals and len(args) == 1:
      (a, da), = args
      if da != lt.F32:
        raise Refused("lite: an external of a non-float32")
      fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()])
      fn = self.module.globals.get(name[5:]) or ir.Function(self.module, fnty, name[5:])
      return b.call(fn, [a]), da
    raise Refused(f"lite: call of {name}")

  def intrinsic(self, name, a):
    fnty = ir.FunctionType(a.type, [a.type])
    full = f"{name}.f{32 if isinstance(a.type, ir.FloatType) else 64}"
    fn = self.module.globals.get(full) or ir.Function(self.module, fnty, full)
    return self.b.call(fn, [a])


def literal_int(e):
  """The value of an int literal (``3``, ``-1``), else None."""
  if isinstance(e, ast.Constant) and type(e.value) is int:
    return e.value
  if (isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub) and isinstance(e.operand, ast.Constant)
      and type(e.operand.value) is int):
    return -e.operand.value
  return None
