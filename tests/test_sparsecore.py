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


# -- vector-lane ops: masked scans, sort_key_val, scan_count, pack/unpack, bitcast ---------
# No JAX oracle runs these (interpret=True cannot run a SparseCore mesh, TPU
# interpret mode has no rule for them): every expected value below is a plain
# Python loop written from the Mosaic op docs their lowerings emit (tpu.scan,
# tpu.sort, tpu.scan_count, tpu.pack_subelements; see docs/tpu.md).
def on_one_subcore(fn, *arrays, out):
  """A SparseCore kernel on one vector subcore: DMA the inputs to VMEM, apply
  ``fn`` to their values, store its results in VMEM and DMA them out."""
  n_in, n_out = len(arrays), len(out)

  def body(*refs):
    ins_hbm, outs_hbm = refs[:n_in], refs[n_in:n_in + n_out]
    ins, outs = refs[n_in + n_out:2 * n_in + n_out], refs[2 * n_in + n_out:]
    for src, dst in zip(ins_hbm, ins):
      pltpu.sync_copy(src, dst)
    for res, buf, dst in zip(fn(*[r[...] for r in ins]), outs, outs_hbm):
      buf[...] = res
      pltpu.sync_copy(buf, dst)
  k = pl.kernel(body, out_type=tuple(out), mesh=vector_mesh(1, 1), interpret="numpy",
                compiler_params=pltpu.CompilerParams(needs_layout_passes=False),  # as pack needs
                scratch_types=[pltpu.VMEM(a.shape, a.dtype) for a in arrays]
                + [pltpu.VMEM(o.shape, o.dtype) for o in out])
  return [np.asarray(r) for r in k(*arrays)]


def scan_reference(op, x, mask):
  """Lanes before the first valid one pass x through; then the running op
  of the valid lanes (an invalid lane holds the value so far)."""
  out, acc = x.copy(), None
  for i in range(x.size):
    if mask[i]:
      acc = x[i] if acc is None else op(acc, x[i])
    if acc is not None:
      out[i] = acc
  return out


MASKS = {"some": [0, 1, 1, 0, 1, 0, 0, 1], "none": [0] * L, "all": [1] * L,
         "last": [0] * (L - 1) + [1]}


@pytest.mark.parametrize("mask_name", sorted(MASKS))
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint32, jnp.float32])
def test_masked_cumsum_cummax_cummin(dtype, mask_name):
  from jax._src.pallas.mosaic import sc_primitives  # cummin is not exported by tpu_sc
  rng = np.random.RandomState(3)
  x = rng.randint(0 if dtype == jnp.uint32 else -50, 50, size=L).astype(dtype)
  if dtype == jnp.float32:
    x = x + np.float32(0.25)
  mask = np.array(MASKS[mask_name], np.int32)

  def fn(xv, mv):
    m = mv != 0
    return plsc.cumsum(xv, mask=m), plsc.cummax(xv, mask=m), sc_primitives.cummin(xv, mask=m)
  spec = jax.ShapeDtypeStruct((L,), dtype)
  got = on_one_subcore(fn, jnp.asarray(x), jnp.asarray(mask), out=[spec] * 3)
  m = mask.astype(bool)
  np.testing.assert_array_equal(got[0], scan_reference(lambda a, b: a + b, x, m))
  np.testing.assert_array_equal(got[1], scan_reference(max, x, m))
  np.testing.assert_array_equal(got[2], scan_reference(min, x, m))


def test_cumsum_without_mask_is_a_prefix_sum():
  x = jnp.arange(1, L + 1, dtype=f32) * 0.5
  [got] = on_one_subcore(lambda v: [plsc.cumsum(v)], x, out=[jax.ShapeDtypeStruct((L,), f32)])
  want, acc = [], np.float32(0)
  for v in np.asarray(x):
    acc = np.float32(acc + v)
    want.append(acc)
  np.testing.assert_array_equal(got, np.array(want, np.float32))


def sort_reference(keys, values, mask, descending):
  """Stable by key (ties keep their input order both ways), the masked-out
  pairs after, in input order; the mask marks the valid outputs."""
  valid = [(k, v) for k, v, m in zip(keys, values, mask) if m]
  valid = sorted(valid, key=lambda kv: kv[0], reverse=descending)  # stable both ways
  rest = [(k, v) for k, v, m in zip(keys, values, mask) if not m]
  pairs = valid + rest
  return (np.array([k for k, _ in pairs], keys.dtype), np.array([v for _, v in pairs], values.dtype),
          np.arange(L) < len(valid))


SORT_KEYS = {
    jnp.int32: [5, -3, 5, 0, -3, 7, 5, -2**31],
    jnp.uint32: [2**32 - 1, 3, 3, 0, 2**31, 3, 1, 2**31],
    jnp.float32: [1.5, -0.5, 1.5, np.inf, -np.inf, 0.0, 1.5, -7.0],
}


@pytest.mark.parametrize("mask_name", ["some", "none", "all", None])
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dtype", sorted(SORT_KEYS, key=str))
def test_sort_key_val_is_stable_with_ties_and_masks(dtype, descending, mask_name):
  keys = np.array(SORT_KEYS[dtype], dtype)
  values = np.arange(L, dtype=np.int32) * 10  # which input each output came from
  mask = np.array(MASKS[mask_name] if mask_name else [1] * L, np.int32)

  def fn(k, v, mv):
    if mask_name is None:
      sk, sv = plsc.sort_key_val(k, v, descending=descending)
      return sk, sv, jnp.ones((L,), i32)
    sk, sv, sm = plsc.sort_key_val(k, v, mask=mv != 0, descending=descending)
    return sk, sv, sm.astype(i32)
  got = on_one_subcore(fn, jnp.asarray(keys), jnp.asarray(values), jnp.asarray(mask),
                       out=[jax.ShapeDtypeStruct((L,), dtype), jax.ShapeDtypeStruct((L,), i32),
                            jax.ShapeDtypeStruct((L,), i32)])
  want = sort_reference(keys, values, mask.astype(bool), descending)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_array_equal(got[2], want[2].astype(np.int32))


def scan_count_reference(x, mask):
  """Count of valid lanes j <= i equal to x[i] (1 on an invalid lane); the
  last valid occurrence of each value is marked."""
  counts = [1 + sum(1 for j in range(i) if mask[j] and x[j] == x[i]) if mask[i] else 1
            for i in range(x.size)]
  last = [bool(mask[i]) and not any(mask[j] and x[j] == x[i] for j in range(i + 1, x.size))
          for i in range(x.size)]
  return np.array(counts, np.int32), np.array(last)


@pytest.mark.parametrize("mask_name", ["some", "none", "all", None])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32])
def test_scan_count_counts_duplicates(dtype, mask_name):
  x = np.array([4, 7, 4, 4, 7, 1, 4, 7], dtype)
  mask = np.array(MASKS[mask_name] if mask_name else [1] * L, np.int32)

  def fn(xv, mv):
    counts, last = plsc.scan_count(xv) if mask_name is None else plsc.scan_count(xv, mv != 0)
    return counts, last.astype(i32)
  got = on_one_subcore(fn, jnp.asarray(x), jnp.asarray(mask),
                       out=[jax.ShapeDtypeStruct((L,), i32)] * 2)
  counts, last = scan_count_reference(x, mask.astype(bool))
  np.testing.assert_array_equal(got[0], counts)
  np.testing.assert_array_equal(got[1], last.astype(np.int32))


def pack_reference(a, b, fmt, dtype):
  """Each element converted (round to nearest even / wrap), then a0 b0 a1 b1
  ... (interleaved) or a then b shaped (n, 2) (compressed)."""
  a = [np.asarray(v).astype(dtype) for v in a]
  b = [np.asarray(v).astype(dtype) for v in b]
  if fmt == plsc.PackFormat.INTERLEAVED:
    return np.array([v for pair in zip(a, b) for v in pair], dtype)
  return np.array(a + b, dtype).reshape(len(a), 2)


@pytest.mark.parametrize("n", [L, 5])  # 5: an odd size
@pytest.mark.parametrize("fmt", ["INTERLEAVED", "COMPRESSED"])
@pytest.mark.parametrize("src,dst", [(jnp.float32, None), (jnp.int32, None),
                                     (jnp.float32, jnp.float16), (jnp.uint32, jnp.uint16)])
def test_pack_and_unpack(src, dst, fmt, n):
  fmt = getattr(plsc.PackFormat, fmt)
  rng = np.random.RandomState(4)
  if np.dtype(src).kind == "f":
    ab = rng.randn(2, n).astype(np.float32) * 100  # not representable in 16 bits: rounds
  else:
    ab = rng.randint(-2**31, 2**31 - 1, size=(2, n)).astype(src)  # wraps to 16 bits
  packed_dtype = dst or {jnp.float32: jnp.bfloat16, jnp.int32: jnp.int16}[src]
  packed_shape = (2 * n,) if fmt == plsc.PackFormat.INTERLEAVED else (n, 2)

  def fn(v):
    packed = plsc.pack(v[0], v[1], format=fmt, preferred_element_type=dst)
    a, b = plsc.unpack(packed, format=fmt, preferred_element_type=dst and src)
    return packed, jnp.stack([a, b])
  got_packed, got_unpacked = on_one_subcore(
      fn, jnp.asarray(ab), out=[jax.ShapeDtypeStruct(packed_shape, packed_dtype),
                                jax.ShapeDtypeStruct((2, n), src)])
  want = pack_reference(list(ab[0]), list(ab[1]), fmt, np.dtype(packed_dtype))
  np.testing.assert_array_equal(got_packed, want)
  np.testing.assert_array_equal(got_unpacked, ab.astype(np.dtype(packed_dtype)).astype(src))


def test_plsc_bitcast_splits_words_like_ndarray_view():
  """Along the minormost dim: word k becomes halves 2k (low) and 2k+1 (high)
  (little-endian, as numpy's view)."""
  import warnings
  x = jnp.array([0x00010002, -1, 0x7FFF8000, 5, 0, 1 << 16, 3, 0x12345678], i32)

  def fn(v):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)  # JAX 0.12: use pltpu.bitcast(dim=-1)
      halves = plsc.bitcast(v, jnp.int16)
      return halves, plsc.bitcast(halves, jnp.int32)
  halves, back = on_one_subcore(fn, x, out=[jax.ShapeDtypeStruct((2 * L,), jnp.int16),
                                            jax.ShapeDtypeStruct((L,), i32)])
  want = []
  for word in np.asarray(x).astype(np.int64) & 0xFFFFFFFF:
    want += [word & 0xFFFF, word >> 16]
  np.testing.assert_array_equal(halves, np.array(want, np.uint16).view(np.int16))
  np.testing.assert_array_equal(back, np.asarray(x))


def test_scan_count_float_equality():
  """pallas_np's reading for floats (docs/tpu.md): -0.0 == 0.0, NaN never a
  duplicate (it counts 1 and is its own last occurrence)."""
  x = jnp.array([0.0, -0.0, np.nan, np.nan, 1.0, 0.0, 1.0, np.nan], f32)
  counts, last = on_one_subcore(lambda v: [c.astype(i32) if c.dtype == bool else c
                                           for c in plsc.scan_count(v)], x,
                                out=[jax.ShapeDtypeStruct((L,), i32)] * 2)
  np.testing.assert_array_equal(counts, [1, 2, 1, 1, 1, 3, 2, 1])
  np.testing.assert_array_equal(last, [0, 0, 1, 1, 0, 1, 1, 1])


def test_per_subcore_dedup_with_sort_scan_count_and_compressed_store():
  """Each vector subcore sorts its L keys, marks the last of each run of
  equal keys with scan_count, stores the unique keys compressed to the front
  of its output row (the rest -1) and counts them with
  all_reduce_population_count. Reference: np.unique per row."""
  keys = jnp.array(np.random.RandomState(7).randint(0, 5, size=(NC * NS, L)), i32)

  def body(k_hbm, u_hbm, n_hbm, k, u, n):
    w = worker_id()
    pltpu.sync_copy(k_hbm.at[w], k)
    sorted_keys, _ = plsc.sort_key_val(k[...], jnp.arange(L, dtype=i32))
    _, last = plsc.scan_count(sorted_keys)
    u[...] = jnp.full((L,), -1, i32)
    plsc.store_compressed(u.at[...], sorted_keys, mask=last)
    n[...] = plsc.all_reduce_population_count(last)
    pltpu.sync_copy(u, u_hbm.at[w])
    pltpu.sync_copy(n, n_hbm.at[w])
  k = pl.kernel(body, out_type=(jax.ShapeDtypeStruct((NC * NS, L), i32),
                                jax.ShapeDtypeStruct((NC * NS, L), i32)),
                mesh=vector_mesh(), interpret="numpy",
                compiler_params=pltpu.CompilerParams(needs_layout_passes=False),
                scratch_types=[pltpu.VMEM((L,), i32)] * 3)
  uniques, counts = [np.asarray(a) for a in k(keys)]
  for row, u, n in zip(np.asarray(keys), uniques, counts):
    want = np.unique(row)
    np.testing.assert_array_equal(u[:want.size], want)
    assert (u[want.size:] == -1).all()
    assert (n == want.size).all()


needs_indices = pytest.mark.skipif(not hasattr(plsc, "Indices"), reason="this JAX has no plsc.Indices")


@needs_indices
@pytest.mark.parametrize("index_values", [[3, -1, 5, -1, 0, 1, 2, -1], [-1] * 8, list(range(8))])
def test_indexed_dmas_skip_ignored_indices(index_values):
  """plsc.Indices(idx, ignored_value=-1): a gather leaves the rows of
  ignored indices untouched in the destination, a scatter does not write
  them (tpu.enqueue_indirect_dma's offset_filter). The wait still waits for
  the whole copy. NumPy reference from that reading (no JAX oracle)."""
  table = jnp.arange(16 * 128, dtype=f32).reshape(16, 128)
  idx = jnp.array(index_values, i32)

  def body(t_hbm, i_hbm, g_hbm, s_hbm, iv, rows):
    pltpu.sync_copy(i_hbm, iv)
    rows[...] = jnp.full(rows.shape, -7.0, f32)
    pltpu.sync_copy(t_hbm.at[plsc.Indices(iv, ignored_value=-1)], rows)
    pltpu.sync_copy(rows, g_hbm)
    pltpu.sync_copy(t_hbm.at[pl.ds(0, 8)], rows)
    pltpu.sync_copy(rows, s_hbm.at[plsc.Indices(iv, ignored_value=-1)])
  k = pl.kernel(body, out_type=(jax.ShapeDtypeStruct((8, 128), f32),
                                jax.ShapeDtypeStruct((16, 128), f32)),
                mesh=vector_mesh(1, 1), interpret="numpy",
                scratch_types=[pltpu.VMEM((8,), i32), pltpu.VMEM((8, 128), f32)])
  gathered, scattered = [np.asarray(a) for a in k(table, idx)]
  t = np.asarray(table)
  want_g = np.full((8, 128), -7.0, np.float32)
  for row, i in enumerate(index_values):
    if i != -1:
      want_g[row] = t[i]
  np.testing.assert_array_equal(gathered, want_g)
  for row, i in enumerate(index_values):  # the other rows of the output are never written
    if i != -1:
      np.testing.assert_array_equal(scattered[i], t[row])


@pytest.mark.skipif(not hasattr(plsc, "slice_subcore_vmem_from_shared"),
                    reason="plsc.slice_subcore_vmem_from_shared is JAX >= 0.12")
def test_slice_subcore_vmem_from_shared_gives_each_subcore_its_stripe():
  """Each vector subcore writes its stripe of the core's VMEM_SHARED: the
  minor dim divided across the physical subcores (get_sparse_core_info(),
  inactive ones included), stripe s = columns [s*w, (s+1)*w)
  (tpu.shared_memref_slice). Race-checked: the stripes are disjoint.
  NumPy reference from that reading (no JAX oracle)."""
  physical = plsc.get_sparse_core_info().num_subcores
  width = 8
  cols = physical * width

  def body(o_hbm, shared):
    s = jax.lax.axis_index("subcore")
    mine = plsc.slice_subcore_vmem_from_shared(shared)
    mine[...] = jnp.full(mine.shape, 10, i32) * jax.lax.axis_index("core") + s
    plsc.subcore_barrier()

    @pl.when(s == 0)
    def _():
      pltpu.sync_copy(shared, o_hbm.at[jax.lax.axis_index("core")])
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct((NC, 2, cols), i32), mesh=vector_mesh(),
                interpret=pallas_np.InterpretParams(detect_races=True),
                scratch_types=[pltpu.VMEM_SHARED((2, cols), i32)])
  got = np.asarray(k())
  for c in range(NC):
    for s in range(NS):  # the stripes of the physical subcores past NS are never written
      np.testing.assert_array_equal(got[c, :, s * width:(s + 1) * width], 10 * c + s)
