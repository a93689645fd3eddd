"""Differential fuzzing, numpy mode vs interpret=True (see tests/fuzz_core.py).

CI runs a deterministic slice (derandomized, fixed examples). The long run
(>= 10,000 cases) is ``pytest -m slow tests/test_fuzz.py`` or
``python scripts/fuzz_long.py``.
"""
import os

import jax.numpy as jnp

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from tests.fuzz_core import programs, run_program

CI_EXAMPLES = int(os.environ.get("PALLAS_NP_FUZZ_EXAMPLES", "50"))


def _check(program):
  dtype, shape, ops, seed = program
  try:
    results = run_program(dtype, shape, ops, seed)
  except Exception as e:
    raise AssertionError(f"dtype={dtype} shape={shape} seed={seed} "
                         f"ops={[o.name for o in ops]}: {type(e).__name__}: {e}") from e
  if results is None:
    return  # interpret=True cannot run this kernel: nothing to compare
  failures = [(name, err) for name, err in results if err]
  assert not failures, f"dtype={dtype} shape={shape} seed={seed}: {failures}"


# No shrinking: one XLA compile per step makes it take minutes; the failing
# program (dtype, shape, op names, seed) is in the assertion message.
@settings(max_examples=CI_EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
@given(programs(max_ops=12))
def test_fuzz_ci_slice(program):
  _check(program)


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("PALLAS_NP_FUZZ_LONG_EXAMPLES", "1000")),
          deadline=None, database=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])
@given(programs(max_ops=20))
def test_fuzz_long(program):
  _check(program)


# -- issue 27 cases (tests/fuzz_core.py, tests/fuzz_refs.py) ------------------------
from tests.fuzz_core import negative_index_programs  # noqa: E402
from tests.fuzz_refs import (alias_prefetch_cases, masked_view_cases,  # noqa: E402
                             run_alias_case, run_masked_view_case)

_SMALL = settings(max_examples=max(CI_EXAMPLES // 5, 5), derandomize=True, deadline=None,
                  database=None, suppress_health_check=list(HealthCheck),
                  phases=[Phase.explicit, Phase.generate])


@_SMALL
@given(negative_index_programs())
def test_fuzz_static_negative_indices(program):
  _check(program)


@_SMALL
@given(alias_prefetch_cases())
def test_fuzz_aliases_with_scalar_prefetch(case):
  err = run_alias_case(*case)
  assert err is None, f"{case}: {err}"


@settings(max_examples=max(CI_EXAMPLES, 20), derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
@given(masked_view_cases())
def test_fuzz_masked_views_crossing_the_edge(case):
  err = run_masked_view_case(*case)
  assert err is None, f"{case}: {err}"


# -- the comparison itself (float-faithful: signed zeros) ------------------------
from tests.fuzz_core import (BINARY_F, UNARY_F, FLOATS, Op, compare,  # noqa: E402
                             make_inputs)


@pytest.mark.parametrize("kind", ["exact", "ulp", "xla_ulp", "sum"])
def test_compare_sees_the_sign_of_zero(kind):
  """-0.0 against +0.0 is a mismatch in every kind; a float32 denormal
  counts as the zero of its own sign only where XLA returned a zero. (Before,
  the denormal flush turned every -0.0 into +0.0 ahead of the sign check.)"""
  import numpy as np
  x = np.float32([1.0, 2.0])
  assert compare(np.float32([-0.0, 1.0]), np.float32([0.0, 1.0]), kind, x, "erf")
  assert compare(np.float32([0.0, 1.0]), np.float32([-0.0, 1.0]), kind, x, "erf")
  assert compare(np.float32([-1e-40, 1.0]), np.float32([0.0, 1.0]), kind, x, "erf")
  assert compare(np.float32([-1e-40, 1.0]), np.float32([-0.0, 1.0]), kind, x, "erf") is None
  assert compare(np.float32([np.nan, 1.0]), np.float32([-np.nan, 1.0]), kind, x, "erf") is None


@pytest.mark.parametrize("kind", ["exact", "ulp"])
def test_compare_is_raw_bits(kind):
  """Denormals XLA kept (moved, not computed) compare by their bits: two
  different float32 denormals, or a denormal where XLA has one of the other
  sign or a nonzero, are mismatches (before, both sides were flushed to
  zero first, so any two denormals of one sign matched); float16 denormals
  are ordinary float32 values and compare exactly too."""
  import numpy as np
  x = np.float32([1.0, 2.0])
  assert compare(np.float32([2e-40, 1.0]), np.float32([1e-40, 1.0]), kind, x)
  assert compare(np.float32([0.0, 1.0]), np.float32([1e-40, 1.0]), kind, x)
  assert compare(np.float32([1e-40, 1.0]), np.float32([-0.0, 1.0]), kind, x)
  assert compare(np.float16([6e-8, 1.0]), np.float16([0.0, 1.0]), kind, x)
  assert compare(np.float32([1e-40, 1.0]), np.float32([1e-40, 1.0]), kind, x) is None
  assert compare(np.float32([1.0, np.nextafter(np.float32(2), np.float32(3))]),
                 np.float32([1.0, 2.0]), kind, x)


def test_compare_xla_ulp_uses_the_conformance_bound():
  """"xla_ulp" ops may be off by what pallas_np.conformance claims for them
  (erf float32: 5 ulp), no more."""
  import numpy as np
  from pallas_np import conformance
  bound = conformance.bound("erf", "float32")
  w = np.float32([0.5, 1.0])
  near = w.view(np.uint32) + np.uint32(bound)
  far = w.view(np.uint32) + np.uint32(bound + 1)
  assert compare(near.view(np.float32), w, "xla_ulp", w, "erf") is None
  assert compare(far.view(np.float32), w, "xla_ulp", w, "erf")
  assert compare(np.float32([0.5, 1.0]), np.float32([0.5, 1.0]), "xla_ulp", w, "exp") is None
  assert compare(near.view(np.float32), w, "xla_ulp", w, "exp")  # bit-exact: bound 0


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_fuzz_program_of_zero_sign_ops(dtype):
  """One fuzz program of the ops whose zero signs NumPy gets wrong (sign,
  round away from zero, clamp, nextafter): fails with any of those fixes
  reverted."""
  names = ["sign", "round_away", "round", "floor", "ceil", "abs", "neg", "relu"]
  ops = [Op(n, lambda x, y, i, f=UNARY_F[n][0]: f(x[...]), "exact", True) for n in names]
  for n in ["clamp", "nextafter", "max", "min", "mul", "add"]:
    f, kind = BINARY_F[n]
    ops.append(Op(n, lambda x, y, i, f=f: f(x[...], y[...]), kind, True))
  ops.append(Op("floor_divide", lambda x, y, i: jnp.floor_divide(x[...], y[...]), "exact", True))
  shape, seed = (4, 64), 3
  x, y, _ = make_inputs(seed, dtype, shape)
  import numpy as np
  assert (np.signbit(x) & (x == 0)).any() and (np.signbit(y) & (y == 0)).any()
  _check((dtype, shape, ops, seed))


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_fuzz_program_of_every_float_op(dtype):
  """Every unary and binary float op of the catalogue once, on special
  values and denormals: "exact" ones (the transcendentals XLA computes with
  its own formulas or the C library, IEEE arithmetic) bit for bit. (One
  (16, 32) program: as many input values as the two (8, 32) seeds it
  replaced, one interpret=True compile instead of two.)"""
  ops = [Op(n, lambda x, y, i, f=f: f(x[...]), k, True) for n, (f, k) in sorted(UNARY_F.items())]
  ops += [Op(n, lambda x, y, i, f=f: f(x[...], y[...]), k, True)
          for n, (f, k) in sorted(BINARY_F.items())]
  _check((dtype, (16, 32), ops, 5))
