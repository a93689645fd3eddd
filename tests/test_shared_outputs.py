"""Vectorized grids whose outputs every grid point sees whole (Triton style:
no BlockSpec, program_id-based offsets and masks). The lanes write the
output in place while every access is recorded; lanes that meet (one writes
what another reads or writes) send the grid back to the loop. These tests
compare vectorized == sequential (bitwise) == interpret=True and check the
path taken."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import pallas_np
from pallas_np.grid import KernelPlan
from tests.test_vectorize import SEQ, VEC, check, modes  # noqa: F401  (fixture)


def _rng(seed, shape, dtype=np.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def whole(kernel, out_shape, grid, *, aliases=None):
  """``make(interp)``: refs are whole arrays (no BlockSpecs), as in Triton."""
  def make(interp):
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interp,
                          input_output_aliases=aliases or {})
  return make


def onto_zeros(kernel, n, grid):
  """``make(interp)`` for ``kernel(x_ref, init_ref, o_ref)`` whose (n,) f32
  output starts as zeros (aliased to the second input)."""
  init = jnp.zeros((n,), jnp.float32)

  def make(interp):
    f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), grid=grid,
                       input_output_aliases={1: 0}, interpret=interp)
    return lambda x: f(x, init)
  return make


@pytest.fixture
def plans(monkeypatch):
  """Every KernelPlan that ran, in order."""
  ran = []
  orig = KernelPlan.run

  def run(self, *args):
    ran.append(self)
    return orig(self, *args)
  monkeypatch.setattr(KernelPlan, "run", run)
  return ran


# -- column reductions, as JAX's GPU layer-norm backward (dw/db) ----------------------
@pytest.mark.parametrize("n", [64, 100])  # 100: the last column block is masked
def test_column_block_reduction_with_masks(modes, n):
  m, bm, bn = 37, 8, 16

  def kernel(x_ref, y_ref, s_ref, d_ref):
    j = pl.program_id(0)
    cols = j * bn + jnp.arange(bn)
    col_ok = cols < n

    def body(i, acc):
      rows = i * bm + jnp.arange(bm)
      mask = (rows < m)[:, None] & col_ok[None, :]
      x = pltriton.load(x_ref.at[rows[:, None], cols[None]], mask=mask, other=0.0)
      y = pltriton.load(y_ref.at[rows[:, None], cols[None]], mask=mask, other=0.0)
      return acc[0] + (x * y).sum(0), acc[1] + x.sum(0)

    s, d = lax.fori_loop(0, pl.cdiv(m, bm), body, (jnp.zeros(bn), jnp.zeros(bn)))
    pltriton.store(s_ref.at[cols], s, mask=col_ok)
    pltriton.store(d_ref.at[cols], d, mask=col_ok)

  x, y = _rng(0, (m, n)), _rng(1, (m, n))
  out = [jax.ShapeDtypeStruct((n,), jnp.float32)] * 2
  got = check(whole(kernel, out, (pl.cdiv(n, bn),)), x, y, expect_mode="vectorized",
              modes=modes)
  np.testing.assert_allclose(got[0], (x * y).sum(0), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[1], x.sum(0), rtol=1e-5, atol=1e-5)


def test_unmasked_program_id_slices(modes):
  """``o_ref[pl.ds(i * B, B)] = ...`` on whole refs, reads and writes."""
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[pl.ds(i * 4, 4), :] = x_ref[pl.ds(i * 4, 4), :] * 2 + i

  x = _rng(2, (32, 8))
  check(whole(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), (8,)), x,
        expect_mode="vectorized", modes=modes)


def test_program_id_gather_from_shared_input_with_other(modes):
  """Masked-off lanes past the end take ``other``; masked loads of a shared
  input at per-lane offsets, one store per lane."""
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    idx = i * 8 + jnp.arange(8)
    v = pltriton.load(x_ref.at[idx], mask=idx < 50, other=-1.0)
    pltriton.store(o_ref.at[idx], v * 3, mask=idx < 50)

  x = _rng(3, (50,))
  got = check(whole(kernel, jax.ShapeDtypeStruct((50,), jnp.float32), (7,)), x,
              expect_mode="vectorized", modes=modes)
  np.testing.assert_allclose(got, x * 3, rtol=1e-6)


def test_masked_on_lane_out_of_bounds_names_its_grid_point():
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    idx = i * 8 + jnp.arange(8)
    pltriton.store(o_ref.at[idx], pltriton.load(x_ref.at[idx]), mask=idx < 50 + (i == 6) * 8)

  x = _rng(4, (56,))
  call = whole(kernel, jax.ShapeDtypeStruct((50,), jnp.float32), (7,))(VEC)
  with pytest.raises(IndexError) as info:
    call(x)
  assert isinstance(info.value, pallas_np.KernelError)
  assert info.value.program_ids == (6,)


# -- what may and may not be merged ------------------------------------------------------
def test_every_point_writes_one_element(modes):
  """The same element written by every point: lanes that meet run in grid
  order (the last writer wins there)."""
  def kernel(o_ref):
    i = pl.program_id(0)
    o_ref[0] = i * 10
    o_ref[i + 1] = i

  check(whole(kernel, jax.ShapeDtypeStruct((9,), jnp.int32), (8,)),
        expect_mode="sequential", modes=modes)


def test_reading_what_a_later_point_writes(modes):
  """Point i reads element i+1 before point i+1 writes it (grid order: the
  initial value). Lanes that meet run in grid order."""
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[i] = o_ref[i + 1] * 2

  x = jnp.arange(9, dtype=jnp.float32)
  check(whole(kernel, jax.ShapeDtypeStruct((9,), jnp.float32), (8,), aliases={0: 0}), x,
        expect_mode="sequential", modes=modes)


@pytest.mark.parametrize("which", ["chain", "accumulate", "atomic"])
def test_points_that_communicate_run_in_grid_order(modes, which):
  """A lane reading what an earlier lane wrote (a chain, a += into one
  element, atomics) fails the merge check: the grid loop runs instead, and
  later calls do not try the batched pass again."""
  def chain(x_ref, _init_ref, o_ref):
    i = pl.program_id(0)
    o_ref[i + 1] = o_ref[i] + x_ref[i]

  def accumulate(x_ref, _init_ref, o_ref):
    o_ref[0] += x_ref[pl.program_id(0)]

  def atomic(x_ref, _init_ref, o_ref):
    pltriton.atomic_add(o_ref, pl.ds(0, 1), x_ref[pl.ds(pl.program_id(0), 1)])

  kernel = {"chain": chain, "accumulate": accumulate, "atomic": atomic}[which]
  x = jnp.arange(1, 9, dtype=jnp.float32)
  got = check(onto_zeros(kernel, 9, (8,)), x, expect_mode="sequential", modes=modes)
  want = {"chain": np.concatenate([[0], np.cumsum(x)]),
          "accumulate": np.r_[x.sum(), np.zeros(8)],
          "atomic": np.r_[x.sum(), np.zeros(8)]}[which]
  np.testing.assert_array_equal(got, want)


def test_conflict_is_remembered(plans):
  def kernel(x_ref, _init_ref, o_ref):
    o_ref[0] += x_ref[pl.program_id(0)]

  x = jnp.arange(1, 9, dtype=jnp.float32)
  f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.float32), grid=(8,),
                     input_output_aliases={1: 0}, interpret=VEC, name="remembered")
  f(x, jnp.zeros((1,), jnp.float32))
  gv = plans[-1].vectorizer
  assert gv.shared_outputs_ok is False
  assert "shared output" in str(gv.last_failure)
  gv.last_failure = None
  np.testing.assert_array_equal(f(x, jnp.zeros((1,), jnp.float32)), [36.0])
  assert plans[-1].last_mode == "sequential"
  assert gv.last_failure is None  # the batched pass was not tried again


@pytest.mark.parametrize("split", ["contiguous", "strided"])
def test_lanes_diverging_in_control_flow(modes, split):
  """pl.when on program_id splits the lanes (a contiguous group runs on
  views, a strided one on copies of the batched operands); the shared output
  is written in place with the group's lanes recorded under their own
  numbers."""
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    cond = i < 3 if split == "contiguous" else i % 2 == 0
    o_ref[pl.ds(i * 2, 2)] = x_ref[pl.ds(i * 2, 2)]

    @pl.when(cond)
    def _():
      o_ref[pl.ds(i * 2, 2)] = o_ref[pl.ds(i * 2, 2)] * 10

  x = _rng(5, (16,))
  check(whole(kernel, jax.ShapeDtypeStruct((16,), jnp.float32), (8,)), x,
        expect_mode="vectorized", modes=modes)


def test_owned_and_shared_outputs_together(modes):
  """One output blocked per grid point, one seen whole."""
  def kernel(x_ref, o_ref, s_ref):
    i = pl.program_id(0)
    o_ref[...] = x_ref[...] + 1
    s_ref[i] = x_ref[...].sum()

  x = _rng(6, (16,))
  make = lambda interp: pl.pallas_call(
      kernel, grid=(8,), interpret=interp,
      out_shape=[jax.ShapeDtypeStruct((16,), jnp.float32),
                 jax.ShapeDtypeStruct((8,), jnp.float32)],
      in_specs=[pl.BlockSpec((2,), lambda i: (i,))],
      out_specs=[pl.BlockSpec((2,), lambda i: (i,)), pl.BlockSpec((8,), lambda i: (0,))])
  check(make, x, expect_mode="vectorized", modes=modes)


def test_jax_gpu_layer_norm_backward_is_vectorized(modes, monkeypatch):
  """JAX's own Triton layer-norm backward: its dw/db kernel reduces over
  whole refs at program_id column offsets; every eqn has a batched rule
  (none runs lane by lane, broadcast_to included)."""
  from jax.experimental.pallas.ops.gpu import layer_norm
  from pallas_np import batching
  lane_looped = []
  orig = batching.lane_loop

  def recording(rule, info, in_batched):
    lane_looped.append(info.primitive.name)
    return orig(rule, info, in_batched)
  monkeypatch.setattr(batching, "lane_loop", recording)
  x, w, b = _rng(7, (2, 20, 200)), _rng(8, (200,)), _rng(9, (200,))
  loss = lambda interp: (lambda x, w, b: (layer_norm.layer_norm(
      x, w, b, interpret=interp) ** 2).sum())
  got = jax.grad(loss(VEC), argnums=(0, 1, 2))(x, w, b)
  assert modes.count("vectorized") >= 2, modes  # dx and dw/db
  assert lane_looped == [], lane_looped
  seq = jax.grad(loss(SEQ), argnums=(0, 1, 2))(x, w, b)
  for g, s in zip(got, seq):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(s))


def test_slabs_see_what_earlier_slabs_merged(modes, monkeypatch):
  """Slabs of 4 lanes: point i reads element (i + 12) % 16: what point i-4
  wrote in an earlier slab, or, in the first slab, an element only later
  points write: lanes of one slab never meet, so the pass is grid order."""
  from pallas_np.grid import slab_runner
  monkeypatch.setattr(slab_runner, "_MAX_LANES", 4)

  def kernel(x_ref, _init_ref, o_ref):
    i = pl.program_id(0)
    o_ref[i] = o_ref[(i + 12) % 16] + x_ref[i]

  x = _rng(10, (16,))
  got = check(onto_zeros(kernel, 16, (16,)), x, expect_mode="vectorized", modes=modes)
  want = np.asarray(x).reshape(4, 4).cumsum(0).reshape(-1)
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_two_dimensional_grid_tiles_of_a_whole_output(modes):
  """A (rows, cols) grid writing program_id-indexed tiles of one whole-array
  output, masked at the ragged edges (Triton matmul-style epilogue)."""
  m, n, bm, bn = 20, 30, 8, 16

  def kernel(x_ref, o_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    rows = i * bm + jnp.arange(bm)
    cols = j * bn + jnp.arange(bn)
    mask = (rows < m)[:, None] & (cols < n)[None, :]
    x = pltriton.load(x_ref.at[rows[:, None], cols[None]], mask=mask, other=0.0)
    pltriton.store(o_ref.at[rows[:, None], cols[None]], jnp.tanh(x) * (i + 2 * j), mask=mask)

  x = _rng(11, (m, n))
  check(whole(kernel, jax.ShapeDtypeStruct((m, n), jnp.float32),
              (pl.cdiv(m, bm), pl.cdiv(n, bn))), x, expect_mode="vectorized", modes=modes)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int32, jnp.int8])
def test_lane_indexed_accesses_keep_dtypes(modes, dtype):
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    idx = i * 8 + jnp.arange(8)
    v = pltriton.load(x_ref.at[idx], mask=idx < 60, other=jnp.asarray(3, dtype))
    o_ref[pl.ds(i * 8, 8)] = v + v

  x = jnp.asarray(np.random.default_rng(12).integers(-20, 20, 60), dtype)
  check(whole(kernel, jax.ShapeDtypeStruct((64,), dtype), (8,)), x,
        expect_mode="vectorized", modes=modes)


def test_lanes_of_different_branches_meeting(modes):
  """Even and odd points write the same element from different branches of a
  lane-dependent cond: each group's lanes keep their pass-wide numbers, so
  the meeting is seen and the grid runs in order."""
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)

    @pl.when(i % 2 == 0)
    def _():
      o_ref[i // 2] = x_ref[i] * 2

    @pl.when(i % 2 == 1)
    def _():
      o_ref[i // 2] = x_ref[i] * 3

  x = _rng(13, (16,))
  got = check(whole(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), (16,)), x,
              expect_mode="sequential", modes=modes)
  np.testing.assert_array_equal(got, np.asarray(x)[1::2] * 3)


def test_read_by_every_lane_before_lanes_write(modes):
  """``v = o_ref[0]`` (one read for every lane) then ``o_ref[i] = v + i``:
  in grid order point 1 reads what point 0 wrote, so the pass must not run."""
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    v = o_ref[0]
    o_ref[i] = v + 1 + i.astype(jnp.float32)

  x = jnp.full((8,), 5.0, jnp.float32)
  got = check(whole(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), (8,), aliases={0: 0}), x,
              expect_mode="sequential", modes=modes)
  np.testing.assert_array_equal(got, np.r_[6.0, 7.0 + np.arange(1, 8)])


def test_triton_add_kernel_many_blocks(modes):
  """The Triton tutorial's vector add: 1000 program ids, masked tail."""
  n, block = 64_000 - 5, 64

  def kernel(x_ref, y_ref, o_ref):
    idx = pl.program_id(0) * block + jnp.arange(block)
    mask = idx < n
    x = pltriton.load(x_ref.at[idx], mask=mask)
    y = pltriton.load(y_ref.at[idx], mask=mask)
    pltriton.store(o_ref.at[idx], x + y, mask=mask)

  x, y = _rng(14, (n,)), _rng(15, (n,))
  got = check(whole(kernel, jax.ShapeDtypeStruct((n,), jnp.float32), (pl.cdiv(n, block),)),
              x, y, expect_mode="vectorized", modes=modes)
  np.testing.assert_array_equal(got, np.asarray(x) + np.asarray(y))


def test_reading_what_another_lane_already_wrote_in_the_pass(modes):
  """Point i writes element i, then reads element i+1: in the batched pass
  lane i+1 has written it already, in grid order not yet. The read must see
  the other lane's write and send the grid back to the loop."""
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[i] = x_ref[i] * 2
    o_ref[8 + i] = o_ref[jnp.minimum(i + 1, 7)]

  x = jnp.arange(16, dtype=jnp.float32)
  got = check(whole(kernel, jax.ShapeDtypeStruct((16,), jnp.float32), (8,), aliases={0: 0}), x,
              expect_mode="sequential", modes=modes)
  np.testing.assert_array_equal(got[8:], np.r_[np.arange(1, 8), 14.0])


# -- randomized: program_id strides that may overlap, reads of other programs' parts -----
def _random_triton_kernel(seed):
  rng = np.random.default_rng(seed)
  progs = int(rng.integers(2, 12))
  block = int(rng.choice([1, 3, 4, 8]))
  stride = int(rng.choice([block, max(block - 1, 1), block + 2]))  # < block: programs overlap
  n = progs * stride + block + 3
  cut = n - int(rng.integers(0, block + 4))  # masked tail
  shift = [None, 0, 1, -1][int(rng.integers(0, 4))]  # read what a neighbour program writes
  twice = bool(rng.random() < 0.3)  # store, then store again elsewhere

  def kernel(x_ref, _init_ref, o_ref):
    i = pl.program_id(0)
    idx = i * stride + jnp.arange(block)
    mask = idx < cut
    v = pltriton.load(x_ref.at[idx], mask=mask, other=0.0)
    if shift is not None:
      j = jnp.clip(idx + shift * stride, 0, n - 1)
      v = v + pltriton.load(o_ref.at[j], mask=mask, other=0.0)
    pltriton.store(o_ref.at[idx], v * (i + 1).astype(jnp.float32), mask=mask)
    if twice:
      k = jnp.clip(idx + block, 0, n - 1)
      pltriton.store(o_ref.at[k], v, mask=mask)

  return onto_zeros(kernel, n, (progs,)), _rng(seed, (n,))


def test_random_program_id_patterns(modes):
  """Vectorized (when the records allow it) == grid loop, bitwise, over
  random strides, overlaps, masks and cross-program reads; both outcomes
  must occur."""
  seen = set()
  for seed in range(40):
    make, x = _random_triton_kernel(seed)
    modes.clear()
    got = make(VEC)(x)
    seen.add(modes[-1])
    want = make(SEQ)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"seed {seed}")
    if seed < 4:
      np.testing.assert_allclose(np.asarray(got), np.asarray(make(True)(x)), rtol=1e-6)
  assert seen == {"vectorized", "sequential"}, seen


def test_grid_report_says_how_and_why():
  """pallas_np.grid_report(): each kernel's last grid mode, and why a grid
  ran in order."""
  pallas_np.clear_caches()

  def own(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[pl.ds(i * 2, 2)] = x_ref[pl.ds(i * 2, 2)] + 1

  def chain(x_ref, _init_ref, o_ref):
    i = pl.program_id(0)
    o_ref[i + 1] = o_ref[i] + x_ref[i]

  x = _rng(16, (16,))
  pallas_np.pallas_call(own, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), grid=(8,))(x)
  pallas_np.pallas_call(own, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), grid=(8,),
                        interpret=SEQ, name="own_seq")(x)
  onto_zeros(chain, 9, (8,))(pallas_np.InterpretParams())(x[:8])
  report = {r["kernel"]: r for r in pallas_np.grid_report()}
  assert report["own"]["mode"] == "vectorized" and report["own"]["why"] is None
  assert report["own"]["grid"] == (8,) and report["own"]["batched_axes"] == (0,)
  assert report["own_seq"] == {"kernel": "own_seq", "grid": (8,), "mode": "sequential",
                               "why": "vectorize=False", "layout": None, "batched_axes": None}
  assert report["chain"]["mode"] == "sequential"
  assert "another lane" in report["chain"]["why"]


def test_failed_batched_compile_is_not_retried(monkeypatch):
  """A kernel with a primitive that has no batched rule (a print) is compiled
  batched once; later calls go straight to the grid loop."""
  from pallas_np.grid import vectorize
  compiled = []
  orig = vectorize.BatchCompiler.__init__

  def init(self, params, name, *rest, **kw):
    compiled.append(name)
    orig(self, params, name, *rest, **kw)
  monkeypatch.setattr(vectorize.BatchCompiler, "__init__", init)

  def printing(x_ref, o_ref):
    pl.debug_print("at {}", pl.program_id(0))
    o_ref[...] = x_ref[...] * 2

  f = pl.pallas_call(printing, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), grid=(4,),
                     in_specs=[pl.BlockSpec((2,), lambda i: (i,))],
                     out_specs=pl.BlockSpec((2,), lambda i: (i,)), interpret=VEC)
  x = _rng(17, (8,))
  for _ in range(3):
    np.testing.assert_array_equal(f(x), np.asarray(x) * 2)
  assert compiled.count("printing") == 1, compiled


def test_auto_mode_weighs_program_id_access_bytes(plans):
  """Auto mode counts what a lane moves through program_id-indexed accesses
  like block bytes: 256 KiB tiles of a whole-array input stay on the grid
  loop, small ones batch; vectorize=True batches both, equal to the loop."""
  def make(tile):
    def tiles(x_ref, o_ref):
      i = pl.program_id(0)
      rows = i * tile + jnp.arange(tile)
      v = pltriton.load(x_ref.at[rows[:, None], jnp.arange(256)[None]])
      pltriton.store(o_ref.at[rows[:, None], jnp.arange(256)[None]], v * 2)
    return lambda interp: pl.pallas_call(
        tiles, out_shape=jax.ShapeDtypeStruct((4 * tile, 256), jnp.float32), grid=(4,),
        interpret=interp)

  for tile, auto_mode in [(256, "sequential"), (8, "vectorized")]:
    x = _rng(18, (4 * tile, 256))
    got = make(tile)(pallas_np.InterpretParams())(x)
    assert plans[-1].last_mode == auto_mode, (tile, plans[-1].last_mode)
    if auto_mode == "sequential":
      assert "too big" in str(plans[-1].vectorizer.last_failure)
    forced = make(tile)(VEC)(x)
    assert plans[-1].last_mode == "vectorized"
    np.testing.assert_array_equal(got, forced)
    np.testing.assert_array_equal(got, np.asarray(x) * 2)
