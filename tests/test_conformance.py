"""The conformance claims (pallas_np/conformance.py) hold against XLA on the
machine the tests run on: every BIT_EXACT primitive is bit-exact with
``jax.jit`` here (float32, bf16, f16), every other one within its ulp bound.
Nothing is read from a table measured on another machine."""
import ml_dtypes
import numpy as np
import pytest

from pallas_np import conformance

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@pytest.mark.parametrize("name", sorted(conformance.BIT_EXACT))
def test_bit_exact_here(name):
  got = conformance.measure_dtypes(name, DTYPES.values(), n=20000, seed=1)
  assert list(got) == list(DTYPES)
  for dt_name in DTYPES:
    assert got[dt_name] == 0, (name, dt_name, got[dt_name])


@pytest.mark.parametrize("name", sorted(conformance.ULP))
def test_ulp_bound_here(name):
  got = conformance.measure_dtypes(name, [DTYPES[d] for d in conformance.ULP[name]],
                                   n=20000, seed=1)
  for dt_name, bound in conformance.ULP[name].items():
    assert got[dt_name] <= bound, (name, dt_name, got[dt_name], bound)


def test_every_domain_has_one_claim():
  assert set(conformance.BIT_EXACT) | set(conformance.ULP) == set(conformance.DOMAINS)
  assert not set(conformance.BIT_EXACT) & set(conformance.ULP)
  assert conformance.describe("sqrt").startswith("bit-exact")
  assert conformance.describe("sin").startswith("bit-exact")


def test_erf_inv_is_xla_polynomial():
  # Issue 27: SciPy's erfinv was up to 62 ulp off XLA's Giles polynomial.
  import jax
  from jax import lax
  from jax.experimental import pallas as pl
  rng = np.random.default_rng(5)
  x = np.concatenate([rng.uniform(-0.64, 0.64, 4096), [0.0, -0.0, 0.5, -0.25]]).astype(np.float32)
  far = rng.uniform(-1, 1, 4096).astype(np.float32)
  far = np.concatenate([far, np.float32([1, -1, -0.99955, 0.9999999, np.nan])])

  def k(x_ref, o_ref):
    o_ref[...] = lax.erf_inv(x_ref[...])

  for v in (x, far):
    f = lambda i, v=v: pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),  # noqa: E731
                                      interpret=i)(v)
    d = conformance.ulp_diff(np.asarray(f("numpy")), np.asarray(f(True)))
    assert d.max() == 0, (d.max(), v[np.argmax(d)])
