"""Idioms real TPU kernel libraries rely on (tokamax, tpu-inference), each
reproduced by a small kernel of our own: a DMA wait whose descriptor runs past
its ref, zero-stride loads, speculative loads past a ref, indexed DMAs through
a sliced index ref, width-changing bitcasts of big refs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from tests.tpu_helpers import compare, numpy_mode, tpu_interpret

f32, i32 = jnp.float32, jnp.int32


# -- 1. a DMA wait only counts bytes ----------------------------------------------------
def _one_wait_for_three_kernel(n_ref, x_hbm, o_ref, buf, sem):
  """Three row DMAs into buf[i] on one semaphore, then one wait whose
  descriptor, buf.at[0, pl.ds(0, 3 * n)], is three times the axis it slices
  (causal_conv1d / conv1d_gdn decode kernels)."""
  n = n_ref[0]
  for i in range(3):
    pltpu.make_async_copy(x_hbm.at[pl.ds(i * 4, 4)], buf.at[i], sem).start()
  total = n * 3
  pltpu.make_async_copy(buf.at[0, pl.ds(0, total)], buf.at[0, pl.ds(0, total)], sem).wait()
  o_ref[...] = buf[...].reshape(12, 128)


def _one_wait_call(n):
  x = jnp.arange(12 * 128, dtype=f32).reshape(12, 128)
  fn = lambda: pl.pallas_call(
      _one_wait_for_three_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, f32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(1,),
          in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
          scratch_shapes=[pltpu.VMEM((3, 4, 128), f32), pltpu.SemaphoreType.DMA]),
  )(jnp.array([n], i32), x)
  return x, fn


def test_a_dma_wait_descriptor_larger_than_its_ref_only_counts_bytes():
  x, fn = _one_wait_call(4)
  got = compare(fn, oracle=tpu_interpret)  # TPU interpret mode: bytes of the shape
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x))


def test_a_dma_wait_for_more_bytes_than_were_sent_deadlocks():
  _, fn = _one_wait_call(5)  # waits for 15 rows' bytes, 12 were sent
  with numpy_mode(), pytest.raises(Exception, match="deadlock"):
    jax.block_until_ready(fn())


# -- 2. zero-stride loads ----------------------------------------------------------------
@pytest.mark.parametrize("start", [0, 3, 15])
def test_a_zero_stride_load_broadcasts_one_row(start):
  """x_ref[pl.ds(start, 8, stride=0)]: 8 copies of row ``start`` (sublane
  broadcast; gmm_v2 int8/fp8 scales). interpret=True ignores the stride."""
  x = jnp.arange(16 * 128, dtype=f32).reshape(16, 128)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(start, 8, stride=0), :] * 2.0
  with numpy_mode():
    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), f32))(x)
  want = np.broadcast_to(np.asarray(x)[start] * 2.0, (8, 128))
  np.testing.assert_array_equal(np.asarray(got), want)


def test_a_zero_stride_load_with_a_dynamic_start_and_an_int_index():
  x = jnp.arange(2 * 16 * 128, dtype=f32).reshape(2, 16, 128)

  def kernel(s_ref, x_ref, o_ref):
    o_ref[...] = x_ref[1, pl.ds(s_ref[0], 8, stride=0), pl.ds(0, 128)]
  with numpy_mode():
    got = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8, 128), f32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)],
    )(jnp.array([5], i32), x)
  np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(np.asarray(x)[1, 5], (8, 128)))


# -- 3. speculative loads past a ref ----------------------------------------------------
def _look_ahead_kernel(ids_ref, x_ref, o_ref):
  """Sums ids[i + 1] for every i, reading ids[n] (one past the end) as the
  not-taken side of a select, as look-ahead pipelines do."""
  n = ids_ref.shape[0]

  def body(i, acc):
    return acc + jax.lax.select(i + 1 < n, ids_ref[i + 1], 0)
  tot = jax.lax.fori_loop(0, n, body, 0)
  o_ref[...] = x_ref[...] + tot.astype(f32)


def _look_ahead_call(kernel=_look_ahead_kernel):
  ids, x = jnp.array([3, 5, 7, 9], i32), jnp.zeros((8, 128), f32)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((8, 128), f32),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)],
  )(ids, x)


def test_a_load_past_a_ref_raises_by_default_and_names_oob_reads():
  with numpy_mode(), pytest.raises(Exception, match="oob_reads='fill'"):
    jax.block_until_ready(_look_ahead_call())


@pytest.mark.parametrize("native", ["off", "sync"])
def test_oob_reads_fill_runs_a_discarded_look_ahead_load(native):
  with numpy_mode(oob_reads="fill", native_loops=native):
    for _ in range(4):  # (past the native tier's hot-run count)
      got = np.asarray(_look_ahead_call())
  np.testing.assert_array_equal(got, np.full((8, 128), 5 + 7 + 9, np.float32))


def test_oob_reads_fill_reads_the_fill_where_a_used_load_runs_past():
  """A value read past the ref and *used* shows up: NaN for floats, the
  minimum for ints; the in-bounds part is read as usual."""
  x = jnp.arange(8 * 128, dtype=f32).reshape(8, 128)

  def kernel(s_ref, x_ref, o_ref, oi_ref):
    o_ref[...] = x_ref[pl.ds(s_ref[0], 4), :]
    oi_ref[0] = s_ref[s_ref[1]]
  with numpy_mode(oob_reads="fill"):
    got, got_i = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((4, 128), f32), jax.ShapeDtypeStruct((1,), i32)),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=(pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pltpu.SMEM)),
    )(jnp.array([6, -1], i32), x)
  got = np.asarray(got)
  np.testing.assert_array_equal(got[:2], np.asarray(x)[6:8])
  assert np.isnan(got[2:]).all()
  assert int(np.asarray(got_i)[0]) == np.iinfo(np.int32).min


def test_oob_reads_fill_still_raises_for_stores_and_dmas():
  def store_kernel(s_ref, o_ref):
    o_ref[s_ref[0]] = 1
  with numpy_mode(oob_reads="fill"), pytest.raises(Exception, match="out-of-bounds"):
    jax.block_until_ready(pl.pallas_call(
        store_kernel, out_shape=jax.ShapeDtypeStruct((4,), i32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.SMEM))(jnp.array([4], i32)))

  def dma_kernel(s_ref, x_hbm, o_ref, sem):
    pltpu.make_async_copy(x_hbm.at[pl.ds(s_ref[0], 8)], o_ref, sem).start()
    pltpu.make_async_copy(x_hbm.at[pl.ds(0, 8)], o_ref, sem).wait()
  with numpy_mode(oob_reads="fill"), pytest.raises(Exception, match="out-of-bounds"):
    jax.block_until_ready(pl.pallas_call(
        dma_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), f32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[pltpu.SemaphoreType.DMA]),
    )(jnp.array([12], i32), jnp.zeros((16, 128), f32)))


# -- 5. an indexed DMA through a slice of the index ref ------------------------------------
def test_indexed_dma_through_a_sliced_index_ref():
  """x_hbm.at[idx_vmem.at[pl.ds(8, 8)]]: the second half of each subcore's
  indices gathers its rows (tokamax SparseCore top_k, JAX's SparseCore
  tutorial)."""
  plsc = pytest.importorskip("jax.experimental.pallas.tpu_sc")
  pallas_np.assume_tpu_chip("v5p")  # meshes ask the chip for its SparseCores (tracing only)
  try:
    mesh = plsc.VectorSubcoreMesh(core_axis_name="core", subcore_axis_name="subcore",
                                  num_cores=1, num_subcores=2)
    table = jnp.arange(64 * 128, dtype=f32).reshape(64, 128)
    idx = jnp.array(np.random.RandomState(0).randint(0, 64, size=32), i32)

    def body(x_hbm, idx_hbm, o_hbm, idx_vmem, rows):
      s = jax.lax.axis_index("subcore")
      pltpu.sync_copy(idx_hbm.at[pl.ds(s * 16, 16)], idx_vmem)
      pltpu.sync_copy(x_hbm.at[idx_vmem.at[pl.ds(8, 8)]], rows)
      pltpu.sync_copy(rows, o_hbm.at[pl.ds(s * 8, 8)])
    k = pl.kernel(body, out_type=jax.ShapeDtypeStruct((16, 128), f32), mesh=mesh,
                  interpret="numpy",
                  scratch_types=[pltpu.VMEM((16,), i32), pltpu.VMEM((8, 128), f32)])
    got = np.asarray(k(table, idx))
  finally:
    pallas_np.assume_tpu_chip("v5e")
  want = np.asarray(table)[np.asarray(idx).reshape(2, 16)[:, 8:].reshape(-1)]
  np.testing.assert_array_equal(got, want)


# -- 6. width-changing bitcasts of big refs, indexed through --------------------------------
ROWS_BIG = 4096


def _bitcast_gather_kernel(idx_ref, x_hbm, o_hbm, buf, sem):
  """Gathers 4-row groups of a bf16 HBM ref seen as int32 (2 bf16 rows per
  int32 row, csa_gather style) into VMEM, bumps them, and writes them to
  an int32 view of the output: both bitcasts are indexed, never copied."""
  x32, o32 = x_hbm.bitcast(i32), o_hbm.bitcast(i32)
  for k in range(3):
    pltpu.make_async_copy(x32.at[pl.ds(idx_ref[k], 4)], buf, sem).start()
    pltpu.make_async_copy(x32.at[pl.ds(idx_ref[k], 4)], buf, sem).wait()
    buf[...] = buf[...] + 1
    pltpu.make_async_copy(buf, o32.at[pl.ds(k * 4, 4)], sem).start()
    pltpu.make_async_copy(buf, o32.at[pl.ds(k * 4, 4)], sem).wait()
  sub = x32.at[pl.ds(8, 8)]  # a view of a view of the bitcast
  pltpu.sync_copy(sub.at[pl.ds(2, 4)], o32.at[pl.ds(12, 4)])
  pltpu.sync_copy(o32.at[pl.ds(0, 4)], buf)  # read back what the first DMA wrote
  pltpu.sync_copy(buf, o32.at[pl.ds(16, 4)])


def _bitcast_gather_call():
  x = jax.random.normal(jax.random.key(0), (ROWS_BIG, 128), jnp.bfloat16)
  return pl.pallas_call(
      _bitcast_gather_kernel, out_shape=jax.ShapeDtypeStruct((40, 128), jnp.bfloat16),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=pl.BlockSpec(memory_space=pl.ANY),
          scratch_shapes=[pltpu.VMEM((4, 128), i32), pltpu.SemaphoreType.DMA]),
  )(jnp.array([6, 1000, ROWS_BIG // 2 - 4], i32), x)


def test_dmas_through_a_widening_bitcast():
  """No JAX oracle: interpret=True and TPU interpret mode both refuse a
  BitcastTransform in a DMA. The reference follows Mosaic's bitcast: int32
  row m, lane n holds bf16 rows 2m (low half) and 2m + 1 (high half)."""
  with numpy_mode():
    got = np.asarray(_bitcast_gather_call()).view(np.uint16)
  x16 = np.asarray(jax.random.normal(jax.random.key(0), (ROWS_BIG, 128), jnp.bfloat16)).view(np.uint16)
  x32 = x16[0::2].astype(np.uint32) | (x16[1::2].astype(np.uint32) << 16)
  o32 = np.zeros((20, 128), np.uint32)
  for k, start in enumerate([6, 1000, ROWS_BIG // 2 - 4]):
    o32[4 * k:4 * k + 4] = x32[start:start + 4] + np.uint32(1)
  o32[12:16] = x32[10:14]
  o32[16:20] = o32[0:4]
  want = np.empty((40, 128), np.uint16)
  want[0::2], want[1::2] = o32 & 0xFFFF, o32 >> 16
  np.testing.assert_array_equal(got, want)


def test_indexing_through_a_bitcast_converts_only_the_rows_it_touches(bitcast_sizes):
  with numpy_mode():
    jax.block_until_ready(_bitcast_gather_call())
  assert bitcast_sizes and max(bitcast_sizes) <= 16 * 128, max(bitcast_sizes)  # never the 4096-row input


# -- 3b. Triton: an unmasked block load that runs past the array, rows dropped at the store --
def test_oob_reads_fill_runs_a_triton_over_read_whose_rows_the_store_masks():
  """tokamax ragged_dot (Triton): ``load(a_ref.at[pl.ds(start, 64)])`` with
  no mask (the block is not bounds-checked) runs past the 100-row array; the
  rows past it are dropped by the masked store."""
  from jax.experimental.pallas import triton as plgpu
  m, block = 100, 64
  x = jnp.arange(m * 8, dtype=f32).reshape(m, 8)

  def kernel(x_ref, o_ref):
    start = pl.program_id(0) * block
    rows = plgpu.load(x_ref.at[pl.ds(start, block)])
    mask = (start + jnp.arange(block) < m)[:, None]
    plgpu.store(o_ref.at[pl.ds(start, block)], rows * 2.0, mask=mask)

  def call():
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((m, 8), f32), grid=(2,),
                          compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))(x)
  with numpy_mode(), pytest.raises(Exception, match="oob_reads='fill'"):
    jax.block_until_ready(call())
  for vec in (False, True):
    with numpy_mode(oob_reads="fill", vectorize=vec):
      got = np.asarray(call())
    np.testing.assert_array_equal(got, np.asarray(x) * 2.0)


@pytest.mark.parametrize("dtype,to", [(np.uint8, np.int32), (np.int32, np.int8), (np.uint16, np.uint32)])
def test_a_bitcast_lens_indexed_through_equals_the_whole_bitcast_indexed(dtype, to):
  """``BitcastLens[idx]`` (only the touched row groups converted) against
  the whole-ref conversion (``lens.tpu_bitcast``, checked against
  interpret=True in test_ref_transforms), for reads and writes."""
  from pallas_np.state import lens
  rng = np.random.RandomState(0)
  parent = rng.randint(0, 200, size=(6, 8, 16, 128)).astype(dtype)
  rows = np.array([4, 0, 5, 2])
  view_rows = lens.bitcast(parent.copy(), to).shape[-2]
  for idx in [(rows,), (1, slice(2, 5)), (rows, slice(None), slice(1, view_rows - 1), slice(0, 64)),
              (Ellipsis, 3, slice(None)), (slice(0, 6, 2), 7, slice(0, view_rows, 2))]:
    want = lens.tpu_bitcast(parent, to)[idx]
    np.testing.assert_array_equal(lens.bitcast(parent.copy(), to)[idx], want)
    p2 = parent.copy()
    new = rng.randint(0, 100, size=want.shape).astype(want.dtype)
    lens.bitcast(p2, to)[idx] = new
    whole = lens.tpu_bitcast(parent, to)
    whole[idx] = new
    np.testing.assert_array_equal(p2, lens.tpu_bitcast(whole, dtype))
