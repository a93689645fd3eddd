"""float32 ``exp``, ``log``, ``tanh`` (and ``exp2``/``log2``, XLA's expansions
around them) in a compiled loop, with the NumPy path's bits: the NumPy
rules compute XLA's own formulas, written in LLVM IR by
``primitives/xla_math.py`` and compiled by ``primitives/libm.py`` into
vectorised loops. An array (``VECTOR_MIN`` elements or more) goes through
that very loop, called by its address (``libm.address``, handed over in the
status array: ``blas_calls``); a smaller one, or one whose operand the open
elementwise loop computes (``in_open_loop``: the formula then runs in that
loop, which LLVM inlines and vectorizes as libm's, with no pass over a
buffer between them), calls the same IR per element, linked into the loop's
library (``aot_worker`` links it, ``codegen.Gen.external`` names it): one
formula, the same roundings and FMAs (``llvm.fma.f32`` is the exactly
rounded FMA on every CPU). exp is the
generation the installed XLA computes (``formula``). Other dtypes (float64:
NumPy's own SIMD functions) and the other transcendentals are refused
(``refusals``).
"""
from __future__ import annotations

import math
import re

import numpy as np

from pallas_np.native import blas_calls, elementwise, loop_fusion
from pallas_np.native.codegen import Refused, Val, dtype_of, register
from pallas_np.primitives import libm, xla_math

# Elements from which an array's exp/log/tanh calls the NumPy rule's own
# vectorised loop (one call) rather than the formula per element.
VECTOR_MIN = 64
# primitive name -> the libm.DEFINED function its float32 NumPy rule calls
FORMULAS = {"exp": "xla_expf", "log": "xla_logf", "tanh": "xla_tanhf"}
# The intrinsics the formulas call, declared in their module.
INTRINSICS = {
    "llvm.fma.f32": "declare float @llvm.fma.f32(float, float, float)",
    "llvm.floor.f32": "declare float @llvm.floor.f32(float)",
    "llvm.fabs.f32": "declare float @llvm.fabs.f32(float)",
    "llvm.copysign.f32": "declare float @llvm.copysign.f32(float, float)",
}


def formula(name: str) -> str:
  """The libm function the float32 NumPy rule of ``name`` runs: for exp,
  the generation of XLA's formula the installed XLA computes
  (``xla_math.exp_generation``: JAX 0.10's clamped one, or the newer split
  scaling)."""
  if name == "exp" and xla_math.exp_generation() == "split":
    return "xla_expf_split"
  return FORMULAS[name]


def ir_of(symbol: str) -> str:
  """``symbol``'s IR as a module of its own: its intrinsics declared, and
  visible to the loop's module (libm defines it ``internal``; here it is
  ``weak_odr``: one copy however many loops call it)."""
  defined = libm.DEFINED.get(symbol)
  if defined is None or defined[0] != 1:
    raise Refused(f"{symbol}: no IR formula")
  ir = defined[1].replace(f"define internal float @{symbol}(",
                          f"define weak_odr float @{symbol}(", 1)
  if f"define weak_odr float @{symbol}(" not in ir:
    raise Refused(f"{symbol}: unexpected IR")
  called = set(re.findall(r"@(llvm\.[\w.]+)", ir))
  if not called <= set(INTRINSICS):
    raise Refused(f"{symbol}: calls {sorted(called - set(INTRINSICS))}")
  return "\n".join([*(INTRINSICS[k] for k in sorted(called)), ir])


def _formula(gen, eqn, ins):
  name = eqn.primitive.name
  if dtype_of(eqn.outvars[0].aval) != np.float32 or any(v.dtype != np.float32 for v in ins):
    raise Refused(f"{name} of a non-float32 (only float32 follows an IR formula)")
  if eqn.params.get("accuracy") is not None:
    raise Refused(f"{name} with an accuracy")
  symbol = formula(name)
  shape = tuple(eqn.outvars[0].aval.shape)
  if (math.prod(shape) >= VECTOR_MIN and ins[0].kind == "a" and ins[0].shape == shape
      and not in_open_loop(gen, ins[0])):
    return [vector_call(gen, symbol, ins[0])]
  fn = gen.external(symbol, ir_of(symbol))
  return elementwise.emit_elementwise(
      gen, eqn, ins, make=lambda dts, out, params: (lambda a: f"{fn}({a})"))


def in_open_loop(gen, x: Val) -> bool:
  """Whether the open elementwise loop computes (or loads) ``x``'s element
  (the formula per element then joins it: ``loop_fusion``)."""
  loop = gen.fuse
  return (isinstance(loop, loop_fusion.Loop) and loop.end == len(gen.lines)
          and loop.depth == gen.depth and x.name in loop.locals)


def _loop_address(gen, symbol: str) -> str:
  """The local holding the address of the NumPy rule's loop of ``symbol``
  (read at the entry from the status array ``blas_calls.status`` fills)."""
  gen.headers.setdefault("cblas", blas_calls.header(blas_calls.header_bits()))
  local = f"_fp_{symbol}"
  if local not in gen.headers:
    gen.headers[local] = ""
    slot = blas_calls.loop_slot(symbol)
    gen.prologue.append(f"    if _st.shape[0] <= {slot} or _st[{slot}] == 0: "
                        "raise RuntimeError('pallas_np native loop: no loop addresses')")
    gen.prologue.append(f"    {local} = _st[{slot}]")
  return local


def vector_call(gen, symbol: str, x: Val) -> Val:
  """``symbol`` over the float32 array ``x`` by the NumPy rule's own loop
  (``libm.address``: vectorised, the same code, the same bits); the
  per-element call of the linked IR does not vectorise."""
  fp = _loop_address(gen, symbol)
  out = gen.array(x.shape, np.dtype(np.float32))
  gen.emit(f"_cblas_loop1({fp}, np.int64({x.name}.ctypes.data), "
           f"np.int64({out.name}.ctypes.data), np.int64({x.size}))")
  return out


register(*FORMULAS)(_formula)

# XLA's expansions the NumPy rules follow (primitives/xla_math.py):
# exp2(x) = exp(x * ln 2), log2(x) = log(x) * (1 / ln 2), the product
# rounded to float32 — the constant itself a float32.
_LN2 = float(np.float32(np.log(2.0)))
_LOG2_E = float(np.float32(1.4426950408889634))


EXPANDED = ("exp2", "log2")


@register(*EXPANDED)
def _expanded(gen, eqn, ins):
  name = eqn.primitive.name
  if dtype_of(eqn.outvars[0].aval) != np.float32 or any(v.dtype != np.float32 for v in ins):
    raise Refused(f"{name} of a non-float32 (only float32 follows an IR formula)")
  if eqn.params.get("accuracy") is not None:
    raise Refused(f"{name} with an accuracy")
  symbol = formula("exp" if name == "exp2" else "log")
  k = gen.constant(_LN2 if name == "exp2" else _LOG2_E, np.dtype(np.float32))
  shape = tuple(eqn.outvars[0].aval.shape)
  if (math.prod(shape) >= VECTOR_MIN and ins[0].kind == "a" and ins[0].shape == shape
      and not in_open_loop(gen, ins[0])):
    f32 = np.dtype(np.float32)
    mul = lambda a, b: f"np.float32({a} * {b})"  # noqa: E731
    if name == "exp2":
      arg = gen.array(shape, f32)
      gen.elementwise(arg, mul, [ins[0], k])
      return [vector_call(gen, symbol, arg)]
    out = gen.array(shape, f32)
    gen.elementwise(out, mul, [vector_call(gen, symbol, ins[0]), k])
    return [out]
  fn = gen.external(symbol, ir_of(symbol))
  k = k.name
  expr = ((lambda a: f"{fn}(np.float32({a} * {k}))") if name == "exp2"
          else (lambda a: f"np.float32({fn}({a}) * {k})"))
  return elementwise.emit_elementwise(gen, eqn, ins, make=lambda dts, out, params: expr)
