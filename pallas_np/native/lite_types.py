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

import numpy as np

BOOL = np.dtype(np.bool_)
I64 = np.dtype(np.int64)
U64 = np.dtype(np.uint64)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
# Integers numba converts to float32 safely (a float32 with any other
# integer is computed in float64).
_F32_SAFE = frozenset(np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.uint8, np.float32))
# ... and in a unification (``a if c else b``, ``min``/``max``): uint16 too.
_F32_UNIFY = _F32_SAFE | {np.dtype(np.uint16)}


def is_int(dt: np.dtype) -> bool:
  return dt.kind in "iu"


def _float_pair(a: np.dtype, b: np.dtype) -> np.dtype:
  """The float type numba computes ``a op b`` in, one of them a float."""
  if F64 in (a, b):
    return F64
  other = b if a == F32 else a
  return F32 if other in _F32_SAFE else F64


def arith(a: np.dtype, b: np.dtype) -> np.dtype | None:
  """Type of ``a + b`` (``-``, ``*``, ``//``, ``%``): both operands are
  converted to it first."""
  if a.kind == "f" or b.kind == "f":
    return _float_pair(a, b)
  signed = a.kind in "ib" or b.kind in "ib"
  return I64 if signed else U64


def bitwise(a: np.dtype, b: np.dtype) -> np.dtype | None:
  """Type of ``a & b`` (``|``, ``^``)."""
  if a.kind == "f" or b.kind == "f":
    return None
  if a == BOOL and b == BOOL:
    return BOOL
  return arith(a, b)


def shift(a: np.dtype, b: np.dtype) -> np.dtype | None:
  """Type of ``a << b`` and ``a >> b`` (both operands converted to it;
  ``>>`` is arithmetic where it is signed)."""
  if a.kind == "f" or b.kind == "f":
    return None
  return U64 if a.kind == "u" else I64


def unify(a: np.dtype, b: np.dtype) -> np.dtype | None:
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
  return np.dtype(f"int{u.itemsize * 16}")


def compare(a: np.dtype, b: np.dtype) -> np.dtype | None:
  """The type both operands of ``a < b`` (``==`` ...) are converted to."""
  if a.kind == "f" or b.kind == "f":
    return _float_pair(a, b)
  return unify(a, b)


def negate(a: np.dtype) -> np.dtype:
  """Type of ``-a`` and ``~a`` (``~`` of a bool is a bool)."""
  if a.kind == "f":
    return a
  return U64 if a.kind == "u" else I64
