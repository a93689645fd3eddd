"""convert_element_type between every pair of JAX's narrow dtypes, against
interpret=True: every value of each <=16-bit source, boundary values (+-0,
NaN, +-inf, range ends, just over/under, x.5) and a random sample of
float32/int32/uint32. One kernel per source dtype, one output per target.
Bit-exact except NaN payloads/signs (see make_converter)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

NAMES = ["bool", "int2", "uint2", "int4", "uint4", "int8", "uint8", "int16", "uint16",
         "int32", "uint32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
         "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e4m3", "float8_e3m4",
         "float8_e8m0fnu", "float4_e2m1fn", "bfloat16", "float16", "float32"]


def _supported(name):
  if name == "bool":
    return np.dtype(np.bool_)
  t = getattr(jnp, name, None)
  if t is None:
    return None
  try:
    jax.jit(lambda x: x + x)(jnp.zeros(2, t))  # JAX/XLA can use the type
  except Exception:  # noqa: BLE001
    return None
  return np.dtype(t)


DTYPES = [d for d in map(_supported, NAMES) if d is not None]
SUB_BYTE = {"int2", "uint2", "int4", "uint4", "float4_e2m1fn"}


def source_values(dt):
  if dt == np.bool_:
    return np.array([False, True])
  if dt.name in SUB_BYTE:
    return np.arange(4 if dt.name.endswith("2") else 16, dtype=np.uint8).view(dt)
  if dt.itemsize == 1:
    return np.arange(256, dtype=np.uint8).view(dt)
  if dt.itemsize == 2:
    return np.arange(1 << 16, dtype=np.uint16).view(dt)
  rng = np.random.default_rng(27)
  ints = [0, 1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 127, 128, 129, 255, 256, 32767, 32768, 65535,
          65536, 2**24, 2**24 + 1, 2**31 - 1, 2**31, 2**32 - 1]
  if dt.kind == "f":
    big = [2.0**k for k in range(-133, 128)] + [0.5, 1.5, 2.5, 7.5, 8.5, 15.5, 16.5, 0.49999997,
                                                240, 448, 464, 57344, 61440, 65504, 65520, 3.4e38]
    v = np.array(ints + big, np.float64).astype(np.float32)
    v = np.concatenate([v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(0))])
    v = np.concatenate([v, -v, np.float32([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0]),
                        rng.integers(0, 2**32, 4096, dtype=np.uint32).view(np.float32),
                        rng.uniform(-300, 300, 4096).astype(np.float32),
                        np.round(rng.uniform(-40, 40, 1024)).astype(np.float32) + 0.5])
    return v
  info = np.iinfo(dt)
  v = np.array(ints + [-x for x in ints], np.int64)
  v = np.concatenate([v, v + 1, v - 1, [info.min, info.max]])
  v = v[(v >= info.min) & (v <= info.max)].astype(dt)
  return np.concatenate([v, rng.integers(info.min, info.max, 4096, dtype=dt, endpoint=True)])


def convert_all(src, interpret):
  dsts = [d for d in DTYPES if d != src]

  def kernel(x_ref, *o_refs):
    x = x_ref[...]
    for d, o in zip(dsts, o_refs):
      o[...] = lax.convert_element_type(x, d)

  def run(x):
    return pl.pallas_call(kernel, out_shape=[jax.ShapeDtypeStruct(x.shape, d) for d in dsts],
                          interpret=interpret)(x)
  return dsts, run


def _as_bits(a):
  a = np.asarray(a)
  if a.dtype == np.bool_:
    return a.astype(np.uint8)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _isnan(a):
  a = np.asarray(a)
  if a.dtype.kind in "biu" or a.dtype.name in ("int2", "uint2", "int4", "uint4"):
    return np.zeros(a.shape, bool)
  return np.isnan(a.astype(np.float32))


def mismatches(src, x, got, want):
  out = []
  for d, g, w in zip([d for d in DTYPES if d != src], got, want):
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype == d, (src, d, g.dtype, w.dtype)
    bad = (_as_bits(g) != _as_bits(w)) & ~(_isnan(g) & _isnan(w))
    if bad.any():
      i = np.flatnonzero(bad)[:3]
      out.append(f"{src}->{d}: {bad.sum()} of {bad.size}, e.g. x={x[i]} numpy={g[i]} xla={w[i]}")
  return out


@pytest.mark.parametrize("src", DTYPES, ids=str)
def test_convert_every_pair(src):
  x = source_values(src)
  _, want_fn = convert_all(src, True)
  _, got_fn = convert_all(src, "numpy")
  bad = mismatches(src, x, got_fn(x), want_fn(x))
  assert not bad, "\n".join(bad)


def test_named_issue_cases():
  f = lambda x, d, i: pl.pallas_call(  # noqa: E731
      lambda x_ref, o_ref: o_ref.__setitem__(..., lax.convert_element_type(x_ref[...], d)),
      out_shape=jax.ShapeDtypeStruct(x.shape, d), interpret=i)(x)
  x = np.array([16.0, -1.0, 8.0, -9.0, np.nan, np.inf, -np.inf, 15.9], np.float32)
  for d, want in [(jnp.uint4, [15, 0, 8, 0, 0, 15, 0, 15]), (jnp.int4, [7, -1, 7, -8, 0, 7, -8, 7])]:
    np.testing.assert_array_equal(np.asarray(f(x, d, "numpy")).astype(int), want)
    np.testing.assert_array_equal(np.asarray(f(x, d, True)).astype(int), want)
  # int -> int4 wraps (keeps the low bits) in XLA, as for every int -> int.
  xi = np.array([100, -100, 8, -9, 7], np.int8)
  np.testing.assert_array_equal(np.asarray(f(xi, jnp.int4, True)).astype(int), [4, -4, -8, 7, 7])
  np.testing.assert_array_equal(np.asarray(f(xi, jnp.int4, "numpy")).astype(int), [4, -4, -8, 7, 7])
