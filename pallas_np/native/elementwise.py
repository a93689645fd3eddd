"""Elementwise primitives in a compiled loop: one scalar expression per
primitive, cast to the result dtype at once (numba computes int32 in
int64, so every result wraps exactly where XLA's does), mirroring the NumPy
rules in ``pallas_np/primitives/elementwise.py`` and ``casts.py`` bit for
bit: XLA's truncating integer division and remainder (x/0 = -1 or all
ones, x%0 = x, INT_MIN/-1 = INT_MIN), over-wide and negative shifts, NaN
propagation and -0.0 < +0.0 in max/min, XLA's sign (either zero kept), a
float32/float16 division by a constant as XLA's multiplication by its
reciprocal, float->int saturation (NaN -> 0), float32->bool reading
denormals as zero.

Not here: float32 ``exp``/``log``/``tanh`` (``transcendental``); refused
(the loop stays on NumPy): the other transcendentals, low-precision
floats, float ``clamp``, ``round`` (``refusals``).
"""
from __future__ import annotations

import numpy as np

from pallas_np.native import shapes
from pallas_np.native.codegen import Refused, Val, dtype_of, np_name, register
from pallas_np.primitives.elementwise import RECIPROCAL_DTYPES, float_reciprocal

# name -> make(in dtypes, out dtype, params) -> expr(*operand exprs)
SCALAR: dict = {}


def scalar_op(*names):
  def deco(fn):
    for n in names:
      SCALAR[n] = fn
    return fn
  return deco


def _cast(dt):
  t = np_name(dt)
  return lambda e: f"{t}({e})"


def _binary(op):
  def make(dts, out, params):
    dt = dts[0]
    if dt == np.bool_:
      raise Refused(f"bool {op}")
    c = _cast(out)
    return lambda a, b: c(f"{a} {op} {b}")
  return make


scalar_op("add", "add_any")(_binary("+"))
scalar_op("sub")(_binary("-"))
scalar_op("mul")(_binary("*"))


def _bitwise_maker(name):
  op = {"and": "&", "or": "|", "xor": "^"}[name]

  def make(dts, out, params):
    if out == np.bool_:
      if name == "xor":
        return lambda a, b: f"({a} != {b})"
      return lambda a, b: f"({a} {op} {b})"
    c = _cast(out)
    return lambda a, b: c(f"{a} {op} {b}")
  return make


for _n in ("and", "or", "xor"):
  SCALAR[_n] = _bitwise_maker(_n)


@scalar_op("not")
def _not(dts, out, params):
  if out == np.bool_:
    return lambda a: f"(not {a})"
  c = _cast(out)
  return lambda a: c(f"~{a}")


def _compare(op):
  return lambda dts, out, params: (lambda a, b: f"({a} {op} {b})")


for _n, _op in (("eq", "=="), ("ne", "!="), ("lt", "<"), ("le", "<="), ("gt", ">"),
                ("ge", ">=")):
  SCALAR[_n] = _compare(_op)


@scalar_op("neg")
def _neg(dts, out, params):
  if out == np.bool_:
    raise Refused("bool neg")
  c = _cast(out)
  return lambda a: c(f"-{a}")


def _minmax_maker(is_max):
  def make(dts, out, params):
    c = _cast(out)
    gt = ">" if is_max else "<"
    if out == np.bool_:
      return lambda a, b: f"({a} {'|' if is_max else '&'} {b})"
    if out.kind in "iu":
      return lambda a, b: c(f"{a} if {a} {gt} {b} else {b}")
    # np.maximum: the first NaN operand (a if it is NaN or wins, else b,
    # NaN or not); XLA's zeros: +0 > -0 (a sum of two zeros is the max,
    # the negated sum of negations the min). Two selects on bitwise-combined
    # conditions: a chain of branches keeps LLVM from vectorizing the loop.
    tie = (lambda a, b: f"{a} + {b}") if is_max else (lambda a, b: f"-((-{a}) + (-{b}))")
    return lambda a, b: (f"({tie(a, b)} if ({a} == {b}) & ({a} == 0) else "
                         f"({a} if ({a} {gt} {b}) | ({a} != {a}) else {b}))")
  return make


SCALAR["max"], SCALAR["min"] = _minmax_maker(True), _minmax_maker(False)


@scalar_op("abs")
def _abs(dts, out, params):
  c = _cast(out)
  if out.kind == "u":
    return lambda a: a
  if out.kind == "i":
    return lambda a: c(f"{a} if {a} >= 0 else -{a}")
  if out.kind == "f":
    return lambda a: c(f"abs({a})")
  raise Refused("abs")


@scalar_op("sign")
def _sign(dts, out, params):
  c = _cast(out)
  if out.kind == "u":
    return lambda a: c(f"1 if {a} != 0 else 0")
  if out.kind == "i":
    return lambda a: c(f"1 if {a} > 0 else (-1 if {a} < 0 else 0)")
  if out.kind == "f":  # NaN and either zero are kept (XLA's sign)
    return lambda a: c(f"{a} if (({a} != {a}) | ({a} == 0)) else (1.0 if {a} > 0 else -1.0)")
  raise Refused("sign")


@scalar_op("div")
def _div(dts, out, params):
  c = _cast(out)
  if out.kind == "f":
    return lambda a, b: c(f"{a} / {b}")
  if out.kind == "u":
    top = int(np.iinfo(out).max)
    return lambda a, b: c(f"{top} if {b} == 0 else {a} // {b}")
  if out.kind == "i":  # truncation (_sdiv); x/0 = -1; INT_MIN/-1 wraps to INT_MIN
    return lambda a, b: c(f"-1 if {b} == 0 else (-np.int64({a}) if {b} == -1 else _sdiv({a}, {b}))")
  raise Refused("bool div")


@scalar_op("rem")
def _rem(dts, out, params):
  c = _cast(out)
  if out.kind == "f":
    return lambda a, b: c(f"np.fmod({a}, {b})")
  if out.kind == "u":
    return lambda a, b: c(f"{a} if {b} == 0 else {a} % {b}")
  if out.kind == "i":  # the dividend's sign (_srem); x%0 = x; x%-1 = 0
    return lambda a, b: c(f"{a} if {b} == 0 else (0 if {b} == -1 else _srem({a}, {b}))")
  raise Refused("bool rem")


def _const_divisor(make, name):
  """``div``/``rem`` of signed integers by a constant other than 0 and -1:
  LLVM's truncating ``sdiv``/``srem`` alone (``_sdiv``/``_srem``), which it
  turns into multiplications and shifts and vectorizes; the guards for the
  other divisors are not written at all."""
  fn = "_sdiv" if name == "div" else "_srem"
  return lambda dts, out, params: (lambda a, b: f"{fn}({a}, {b})")


def _py_sdiv(a, b):
  """``_sdiv`` on NumPy integer scalars (constant folding): truncation."""
  q = abs(int(a)) // abs(int(b))
  return type(a)(q if (a < 0) == (b < 0) else -q)


def _py_srem(a, b):
  """``_srem`` on NumPy integer scalars: the dividend's sign."""
  r = abs(int(a)) % abs(int(b))
  return type(a)(-r if a < 0 else r)


def _int_types(dt):
  bits = dt.itemsize * 8
  return bits, f"np.uint{bits}", f"np.int{bits}"


def _shift_in_range(out, bits):
  """The condition that a shift amount is below the width (XLA shifts a
  wider or negative amount out completely)."""
  if out.kind == "i":
    return lambda s: f"((0 <= {s}) & ({s} < {bits}))"  # (bitwise: a chained test branches)
  return lambda s: f"({s} < {bits})"


@scalar_op("shift_left")
def _shift_left(dts, out, params):
  if out.kind not in "iu":
    raise Refused("shift of a non-integer")
  bits, _, _ = _int_types(out)
  c = _cast(out)
  ok = _shift_in_range(out, bits)
  # (the 0 of the result's type: numba unifies a uint64 with an int literal into float64)
  zero = f"np.{out.name}(0)"
  return lambda a, s: c(f"(np.int64({a}) << np.int64({s})) if {ok(s)} else 0") if out.itemsize < 8 \
      else c(f"({a} << {s}) if {ok(s)} else {zero}")


@scalar_op("shift_right_logical")
def _shift_right_logical(dts, out, params):
  if out.kind not in "iu":
    raise Refused("shift of a non-integer")
  bits, u, _ = _int_types(out)
  c = _cast(out)
  ok = _shift_in_range(out, bits)
  return lambda a, s: c(f"({u}({a}) >> {u}({s})) if {ok(s)} else {u}(0)")  # (see shift_left)


@scalar_op("shift_right_arithmetic")
def _shift_right_arithmetic(dts, out, params):
  if out.kind not in "iu":
    raise Refused("shift of a non-integer")
  bits, _, sg = _int_types(out)
  c = _cast(out)
  ok = _shift_in_range(out, bits)
  return lambda a, s: c(f"{sg}({a}) >> ({sg}({s}) if {ok(s)} else {sg}({bits - 1}))")


@scalar_op("select_n")
def _select_n(dts, out, params):
  if len(dts) != 3:
    raise Refused("select_n of more than two cases")
  p = "{}" if dts[0] == np.bool_ else "({} != 0)"
  return lambda pred, c0, c1: f"({c1} if {p.format(pred)} else {c0})"


@scalar_op("clamp")
def _clamp(dts, out, params):
  if out.kind not in "iu":
    raise Refused("float clamp")  # np.maximum's choice between zeros is NumPy's
  c = _cast(out)
  return lambda lo, x, hi: c(f"min(max({x}, {lo}), {hi})")


@scalar_op("is_finite")
def _is_finite(dts, out, params):
  return lambda a: f"(({a} - {a}) == 0)"


def _float_unary(fn):
  def make(dts, out, params):
    if out.kind != "f":
      raise Refused(fn)
    c = _cast(out)
    return lambda a: c(f"np.{fn}({a})")
  return make


# IEEE-exact (correctly rounded: double rounding to float32 is innocuous)
SCALAR["sqrt"] = _float_unary("sqrt")
SCALAR["floor"] = _float_unary("floor")
SCALAR["ceil"] = _float_unary("ceil")


@scalar_op("rsqrt")
def _rsqrt(dts, out, params):
  """The NumPy rule's ``reciprocal(sqrt(x))``: two correctly rounded ops."""
  if out.kind != "f":
    raise Refused("rsqrt")
  c = _cast(out)
  return lambda a: c(f"1.0 / {c(f'np.sqrt({a})')}")


@scalar_op("square")
def _square(dts, out, params):
  if out == np.bool_:
    raise Refused("bool square")
  c = _cast(out)
  return lambda a: c(f"{a} * {a}")


@scalar_op("convert_element_type")
def _convert(dts, out, params):
  src = dts[0]
  c = _cast(out)
  if src == out:
    return lambda a: a
  if out == np.bool_:
    if src == np.float32:  # DAZ: a denormal reads as zero; NaN is True
      tiny = float(np.finfo(np.float32).tiny)
      return lambda a: f"(not (abs({a}) < np.float32({tiny!r})))"
    return lambda a: f"({a} != 0)"
  if src == np.bool_:
    return lambda a: c(f"1 if {a} else 0")
  if src.kind in "iu" and out.kind in "iu":
    return lambda a: c(a)  # wraps
  if out.kind == "f":
    return lambda a: c(a)  # one rounding (int->float, f64->f32) or exact
  # float -> int: truncate, NaN -> 0, saturate at the range
  info = np.iinfo(out)
  lo, hi = float(info.min), float(info.max)
  top = 2.0 ** (out.itemsize * 8 - (1 if out.kind == "i" else 0))
  bound = lambda v: float(np.asarray(np.asarray(v, np.float64).astype(src)).astype(np.float64))
  if bound(hi) < hi or bound(lo) > lo:
    raise Refused("float->int bound inside the range")  # (float16 & co. only)
  big = f"np.{out.name}({int(info.max)})"
  zero = c("0")
  return lambda a: (f"({zero} if {a} != {a} else ({big} if np.float64({a}) >= {top!r} else "
                    + c(f"min(max(np.trunc(np.float64({a})), {lo!r}), {hi!r})") + "))")


def emit_elementwise(gen, eqn, ins, make=None):
  """An elementwise eqn: ``make`` (the primitive's ``SCALAR`` entry by
  default) builds the scalar expression."""
  name = eqn.primitive.name
  make = make or SCALAR[name]
  out_aval = eqn.outvars[0].aval
  out_dt = dtype_of(out_aval)
  shape = tuple(out_aval.shape)
  params = eqn.params
  if name == "convert_element_type" and np.dtype(params["new_dtype"]) != out_dt:
    raise Refused("convert_element_type")
  if name == "div" and out_dt in RECIPROCAL_DTYPES and ins[1].glob and not ins[0].glob:
    # x / constant is x * (1 / constant) in XLA (primitives/elementwise.py)
    recip = float_reciprocal(np.reshape(gen.globals[ins[1].name], ins[1].shape), out_dt)
    ins = [ins[0], gen.constant(recip, out_dt)]
    make = SCALAR["mul"]
  if (name in ("div", "rem") and out_dt.kind == "i" and ins[1].glob and ins[1].kind == "s"
      and int(gen.globals[ins[1].name]) not in (0, -1)):
    make = _const_divisor(make, name)
  expr = make([v.dtype for v in ins], out_dt, params)
  if any(v.kind == "r" for v in ins):
    raise Refused(f"{name} of a ref")
  ins = [shapes.broadcast_to(gen, v, shape) if v.kind == "a" and v.shape != shape else v
         for v in ins]
  if not shape:
    text = expr(*[v.name for v in ins])
    if all(v.glob for v in ins):  # constants only: folded (index arithmetic)
      return [gen.constant(_fold(text, gen.globals), out_dt)]
    out = Val(gen.fresh(), (), out_dt, "s")
    gen.scalar_line(f"{out.name} = {text}")
    return [out]
  out = gen.array(shape, out_dt)
  gen.elementwise(out, expr, ins)
  return [out]


def _fold(text, constants):
  """A scalar expression on constants, evaluated with NumPy scalars (the
  expressions cast every result, so NumPy's scalar rules give numba's
  bits)."""
  with np.errstate(all="ignore"):
    return eval(text, {"np": np, "_sdiv": _py_sdiv, "_srem": _py_srem, **constants})  # noqa: S307 - our own expression


emit_elementwise.lazy_ok = "reads"  # (codegen.Gen.run_jaxpr, shapes.ref_in_place)
register(*SCALAR)(emit_elementwise)
