"""float32 ``exp``, ``log`` and ``tanh`` in a compiled loop, with the NumPy
path's bits: the NumPy rules compute XLA's own formulas, written in LLVM IR
by ``primitives/xla_math.py`` and compiled by ``primitives/libm.py``; the
generated code calls the same IR, linked into the loop's library
(``aot_worker`` links it, ``codegen.Gen.external`` names it), so both
paths run one formula with the same roundings and FMAs (``llvm.fma.f32``
is the exactly rounded FMA on every CPU). Other dtypes (float64: NumPy's
own SIMD functions) and the other transcendentals are refused
(``refusals``).
"""
from __future__ import annotations

import re

import numpy as np

from pallas_np.native import elementwise
from pallas_np.native.codegen import Refused, dtype_of, register
from pallas_np.primitives import libm

# primitive name -> the libm.DEFINED function its float32 NumPy rule calls
FORMULAS = {"exp": "xla_expf", "log": "xla_logf", "tanh": "xla_tanhf"}
# The intrinsics the formulas call, declared in their module.
INTRINSICS = {
    "llvm.fma.f32": "declare float @llvm.fma.f32(float, float, float)",
    "llvm.floor.f32": "declare float @llvm.floor.f32(float)",
    "llvm.fabs.f32": "declare float @llvm.fabs.f32(float)",
    "llvm.copysign.f32": "declare float @llvm.copysign.f32(float, float)",
}


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
  symbol = FORMULAS[name]
  fn = gen.external(symbol, ir_of(symbol))
  return elementwise.emit_elementwise(
      gen, eqn, ins, make=lambda dts, out, params: (lambda a: f"{fn}({a})"))


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
  symbol = FORMULAS["exp" if name == "exp2" else "log"]
  fn = gen.external(symbol, ir_of(symbol))
  k = gen.constant(_LN2 if name == "exp2" else _LOG2_E, np.dtype(np.float32)).name
  expr = ((lambda a: f"{fn}(np.float32({a} * {k}))") if name == "exp2"
          else (lambda a: f"np.float32({fn}({a}) * {k})"))
  return elementwise.emit_elementwise(gen, eqn, ins, make=lambda dts, out, params: expr)
