"""Loops whose only work is an eqn JAX gives no effects.

``plsc.parallel_loop`` over refs and a ``pallas_call`` closing over refs
write memory, but their eqns carry no effects, and JAX derives a loop's
effects from its body's: a ``pl.loop`` (a scan with an unused counter) whose
body is such an eqn looked dead and was dropped, leaving the refs unchanged
(JAX's ``tpu_sparsecore_pallas_test`` ``test_parallel_loop``)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np

plsc = pytest.importorskip("jax.experimental.pallas.tpu_sc")


@pytest.fixture(scope="module", autouse=True)
def sparse_core_chip():
  """Meshes ask the chip for its SparseCore count: assume a v5p (tracing only)."""
  pallas_np.assume_tpu_chip("v5p")
  yield
  pallas_np.assume_tpu_chip("v5e")


@pytest.mark.parametrize("outer_parallel", [False, True])
@pytest.mark.parametrize("unroll", [1, 4])
def test_parallel_loop_inside_a_loop_writes_its_ref(outer_parallel, unroll):
  x = np.arange(16 * 16, dtype=np.int32).reshape(16, 16)
  outer = plsc.parallel_loop if outer_parallel else pl.loop

  @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
             mesh=plsc.ScalarSubcoreMesh(axis_name="core", num_cores=1),
             scratch_types=(pltpu.SMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA),
             interpret="numpy")
  def kernel(x_ref, o_ref, tmp_ref, sem):
    pltpu.async_copy(x_ref, tmp_ref, sem).wait()

    @outer(0, tmp_ref.shape[0])
    def _(i):
      @plsc.parallel_loop(0, tmp_ref.shape[1], unroll=unroll)
      def _(j):
        tmp_ref[i, j] += i + 1
    pltpu.async_copy(tmp_ref, o_ref, sem).wait()

  np.testing.assert_array_equal(np.asarray(kernel(jnp.asarray(x))),
                                x + np.arange(1, 17)[:, None])


def test_transform_after_an_indexer_raises_in_mosaics_words():
  """JAX's ``test_invalid_gather_1d_with_extra_transforms`` expects Mosaic's
  wording; pallas_np's UnsupportedError (a NotImplementedError) says it."""
  x = np.arange(8, dtype=np.int32)
  mesh = plsc.VectorSubcoreMesh(core_axis_name="core", subcore_axis_name="subcore",
                                num_cores=1, num_subcores=1)

  @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh,
             scratch_types=(pltpu.VMEM((8,), jnp.int32), pltpu.VMEM((8,), jnp.int32)),
             interpret="numpy")
  def kernel(x_hbm, idx_hbm, o_hbm, idx, buf):
    pltpu.sync_copy(idx_hbm, idx)
    pltpu.sync_copy(x_hbm.at[idx].reshape(8), buf)
    pltpu.sync_copy(buf, o_hbm)

  with pytest.raises(NotImplementedError, match="cannot have any transforms following the indexer"):
    jax.block_until_ready(kernel(jnp.asarray(x), jnp.asarray(x[::-1].copy())))
