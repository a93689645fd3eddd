"""lite's typing rules (``native/lite_types.py``) against numba's own
typing context, for every pair of the dtypes the generated code holds: a
rule that differs from numba's would give the lite build other bits than
the numba build of the same source."""
import itertools
import operator

import numpy as np
import pytest

from pallas_np.native import lite_dtype
from pallas_np.native import lite_types as lt

numba = pytest.importorskip("numba")
from numba.core import types as nbt  # noqa: E402

# (lite's own dtypes: lite_dtype, as the compile process, which imports no NumPy, holds them)
DTYPES = [lite_dtype.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8,
                                        np.uint16, np.uint32, np.uint64, np.float32, np.float64)]


@pytest.fixture(scope="module")
def ctx():
  c = numba.core.registry.cpu_target.typing_context
  c.refresh()
  return c


def _nb(dt):
  return numba.from_dtype(np.dtype(dt.name))


def _np(t):
  return None if t is None else lite_dtype.dtype(str(t))


def _resolve(ctx, op, a, b):
  try:
    sig = ctx.resolve_function_type(op, (_nb(a), _nb(b)), {})
  except Exception:  # noqa: BLE001 - numba has no such operation
    return None
  return sig


PAIRS = list(itertools.product(DTYPES, DTYPES))


@pytest.mark.parametrize("op", [operator.add, operator.sub, operator.mul, operator.floordiv,
                                operator.mod])
def test_arith_is_numbas(ctx, op):
  for a, b in PAIRS:
    sig = _resolve(ctx, op, a, b)
    assert sig is not None
    assert _np(sig.return_type) == lt.arith(a, b), (op, a, b)


@pytest.mark.parametrize("op", [operator.and_, operator.or_, operator.xor])
def test_bitwise_is_numbas(ctx, op):
  for a, b in PAIRS:
    sig = _resolve(ctx, op, a, b)
    assert _np(sig and sig.return_type) == lt.bitwise(a, b), (op, a, b)


@pytest.mark.parametrize("op", [operator.lshift, operator.rshift])
def test_shift_is_numbas(ctx, op):
  for a, b in PAIRS:
    sig = _resolve(ctx, op, a, b)
    assert _np(sig and sig.return_type) == lt.shift(a, b), (op, a, b)


@pytest.mark.parametrize("op", [operator.lt, operator.eq, operator.ne, operator.ge])
def test_compare_operands_are_numbas(ctx, op):
  for a, b in PAIRS:
    sig = _resolve(ctx, op, a, b)
    assert sig.args[0] == sig.args[1]
    assert _np(sig.args[0]) == lt.compare(a, b), (op, a, b)


def test_unify_is_numbas(ctx):
  for a, b in PAIRS:
    assert _np(ctx.unify_types(_nb(a), _nb(b))) == lt.unify(a, b), (a, b)


def test_negate_is_numbas(ctx):
  for a in DTYPES:
    sig = ctx.resolve_function_type(operator.neg, (_nb(a),), {})
    assert _np(sig.return_type) == lt.negate(a), a
    if a is not lt.BOOL and a.kind != "f":
      sig = ctx.resolve_function_type(operator.invert, (_nb(a),), {})
      assert _np(sig.return_type) == lt.negate(a), a


def test_int_literal_is_int64(ctx):
  """The rules take an int literal as int64 (numba's Literal[int]
  resolves as int64): ``x + 1`` of a uint32 is int64, ``x < 1`` of a
  uint64 compares in float64."""
  lit = nbt.literal(1)
  for a in DTYPES:
    sig = ctx.resolve_function_type(operator.add, (_nb(a), lit), {})
    assert _np(sig.return_type) == lt.arith(a, lt.I64), a
    sig = ctx.resolve_function_type(operator.lt, (_nb(a), lit), {})
    assert _np(sig.args[0]) == lt.compare(a, lt.I64), a
