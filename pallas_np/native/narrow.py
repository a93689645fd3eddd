"""bfloat16 conversions in a compiled loop, with the NumPy rule's bits
(``primitives/casts.py``: ``astype`` through ml_dtypes).

A bfloat16 value is held in float32, exactly (its bits shifted up by 16:
``codegen.NARROW``), between the conversions emitted here and the dots
that read it (``dots``: bfloat16 operands are multiplied in float64, as
the NumPy rule does). TPU library kernels (JAX's paged attention) cast
their float32 blocks to bfloat16 right before an MXU dot; nothing else
may touch such a value (``codegen.NARROW_OK``).

float32 -> bfloat16 rounds to nearest even on the bits; a NaN becomes
the quiet NaN of its sign (``0x7fc0``/``0xffc0``), as ml_dtypes converts
it. ``_rounding_matches`` checks that rule against the installed
ml_dtypes on probe values (payload NaNs, signalling NaNs, ties, the
denormals, the overflow to infinity); where it differs, conversions to
bfloat16 are refused.
"""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np.dtypes import np_dtype
from pallas_np.native import codegen
from pallas_np.native.codegen import NARROW, Refused

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
# float32 bit patterns whose bfloat16 rounding the rule must give.
PROBES = (0x7FC00001, 0x7F800001, 0xFFC12345, 0x7FA00000, 0xFF800001, 0x00000001, 0x00017FFF,
          0x00018000, 0x00008000, 0x80008000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x3F808000,
          0x3F818000, 0x3F807FFF, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x3F800000)


def round_bits(u: int) -> int:
  """float32 bits ``u`` -> the float32 bits of its bfloat16 rounding (the
  rule the generated code applies)."""
  if (u & 0x7FFFFFFF) > 0x7F800000:
    return (u & 0x80000000) | 0x7FC00000
  return (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000


def _rounding_matches() -> bool:
  bits = np.array(PROBES, np.uint32)
  with np.errstate(invalid="ignore"):
    got = bits.view(F32).astype(NARROW).astype(F32).view(np.uint32)
  return all(int(g) == round_bits(int(u)) for g, u in zip(got, bits))


_MATCHES = []  # [bool] once probed


def _to_bf16(gen, x):
  if not _MATCHES:
    _MATCHES.append(_rounding_matches())
  if not _MATCHES[0]:
    raise Refused("float32 -> bfloat16: the installed ml_dtypes rounds otherwise")
  if x.kind != "a":
    raise Refused("a scalar float32 -> bfloat16")
  out = gen.array(x.shape, F32)
  ub, ob, b = gen.fresh("u"), gen.fresh("u"), gen.fresh("b")
  gen.emit(f"{ub} = {x.name}.view(np.uint32)")
  gen.emit(f"{ob} = {out.name}.view(np.uint32)")
  with gen.block(f"for _i in range({x.size}):"):
    gen.emit(f"{b} = np.uint64({ub}[_i])")
    with gen.block(f"if ({b} & 0x7FFFFFFF) > 0x7F800000:"):
      gen.emit(f"{ob}[_i] = np.uint32(({b} & 0x80000000) | 0x7FC00000)")
    with gen.block("else:"):
      gen.emit(f"{ob}[_i] = np.uint32(({b} + 0x7FFF + (({b} >> 16) & 1)) & 0xFFFF0000)")
  gen.fuse = None
  return out


def convert(gen, eqn, ins):
  """``convert_element_type`` from or to bfloat16."""
  src = np_dtype(jc.physical_dtype(eqn.invars[0].aval.dtype))
  dst = np_dtype(eqn.params["new_dtype"])
  x = ins[0]
  if src == NARROW and dst in (NARROW, F32):
    return [x]  # (the float32 it is held in)
  if src == NARROW and dst == F64:
    if x.kind == "s":
      return [gen.scalar(f"np.float64({x.name})", F64)]
    out = gen.array(x.shape, F64)
    gen.elementwise(out, lambda a: f"np.float64({a})", [x])
    return [out]
  if src == F32 and dst == NARROW:
    return [_to_bf16(gen, x)]
  raise Refused(f"convert_element_type {src} -> {dst}")


codegen.narrow_convert.append(convert)
