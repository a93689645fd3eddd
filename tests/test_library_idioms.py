"""Constructs of public kernel libraries' kernels (tokamax, tpu-inference),
each reproduced by a small kernel or call of our own (CI has no mirror of
the libraries): what the hardware / XLA does, against a reference written
from the semantics or JAX's own interpreters."""
import numpy as np
import pytest


# -- an indexed gather of rows through a width-changing ref bitcast --------------------
# DeepSeek-V4 csa_gather (tpu-inference): ``pl.Indirect`` block specs gather
# rows of ``cache_u8.bitcast(jnp.int32)`` by a token index array: the index
# array sits on the second-minor dim, the one the bitcast packs along.
@pytest.mark.parametrize("dtype,to", [(np.uint8, np.int32), (np.int32, np.int8),
                                      (np.uint16, np.uint32), (np.uint32, np.uint16)])
def test_a_gather_along_the_packed_dim_of_a_bitcast_lens(dtype, to):
  """Reads and writes of ``lens[rows]`` (rows with duplicates and rows of
  one packed group) against the whole ref converted and indexed
  (``lens.tpu_bitcast``, checked against interpret=True in
  test_ref_transforms)."""
  from pallas_np.state import lens
  rng = np.random.RandomState(1)
  parent = rng.randint(0, 200, size=(64, 16)).astype(dtype)
  view_rows = lens.bitcast(parent.copy(), to).shape[0]
  rows = np.array([5, 4, view_rows - 1, 0, 5, 6, 7, 1], np.int32)
  for idx in [(rows,), (rows, slice(2, 9)), (rows, 3)]:
    want = lens.tpu_bitcast(parent, to)[idx]
    np.testing.assert_array_equal(lens.bitcast(parent.copy(), to)[idx], want)
    new = rng.randint(0, 100, size=want.shape).astype(want.dtype)
    got_parent = parent.copy()
    lens.bitcast(got_parent, to)[idx] = new
    whole = lens.tpu_bitcast(parent, to)
    whole[idx] = new  # NumPy: the last of duplicate rows wins
    np.testing.assert_array_equal(got_parent, lens.tpu_bitcast(whole, dtype))


def test_a_gather_along_the_packed_dim_converts_only_the_gathered_groups(bitcast_sizes):
  """The csa_gather slow path: a gather of 16 rows of a 4096-row bitcast
  converted the whole ref on every DMA (minutes per test)."""
  from pallas_np.state import lens
  parent = np.arange(4 * 4096 * 8, dtype=np.int64).astype(np.uint8).reshape(4 * 4096, 8)
  rows = np.arange(0, 4096, 256, dtype=np.int32)
  got = lens.bitcast(parent, np.int32)[rows]
  assert max(bitcast_sizes) <= 16 * 4 * 8, max(bitcast_sizes)
  want = parent.reshape(4096, 4, 8).astype(np.uint32)
  want = want[:, 0] | want[:, 1] << 8 | want[:, 2] << 16 | want[:, 3] << 24  # little-endian bytes
  np.testing.assert_array_equal(got.view(np.uint32), want[rows])


# -- pltriton.approx_tanh (tokamax's Triton attention and GLU kernels) ------------------
def _approx_tanh_call(x):
  import jax
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pltriton

  def kernel(x_ref, o_ref):
    o_ref[...] = pltriton.approx_tanh(x_ref[...])
  return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(x)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_approx_tanh_is_xlas_float32_tanh_on_every_cpu(dtype):
  """The GPU's tanh.approx is specified only to ~2**-11 and interpret=True
  has no rule for its asm; numpy mode gives XLA's float32 tanh (what
  ``lax.tanh`` gives, the same bits on any CPU; NumPy's float32 tanh, whose
  SIMD path depends on the CPU, differed from it in the last bit on most of
  these inputs), rounded to bf16/f16."""
  import jax
  import jax.numpy as jnp
  from tests.tpu_helpers import numpy_mode
  special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 3e-4, -5e-4, 19.9, -20.5, 7.99, 8.1]
  x32 = np.concatenate([np.linspace(-9, 9, 4096 - len(special)), special]).astype(np.float32)
  x = jnp.asarray(x32).astype(dtype).reshape(32, 128)
  with numpy_mode():
    got = np.asarray(_approx_tanh_call(x))
  want = np.asarray(jax.jit(lambda v: jnp.tanh(v.astype(jnp.float32)).astype(v.dtype))(x))
  bits = np.uint32 if dtype == "float32" else np.uint16
  np.testing.assert_array_equal(got.view(bits), want.view(bits))


# -- the zero signs of a float cumsum ----------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape,axis", [((8, 16), 1), ((8, 16), 0), ((8, 1), 1), ((1, 128), 0)])
@pytest.mark.parametrize("reverse", [False, True])
def test_cumsum_zero_signs_follow_xla(dtype, shape, axis, reverse):
  """XLA sums each prefix as a reduce-window from +0.0, so no partial sum is
  -0.0 (NumPy's cumsum starts from the first element and keeps it); along
  an axis of length 1 XLA's simplifier drops the window (the input comes
  back, -0.0 kept) except in bf16. Bits against interpret=True, whose
  cumsum is XLA's."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.experimental import pallas as pl
  from tests.tpu_helpers import hlo_interpret, numpy_mode
  rng = np.random.RandomState(sum(shape) + axis)
  x = jnp.asarray(rng.choice(np.float32([-0.0, -0.0, 0.0, 1.0, -1.0]), size=shape), dtype)

  def kernel(x_ref, o_ref):
    o_ref[...] = lax.cumsum(x_ref[...], axis=axis, reverse=reverse)

  def call():
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(shape, x.dtype))(x)
  with numpy_mode():
    got = np.asarray(call())
  with hlo_interpret():
    want = np.asarray(call())
  bits = np.uint32 if dtype == "float32" else np.uint16
  np.testing.assert_array_equal(got.view(bits), want.view(bits))


# -- DMAs into the tile padding past an array's end (tokamax gmm_v2 n=500, tgmm k=n=255) ---
def _padded_dma_call(cols_window, rows=13, cols=500, row_window=(8, 8), traced_size=False):
  """DMAs a window of a (13, 500) HBM array that runs past its end (into
  the (16, 512) tile padding) into VMEM, doubles it, DMAs it back through
  the same window of the output, and returns what VMEM held there."""
  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  r0, nr = row_window

  def kernel(x_hbm, o_hbm, seen_ref, buf, sem):
    zero = pl.program_id(0)  # traced starts: JAX checks static ones at trace time
    # emit_pipeline's ragged last block: a traced size rounded up to the tiling
    size = jnp.where(zero == 0, cols_window, 128) if traced_size else cols_window
    window = (pl.ds(zero + r0, nr), pl.ds(zero, size))
    part = buf.at[:, pl.ds(0, size)]
    buf[...] = jnp.zeros_like(buf)
    pltpu.async_copy(x_hbm.at[window], part, sem).wait()
    buf[...] = buf[...] * 2.0
    seen_ref[...] = buf[...]
    pltpu.async_copy(part, o_hbm.at[window], sem).wait()
  x = jnp.arange(rows * cols, dtype=jnp.float32).reshape(rows, cols)
  return pl.pallas_call(
      kernel, grid=(1,),
      out_shape=(jax.ShapeDtypeStruct((rows, cols), jnp.float32),
                 jax.ShapeDtypeStruct((nr, cols_window), jnp.float32)),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=(pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pltpu.VMEM)),
      scratch_shapes=[pltpu.VMEM((nr, cols_window), jnp.float32), pltpu.SemaphoreType.DMA],
      input_output_aliases={0: 0})(x)


@pytest.mark.parametrize("window", [dict(cols_window=512), dict(cols_window=512, row_window=(8, 8)),
                                    dict(cols_window=256, row_window=(12, 4)),
                                    dict(cols_window=512, traced_size=True)])
def test_a_dma_into_the_tile_padding_follows_tpu_interpret_mode(window):
  """buffer_bounds='padded': the window reads NaN (the uninitialized fill)
  past the end and its writes there are dropped, as TPU interpret mode with
  buffer_bounds='padded' does; the default raises and names the option."""
  import jax
  from jax.experimental.pallas import tpu as pltpu
  import pallas_np
  from tests.tpu_helpers import numpy_mode
  pallas_np.assume_tpu_chip("v5e")  # TPU interpret mode's padding asks the chip (v4+: the same)
  with numpy_mode(), pytest.raises(Exception, match="buffer_bounds='padded'"):
    jax.block_until_ready(_padded_dma_call(**window))
  with numpy_mode(buffer_bounds="padded"):
    got = [np.asarray(a) for a in _padded_dma_call(**window)]
  with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(buffer_bounds="padded")):
    want = [np.asarray(a) for a in _padded_dma_call(**window)]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  assert np.isnan(got[1]).any()  # the padding was read


def test_a_dma_past_the_tile_padding_still_raises():
  import jax
  from tests.tpu_helpers import numpy_mode
  with numpy_mode(buffer_bounds="padded"), pytest.raises(Exception, match="out-of-bounds"):
    jax.block_until_ready(_padded_dma_call(cols_window=640))


# -- an indexed DMA through an index ref sliced with a traced size ----------------------
# tokamax SparseCore top_k writes its survivors with
# ``out.at[iota_ref.at[pl.ds(0, n)]]``, n the (traced) number of survivors.
def _traced_index_slice_kernel(scatter):
  """Each vector subcore DMAs ``n = 3 * s + 2`` rows through its index ref
  sliced at ``pl.ds(0, n)``: a gather (table rows by index) or a scatter
  (its first n rows to the indexed rows of the output), then waits."""
  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu

  def body(x_hbm, idx_hbm, o_hbm, idx_vmem, rows, sem):
    s = jax.lax.axis_index("subcore")
    n = 3 * s + 2
    pltpu.sync_copy(idx_hbm.at[pl.ds(s * 8, 8)], idx_vmem)
    if scatter:
      pltpu.sync_copy(x_hbm.at[pl.ds(s * 8, 8)], rows)
      copy = pltpu.make_async_copy(rows.at[pl.ds(0, n)], o_hbm.at[idx_vmem.at[pl.ds(0, n)]], sem)
      copy.start()
      copy.wait()
    else:
      rows[...] = jnp.full(rows.shape, -1.0, rows.dtype)
      copy = pltpu.make_async_copy(x_hbm.at[idx_vmem.at[pl.ds(0, n)]], rows.at[pl.ds(0, n)], sem)
      copy.start()
      copy.wait()
      pltpu.sync_copy(rows, o_hbm.at[pl.ds(s * 8, 8)])
  return body


@pytest.mark.parametrize("scatter", [False, True])
def test_an_indexed_dma_through_an_index_slice_of_traced_size(scatter):
  """Exactly the first n indices move n rows (the wait takes the n rows'
  bytes); rows past n keep what they held. NumPy reference (no JAX
  interpreter runs SparseCore indexed DMAs: TPU interpret mode reads
  garbage indices there, interpret=True cannot trace a traced size)."""
  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  import pallas_np
  plsc = pytest.importorskip("jax.experimental.pallas.tpu_sc")
  pallas_np.assume_tpu_chip("v5p")  # meshes ask the chip for its SparseCores (tracing only)
  try:
    mesh = plsc.VectorSubcoreMesh(core_axis_name="core", subcore_axis_name="subcore",
                                  num_cores=1, num_subcores=2)
    table = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128)
    # distinct indices (a scatter with repeated rows would race on a TPU)
    idx = jnp.asarray(np.random.RandomState(0).permutation(32)[:16], jnp.int32)
    k = pl.kernel(_traced_index_slice_kernel(scatter),
                  out_type=jax.ShapeDtypeStruct((32 if scatter else 16, 128), jnp.float32),
                  mesh=mesh, interpret="numpy",
                  scratch_types=[pltpu.VMEM((8,), jnp.int32), pltpu.VMEM((8, 128), jnp.float32),
                                 pltpu.SemaphoreType.DMA])
    got = np.asarray(k(table, idx))
  finally:
    pallas_np.assume_tpu_chip("v5e")
  t, ix = np.asarray(table), np.asarray(idx).reshape(2, 8)
  if scatter:  # the other output rows are never written (uninitialised)
    for s in range(2):
      n = 3 * s + 2
      np.testing.assert_array_equal(got[ix[s, :n]], t[s * 8:s * 8 + n])
  else:
    want = np.full((16, 128), -1.0, np.float32)
    for s in range(2):
      n = 3 * s + 2
      want[s * 8:s * 8 + n] = t[ix[s, :n]]
    np.testing.assert_array_equal(got, want)


# -- a compressed store / expanded load whose window runs past the ref ------------------
# tokamax SparseCore top_k appends survivors with
# ``plsc.store_compressed(out.at[pl.ds(count, lanes)], x, mask=m)``: the
# window may run past the ref's end, only the count(m) elements written
# must lie inside it.
def _compressed_window_kernel(start, n_true):
  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  from jax.experimental.pallas import tpu_sc as plsc

  def body(x_hbm, o_hbm, got_hbm, x, o, got):
    pltpu.sync_copy(x_hbm, x)
    o[...] = jnp.zeros_like(o)
    s = jax.lax.axis_index("subcore") + start  # traced: JAX checks static windows
    mask = jnp.arange(8) >= 8 - n_true  # the last n_true lanes
    got[...] = plsc.load_expanded(x.at[pl.ds(s, 8)], mask=mask)
    plsc.store_compressed(o.at[pl.ds(s, 8)], got[...] * 10.0, mask=mask)
    pltpu.sync_copy(o, o_hbm)
    pltpu.sync_copy(got, got_hbm)
  return body


def _compressed_window_call(start, n_true):
  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  import pallas_np
  plsc = pytest.importorskip("jax.experimental.pallas.tpu_sc")
  pallas_np.assume_tpu_chip("v5p")  # meshes ask the chip for its SparseCores (tracing only)
  try:
    mesh = plsc.VectorSubcoreMesh(core_axis_name="core", subcore_axis_name="subcore",
                                  num_cores=1, num_subcores=1)
    x = jnp.arange(8, dtype=jnp.float32) + 1
    k = pl.kernel(_compressed_window_kernel(start, n_true),
                  out_type=(jax.ShapeDtypeStruct((8,), jnp.float32),
                            jax.ShapeDtypeStruct((8,), jnp.float32)),
                  mesh=mesh, interpret="numpy",
                  scratch_types=[pltpu.VMEM((8,), jnp.float32)] * 3)
    return [np.asarray(a) for a in k(x)]
  finally:
    pallas_np.assume_tpu_chip("v5e")


@pytest.mark.parametrize("start,n_true", [(5, 3), (0, 8), (7, 1), (3, 0)])
def test_a_compressed_store_window_may_run_past_the_ref(start, n_true):
  """The i-th masked lane goes to (comes from) element ``start + i``, as the
  docstrings of store_compressed / load_expanded say; nothing else of the
  window is touched. NumPy reference (no JAX interpreter runs them)."""
  o, got = _compressed_window_call(start, n_true)
  x = np.arange(8, dtype=np.float32) + 1
  lanes = np.arange(8 - n_true, 8)
  np.testing.assert_array_equal(got[lanes], x[start:start + n_true])
  want = np.zeros(8, np.float32)
  want[start:start + n_true] = 10 * x[start:start + n_true]
  np.testing.assert_array_equal(o, want)


def test_a_compressed_store_past_the_ref_still_raises():
  with pytest.raises(Exception, match="out-of-bounds|out of bounds"):
    _compressed_window_call(6, 3)  # element 8 would be written


# -- a narrow-float matmul split into sub-tiles: the same bits as the whole ------------
# tokamax splash attention's ``qk_diag_skip`` computes a causal block's QK^T
# as a grid of sub-tile dots (skipping those above the diagonal) and its
# tests demand the bits of the one big dot: an MXU's result per element
# does not depend on how M and N are tiled.
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn"])
def test_a_narrow_float_dot_does_not_depend_on_the_tiling(dtype):
  """Each element is the exact sum of the (exact) products rounded once to
  float32: the NumPy float64 reference, whole or split."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.experimental import pallas as pl
  from tests.tpu_helpers import numpy_mode
  dims = (((1,), (1,)), ((), ()))

  def kernel(split):
    def body(q_ref, k_ref, o_ref):
      q, k = q_ref[...], k_ref[...]
      if not split:
        o_ref[...] = lax.dot_general(q, k, dims, preferred_element_type=jnp.float32)
        return
      o_ref[...] = jnp.concatenate([
          jnp.concatenate([lax.dot_general(q[i * 64:(i + 1) * 64], k[j * 64:(j + 1) * 64], dims,
                                           preferred_element_type=jnp.float32)
                           for j in range(4)], axis=1)
          for i in range(4)], axis=0)
    return body
  q = (jax.random.normal(jax.random.key(1), (256, 128)) * 0.5).astype(dtype)
  k = (jax.random.normal(jax.random.key(2), (256, 128)) * 0.5).astype(dtype)
  with numpy_mode():
    whole, split = (np.asarray(pl.pallas_call(kernel(s), jax.ShapeDtypeStruct((256, 256),
                                                                            jnp.float32))(q, k))
                    for s in (False, True))
  want = (np.asarray(q).astype(np.float64) @ np.asarray(k).astype(np.float64).T).astype(np.float32)
  np.testing.assert_array_equal(whole.view(np.uint32), want.view(np.uint32))
  np.testing.assert_array_equal(split.view(np.uint32), want.view(np.uint32))
