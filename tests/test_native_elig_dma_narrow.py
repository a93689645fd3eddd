"""bfloat16 in a compiled loop (pallas_np/native/narrow.py, dots.py): a
float32 block cast to bfloat16 right before a dot with float32 results,
as JAX's TPU paged attention does inside its DMA loop, with the NumPy
path's bits. Before, such a loop was refused ("dtype bfloat16")."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from pallas_np import native
from pallas_np.native import codegen
from tests.native_elig_util import OFF, SYNC, bits

# float32 bit patterns: NaNs with payloads (quiet, signalling, negative),
# ties to even, denormals, the largest finite values (overflow to inf).
PROBES = (0x7FC00001, 0x7F800001, 0xFFC12345, 0x7FA00000, 0xFF800001, 0x00000001, 0x00017FFF,
          0x00018000, 0x00008000, 0x80008000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x3F808000,
          0x3F818000, 0x3F807FFF, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000)


def _dot_kernel(q_ref, k_ref, o_ref):
  def body(i, acc):
    q = q_ref[...].astype(jnp.bfloat16)
    k = k_ref[pl.ds(i * 8, 8), :].astype(jnp.bfloat16)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return acc + s * 0.5
  o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros(o_ref.shape, jnp.float32))


def _make_dot(interp):
  return pl.pallas_call(_dot_kernel, out_shape=jax.ShapeDtypeStruct((16, 8), jnp.float32),
                        interpret=interp)


def test_bf16_dot_bit_exact():
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
  before = native.stats()["native_calls"]
  got = _make_dot(SYNC)(q, k)
  assert native.stats()["native_calls"] > before, "the compiled loop did not run"
  np.testing.assert_array_equal(bits(got), bits(_make_dot(OFF)(q, k)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(_make_dot(True)(q, k)), rtol=1e-5,
                             atol=1e-5)


def _round_kernel(x_ref, o_ref):
  def body(i, acc):
    return acc + x_ref[...].astype(jnp.bfloat16).astype(jnp.float32)
  o_ref[...] = lax.fori_loop(0, 1, body, jnp.zeros(o_ref.shape, jnp.float32))


def test_bf16_rounding_bits_as_numpy():
  """Ties to even, denormals, overflow to infinity, NaNs with payloads
  and signs: the conversion's bits are ml_dtypes' (the NumPy rule's)."""
  rng = np.random.default_rng(4)
  pattern = np.concatenate([np.array(PROBES, np.uint32),
                            rng.integers(0, 1 << 32, 1024 - len(PROBES), dtype=np.uint32)])
  x = jnp.asarray(pattern.view(np.float32).reshape(8, 128))
  make = lambda interp: pl.pallas_call(_round_kernel, out_shape=jax.ShapeDtypeStruct(
      (8, 128), jnp.float32), interpret=interp)
  before = native.stats()["native_calls"]
  got = np.asarray(make(SYNC)(x))
  assert native.stats()["native_calls"] > before, "the compiled loop did not run"
  want = np.asarray(make(OFF)(x))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _bf16_add_kernel(x_ref, o_ref):
  def body(i, acc):
    return acc + (x_ref[...].astype(jnp.bfloat16) * 2).astype(jnp.float32)
  o_ref[...] = lax.fori_loop(0, 2, body, jnp.zeros(o_ref.shape, jnp.float32))


@pytest.mark.parametrize("kernel,why", [(_bf16_add_kernel, "dtype bfloat16 in mul")])
def test_bf16_arithmetic_refused(kernel, why):
  """Arithmetic on bfloat16 values (rounded to bfloat16 at each step) is
  not held in float32: the loop is refused, by name."""
  make = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                        interpret=SYNC)
  closed = jax.make_jaxpr(make)(jnp.zeros((8, 128), jnp.float32))
  loop = next(e for e in closed.jaxpr.eqns[0].params["jaxpr"].eqns
              if e.primitive.name in ("while", "scan"))
  with pytest.raises(codegen.Refused, match=why):
    codegen.loop_source(loop, False, "nan")
