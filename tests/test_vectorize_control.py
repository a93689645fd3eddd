"""Grid vectorization, continued: control flow that depends on program_id,
lane-dependent windows, reductions and dots in grid-loop order, the checks
and errors of batched passes, and the lane layout (shared helpers:
tests/vectorize_helpers.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np.grid import KernelPlan
from tests.conftest import assert_same
from tests.vectorize_helpers import (  # noqa: F401 (modes: a fixture)
    sort_kernel, _normal, _rng_normal, VEC, SEQ, modes, row_blocks, check)


# -- control flow that depends on program_id ---------------------------------------
def test_cond_on_batched_program_id(modes):
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = x_ref[...]

    @pl.when(i % 3 == 1)  # scattered lanes: copied in and out
    def _():
      o_ref[...] = x_ref[...] * 2.0

    @pl.when(i < 5)  # a contiguous lane range: views
    def _():
      o_ref[...] += 100.0

    o_ref[...] = lax.cond(i % 2 == 0, lambda v: v + 1.0, lambda v: v - 1.0, o_ref[...])

  x = jnp.arange(12 * 8, dtype=jnp.float32).reshape(12, 8)

  make = row_blocks(kernel, x, rows=1)
  check(make, x, expect_mode="vectorized", modes=modes)


def test_switch_with_batched_index(modes):
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = lax.switch(i % 3, [lambda v: v * 2.0, lambda v: v + 7.0,
                                    lambda v: jnp.sin(v)], x_ref[...])

  x = jnp.linspace(-2.0, 2.0, 9 * 4, dtype=jnp.float32).reshape(9, 4)

  make = row_blocks(kernel, x, rows=1)
  check(make, x, expect_mode="vectorized", modes=modes)


def test_fori_loop_with_batched_trip_count(modes):
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = jnp.zeros_like(o_ref)

    def body(t, carry):
      o_ref[...] += x_ref[...] * t.astype(jnp.float32)
      return carry + 1
    n = lax.fori_loop(0, i + 1, body, jnp.int32(0))
    o_ref[...] += n.astype(jnp.float32)

  x = jnp.ones((6, 8), jnp.float32)

  make = row_blocks(kernel, x, rows=1)
  check(make, x, expect_mode="vectorized", modes=modes)


def test_scan_and_static_fori_loop(modes):
  def kernel(x_ref, o_ref):
    i = pl.program_id(0).astype(jnp.float32)

    def step(c, row):
      c = c * 0.5 + row + i
      return c, c * 2.0
    c, ys = lax.scan(step, jnp.zeros((8,), jnp.float32), x_ref[...])
    o_ref[...] = ys + c[None, :]
    o_ref[...] = lax.fori_loop(0, 3, lambda t, v: v + i * t, o_ref[...])

  x = _normal(6, (20, 8))

  make = row_blocks(kernel, x, rows=4)
  check(make, x, expect_mode="vectorized", modes=modes)


@pytest.fixture
def body_compiles(monkeypatch):
  """Bodies compiled by the batched loop rules' carry fixpoint, per loop."""
  from pallas_np.control_flow import lane_groups
  counts = []
  orig = lane_groups.fixpoint_carry

  def fixpoint(compile_body, n_carry, carry_in):
    counts.append(0)

    def counted(cb):
      counts[-1] += 1
      return compile_body(cb)
    return orig(counted, n_carry, carry_in)
  monkeypatch.setattr(lane_groups, "fixpoint_carry", fixpoint)
  return counts


def test_loop_carries_made_batched_by_the_body_compile_it_once(modes, body_compiles):
  # Both carries start unbatched (zeros) and become batched through a
  # batched value the body reads: the guess from the jaxpr's data flow
  # gets it right, so each body is compiled once, not twice. (The causal
  # kv loop of GPU-style attention paid ~1.7 ms for the second compile.)
  def kernel(x_ref, o_ref):
    x = x_ref[...]

    def step(c, row):
      c = c * 0.5 + row + x[0]
      return c, c * 2.0
    c, ys = lax.scan(step, jnp.zeros((8,), jnp.float32), x)
    acc = lax.fori_loop(0, 3, lambda t, v: v + x * t.astype(jnp.float32),
                        jnp.zeros_like(x))
    o_ref[...] = ys + c[None, :] + acc

  x = _normal(13, (20, 8))
  check(row_blocks(kernel, x, rows=4), x, expect_mode="vectorized", modes=modes)
  assert body_compiles and all(n == 1 for n in body_compiles), body_compiles


def test_loop_with_a_lane_dependent_trip_count_skips_the_fixpoint(modes, body_compiles):
  # The trip count depends on a batched value: every carry is batched
  # (lanes stop at different steps), nothing to find by compiling.
  def kernel(x_ref, o_ref):
    n = x_ref[0, 0].astype(jnp.int32)
    o_ref[...] = lax.fori_loop(0, n, lambda t, v: v * 0.5 + x_ref[...], jnp.zeros_like(x_ref))

  x = jnp.asarray(np.arange(6)[:, None] + np.zeros((6, 8)), jnp.float32)
  check(row_blocks(kernel, x, rows=1), x, expect_mode="vectorized", modes=modes)
  assert body_compiles == [], body_compiles


def test_loop_carry_made_batched_by_program_id_inside_the_body(modes, body_compiles):
  # program_id read inside the body: invisible to the data-flow guess, so
  # the fixpoint finds it by compiling (twice), and the carry is batched.
  # (interpret=True cannot lower program_id inside a loop: NumPy reference.)
  def kernel(x_ref, o_ref):
    def body(t, v):
      return v + (pl.program_id(0) * t).astype(jnp.float32)
    o_ref[...] = x_ref[...] + lax.fori_loop(0, 3, body, jnp.zeros((1, 8), jnp.float32))

  x = _normal(14, (6, 8))
  make = row_blocks(kernel, x, rows=1)
  seq = make(SEQ)(x)
  modes.clear()
  got = make(VEC)(x)
  assert modes[-1] == "vectorized"
  assert body_compiles and all(n == 2 for n in body_compiles), body_compiles
  assert_same(got, seq, rtol=0, atol=0)
  assert_same(got, np.asarray(x) + 3.0 * np.arange(6, dtype=np.float32)[:, None],
              rtol=0, atol=0)


def test_lane_dependent_window_of_a_batched_block(modes):
  # Each lane reads rows [8*i, 8*i + 16) of its own block (a decode kernel's
  # K tile at a per-lane offset): one gather over all lanes, its columns
  # copied as runs (_trailing_slices).
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = x_ref[pl.ds(i * 8, 16), pl.ds(0, 16)] * 2.0 + x_ref[pl.ds(i, 16), 3:19]

  x = _normal(15, (4, 64, 32))

  def make(interp):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((4, 16, 16), jnp.float32), grid=(4,),
        in_specs=[pl.BlockSpec((None, 64, 32), lambda i: (i, 0, 0))],
        out_specs=pl.BlockSpec((None, 16, 16), lambda i: (i, 0, 0)), interpret=interp)
  got = check(make, x, expect_mode="vectorized", modes=modes)
  xs = np.asarray(x)
  assert_same(got, np.stack([xs[i, 8 * i:8 * i + 16, :16] * 2.0 + xs[i, i:i + 16, 3:19]
                             for i in range(4)]), rtol=0, atol=0)


@pytest.mark.parametrize("case", ["rows_batched", "both_ranges", "col_gather", "int_index",
                                  "strided", "shared_ref"])
def test_trailing_slices_read_the_same_elements(case):
  from pallas_np.state.lane_access import trailing_slices as _trailing_slices
  rng = np.random.default_rng(16)
  ref = rng.standard_normal((5, 40, 12))
  lanes = 5
  lane = np.arange(lanes).reshape(lanes, 1, 1)
  rows = (np.arange(8) + 3 * np.arange(lanes)[:, None]).reshape(lanes, 8, 1)
  cols = np.arange(2, 10).reshape(1, 1, 8)
  full = (lanes, 8, 8)
  want_slices = 1
  if case == "rows_batched":
    index = (lane, rows, cols)
  elif case == "both_ranges":
    index = (lane, (np.arange(8) + 4).reshape(1, 8, 1), cols)
    want_slices = 2
  elif case == "col_gather":  # columns out of order: stays a gather
    index = (lane, rows, np.array([0, 3, 1, 2, 5, 4, 7, 6]).reshape(1, 1, 8))
    want_slices = 0
  elif case == "int_index":  # ref[pl.ds(...), 4]: no column axis; left a gather
    index, full = (lane[:, :, 0], rows[:, :, 0], np.full((1, 1), 4)), (lanes, 8)
    want_slices = 0
  elif case == "strided":
    index = (lane, rows, (1 + 3 * np.arange(4)).reshape(1, 1, 4))
    full = (lanes, 8, 4)
  else:  # a ref every lane shares, per-lane row offsets
    index, full = (rows[0:1, :, 0].reshape(1, 8, 1) + np.arange(lanes).reshape(lanes, 1, 1),
                   cols), (lanes, 8, 8)
    ref = ref[0]
  got = _trailing_slices(index, full)
  assert sum(isinstance(i, slice) for i in got) == want_slices, got
  np.testing.assert_array_equal(np.broadcast_to(ref[got], full),
                                np.broadcast_to(ref[index], full))


def test_dynamic_slice_of_shared_input_by_program_id(modes):
  # x is one block shared by all lanes; each lane reads its own rows.
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = x_ref[pl.ds(i * 2, 2), :] * 3.0 + x_ref[0, :][None, :]

  x = jnp.arange(16 * 4, dtype=jnp.float32).reshape(16, 4)

  def make(interp):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(8,),
        in_specs=[pl.BlockSpec((16, 4), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((2, 4), lambda i: (i, 0)), interpret=interp)
  check(make, x, expect_mode="vectorized", modes=modes)


def test_scalar_prefetch_index_map(modes):
  def kernel(perm_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] + perm_ref[pl.program_id(0)].astype(jnp.float32)

  perm = jnp.array([3, 0, 2, 1], jnp.int32)
  x = jnp.arange(4 * 8, dtype=jnp.float32).reshape(4, 8)

  def make(interp):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(4,),
            in_specs=[pl.BlockSpec((1, 8), lambda i, p: (p[i], 0))],
            out_specs=pl.BlockSpec((1, 8), lambda i, p: (i, 0))),
        interpret=interp)
  check(make, perm, x, expect_mode="vectorized", modes=modes)


def test_float_reductions_add_in_grid_loop_order_in_either_layout(modes):
  """NumPy sums pairwise along a contiguous axis and element by element across
  a strided one; a lanes-last pass must still round as the grid loop does."""
  def kernel(x_ref, s_ref, p_ref):
    x = x_ref[...]                       # (2, 1000): long rows
    s_ref[...] = jnp.sum(x, axis=1, keepdims=True) + jnp.mean(x * x, axis=1, keepdims=True)
    p_ref[...] = jnp.prod(1.0 + x / 64.0, axis=1, keepdims=True) + jnp.sum(x, axis=0)[None, :8]

  x = _normal(31, (64, 1000))

  def make(interp):
    return pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((64, 1), jnp.float32),
                           jax.ShapeDtypeStruct((64, 8), jnp.float32)),
        grid=(32,), in_specs=[pl.BlockSpec((2, 1000), lambda i: (i, 0))],
        out_specs=(pl.BlockSpec((2, 1), lambda i: (i, 0)),
                   pl.BlockSpec((2, 8), lambda i: (i, 0))), interpret=interp)
  check(make, x, expect_mode="vectorized", modes=modes, rtol=1e-4, atol=1e-4)


def test_edge_blocks_and_reductions(modes):
  # 10 rows in blocks of 4: the last block is partial (padding dropped).
  def kernel(x_ref, o_ref, s_ref):
    x = x_ref[...]
    m = jnp.max(x, axis=1, keepdims=True)
    e = jnp.exp(x - m)
    o_ref[...] = e / jnp.sum(e, axis=1, keepdims=True)
    s_ref[...] = jnp.cumsum(x, axis=1) + jnp.argmax(x, axis=1)[:, None].astype(jnp.float32)

  x = _normal(7, (10, 16))

  def make(interp):
    return pl.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2, grid=(3,),
        in_specs=[pl.BlockSpec((4, 16), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((4, 16), lambda i: (i, 0))] * 2, interpret=interp)
  check(make, x, expect_mode="vectorized", modes=modes)


def test_batched_dot_general_and_run_scoped(modes):
  def kernel(q_ref, k_ref, o_ref):
    def body(tmp_ref):
      s = jnp.einsum("hqd,hkd->hqk", q_ref[...], k_ref[...])
      tmp_ref[...] = s * 0.5
      o_ref[...] = jnp.einsum("hqk,hkd->hqd", tmp_ref[...], k_ref[...])
    pl.run_scoped(body, pltpu.VMEM((2, 4, 4), jnp.float32))

  rng = np.random.default_rng(8)
  q = _rng_normal(rng, (6, 4, 8))
  k = _rng_normal(rng, (2, 4, 8))

  def make(interp):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(3,),
        in_specs=[pl.BlockSpec((2, 4, 8), lambda i: (i, 0, 0)),
                  pl.BlockSpec((2, 4, 8), lambda i: (0, 0, 0))],
        out_specs=pl.BlockSpec((2, 4, 8), lambda i: (i, 0, 0)), interpret=interp)
  check(make, q, k, expect_mode="vectorized", modes=modes, rtol=1e-5, atol=1e-5)


_DOT_FORMS = {
    # name: (lhs block, rhs block, product of the two blocks, rhs batched)
    "row_gemv": ((1, 32), (32, 16), lambda a, b: a @ b, False),
    "column_gemv": ((4, 32), (32, 1), lambda a, b: a @ b, False),
    "row_dot": ((1, 32), (32, 1), lambda a, b: a @ b, False),
    "rhs_transposed": ((4, 32), (16, 32), lambda a, b: a @ b.T, False),
    "lhs_transposed": ((32, 4), (32, 16), lambda a, b: a.T @ b, False),
    "rhs_batched": ((4, 32), (32, 16), lambda a, b: a @ b, True),
    "batch_dims": ((2, 4, 32), (2, 16, 32),
                   lambda a, b: jnp.einsum("hqd,hkd->hqk", a, b), True),
}


@pytest.mark.parametrize("form", sorted(_DOT_FORMS))
def test_batched_dots_make_the_grid_loops_blas_calls_lane_by_lane(form, modes, monkeypatch):
  """Every lane of a batched dot_general is the very BLAS call a grid point
  makes (the same 2-D shapes and operand layouts, for which NumPy picks one
  routine): BLAS rounds differently with the row count, the routine (gemm /
  gemv / dot) and transposes, so anything else (folding the lanes into the
  lhs rows, say) is not bitwise equal to the grid loop on every CPU. Checked
  on the calls themselves, so the test fails on machines whose BLAS happens
  to round both ways alike."""
  from pallas_np import blas
  lhs_block, rhs_block, product, rhs_batched = _DOT_FORMS[form]
  calls = []
  orig = blas.matmul_for

  def recording_matmul_for(macs):
    matmul = orig(macs)

    def recorded(x, y, out=None):
      calls.append(tuple((a.shape[-2:], a.strides[-1] == a.itemsize,
                          a.strides[-2] == a.itemsize) for a in (x, y)))
      return matmul(x, y, out=out)
    return recorded
  monkeypatch.setattr(blas, "matmul_for", recording_matmul_for)

  n = 16
  rng = np.random.default_rng(9)
  lhs = _rng_normal(rng, (n * lhs_block[0], *lhs_block[1:]))
  rhs = _rng_normal(rng, ((n if rhs_batched else 1) * rhs_block[0], *rhs_block[1:]))
  out_block = jax.eval_shape(product, jax.ShapeDtypeStruct(lhs_block, jnp.float32),
                             jax.ShapeDtypeStruct(rhs_block, jnp.float32)).shape
  zeros = (0,) * (len(lhs_block) - 1)

  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = product(x_ref[...], y_ref[...])

  def make(interp):
    return pl.pallas_call(
        kernel, grid=(n,),
        out_shape=jax.ShapeDtypeStruct((n * out_block[0], *out_block[1:]), jnp.float32),
        in_specs=[pl.BlockSpec(lhs_block, lambda i: (i, *zeros)),
                  pl.BlockSpec(rhs_block, (lambda i: (i, *zeros)) if rhs_batched
                               else (lambda i: (0, *zeros)))],
        out_specs=pl.BlockSpec(out_block, lambda i: (i, *zeros)), interpret=interp)

  pallas_np.clear_caches()
  make(SEQ)(lhs, rhs)
  grid_loop_calls = set(calls)
  assert grid_loop_calls
  pallas_np.clear_caches()
  calls.clear()
  check(make, lhs, rhs, expect_mode="vectorized", modes=modes, rtol=1e-5, atol=1e-5)
  assert calls and set(calls) == grid_loop_calls


def test_program_id_written_to_ref(modes):
  # Batched int indexing into a lane-private output block, bf16 output.
  def kernel(o_ref):
    i = pl.program_id(0)
    j = pl.program_id(1)
    o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[0, j] = (i * 10 + j).astype(o_ref.dtype)

  def make(interp):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((4, 3 * 8), jnp.bfloat16), grid=(4, 3),
        out_specs=pl.BlockSpec((1, 8), lambda i, j: (i, j)), interpret=interp)
  check(make, expect_mode="vectorized", modes=modes)


def test_whole_output_written_by_every_point_is_checked_and_merged(modes):
  """Every grid point sees the whole output but writes its own element:
  batched with lane copies (tests/test_shared_outputs.py has the rest)."""
  def kernel(o_ref):
    i = pl.program_id(0)
    o_ref[i] = i

  def make(interp):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.int32), grid=(8,),
        out_specs=pl.BlockSpec((8,), lambda i: (0,)), interpret=interp)
  check(make, expect_mode="vectorized", modes=modes)


def test_error_in_one_lane_names_its_grid_point(modes):
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = x_ref[pl.ds(i * 2 + (i == 5).astype(jnp.int32) * 100, 2), :]

  x = jnp.zeros((16, 4), jnp.float32)
  f = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(8,),
      in_specs=[pl.BlockSpec((16, 4), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((2, 4), lambda i: (i, 0)), interpret=VEC)
  with pytest.raises(IndexError) as info:
    pallas_np.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(8,),
        in_specs=[pl.BlockSpec((16, 4), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((2, 4), lambda i: (i, 0)), interpret=VEC)(x)
  assert isinstance(info.value, pallas_np.KernelError)
  assert info.value.program_ids == (5,)
  del f


def test_vectorize_false_and_auto(modes):
  x = _normal(9, (8, 16))

  make = row_blocks(sort_kernel, x, rows=1)
  modes.clear()
  make("numpy")(x)
  assert modes[-1] == "vectorized"  # the default (vectorize=None) decides
  make(SEQ)(x)
  assert modes[-1] == "sequential"


def test_auto_mode_skips_big_blocks_without_running_the_analysis(modes, monkeypatch):
  # Output blocks alone over the auto limit: sequential, and decided before
  # the batched index maps are compiled and evaluated (a first-call cost).
  from pallas_np.grid import vectorize
  x = _normal(10, (8, 256))
  make = row_blocks(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2.0), x, rows=2)
  monkeypatch.setattr(vectorize, "_AUTO_LANE_BYTES", 1024)  # 2x256 f32 = 2 KiB per lane
  analysed = []
  orig = vectorize.GridVectorizer.index_maps
  monkeypatch.setattr(vectorize.GridVectorizer, "index_maps",
                      lambda self, axes: analysed.append(axes) or orig(self, axes))
  modes.clear()
  got = make("numpy")(x)
  assert modes[-1] == "sequential" and not analysed
  assert_same(got, x * 2.0, rtol=0, atol=0)
  assert_same(make(VEC)(x), x * 2.0, rtol=0, atol=0)  # vectorize=True still batches
  assert modes[-1] == "vectorized" and analysed


def test_vectorized_run_never_compiles_the_sequential_plan(monkeypatch):
  # The batched plan replaces the sequential one: compiling both doubled the
  # first call's plan cost (bitonic 1024x256 one row per step: ~10 ms).
  plans = []
  orig = KernelPlan.run
  monkeypatch.setattr(KernelPlan, "run", lambda self, *a: plans.append(self) or orig(self, *a))
  x = _normal(11, (8, 16))
  make = row_blocks(sort_kernel, x, rows=1)
  got = make(VEC)(x)
  assert plans[-1].last_mode == "vectorized" and plans[-1]._kernel is None
  seq = make(SEQ)(x)
  assert plans[-1].last_mode == "sequential" and plans[-1]._kernel is not None
  assert_same(got, seq, rtol=0, atol=0)
  assert_same(got, jnp.sort(x, axis=1), rtol=0, atol=0)


def test_layout_choice_lanes_last_for_short_rows_first_for_long_rows_and_gemms(modes):
  """Auto mode lays the lanes last where the kernel's values have a short last
  axis (the benchmark's bitonic sort transposes each one-row block into a
  column), first for long rows and GEMMs; each equals the grid loop."""
  from benchmarks.bitonic_sort import bitonic_kernel
  from benchmarks.kernels import matmul_kernel, softmax_kernel
  pallas_np.clear_caches()

  def rows_of(kernel, name, x, rows, *extra, out_cols=None):
    out_cols = out_cols or x.shape[1]
    def make(interp):
      return pl.pallas_call(
          kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], out_cols), jnp.float32),
          grid=(x.shape[0] // rows,),
          in_specs=[pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0)),
                    *[pl.BlockSpec(e.shape, lambda i: (0, 0)) for e in extra]],
          out_specs=pl.BlockSpec((rows, out_cols), lambda i: (i, 0)), interpret=interp,
          name=name)
    auto = make(pallas_np.InterpretParams(check_avals=True))(x, *extra)
    report[name] = pallas_np.grid_report()[-1]
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(make(SEQ)(x, *extra)))
    return auto

  report = {}
  # (1024 lanes of 64-wide rows: slabs of >= 256 KiB of blocks, below which
  # any pass stays lanes-first, slab_runner._LANES_LAST_MIN_BYTES)
  got = rows_of(bitonic_kernel, "sort", _normal(50, (1024, 64)), 1)
  x = _normal(50, (64, 32))
  np.testing.assert_array_equal(np.asarray(got),
                                np.sort(np.asarray(_normal(50, (1024, 64))), axis=-1))
  rows_of(softmax_kernel, "softmax", _normal(51, (64, 256)), 2)
  rows_of(matmul_kernel, "matmul", x, 1, _normal(52, (32, 16)), out_cols=16)
  assert all(report[k]["mode"] == "vectorized" for k in ("sort", "softmax", "matmul")), report
  assert report["sort"]["layout"] == "lanes-last"
  assert report["softmax"]["layout"] == "lanes-first"
  assert report["matmul"]["layout"] == "lanes-first"


def test_auto_lane_limit_is_higher_for_lanes_last_passes(modes):
  """Auto mode batches blocks of up to 128 KiB per lane, up to 512 KiB
  (exclusive) when the pass is lanes-last: bitonic in 64-row blocks (128 KiB
  per lane) batches, in 256-row blocks (512 KiB) it does not."""
  from benchmarks.bitonic_sort import bitonic_kernel
  pallas_np.clear_caches()
  auto = pallas_np.InterpretParams(check_avals=True)
  x = _normal(53, (2048, 256))
  for rows, mode in ((64, "vectorized"), (256, "sequential")):
    make = row_blocks(bitonic_kernel, x, rows=rows)
    modes.clear()
    got = make(auto)(x)
    assert modes[-1] in ((mode,) if mode == "vectorized" else ("sequential", "threaded")), modes
    np.testing.assert_array_equal(np.asarray(got), np.sort(np.asarray(x), axis=-1))
  report = pallas_np.grid_report()
  assert report[0]["layout"] == "lanes-last"
  assert "too big" in report[1]["why"]


def test_causal_attention_batches_batch_and_head_not_its_loop_axis(modes):
  """GPU-style causal attention, grid (batch, head, q block), whole K/V
  blocks (128 KiB each per lane) read in 64-row tiles by a fori_loop whose
  trip count depends on program_id(2). Auto mode batches (batch, head): the
  q-block axis drives the loop (batching it would iterate every lane to the
  longest trip count), and K/V lanes are views read in tiles, so their block
  bytes do not count against the auto limit. Bitwise the sequential result."""
  from benchmarks import kernels
  from pallas_np import api
  from pallas_np.grid import lanes
  pallas_np.clear_caches()
  case = kernels.case_gpu_attention()
  seq = case.make(SEQ)(*case.args)
  for interp in (pallas_np.InterpretParams(check_avals=True), VEC):
    modes.clear()
    got = case.make(interp)(*case.args)
    assert modes[-1] == "vectorized", (interp, modes)
    report = pallas_np.grid_report()[-1]
    assert report["batched_axes"] == (0, 1), report
    assert_same(got, seq, rtol=0, atol=0)
  assert_same(got, case.reference(*case.args), rtol=1e-5, atol=1e-5)
  kp = [entry[1] for entry in api._plan_cache.values()][-1]
  assert lanes.loop_axes(kp) == {2}
  assert lanes.partly_read_operands(kp) == {1, 2}  # K and V, not q or the output


def test_lane_view_over_two_grid_axes():
  """Lanes walking (batch, head) blocks of a (B, H, S, D) operand in C order
  are one view of it (no gather copy); any other order is gathered."""
  from pallas_np.grid import slab_runner
  buf = np.arange(2 * 3 * 8 * 4, dtype=np.float32).reshape(2, 3, 8, 4)
  window = buf.reshape(2, 3, 2, 4, 4)[:, :, :, None]  # blocks of (4, 4): positions (2, 3, 2, 1)
  b, h = np.divmod(np.arange(6), 3)
  cols = [b, h, np.full(6, 1), np.zeros(6, np.int64)]
  view, copied = slab_runner.gather(window, cols)
  assert not copied and np.shares_memory(view, buf)
  np.testing.assert_array_equal(view, window[tuple(cols)])
  part = [c[2:5] for c in cols]  # a slab of lanes 2..4
  view, copied = slab_runner.gather(window, part)
  assert not copied
  np.testing.assert_array_equal(view, window[tuple(part)])
  order = np.array([0, 3, 1, 4, 2, 5])  # head-major: not one stride
  perm = [c[order] for c in cols]
  got, copied = slab_runner.gather(window, perm)
  assert copied
  np.testing.assert_array_equal(got, window[tuple(perm)])


def test_partly_read_operands_counts_any_whole_access_as_whole():
  from pallas_np import api
  from pallas_np.grid import lanes
  x = _normal(54, (4, 32, 8))

  def tile_only(x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(8, 8), :] * 2.0

  def tile_and_whole(x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(8, 8), :] + jnp.sum(x_ref[...], axis=0, keepdims=True)

  found = []
  for kernel in (tile_only, tile_and_whole):
    pallas_np.clear_caches()
    got = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((4, 8, 8), jnp.float32), grid=(4,),
        in_specs=[pl.BlockSpec((None, 32, 8), lambda i: (i, 0, 0))],
        out_specs=pl.BlockSpec((None, 8, 8), lambda i: (i, 0, 0)), interpret=SEQ)(x)
    want = np.asarray(x)[:, 8:16] * 2.0 if kernel is tile_only else \
        np.asarray(x)[:, 8:16] + np.asarray(x).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    kp = [entry[1] for entry in api._plan_cache.values()][-1]
    found.append(lanes.partly_read_operands(kp))
  assert found == [{0}, set()]
