"""lite's rules for what the generated source holds beside the loop's own
function (docs/native.md, "lite"): the module headers codegen writes and
the forms that go with them, so that a body or loop with a float dot, a
float32 loop of the NumPy rules, a pairwise sum or a signed-zero extremum
is compiled in this process, not by a numba compile process beside the
caller.

- ``blas_calls.header``: the intrinsics ``_cblas_<routine>(address, *args)``
  become a call through the address (``inttoptr`` of the int64 read from
  the status array, the routine's C type from ``blas_calls.ROUTINES``),
  each argument converted as numba converts it to the intrinsic's
  signature. The addresses are looked up by the caller (``blas_calls
  .status``), never compiled in: an object from the disk cache is loaded
  into another process.
- ``@_njit`` helpers (``reductions._leaf_source``): each becomes an
  internal LLVM function per argument signature (numba's dispatch: arrays
  by data pointer with their static shape, scalars by value), returning
  its result through a pointer; LLVM inlines it as numba's would be.
- ``import math as _math``: ``_math.copysign`` (``llvm.copysign``).
- what the prologues and dots read: ``_st.shape[0]``, ``X.ctypes.data``,
  ``X.strides[k]`` (an operand's, from its array struct), ``raise
  RuntimeError`` (the status' slot 0 set to ``RUNTIME_ERROR``; ``lite_jit``
  raises it), a call as a statement and ``x += y``.

A header whose text is not exactly one of these (a DMA call site's
``_pycall``) is refused: numba builds that loop.
"""
from __future__ import annotations

import ast

import llvmlite.ir as ir

from pallas_np.native import contract
from pallas_np.native import lite_types as lt
from pallas_np.native.contract import RUNTIME_ERROR, Refused
from pallas_np.native.lite_arrays import DIMS_OFFSET
from pallas_np.native.lite_expr import I32, I64, PTR, Arr, cast, const, lltype, literal_int

NJIT = "from numba import njit as _njit\n"
MATH = "import math as _math\n"
# the intrinsics' argument kinds as numba types them (blas_calls.header's ``nt``)
_NT = {"e": lt.I64, "i": lt.I64, "f": lt.F32, "d": lt.F64, "p": lt.I64, "q": lt.I64}
_RET = {"v": None, "f": lt.F32, "d": lt.F64}


def _known_headers():
  """(text, what it defines) of every header lite reads."""
  out = [(NJIT, "njit"), (MATH, "math")]
  for bits in (64, 32):
    out.append((contract.cblas_header(bits), ("cblas", bits)))
  return out


class Headers:
  """The module rules of ``lite.Translator`` (a mixin, before
  ``Expressions``: its ``e_Call``, ``e_Subscript`` and ``e_Attribute``
  come first and hand the rest on)."""

  helper_of = None  # (a helper's translator: the main one)

  def module_function(self, text: str):
    """``native_loop``'s ``ast.FunctionDef`` of the module ``text``: its
    known headers noted (their lines blanked, so that line numbers stay),
    each ``@_njit`` function kept as a helper; anything else refused."""
    self.cblas_bits = None
    self.has = set()
    for header, what in _known_headers():
      if header in text:
        text = text.replace(header, "\n" * header.count("\n"), 1)
        if isinstance(what, tuple):
          if self.cblas_bits is not None:
            raise Refused("lite: two BLAS headers")
          self.cblas_bits = what[1]
        else:
          self.has.add(what)
    tree = ast.parse(text)
    self.helper_defs, self.helper_fns, main = {}, {}, None
    for node in tree.body:
      if not isinstance(node, ast.FunctionDef):
        raise Refused(f"lite: a module other than functions ({ast.dump(node)[:80]})")
      if node.name == "native_loop" and not node.decorator_list and main is None:
        main = node
      elif ("njit" in self.has and len(node.decorator_list) == 1
            and isinstance(node.decorator_list[0], ast.Name)
            and node.decorator_list[0].id == "_njit" and node.name.startswith("_")):
        self.helper_defs[node.name] = node
      else:
        raise Refused(f"lite: a module function {node.name}")
    if main is None:
      raise Refused("lite: no native_loop")
    return _RuntimeErrors().visit(main) if "RuntimeError" in text else main

  # -- statements -----------------------------------------------------------------------
  def s_Expr(self, s):
    if not isinstance(s.value, ast.Call):
      raise Refused("lite: an expression statement other than a call")
    self.expr(s.value)

  def s_AugAssign(self, s):
    if not isinstance(s.target, ast.Name):
      raise Refused("lite: an augmented assignment to other than a name")
    value = ast.BinOp(left=ast.Name(id=s.target.id, ctx=ast.Load()), op=s.op, right=s.value)
    self.store_target(s.target, self.scalar(value))

  def runtime_error(self):
    """``raise RuntimeError(...)`` (rewritten by ``module_function``)."""
    if self.helper_of is not None:
      raise Refused("lite: a raise in a helper")
    self.b.store(I64(RUNTIME_ERROR), self.b.bitcast(self.st.ptr, I64.as_pointer()))
    self.b.ret(I32(1))
    return ir.Constant(ir.IntType(1), 0), lt.BOOL

  # -- expressions ----------------------------------------------------------------------
  def e_Attribute(self, e):
    """``X.ctypes.data``: the data pointer's value (int64); ``np.inf``,
    ``np.nan`` (float64, as numba types them)."""
    if e.attr in ("inf", "nan") and self.is_np(e, e.attr):
      return const(lt.F64, float(e.attr)), lt.F64
    if (e.attr == "data" and isinstance(e.value, ast.Attribute) and e.value.attr == "ctypes"):
      arr, _ = self.expr(e.value.value)
      if isinstance(arr, Arr):
        return self.b.ptrtoint(arr.ptr, I64), lt.I64
    return super().e_Attribute(e)

  def e_Subscript(self, e):
    v = e.value
    if (isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name)
        and (v.attr == "strides" or (v.attr == "shape" and v.value.id == self.st_name))):
      return self.array_field(v.value.id, v.attr, literal_int(e.slice))
    return super().e_Subscript(e)  # (other shapes and a[lo:hi]: lite_arrays)

  def array_field(self, name, field, k):
    """``_st.shape[0]``, ``X.strides[k]`` of an operand: read from the
    array struct (numba reads its own copy of the same fields)."""
    if k is None or k < 0:
      raise Refused(f"lite: .{field}[] of a non-constant index")
    b = self.b
    if field == "shape":
      if self.helper_of is not None or name != self.st_name or k != 0:
        raise Refused(f"lite: the shape of {name}")
      dims = b.load(b.bitcast(b.gep(self.fn.args[0], [I64(DIMS_OFFSET)]), I64.as_pointer().as_pointer()))
      return b.load(dims), lt.I64
    obj = self.operand_object(name)
    arr, _ = self.load_name(name)
    if not isinstance(arr, Arr) or k >= len(arr.shape):
      raise Refused(f"lite: the strides of {name}")
    if arr.strides is not None:
      return arr.strides[k], lt.I64
    return self.strides(obj, len(arr.shape))[k], lt.I64

  def operand_object(self, name):
    """The ``PyObject*`` of the operand ``name`` (never reassigned by the
    generated code)."""
    names = [a.arg for a in self.fn_ast.args.args]
    if self.helper_of is not None or name not in names[1:]:
      raise Refused(f"lite: the array struct of {name} (not an operand)")
    return self.fn.args[3 + names.index(name) - 1]

  def e_BoolOp(self, e):
    """``a and b and c``: ``a and (b and c)`` (Python's and numba's)."""
    if len(e.values) > 2:
      rest = ast.copy_location(ast.BoolOp(op=e.op, values=e.values[1:]), e)
      e = ast.copy_location(ast.BoolOp(op=e.op, values=[e.values[0], rest]), e)
    return super().e_BoolOp(e)

  def e_Call(self, e):
    f = e.func
    if isinstance(f, ast.Name) and f.id not in self.vars and not e.keywords:
      if f.id.startswith("_cblas_") and self.cblas_bits is not None:
        return self.cblas_call(f.id[7:], e.args)
      if f.id == _RAISE and not e.args:
        return self.runtime_error()
      if f.id in self.helper_defs:
        return self.helper_call(f.id, e.args)
    if (isinstance(f, ast.Attribute) and f.attr == "copysign" and isinstance(f.value, ast.Name)
        and f.value.id == "_math" and "math" in self.has and "_math" not in self.vars
        and len(e.args) == 2 and not e.keywords):
      (a, da), (c, dc) = (self.scalar(x) for x in e.args)
      if da.kind not in "iuf" or dc.kind not in "iuf":
        raise Refused("lite: copysign of these types")
      a, c = cast(self.b, a, da, lt.F64), cast(self.b, c, dc, lt.F64)
      fn = self.module.globals.get("llvm.copysign.f64") or ir.Function(
          self.module, ir.FunctionType(a.type, [a.type, a.type]), "llvm.copysign.f64")
      return self.b.call(fn, [a, c]), lt.F64
    return super().e_Call(e)

  def cblas_call(self, name, args):
    """``_cblas_<name>(address, *args)``: blas_calls.header's intrinsic."""
    routines = {**contract.ROUTINES, "loop1": ("ppq", "f", "v")}
    if name not in routines:
      raise Refused(f"lite: _cblas_{name}")
    kinds, _, ret = routines[name]
    if len(args) != len(kinds) + 1:
      raise Refused(f"lite: _cblas_{name}'s arguments")
    b = self.b
    vals = [self.scalar(a) for a in args]
    fp = cast(b, *vals[0], lt.I64) if vals[0][1].kind in "iu" else None
    if fp is None:
      raise Refused("lite: a routine address that is not an integer")
    lts = {"e": I32, "i": ir.IntType(self.cblas_bits), "f": ir.FloatType(), "d": ir.DoubleType(),
           "p": PTR, "q": I64}
    rl = {"v": ir.VoidType(), "f": ir.FloatType(), "d": ir.DoubleType()}[ret]
    fnty = ir.FunctionType(rl, [lts[k] for k in kinds])
    llargs = []
    for k, (v, dv) in zip(kinds, vals[1:]):
      if dv.kind not in "iuf" and dv is not lt.BOOL:
        raise Refused(f"lite: _cblas_{name}'s argument of {dv}")
      v = cast(b, v, dv, _NT[k])  # (numba: to the intrinsic's signature, then its codegen)
      if k == "p":
        v = b.inttoptr(v, PTR)
      elif lts[k] != v.type:
        v = b.trunc(v, lts[k])
      llargs.append(v)
    r = b.call(b.inttoptr(fp, fnty.as_pointer()), llargs)
    if ret == "v":
      return ir.Constant(ir.IntType(1), 0), lt.BOOL  # (none: only a statement uses it)
    return r, _RET[ret]

  # -- njit helpers ---------------------------------------------------------------------
  def helper_call(self, name, args):
    vals = [self.expr(a) for a in args]
    sig = tuple(v.sig() if isinstance(v, Arr) else dt for v, dt in vals)
    main = self.helper_of or self
    key = (name, sig)
    got = main.helper_fns.get(key)
    if got is None:
      main.helper_fns[key] = "translating"
      got = main.helper_fns[key] = self.translate_helper(main, name, vals)
    if got == "translating":
      raise Refused(f"lite: a recursive helper {name}")
    fn, rdt = got
    slot = self.alloca_b.alloca(lltype(rdt))
    llargs = [self.b.bitcast(slot, PTR)] + [v.ptr if isinstance(v, Arr) else v for v, _ in vals]
    self.b.call(fn, llargs)
    return self.b.load(slot), rdt

  def translate_helper(self, main, name, vals):
    """(LLVM function, result dtype) of the helper ``name`` for these
    arguments: ``void f(result*, *args)``, internal."""
    node = main.helper_defs[name]
    a = node.args
    if len(a.args) != len(vals) or a.vararg or a.kwonlyargs or a.defaults or a.kwarg:
      raise Refused(f"lite: {name}'s arguments")
    if any(isinstance(v, Arr) and v.strides is not None for v, _ in vals):
      raise Refused(f"lite: {name} of a strided array")
    sub = object.__new__(_helper_class(type(main)))
    sub.__dict__.update({k: main.__dict__[k] for k in (
        "text_lines", "globals", "module", "externals", "cblas_bits", "has", "helper_defs")})
    sub.helper_of = main
    sub.fn_ast, sub.vars, sub.loops, sub.trips, sub.gconsts = node, {}, [], [None], {}
    sub.st_name, sub.ret_dtype, sub.arena_static, sub.arena_dynamic = None, None, 0, 0
    sub.out_sizes, sub.branches_open, sub.effects = None, 0, False  # (lite_arrays' bookkeeping)
    params = [PTR] + [PTR if isinstance(v, Arr) else lltype(dt) for v, dt in vals]
    fn = ir.Function(main.module, ir.FunctionType(ir.VoidType(), params),
                     name=f"{name}.{len(main.helper_fns)}")
    fn.linkage = "internal"
    sub.fn = fn
    entry = fn.append_basic_block("entry")
    body = fn.append_basic_block("body")
    sub.alloca_b, sub.b = ir.IRBuilder(entry), ir.IRBuilder(body)
    sub.ret_ptr = fn.args[0]
    for arg, (v, dt), p in zip(a.args, vals, fn.args[1:]):
      if isinstance(v, Arr):
        sub.assign_arr(arg.arg, Arr(p, v.dtype, v.shape, False))
      else:
        sub.assign(arg.arg, p, dt)
    sub.block(node.body)
    main.effects |= sub.effects  # (a store through an operand: no run-time np.empty after it)
    if not sub.b.block.is_terminated or sub.ret_dtype is None:
      raise Refused(f"lite: {name} does not end with a return")
    sub.alloca_b.branch(body)
    return fn, sub.ret_dtype


_RAISE = "_lite_runtime_error"


class _RuntimeErrors(ast.NodeTransformer):
  """``raise RuntimeError(...)`` (the prologues' missing addresses) as a
  call statement of ``_RAISE`` (``Headers.runtime_error``)."""

  def visit_Raise(self, node):
    exc = node.exc
    if (isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name) and exc.func.id == "RuntimeError"
        and node.cause is None):
      call = ast.Call(func=ast.Name(id=_RAISE, ctx=ast.Load()), args=[], keywords=[])
      return ast.copy_location(ast.Expr(value=call), node)
    return node


_helper_classes: dict = {}


def _helper_class(base):
  """``base`` (lite's Translator) with the rules of a helper's body."""
  cls = _helper_classes.get(base)
  if cls is None:
    cls = _helper_classes[base] = type("HelperTranslator", (_Helper, base), {})
  return cls


class _Helper:
  """A helper's body: ``return x`` of one type throughout (numba would
  unify several), no buffers of its own, no raise."""

  def s_Return(self, s):
    if s.value is None:
      raise Refused("lite: a helper without a result")
    val, dt = self.scalar(s.value)
    if self.ret_dtype is None:
      self.ret_dtype = dt
    elif self.ret_dtype != dt:
      raise Refused("lite: a helper returning two types")
    self.b.store(val, self.b.bitcast(self.ret_ptr, lltype(dt).as_pointer()))
    self.b.ret_void()

  def s_Raise(self, s):
    raise Refused("lite: a raise in a helper")

  def empty(self, call):
    raise Refused("lite: np.empty in a helper")

  def copy(self, arr):
    raise Refused("lite: .copy() in a helper")
