"""``plgpu.RefUnion`` (SMEM members that alias one byte buffer, the
``ExtractAliasedRef`` transform): members are views of the union's bytes;
members whose GPU layout is not row-major are refused; sub-byte members are
packed as on the GPU (two 4-bit elements a byte, the first in the low bits).
Expected values: NumPy byte reinterpretation of what the kernel wrote."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from tests.mgpu_helpers import plgpu

import pallas_np
from pallas_np.errors import KernelError, UnsupportedError

if not hasattr(plgpu, "RefUnion"):
  pytest.skip("this JAX has no plgpu.RefUnion", allow_module_level=True)


def _call(kernel, out_shape, scratch, *args, in_specs=None):
  kwargs = {} if in_specs is None else {"in_specs": in_specs}
  return pl.pallas_call(kernel, out_shape=out_shape, interpret="numpy",
                        out_specs=pl.BlockSpec(memory_space=plgpu.GMEM),
                        scratch_shapes=scratch, compiler_params=plgpu.CompilerParams(),
                        **kwargs)(*args)


def test_members_of_other_groups_see_the_same_bytes():
  """Group 0: one f32 (2, 256) member (2048 bytes); group 1: a bf16 (256,)
  member (512 bytes, aligned to 1024) then an f32 (128,) one at byte 1024,
  i.e. the f32 member's elements 256..383 (JAX's own layout, as its
  test_smem_aliasing_works_basic relies on)."""
  def kernel(x_ref, o_ref, union):
    big, [_, [small]] = union
    big[...] = x_ref[...] + 1
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(small, o_ref)
    plgpu.wait_smem_to_gmem(0)

  x = np.arange(512, dtype=np.float32).reshape(2, 256)
  scratch = [plgpu.RefUnion(plgpu.SMEM((2, 256), jnp.float32),
                            [plgpu.SMEM((256,), jnp.bfloat16),
                             [plgpu.SMEM((128,), jnp.float32,
                                         transforms=(plgpu.TilingTransform((64,)),))]])]
  out = _call(kernel, jax.ShapeDtypeStruct((128,), jnp.float32), scratch, x,
              in_specs=[pl.BlockSpec((2, 256), lambda: (0, 0))])
  np.testing.assert_array_equal(np.asarray(out), x.reshape(-1)[256:384] + 1)


def test_member_of_another_dtype_reads_the_bytes_reinterpreted():
  def kernel(x_ref, o_ref, union):
    as_f32, as_i32 = union
    as_f32[...] = x_ref[...] * 2
    o_ref[...] = as_i32[...]

  x = np.linspace(-5, 5, 8 * 128, dtype=np.float32).reshape(8, 128)
  scratch = [plgpu.RefUnion(plgpu.SMEM((8, 128), jnp.float32),
                            plgpu.SMEM((8, 128), jnp.int32))]
  out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.int32),
                       interpret="numpy", scratch_shapes=scratch,
                       compiler_params=plgpu.CompilerParams())(x)
  np.testing.assert_array_equal(np.asarray(out), (x * 2).view(np.int32))


def test_unions_of_different_members_in_successive_scopes():
  @plgpu.kernel(out_type=(jax.ShapeDtypeStruct((64, 32), jnp.float32),
                          jax.ShapeDtypeStruct((64, 64), jnp.float16)))
  def kernel(o32, o16):
    def scope(union):
      [smem] = union
      smem[...] = jnp.full(smem.shape, 3, smem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(smem, o32 if smem.dtype == jnp.float32 else o16)
      plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(scope, plgpu.RefUnion(plgpu.SMEM((64, 32), jnp.float32)))
    pl.run_scoped(scope, plgpu.RefUnion(plgpu.SMEM((64, 64), jnp.float16)))

  with pallas_np.force_numpy_interpret():
    a, b = kernel()
  np.testing.assert_array_equal(np.asarray(a), np.full((64, 32), 3, np.float32))
  np.testing.assert_array_equal(np.asarray(b), np.full((64, 64), 3, np.float16))


@pytest.mark.parametrize("small", [jnp.uint4, jnp.int4])
def test_sub_byte_members_are_packed(small):
  """Bytes written as int8 read as 4-bit elements (low nibble first) and
  4-bit elements written read back as bytes; int4 nibbles sign-extend."""
  x = np.arange(-64, 64, dtype=np.int8)

  def kernel(x_ref, o4_ref, o8_ref, union):
    bytes_, nibbles = union
    bytes_[...] = x_ref[...]
    o4_ref[...] = nibbles[...]
    nibbles[0:4] = (jax.lax.iota(jnp.int8, 4) + 1).astype(small)  # bytes 0 and 1
    o8_ref[...] = bytes_[...]

  o4, o8 = pl.pallas_call(
      kernel, out_shape=(jax.ShapeDtypeStruct((256,), small),
                         jax.ShapeDtypeStruct((128,), jnp.int8)),
      interpret="numpy", compiler_params=plgpu.CompilerParams(),
      scratch_shapes=[plgpu.RefUnion(plgpu.SMEM((128,), jnp.int8),
                                     plgpu.SMEM((256,), small))])(x)
  u = x.view(np.uint8)
  nib = np.stack([u & 0xF, u >> 4], axis=-1).reshape(-1).astype(np.int16)
  if small == jnp.int4:
    nib = np.where(nib >= 8, nib - 16, nib)
  np.testing.assert_array_equal(np.asarray(o4).astype(np.int16), nib)
  want = x.copy()
  want[0], want[1] = np.int8(0x21), np.int8(0x43)
  np.testing.assert_array_equal(np.asarray(o8), want)


@pytest.mark.parametrize("member", [
    lambda: plgpu.SMEM((64, 64), jnp.float16, transforms=(plgpu.TilingTransform((8, 64)),
                                                          plgpu.SwizzleTransform(128))),
], ids=["swizzled"])
def test_members_the_gpu_lays_out_differently_are_refused(member):
  def kernel(o_ref, union):
    first, second = union
    first[...] = jnp.zeros(first.shape, first.dtype)
    o_ref[...] = jnp.ones(o_ref.shape, o_ref.dtype)
    del second

  scratch = [plgpu.RefUnion(member(), plgpu.SMEM((64, 64), jnp.float16))]
  with pytest.raises((UnsupportedError, KernelError), match="ref union member"):
    pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                   interpret="numpy", scratch_shapes=scratch,
                   compiler_params=plgpu.CompilerParams())()
