"""``plgpu.inline_mgpu`` bodies that numpy mode runs (pallas_np.mosaic_gpu.
inline_values): CUDA special registers of the running block, scalar arith,
FragmentedArray splats/arithmetic/broadcasts, scalar memref stores; and the
refusal of what is not modelled. Expected values: NumPy written from CUDA's
launch of a plgpu mesh (JAX's lowering: Pallas grid reversed into x/y/z,
axes beyond the minor two squashed into z, each axis scaled by the cluster)."""
from __future__ import annotations

import inspect

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from tests.mgpu_helpers import plgpu

import pallas_np
from pallas_np.errors import KernelError, UnsupportedError

mgpu = pytest.importorskip("jax.experimental.mosaic.gpu")
from jax._src.lib.mlir import ir  # noqa: E402
from jax._src.lib.mlir.dialects import arith as arith_dialect  # noqa: E402
from jax._src.lib.mlir.dialects import gpu as gpu_dialect  # noqa: E402
from jax._src.lib.mlir.dialects import memref as memref_dialect  # noqa: E402

I32 = jnp.int32

def _load(ref, **kwargs):
  """``plgpu.load`` of the whole ref (JAX 0.10 takes an index, 0.12 not)."""
  if "idx" in inspect.signature(plgpu.load).parameters:
    return plgpu.load(ref, (), **kwargs)
  return plgpu.load(ref, **kwargs)



def _cuda_coordinates():
  """(linear CUDA block index, x block id, cluster x id) of the block."""
  layout = plgpu.Layout.WG_SPLAT

  @plgpu.inline_mgpu(return_type=(plgpu.ShapeDtypeStruct((), I32, layout=layout),) * 3)
  def fn(_):
    dim = gpu_dialect.Dimension
    gx, gy = gpu_dialect.grid_dim(dim.x), gpu_dialect.grid_dim(dim.y)
    bx, by, bz = (gpu_dialect.block_id(d) for d in (dim.x, dim.y, dim.z))
    linear = arith_dialect.addi(bx, arith_dialect.addi(
        arith_dialect.muli(by, gx), arith_dialect.muli(bz, arith_dialect.muli(gx, gy))))
    i32 = ir.IntegerType.get_signless(32)
    as_i32 = lambda v: mgpu.FragmentedArray.splat(  # noqa: E731
        arith_dialect.index_cast(i32, v), shape=(), is_signed=True)
    return (as_i32(linear), as_i32(bx),
            as_i32(gpu_dialect.cluster_block_id(dim.x)))
  return fn()


@pytest.mark.parametrize("grid,cluster", [((2, 3), ()), ((2, 3), (2,)), ((2, 3, 4, 5), (2,)),
                                          ((2, 3, 4), (2, 3))])
def test_special_registers_follow_cuda_launch_grid(grid, cluster):
  grid_names = tuple("abcd"[:len(grid)])
  cluster_names = tuple("xy"[:len(cluster)])
  shape = (*cluster, *grid)

  @plgpu.kernel(out_type=[jax.ShapeDtypeStruct(shape, I32)] * 3, grid=grid,
                grid_names=grid_names, cluster=cluster, cluster_names=cluster_names)
  def kernel(lin_ref, bx_ref, cx_ref):
    lin, bx, cx = _cuda_coordinates()
    at = tuple(lax.axis_index(n) for n in (*cluster_names, *grid_names))
    lin_ref[at] = lin
    bx_ref[at] = bx
    cx_ref[at] = cx

  with pallas_np.force_numpy_interpret():
    lin, bx, cx = (np.asarray(o) for o in kernel())
  padded = (1,) * (len(grid) - len(cluster)) + tuple(cluster)
  want_lin = np.empty(shape, np.int32)
  want_bx = np.empty(shape, np.int32)
  want_cx = np.empty(shape, np.int32)
  for c in np.ndindex(*cluster):
    for g in np.ndindex(*grid):
      cpad = (0,) * (len(grid) - len(cluster)) + c
      scaled = tuple(gi * ci + k for gi, ci, k in zip(g, padded, cpad))  # row-major
      want_lin[(*c, *g)] = np.ravel_multi_index(scaled, tuple(a * b for a, b in
                                                              zip(grid, padded)))
      want_bx[(*c, *g)] = scaled[-1]
      want_cx[(*c, *g)] = cpad[-1]
  np.testing.assert_array_equal(lin, want_lin)
  np.testing.assert_array_equal(bx, want_bx)
  np.testing.assert_array_equal(cx, want_cx)
  assert math.prod(shape) == len(np.unique(lin))


def test_splat_arithmetic_and_broadcast_of_layout_args():
  layout = plgpu.Layout.WGMMA
  x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 7
  s = np.linspace(-3, 3, 64).astype(np.float32)

  @plgpu.kernel(out_type=jax.ShapeDtypeStruct((64, 32), jnp.float32))
  def kernel(x_ref, s_ref, o_ref):
    @plgpu.inline_mgpu(arg_types=(layout, layout.reduce(1)),
                       return_type=plgpu.ShapeDtypeStruct((64, 32), jnp.float32, layout=layout))
    def fn(ctx, xs, ss):
      del ctx
      one = mgpu.FragmentedArray.splat(mgpu.c(1.5, ir.F32Type.get()), (64, 32))
      return ss.broadcast_in_dim((64, 32), [0], layout=None) * xs - one + xs / xs
    o_ref[...] = fn(_load(x_ref, layout=layout, optimized=False),
                    _load(s_ref, layout=layout.reduce(1), optimized=False))

  with pallas_np.force_numpy_interpret():
    out = np.asarray(kernel(x, s))
  with np.errstate(invalid="ignore"):
    want = s[:, None] * x - np.float32(1.5) + x / x
  np.testing.assert_array_equal(out, want)


def test_integer_splat_wraps_and_scalar_store():
  @plgpu.kernel(out_type=(jax.ShapeDtypeStruct((), I32), jax.ShapeDtypeStruct((8,), jnp.int16)))
  def kernel(o_ref, w_ref):
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT))
    def write(ctx, ref, value):
      del ctx
      memref_dialect.store(value.registers.item(), ref, [])
    write(o_ref, jnp.array(42, I32))

    @plgpu.inline_mgpu(return_type=plgpu.ShapeDtypeStruct((8,), jnp.int16,
                                                          layout=plgpu.Layout.WG_SPLAT((8,))))
    def wrap(ctx):
      del ctx
      big = mgpu.FragmentedArray.splat(mgpu.c(30000, ir.IntegerType.get_signless(16)), (8,),
                                       is_signed=True)
      return big + big
    w_ref[...] = wrap()

  with pallas_np.force_numpy_interpret():
    o, w = kernel()
  assert int(o) == 42
  np.testing.assert_array_equal(np.asarray(w), np.full(8, np.int16(60000 - 65536)))


def test_unmodelled_construct_is_refused_by_name():
  @plgpu.kernel(out_type=jax.ShapeDtypeStruct((), I32))
  def kernel(o_ref):
    @plgpu.inline_mgpu(return_type=plgpu.ShapeDtypeStruct((), I32,
                                                          layout=plgpu.Layout.WG_SPLAT))
    def tid(ctx):
      del ctx
      t = gpu_dialect.thread_id(gpu_dialect.Dimension.x)
      return mgpu.FragmentedArray.splat(
          arith_dialect.index_cast(ir.IntegerType.get_signless(32), t), (), is_signed=True)
    o_ref[...] = tid()

  with pytest.raises((UnsupportedError, KernelError), match=r"gpu\.thread_id"):
    with pallas_np.force_numpy_interpret():
      kernel()


def test_tiled_ref_argument_may_be_passed_unused():
  transforms = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))

  @plgpu.kernel(out_type=jax.ShapeDtypeStruct((64, 32), jnp.float32),
                scratch_types=[plgpu.SMEM((64, 32), jnp.float32, transforms=transforms)])
  def kernel(x_ref, o_ref, smem):
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms),))
    def touch(ctx, ref):
      del ctx, ref
    touch(smem)
    o_ref[...] = x_ref[...] + 1

  x = np.ones((64, 32), np.float32)
  with pallas_np.force_numpy_interpret():
    np.testing.assert_array_equal(np.asarray(kernel(x)), x + 1)


def _tiled_roundtrip(await_copy: bool):
  """A tiled/swizzled SMEM ref (indexed on the Pallas side): loaded tiled,
  doubled plus one, stored tiled into a leading slice, sent to GMEM by a
  TMA store from the launch context (awaited, or left to the block's end)."""
  tile = (64, 64)
  transforms = (plgpu.TilingTransform(tile), plgpu.SwizzleTransform(128))

  def kernel(x_ref, o_ref, smem, bar):
    plgpu.copy_gmem_to_smem(x_ref, smem, bar)
    plgpu.barrier_wait(bar)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms),),
                       return_type=plgpu.ShapeDtypeStruct((128, 128), jnp.bfloat16,
                                                          layout=plgpu.Layout.WGMMA))
    def grow(ctx, ref):
      del ctx
      assert list(ref.type.shape) == [2, 2, 64, 64], ref.type.shape
      x = mgpu.FragmentedArray.load_tiled(ref, swizzle=128)
      one = mgpu.FragmentedArray.splat(mgpu.c(1.0, x.mlir_dtype), x.shape, layout=x.layout)
      return x + x + one

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(transforms),
                                  plgpu.RefType()))
    def store(ctx, arr, ref, out):
      first = mgpu.memref_slice(ref, (1,))
      arr.store_tiled(first, swizzle=128)
      mgpu.commit_shared()
      ctx.async_copy(src_ref=first, dst_ref=out, swizzle=128,
                     gmem_transform=mgpu.TileTransform(tile))
      if await_copy:
        ctx.await_async_copy(0)
      with mgpu.utils.when(mgpu.utils.single_thread_predicate()):
        pass

    store(grow(smem.at[0]), smem, o_ref)

  return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((128, 128), jnp.bfloat16),
                      scratch_types=[plgpu.SMEM((2, 128, 128), jnp.bfloat16,
                                                transforms=transforms), plgpu.Barrier()])


@pytest.mark.parametrize("await_copy", [True, False])
def test_tiled_ref_loads_stores_and_tma_store(await_copy):
  x = jax.random.uniform(jax.random.key(0), (2, 128, 128), minval=-8,
                         maxval=8).astype(jnp.bfloat16)
  with pallas_np.force_numpy_interpret():
    out = _tiled_roundtrip(await_copy)(x)
  x0 = np.asarray(x[0]).astype(np.float32)
  want = (x0 + x0 + 1).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(out), want)


def test_pallas_call_grid_registers_are_refused():
  def kernel(o_ref):
    o_ref[...] = jnp.full((128,), _cuda_coordinates()[0])

  fn = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), I32), interpret="numpy",
                      compiler_params=plgpu.CompilerParams())
  with pytest.raises((UnsupportedError, KernelError), match="gpu.grid_dim"):
    fn()


def test_warp_body_returning_an_array_is_refused_as_by_jax():
  @plgpu.kernel(out_type=jax.ShapeDtypeStruct((), I32))
  def kernel(o_ref):
    @plgpu.warp_map
    def _(warp_id):
      @plgpu.inline_mgpu(return_type=plgpu.ShapeDtypeStruct(
          (128,), I32, layout=plgpu.Layout.WG_SPLAT((128,))))
      def fn(ctx):
        del ctx
        return mgpu.FragmentedArray.splat(mgpu.c(1, ir.IntegerType.get_signless(32)), (128,),
                                          is_signed=True)
      @pl.when(warp_id == 0)
      def _():
        o_ref[...] = fn()[0]

  with pytest.raises(ValueError, match="single-warp context only supports scalar"):
    with pallas_np.force_numpy_interpret():
      kernel()


def test_warp_body_returning_a_scalar_reads_its_argument():
  @plgpu.kernel(out_type=(jax.ShapeDtypeStruct((), I32), jax.ShapeDtypeStruct((), I32)))
  def kernel(y_ref, z_ref):
    @plgpu.warp_map
    def _(warp_id):
      @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT),
                         return_type=plgpu.ShapeDtypeStruct((), I32,
                                                            layout=plgpu.Layout.WG_SPLAT))
      def write(ctx, ref, wid):
        del ctx
        memref_dialect.store(wid.registers.item(), ref, [])
        ten = mgpu.FragmentedArray.splat(mgpu.c(10, ir.IntegerType.get_signless(32)), (),
                                         is_signed=True)
        return wid + ten
      @pl.when(warp_id == 2)
      def _():
        z_ref[...] = write(y_ref, warp_id)

  with pallas_np.force_numpy_interpret():
    y, z = kernel()
  assert (int(y), int(z)) == (2, 12)
