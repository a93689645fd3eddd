"""numba's typing of the scalar operations the generated loop source uses,
for ``lite`` (the in-process compiler of that source, docs/native.md).

The loop source (``codegen``) is written for numba: its meaning is
numba's typing (NBEP 1: integer arithmetic in 64 bits, int literals int64,
float literals float64, a float32 with a wide integer computed in float64,
unification of the two sides of ``a if c else b``). These functions give
numba's result and operand types for a pair of dtypes, as numba's typing
context resolves them (numba 0.68; ``tests/test_native_lite_types.py``
checks every pair against numba's own resolver). ``None``: numba has no
such operation (lite refuses it).
"""
from __future__ import annotations

from pallas_np.native.lite_dtype import DType, dtype

BOOL = dtype("bool")
I64 = dtype("int64")
U64 = dtype("uint64")
F32 = dtype("float32")
F64 = dtype("float64")
# Integers numba converts to float32 safely (a float32 with any other
# integer is computed in float64).
_F32_SAFE = frozenset(dtype(t) for t in ("bool", "int8", "int16", "uint8", "float32"))
# ... and in a unification (``a if c else b``, ``min``/``max``): uint16 too.
_F32_UNIFY = _F32_SAFE | {dtype("uint16")}


def is_int(dt: DType) -> bool:
  return dt.kind in "iu"


def _float_pair(a: DType, b: DType) -> DType:
  """The float type numba computes ``a op b`` in, one of them a float."""
  if F64 in (a, b):
    return F64
  other = b if a == F32 else a
  return F32 if other in _F32_SAFE else F64


def arith(a: DType, b: DType) -> DType | None:
  """Type of ``a + b`` (``-``, ``*``, ``//``, ``%``): both operands are
  converted to it first."""
  if a.kind == "f" or b.kind == "f":
    return _float_pair(a, b)
  signed = a.kind in "ib" or b.kind in "ib"
  return I64 if signed else U64


def bitwise(a: DType, b: DType) -> DType | None:
  """Type of ``a & b`` (``|``, ``^``)."""
  if a.kind == "f" or b.kind == "f":
    return None
  if a == BOOL and b == BOOL:
    return BOOL
  return arith(a, b)


def shift(a: DType, b: DType) -> DType | None:
  """Type of ``a << b`` and ``a >> b`` (both operands converted to it;
  ``>>`` is arithmetic where it is signed)."""
  if a.kind == "f" or b.kind == "f":
    return None
  return U64 if a.kind == "u" else I64


def unify(a: DType, b: DType) -> DType | None:
  """The type numba gives a value that is ``a`` on one path and ``b`` on
  another."""
  if a == b:
    return a
  if a == BOOL:
    return b
  if b == BOOL:
    return a
  if a.kind == "f" or b.kind == "f":
    if F64 in (a, b):
      return F64
    other = b if a == F32 else a
    return F32 if other in _F32_UNIFY else F64
  if a.kind == b.kind:
    return a if a.itemsize >= b.itemsize else b
  s, u = (a, b) if a.kind == "i" else (b, a)
  if u.itemsize < s.itemsize:
    return s
  if u.itemsize == 8:
    return F64
  return dtype(f"int{u.itemsize * 16}")


def compare(a: DType, b: DType) -> DType | None:
  """The type both operands of ``a < b`` (``==`` ...) are converted to."""
  if a.kind == "f" or b.kind == "f":
    return _float_pair(a, b)
  return unify(a, b)


def negate(a: DType) -> DType:
  """Type of ``-a`` and ``~a`` (``~`` of a bool is a bool)."""
  if a.kind == "f":
    return a
  return U64 if a.kind == "u" else I64
