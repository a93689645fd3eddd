"""``plgpu.async_store_smem`` (a register array stored into the SMEM of a
block of the cluster, completing the destination block's barrier),
``plgpu.cluster_ref`` (reads and writes of a peer block's SMEM) and
``plgpu.barrier_test`` (in a warp). Expected values: NumPy written from the
semantics (each block of a 2-block cluster stores into the other's SMEM)."""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from tests.mgpu_helpers import plgpu

import pallas_np
from pallas_np.errors import KernelError, UnsupportedError

TILED = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def _load(ref, **kwargs):
  """``plgpu.load`` of the whole ref (JAX 0.10 takes an index, 0.12 not)."""
  if "idx" in inspect.signature(plgpu.load).parameters:
    return plgpu.load(ref, (), **kwargs)
  return plgpu.load(ref, **kwargs)


@pytest.mark.parametrize("atomic", [None, "add", "max"])
def test_async_store_smem_into_the_peer_block(atomic):
  shape = (2, 64, 32)
  kw = {} if atomic is None else {"atomic": atomic}

  @plgpu.kernel(out_type=jax.ShapeDtypeStruct(shape, jnp.int32),
                scratch_types=[plgpu.SMEM((64, 32), jnp.int32, transforms=TILED),
                               plgpu.ClusterBarrier(collective_axes=("c",), num_arrivals=1),
                               plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1)],
                cluster=(2,), cluster_names=("c",))
  def kernel(x_ref, init_ref, o_ref, smem, ready, init_bar, store_bar):
    me = jax.lax.axis_index("c")
    plgpu.copy_gmem_to_smem(init_ref.at[me], smem, init_bar)
    plgpu.barrier_wait(init_bar)
    plgpu.barrier_arrive(ready)  # both blocks hold their initial values
    plgpu.barrier_wait(ready)
    x = _load(x_ref.at[me], layout=plgpu.Layout.WGMMA, optimized=False)
    plgpu.async_store_smem(x, smem, store_bar, cluster_idx=1 - me, cluster_dim="c", **kw)
    plgpu.barrier_wait(store_bar)
    o_ref[me] = _load(smem, layout=plgpu.Layout.WGMMA)

  x = np.arange(np.prod(shape), dtype=np.int32).reshape(shape) - 1000
  init = np.full(shape, 10, np.int32)
  with pallas_np.force_numpy_interpret():
    out = np.asarray(kernel(x, init))
  peer = x[::-1]
  want = {None: peer, "add": init + peer, "max": np.maximum(init, peer)}[atomic]
  np.testing.assert_array_equal(out, want)


def test_barrier_test_in_a_warp_observes_completed_phases():
  @plgpu.kernel(out_type=jax.ShapeDtypeStruct((6,), jnp.int32),
                scratch_types=[plgpu.Barrier(num_barriers=2)])
  def kernel(o_ref, bars):
    def warp0():
      o_ref[0] = plgpu.barrier_test(bars.at[0]).astype(jnp.int32)  # nothing arrived
      plgpu.barrier_arrive(bars.at[0])
      o_ref[1] = plgpu.barrier_test(bars.at[0]).astype(jnp.int32)  # phase 0 complete
      o_ref[2] = plgpu.barrier_test(bars.at[0]).astype(jnp.int32)  # observed: phase 1 next
      o_ref[3] = plgpu.barrier_test(bars.at[1]).astype(jnp.int32)
      plgpu.barrier_arrive(bars.at[1])
      plgpu.barrier_arrive(bars.at[0])
      o_ref[4] = plgpu.barrier_test(bars.at[1]).astype(jnp.int32)
      o_ref[5] = plgpu.barrier_test(bars.at[0]).astype(jnp.int32)
    plgpu.warp_map(lambda w: pl.when(w == 0)(warp0))

  with pallas_np.force_numpy_interpret():
    out = np.asarray(kernel())
  np.testing.assert_array_equal(out, [0, 1, 0, 0, 1, 1])


def test_barrier_test_outside_a_warp_is_refused():
  @plgpu.kernel(out_type=jax.ShapeDtypeStruct((), jnp.int32),
                scratch_types=[plgpu.Barrier()])
  def kernel(o_ref, bar):
    o_ref[...] = plgpu.barrier_test(bar).astype(jnp.int32)

  with pytest.raises((UnsupportedError, KernelError), match="outside a warp"):
    with pallas_np.force_numpy_interpret():
      kernel()


@pytest.mark.parametrize("cluster", [(2, 1), (1, 2)])
def test_cluster_ref_reads_and_writes_the_peer_blocks_smem(cluster):
  axis = "x" if cluster[0] == 2 else "y"
  shape = (2, 64, 32)

  @plgpu.kernel(out_type=(jax.ShapeDtypeStruct(shape, jnp.float32),) * 2,
                scratch_types=[plgpu.SMEM((64, 32), jnp.float32, transforms=TILED),
                               plgpu.SMEM((64, 32), jnp.float32),
                               plgpu.Barrier(),
                               plgpu.ClusterBarrier(collective_axes=(axis,)),
                               plgpu.ClusterBarrier(collective_axes=(axis,))],
                cluster=cluster, cluster_names=("x", "y"))
  def kernel(x_ref, read_ref, written_ref, smem, inbox, bar, ready, written):
    me = jax.lax.axis_index(axis)
    plgpu.copy_gmem_to_smem(x_ref.at[me], smem, bar)
    plgpu.barrier_wait(bar)
    plgpu.barrier_arrive(ready)
    plgpu.barrier_wait(ready)
    peer = plgpu.cluster_ref(smem, {axis: 1 - me})
    read_ref[me] = peer[...]
    plgpu.cluster_ref(inbox, {axis: 1 - me})[...] = smem[...] * 2  # a DSMEM store
    plgpu.barrier_arrive(written)
    plgpu.barrier_wait(written)
    written_ref[me] = inbox[...]

  x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  with pallas_np.force_numpy_interpret():
    read, written = (np.asarray(o) for o in kernel(x))
  np.testing.assert_array_equal(read, x[::-1])
  np.testing.assert_array_equal(written, 2 * x[::-1])
