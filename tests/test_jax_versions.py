"""What differs between the supported JAX versions (docs/jax_versions.md):
primitives newer JAX emits, and the checks that keep fast-path failures
visible. Each test runs on every installed JAX; where a primitive does not
exist in this JAX, the test asserts the jnp function does not bind it (so the
rule is exercised wherever it can be)."""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from pallas_np import _compat as jc
from pallas_np import errors
from pallas_np.grid import vectorize

rng = np.random.default_rng(0)
LOW_AND_F32 = [np.float32, ml_dtypes.bfloat16, np.float16]


def _kernel_of(fn):
  def kernel(*refs):
    *ins, out = refs
    out[...] = fn(*[r[...] for r in ins])
  return kernel


def _both(fn, *args, **kw):
  """(numpy mode, interpret=True) results of a kernel computing fn(*args)."""
  out = jax.eval_shape(fn, *args)
  call = functools.partial(pl.pallas_call, _kernel_of(fn), out_shape=out, **kw)
  return np.asarray(call(interpret="numpy")(*args)), np.asarray(call(interpret=True)(*args))


def _assert_bit_exact(got, want):
  """Same bits, except NaN payload/sign (only NaN positions must agree)."""
  got, want = np.asarray(got), np.asarray(want)
  if got.dtype.kind in "iub":
    np.testing.assert_array_equal(got, want)
    return
  nan = np.isnan(got.astype(np.float32))
  np.testing.assert_array_equal(nan, np.isnan(want.astype(np.float32)))
  np.testing.assert_array_equal(got[~nan].view(np.uint8), want[~nan].view(np.uint8))


def _prim_names(fn, *args):
  """Primitive names in fn's jaxpr, sub-jaxprs (jit bodies) included."""
  names, todo = set(), [jax.make_jaxpr(fn)(*args).jaxpr]
  while todo:
    jaxpr = todo.pop()
    names.update(e.primitive.name for e in jaxpr.eqns)
    todo.extend(j.jaxpr if hasattr(j, "jaxpr") else j for j in jc.subjaxprs(jaxpr))
  return names


@pytest.mark.parametrize("dtype", LOW_AND_F32)
def test_polynomial_bit_exact(dtype):
  x = rng.uniform(-3, 3, (8, 128)).astype(np.float32).astype(dtype)
  c = np.float32([1.5, -2.25, 3.0, 0.1, 7.0]).astype(dtype)
  fn = lambda c, x: jnp.polyval(c, x)  # noqa: E731
  names = _prim_names(fn, c, x)
  if getattr(jc.lax_internal, "polynomial_p", None) is None:
    assert "polynomial" not in names  # older JAX: mul/add chain (FMA caveat in docs/limits.md)
    return
  got, want = _both(fn, c, x)
  if dtype == np.float16 and _xla_contracts_float16():
    # XLA's CPU on an AVX512-FP16 CPU: each Horner step one float16 FMA (one
    # rounding); numpy mode keeps the formula XLA has on every other CPU
    # (docs/limits.md): both against references written here
    _assert_bit_exact(got, _horner_per_op(c, x))
    _assert_bit_exact(want, _horner_fma(c, x))
    return
  _assert_bit_exact(got, want)  # Horner with XLA's FMA


def _horner_per_op(c, x):
  """float16/bf16 Horner, each product and sum rounded to the dtype."""
  f32 = np.float32
  acc = np.asarray(c[0])
  for ci in c[1:]:
    acc = (f32(f32(acc) * f32(x)).astype(x.dtype).astype(f32) + f32(ci)).astype(x.dtype)
  return acc


def _horner_fma(c, x):
  """float16 Horner, each step ``acc * x + c`` exact (in float64: 11-bit
  operands) then rounded once."""
  acc = np.asarray(c[0])
  for ci in c[1:]:
    acc = (np.float64(acc) * np.float64(x) + np.float64(ci)).astype(x.dtype)
  return acc


@functools.cache
def _xla_contracts_float16() -> bool:
  """Whether this CPU's XLA fuses a float16 multiply and add into one FMA
  ((1 + 2^-6) squared, minus 1: 2^-5 + 2^-12 with one rounding, 2^-5 with
  two)."""
  a = np.float16(1 + 2.0 ** -6)
  got = np.float16(jax.jit(lambda a, b, c: a * b + c)(a, a, np.float16(-1)))
  assert got in (np.float16(2.0 ** -5), np.float16(2.0 ** -5 + 2.0 ** -12)), got
  return bool(got != np.float16(2.0 ** -5))


@pytest.mark.parametrize("dtype", LOW_AND_F32 + [np.int32])
def test_one_minus_square_bit_exact(dtype):
  if not hasattr(lax, "one_minus_square"):
    assert getattr(jc.lax_internal, "one_minus_square_p", None) is None
    return
  x = (rng.uniform(-300, 300, (8, 128)) if dtype == np.int32
       else rng.uniform(-1.5, 1.5, (8, 128))).astype(dtype)
  got, want = _both(lax.one_minus_square, x)
  _assert_bit_exact(got, want)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_log2_low_precision_bit_exact(dtype):
  # log2 is a primitive from JAX 0.11: XLA computes log(x) * (1/ln 2), the
  # log and the constant rounded to the dtype. Before, jnp.log2 was
  # log(x) / log(2) in ordinary primitives (float16 then within 1 ulp).
  x = np.concatenate([rng.uniform(0, 100, 1020), [0, np.inf, np.nan, 1]]).astype(np.float32)
  x = x.reshape(8, 128).astype(dtype)
  if not hasattr(lax, "log2_p"):
    assert "log2" not in _prim_names(jnp.log2, x)
    return
  got, want = _both(jnp.log2, x)
  _assert_bit_exact(got, want)


def test_digamma_at_zero_follows_installed_xla():
  x = np.float32([0.0, -0.0, -1.0, -2.0, 0.5]).reshape(1, 5)
  got, want = _both(lax.digamma, x)
  np.testing.assert_array_equal(got, want)  # NaN == NaN under assert_array_equal


@pytest.mark.parametrize("name", ["searchsorted", "nonzero", "einsum"])
def test_hi_primitive_jnp_functions(name):
  a = np.sort(rng.standard_normal(64).astype(np.float32)).reshape(1, 64)
  v = rng.standard_normal(128).astype(np.float32).reshape(1, 128)
  fn, args = {
      "searchsorted": (lambda a, v: jnp.searchsorted(a[0], v[0])[None], (a, v)),
      "nonzero": (lambda a, v: jnp.nonzero(v[0] > 0, size=16)[0][None], (a, v)),
      "einsum": (lambda a, v: jnp.einsum("ij,ik->jk", a, v), (a, v)),
  }[name]
  # JAX 0.12 binds searchsorted/nonzero as one call_hi_primitive (its
  # expansion is what runs); older JAX as ordinary primitives. Same results.
  got, want = _both(fn, *args)
  np.testing.assert_array_equal(got, want)


def test_scan_in_kernel_is_vectorized():
  """scan's carry counts (params changed in JAX 0.11) feed the batched rule:
  a fori_loop kernel must take the vectorized path, not fall back."""
  def kernel(x_ref, o_ref):
    o_ref[...] = lax.fori_loop(0, 4, lambda i, c: c * 2.0 + 1.0, x_ref[...])

  x = rng.standard_normal((64, 128)).astype(np.float32)
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  f = pallas_np.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                            grid=(8,), in_specs=[spec], out_specs=spec)
  got = np.asarray(f(x))
  want = x
  for _ in range(4):
    want = want * np.float32(2) + np.float32(1)
  np.testing.assert_array_equal(got, want)
  modes = [r["mode"] for r in pallas_np.grid_report() if r["kernel"] == "kernel"]
  assert modes and modes[-1] == "vectorized", pallas_np.grid_report()


def _double(x_ref, o_ref):
  o_ref[...] = x_ref[...] * 2.0


def test_fast_path_failure_is_an_error_in_strict_mode(monkeypatch):
  """A vectorized pass that fails where the sequential loop succeeds is a bug
  the fallback would hide as a slowdown: strict mode (the test-suite's
  default) raises it; without it the result is right and grid_report says why."""
  def broken(*args, **kwargs):
    raise KeyError("num_consts")  # what JAX 0.11's scan params did to the batched rule

  monkeypatch.setattr(vectorize, "run_vectorized", broken)
  x = np.arange(64 * 128, dtype=np.float32).reshape(64, 128)
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  make = lambda: pallas_np.pallas_call(  # noqa: E731
      _double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(8,),
      in_specs=[spec], out_specs=spec, interpret=pallas_np.InterpretParams(vectorize=True))
  monkeypatch.setenv("PALLAS_NP_STRICT_FALLBACKS", "1")
  pallas_np.clear_caches()
  with pytest.raises(errors.FallbackError, match="vectorized run .* KeyError"):
    make()(x)
  monkeypatch.setenv("PALLAS_NP_STRICT_FALLBACKS", "0")
  pallas_np.clear_caches()
  np.testing.assert_array_equal(np.asarray(make()(x)), x * 2)
  report = [r for r in pallas_np.grid_report() if r["kernel"] == "_double"]
  assert report[-1]["mode"] == "sequential" and "num_consts" in str(report[-1]["why"])
