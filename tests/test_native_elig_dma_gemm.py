"""``q @ k.T`` (dot_general contracting both operands' last dims, as TPU
flash attention and the decode kernels write it) in a compiled loop: a
transposed-B GEMM on ``k`` itself instead of a copy of ``k.T``
(native/dots.py, ``blas_calls.trans_b_matches``), with the NumPy path's
bits (the NumPy rule copies ``k.T`` to C order for a no-transpose GEMM)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from pallas_np.native import blas_calls, codegen
from tests.native_elig_util import compiled_equals_numpy

NT = (((1,), (1,)), ((), ()))


def _qk_kernel(q_ref, k_ref, o_ref):
  def body(i, acc):
    k = k_ref[pl.ds(i * 32, 32), :]
    return acc + lax.dot_general(q_ref[...], k, NT) * 0.5
  o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros(o_ref.shape, jnp.float32))


def _make(interp):
  return pl.pallas_call(_qk_kernel, out_shape=jax.ShapeDtypeStruct((16, 32), jnp.float32),
                        interpret=interp)


@pytest.mark.skipif(blas_calls.found() is None, reason="NumPy's BLAS is not an OpenBLAS found here")
def test_q_at_k_transposed_gemm_bit_exact():
  rng = np.random.default_rng(6)
  q = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((128, 64)), jnp.float32)
  compiled_equals_numpy(_make, q, k, rtol=1e-4)
  closed = jax.make_jaxpr(_make(False))(q, k)
  loop = next(e for e in closed.jaxpr.eqns[0].params["jaxpr"].eqns
              if e.primitive.name in ("while", "scan"))
  text = codegen.loop_source(loop, False, "nan").text
  assert f", {blas_calls.ROW_MAJOR}, {blas_calls.NO_TRANS}, {blas_calls.TRANS}, 16, 32, 64," in text
