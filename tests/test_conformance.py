"""The conformance table (pallas_np/conformance.py) holds: every bit-exact
entry is bit-exact and every ulp bound holds over a fresh sample."""
import ml_dtypes
import numpy as np
import pytest

from pallas_np import conformance

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@pytest.mark.parametrize("name", sorted(conformance.ULP))
def test_table_entry_holds(name):
  for dt_name, bound in conformance.ULP[name].items():
    got = conformance.measure(name, DTYPES[dt_name], n=20000, seed=1)
    assert got <= bound, (name, dt_name, got, bound)


def test_every_domain_has_an_entry():
  assert set(conformance.ULP) == set(conformance.DOMAINS)
  assert conformance.describe("sqrt").startswith("bit-exact")


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

  for v, bound in [(x, 0), (far, 2)]:
    f = lambda i, v=v: pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),  # noqa: E731
                                      interpret=i)(v)
    d = conformance.ulp_diff(np.asarray(f("numpy")), np.asarray(f(True)))
    assert d.max() <= bound, (d.max(), v[np.argmax(d)])
