"""``plgpu.mma`` (Ampere's register-level MMA, JAX >= 0.11): ``acc + a @ b``
with products and sums in the accumulator's type. Expected values: NumPy
(operands are small integers, so every float sum is exact; int8 sums wrap
in int32 as the hardware's do)."""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.mgpu_helpers import plgpu

import pallas_np

if not hasattr(plgpu, "mma"):
  pytest.skip("this JAX has no plgpu.mma", allow_module_level=True)

def _load(ref, **kwargs):
  """``plgpu.load`` of the whole ref (JAX 0.10 takes an index, 0.12 not)."""
  if "idx" in inspect.signature(plgpu.load).parameters:
    return plgpu.load(ref, (), **kwargs)
  return plgpu.load(ref, **kwargs)



@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8])
def test_mma_adds_product_to_accumulator(dtype):
  m = k = 128
  n = 8
  dtype = jnp.dtype(dtype)
  is_int = jnp.issubdtype(dtype, jnp.integer)
  acc_dtype = jnp.int32 if is_int else jnp.float32

  @plgpu.kernel(out_type=jax.ShapeDtypeStruct((m, n), acc_dtype))
  def kernel(a_ref, b_ref, c_ref, o_ref):
    acc = plgpu.layout_cast(c_ref[...], plgpu.Layout.MMA_ACC(dtype))
    a = _load(a_ref, layout=plgpu.Layout.MMA_LHS(dtype), optimized=False)
    b = _load(b_ref.T, layout=plgpu.Layout.MMA_RHS(dtype), optimized=False)
    o_ref[...] = plgpu.mma(acc, a, b)

  rng = np.random.default_rng(0)
  hi = 127 if is_int else 4
  a = rng.integers(-hi, hi + 1, (m, k)).astype(dtype)
  b = rng.integers(-hi, hi + 1, (n, k)).astype(dtype)
  c = rng.integers(-8, 9, (m, n)).astype(acc_dtype)
  with pallas_np.force_numpy_interpret():
    out = np.asarray(kernel(a, b, c))
  want = c.astype(np.int64) + a.astype(np.int64) @ b.T.astype(np.int64)
  np.testing.assert_array_equal(out, want.astype(acc_dtype))
