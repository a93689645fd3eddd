"""SparseCore kernels (``jax.experimental.pallas.tpu_sc``) in numpy mode:
vector-subcore and scalar-subcore meshes run by pallas_np.meshes, one
program per subcore.

No JAX oracle: interpret=True cannot run a SparseCore mesh, and TPU
interpret mode fails on these kernels (it reads a garbage row index in the
indexed-DMA gather below: "Out-of-bounds read ... reading [(103, ...)]" on
JAX 0.10 and 0.12). Every expected value is a NumPy reference written from
the semantics in ``tpu_sc``'s docstrings.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np

plsc = pytest.importorskip("jax.experimental.pallas.tpu_sc")
f32, i32 = jnp.float32, jnp.int32
NC, NS, L = 2, 4, 8  # SparseCores, vector subcores each, lanes


@pytest.fixture(scope="module", autouse=True)
def sparse_core_chip():
  """Meshes ask the chip for its SparseCore count: assume a v5p (tracing only)."""
  pallas_np.assume_tpu_chip("v5p")
  yield
  pallas_np.assume_tpu_chip("v5e")


def vector_mesh(cores=NC, subcores=NS):
  return plsc.VectorSubcoreMesh(core_axis_name="core", subcore_axis_name="subcore",
                                num_cores=cores, num_subcores=subcores)


def worker_id():
  return jax.lax.axis_index("core") * NS + jax.lax.axis_index("subcore")


# -- indexed DMAs: ref.at[index_ref] ---------------------------------------------------
def test_gather_rows_with_an_index_ref():
  """Each subcore DMAs its slice of the indices to VMEM, then gathers those
  rows of the HBM table with one indexed DMA (x_hbm.at[idx_vmem])."""
  table = jnp.arange(64 * 128, dtype=f32).reshape(64, 128)
  idx = jnp.array(np.random.RandomState(0).randint(0, 64, size=NC * NS * L), i32)

  def body(x_hbm, idx_hbm, o_hbm, idx_vmem, rows):
    w = worker_id()
    pltpu.sync_copy(idx_hbm.at[pl.ds(w * L, L)], idx_vmem)
    pltpu.sync_copy(x_hbm.at[idx_vmem], rows)
    pltpu.sync_copy(rows, o_hbm.at[pl.ds(w * L, L)])
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct((NC * NS * L, 128), f32),
                mesh=vector_mesh(), interpret="numpy",
                scratch_types=[pltpu.VMEM((L,), i32), pltpu.VMEM((L, 128), f32)])
  np.testing.assert_array_equal(np.asarray(k(table, idx)), np.asarray(table)[np.asarray(idx)])
  np.testing.assert_array_equal(np.asarray(jax.jit(k)(table, idx)),
                                np.asarray(table)[np.asarray(idx)])


def test_scatter_rows_with_an_index_ref_and_bounds():
  x = jnp.arange(16 * 128, dtype=f32).reshape(16, 128)
  perm = jnp.array(np.random.RandomState(1).permutation(16), i32)

  def body(x_hbm, p_hbm, o_hbm, idx, buf):
    s = jax.lax.axis_index("subcore")
    pltpu.sync_copy(p_hbm.at[pl.ds(s * 8, 8)], idx)
    pltpu.sync_copy(x_hbm.at[pl.ds(s * 8, 8)], buf)
    pltpu.sync_copy(buf, o_hbm.at[idx])  # SCATTER_LINE
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, f32), mesh=vector_mesh(1, 2),
                interpret="numpy",
                scratch_types=[pltpu.VMEM((8,), i32), pltpu.VMEM((8, 128), f32)])
  want = np.empty((16, 128), np.float32)
  want[np.asarray(perm)] = np.asarray(x)
  np.testing.assert_array_equal(np.asarray(k(x, perm)), want)
  with pytest.raises(IndexError, match="index 99") as info:
    k(x, perm.at[11].set(99))  # subcore 1's fourth row
  line = next(i for i, l in enumerate(open(__file__), 1) if l.rstrip().endswith("# SCATTER_LINE"))
  assert f"{__file__}:{line}" in str(info.value)
  assert "subcore 1 (core=0, subcore=1)" in str(info.value)


# -- a histogram: parallel_loop, addupdate_scatter, VMEM_SHARED, subcore barriers ---------
B = 16


def histogram_kernel(barriers=True):
  """Each subcore counts its values with vector scatter-adds into a private
  VMEM histogram, then the subcores of a SparseCore add theirs into the
  core's shared VMEM (Spmem) one after another, separated by subcore
  barriers; subcore 0 writes the core's histogram out."""
  def body(v_hbm, o_hbm, v_vmem, shared, local):
    sub = jax.lax.axis_index("subcore")
    pltpu.sync_copy(v_hbm.at[pl.ds(worker_id() * 32, 32)], v_vmem)
    local[...] = jnp.zeros_like(local)

    @plsc.parallel_loop(0, 32, L)
    def _(i):
      plsc.addupdate_scatter(local, [v_vmem[pl.ds(i, L)]], jnp.ones((L,), f32))

    @pl.when(sub == 0)
    def _():
      pltpu.sync_copy(local, shared)
    if barriers:
      plsc.subcore_barrier()
    for s in range(1, NS):
      @pl.when(sub == s)
      def _():
        def add_mine(tmp):
          pltpu.sync_copy(shared, tmp)
          tmp[...] = tmp[...] + local[...]
          pltpu.sync_copy(tmp, shared)
        pl.run_scoped(add_mine, pltpu.VMEM((B,), f32))
      if barriers:
        plsc.subcore_barrier()

    @pl.when(sub == 0)
    def _():
      pltpu.sync_copy(shared, o_hbm.at[jax.lax.axis_index("core")])
  return pl.kernel(body, out_type=jax.ShapeDtypeStruct((NC, B), f32), mesh=vector_mesh(),
                   scratch_types=[pltpu.VMEM((32,), i32), pltpu.VMEM_SHARED((B,), f32),
                                  pltpu.VMEM((B,), f32)],
                   interpret=pallas_np.InterpretParams(detect_races=True))


VALS = jnp.array(np.random.RandomState(2).randint(0, B, size=NC * NS * 32), i32)


def test_histogram_with_barriers_and_shared_vmem():
  got = np.asarray(histogram_kernel()(VALS))
  v = np.asarray(VALS).reshape(NC, NS * 32)
  want = np.stack([np.bincount(v[c], minlength=B) for c in range(NC)]).astype(np.float32)
  np.testing.assert_array_equal(got, want)


def test_histogram_without_barriers_races():
  with pytest.raises(pallas_np.RaceError, match="shared scratch_operands|subcore"):
    for _ in range(3):
      histogram_kernel(barriers=False)(VALS)


def test_a_subcore_that_skips_the_barrier_deadlocks():
  def body(x_hbm, o_hbm):
    @pl.when(jax.lax.axis_index("subcore") != 1)
    def _():
      plsc.subcore_barrier()
    pltpu.sync_copy(x_hbm, o_hbm)
  x = jnp.ones((8, 128), f32)
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, f32), mesh=vector_mesh(1, 2),
                interpret="numpy")
  with pytest.raises(pallas_np.KernelError, match="deadlock across subcores") as info:
    k(x)
  assert "subcore_barrier" in str(info.value)


# -- vector gathers/scatters inside VMEM ------------------------------------------------
def test_load_gather_and_store_scatter_with_masks():
  table = jnp.arange(64, dtype=f32) * 3
  idx = jnp.array([5, 0, 63, 7, 7, 1, 2, 40], i32)

  def body(t_hbm, i_hbm, o_hbm, t, ii, out):
    pltpu.sync_copy(t_hbm, t)
    pltpu.sync_copy(i_hbm, ii)
    mask = jnp.arange(L) % 2 == 0
    g = plsc.load_gather(t, [ii[...]], mask=mask)
    out[...] = jnp.zeros_like(out)
    plsc.store_scatter(out, [ii[...]], jnp.where(mask, g, -1.0), mask=mask)
    plsc.addupdate_scatter(out, [jnp.full((L,), 10, i32)], jnp.ones((L,), f32))
    pltpu.sync_copy(out, o_hbm)
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct((64,), f32), mesh=vector_mesh(1, 1),
                interpret="numpy",
                scratch_types=[pltpu.VMEM((64,), f32), pltpu.VMEM((L,), i32),
                               pltpu.VMEM((64,), f32)])
  want = np.zeros(64, np.float32)
  for lane in range(0, L, 2):
    want[int(idx[lane])] = float(table[int(idx[lane])])
  want[10] += L
  np.testing.assert_array_equal(np.asarray(k(table, idx)), want)


def test_expanded_load_and_compressed_store():
  def body(x_hbm, o_hbm, x, o):
    pltpu.sync_copy(x_hbm, x)
    mask = (jnp.arange(L) % 3) != 1  # T F T T F T T F
    v = plsc.load_expanded(x.at[pl.ds(0, L)], mask=mask)
    o[...] = jnp.zeros_like(o)
    plsc.store_compressed(o.at[pl.ds(0, L)], jnp.where(mask, v, 0.0), mask=mask)
    plsc.addupdate(o.at[pl.ds(L, L)], jnp.ones((L,), f32))
    pltpu.sync_copy(o, o_hbm)
  x = jnp.arange(2 * L, dtype=f32) + 1
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct((2 * L,), f32), mesh=vector_mesh(1, 1),
                interpret="numpy",
                scratch_types=[pltpu.VMEM((2 * L,), f32), pltpu.VMEM((2 * L,), f32)])
  mask = (np.arange(L) % 3) != 1
  n = int(mask.sum())
  want = np.zeros(2 * L, np.float32)
  want[:n] = np.asarray(x)[:n]  # expanded then compressed with the same mask: the first n
  want[L:] = 1
  np.testing.assert_array_equal(np.asarray(k(x)), want)


# -- the scalar subcore --------------------------------------------------------------------
def test_scalar_subcore_mesh():
  mesh = plsc.ScalarSubcoreMesh(axis_name="core", num_cores=2)
  x = jnp.arange(16 * 128, dtype=f32).reshape(16, 128)

  def body(x_hbm, o_hbm):
    c = jax.lax.axis_index("core")
    pltpu.sync_copy(x_hbm.at[pl.ds(c * 8, 8)], o_hbm.at[pl.ds((1 - c) * 8, 8)])
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, f32), mesh=mesh, interpret="numpy")
  want = np.concatenate([np.asarray(x)[8:], np.asarray(x)[:8]])
  np.testing.assert_array_equal(np.asarray(k(x)), want)
  with pallas_np.force_numpy_interpret():
    np.testing.assert_array_equal(np.asarray(jax.jit(
        pl.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, f32), mesh=mesh))(x)), want)


def test_scalar_and_vector_subcores_together():
  """pl.kernel over [ScalarSubcoreMesh, VectorSubcoreMesh] (MPMD): the scalar
  subcore of each SparseCore stages rows into the core's shared VMEM
  (VMEM_SHARED, which it shares with its vector subcores) and copies them out;
  the vector subcores scale their own rows. All programs run at once."""
  smesh = plsc.ScalarSubcoreMesh(axis_name="core", num_cores=NC)
  vmesh = vector_mesh(NC, 2)
  x = jnp.arange(4 * NC * 8 * 128, dtype=f32).reshape(4 * NC * 8, 128)

  def scalar_body(x_hbm, o_hbm, spmem, vbuf):
    c = jax.lax.axis_index("core")
    pltpu.sync_copy(x_hbm.at[pl.ds(c * 8, 8)], spmem)
    pltpu.sync_copy(spmem, o_hbm.at[pl.ds(c * 8, 8)])

  def vector_body(x_hbm, o_hbm, spmem, vbuf):
    w = jax.lax.axis_index("core") * 2 + jax.lax.axis_index("subcore")
    rows = pl.ds(NC * 8 + w * 8, 8)
    pltpu.sync_copy(x_hbm.at[rows], vbuf)
    vbuf[...] = vbuf[...] * 2.0
    pltpu.sync_copy(vbuf, o_hbm.at[rows])
  try:
    k = pl.kernel([scalar_body, vector_body], out_type=jax.ShapeDtypeStruct(x.shape, f32),
                  mesh=[smesh, vmesh], interpret="numpy",
                  scratch_types=[pltpu.VMEM_SHARED((8, 128), f32),
                                 (pltpu.VMEM @ vmesh)((8, 128), f32)])
  except TypeError:
    pytest.skip("this JAX's pl.kernel takes one body")
  got = np.asarray(k(x))
  want = np.asarray(x).copy()
  want[NC * 8:NC * 8 + NC * 2 * 8] *= 2
  np.testing.assert_array_equal(got[:NC * 8 * 3], want[:NC * 8 * 3])


def test_core_map_over_vector_subcores():
  """pl.core_map(VectorSubcoreMesh) on refs, with core_map scratch."""
  x = jnp.arange(16 * 128, dtype=f32).reshape(16, 128)

  def f(x):
    def stateful(refs):
      x_ref, o_ref = refs

      @pl.core_map(vector_mesh(1, 2), interpret="numpy",
                   scratch_shapes=[pltpu.VMEM((8, 128), f32)])
      def _(buf):
        s = jax.lax.axis_index("subcore")
        pltpu.sync_copy(x_ref.at[pl.ds(s * 8, 8)], buf)
        buf[...] = buf[...] * 3 + s.astype(f32)
        pltpu.sync_copy(buf, o_ref.at[pl.ds(s * 8, 8)])
    return pl.run_state(stateful)((x, jnp.zeros_like(x)))[1]
  want = np.asarray(x) * 3 + (np.arange(16) >= 8)[:, None]
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), want)
  np.testing.assert_array_equal(np.asarray(pallas_np.jit(f)(x)), want)


def test_fetch_and_add_hands_out_unique_tickets():
  """Every subcore takes a ticket from subcore 0's SMEM counter with an
  atomic fetch_and_add; the tickets are 0..n-1 in some order and the counter
  ends at n."""
  n = 4

  def body(o_hbm, c_hbm, counter, ticket_v):
    sub = jax.lax.axis_index("subcore")

    @pl.when(sub == 0)
    def _():
      counter[0] = 0
    plsc.subcore_barrier()
    t = plsc.fetch_and_add(counter.at[0], jnp.int32(1), subcore_id=jnp.int32(0))
    ticket_v[...] = jnp.full((L,), t, i32)
    pltpu.sync_copy(ticket_v, o_hbm.at[sub])
    plsc.subcore_barrier()

    @pl.when(sub == 0)
    def _():
      ticket_v[...] = jnp.full((L,), counter[0], i32)
      pltpu.sync_copy(ticket_v, c_hbm)
  k = pl.kernel(body, out_type=(jax.ShapeDtypeStruct((n, L), i32), jax.ShapeDtypeStruct((L,), i32)),
                mesh=vector_mesh(1, n), interpret="numpy",
                scratch_types=[pltpu.SMEM((1,), i32), pltpu.VMEM((L,), i32)])
  tickets, count = k()
  assert sorted(np.asarray(tickets)[:, 0].tolist()) == list(range(n))
  assert (np.asarray(tickets) == np.asarray(tickets)[:, :1]).all()
  assert (np.asarray(count) == n).all()


@pytest.mark.parametrize("bits", [[0, 0, 1, 0, 1, 1, 0, 0], [0] * 8])
def test_mask_all_reductions(bits):
  """all_reduce_population_count / all_reduce_ffs, from their docstrings:
  every element holds the count of True / the first True's index (the size
  when none)."""
  def body(b_hbm, o_hbm, b, o):
    pltpu.sync_copy(b_hbm, b)
    m = b[...] != 0
    o[0] = plsc.all_reduce_population_count(m)
    o[1] = plsc.all_reduce_ffs(m)
    pltpu.sync_copy(o, o_hbm)
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct((2, L), i32), mesh=vector_mesh(1, 1),
                interpret="numpy",
                scratch_types=[pltpu.VMEM((L,), i32), pltpu.VMEM((2, L), i32)])
  got = np.asarray(k(jnp.array(bits, i32)))
  bits = np.array(bits, bool)
  np.testing.assert_array_equal(got[0], np.full(L, bits.sum()))
  np.testing.assert_array_equal(got[1], np.full(L, np.argmax(bits) if bits.any() else L))
