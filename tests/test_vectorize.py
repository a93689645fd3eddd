"""Grid vectorization: the batched pass must give exactly what the sequential
grid loop and interpret=True give, and must really be taken where the
analysis says the grid points are independent (and not where they aren't)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np import _compat as jc
from tests.conftest import assert_same
from tests.tpu_helpers import scratch_reset_only_at_origin
from tests.vectorize_helpers import (  # noqa: F401 (modes: a fixture)
    sort_kernel, _normal, _rng_normal, VEC, SEQ, modes, row_blocks, check)


# -- broadcasts: materialised when small, views when big ----------------------------
def test_broadcast_in_dim_small_and_big(modes):
  """Small broadcasts are fresh arrays, big ones views, unit-dim inserts
  reshapes: all three batched and sequential, written back through refs."""
  def k(x_ref, v_ref, o_small, o_big, o_mask):
    x = x_ref[...]  # (8, 128)
    row = x[:, 0]  # (8,)
    small = lax.broadcast_in_dim(row, (8, 16), (0,)) + row[:, None]  # 128 elements
    o_small[...] = small * 2
    big = lax.broadcast_in_dim(v_ref[0], (64, 128), (1,))  # 8192 elements
    o_big[...] = big + lax.broadcast_in_dim(x[:1, :1], (64, 128), (0, 1))
    ids = lax.broadcasted_iota(jnp.int32, (16,), 0)
    mask = ids[:, None] < ids[None, :]  # (16, 16) from two unit-dim inserts
    o_mask[...] = jnp.where(mask, 1.0, 0.0) + pl.program_id(0).astype(jnp.float32)

  def make(interp):
    return pl.pallas_call(
        k, out_shape=(jax.ShapeDtypeStruct((32, 16), jnp.float32),
                      jax.ShapeDtypeStruct((256, 128), jnp.float32),
                      jax.ShapeDtypeStruct((64, 16), jnp.float32)),
        grid=(4,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0)),
                             pl.BlockSpec((1, 128), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((8, 16), lambda i: (i, 0)),
                   pl.BlockSpec((64, 128), lambda i: (i, 0)),
                   pl.BlockSpec((16, 16), lambda i: (i, 0))],
        interpret=interp)
  check(make, _normal(0, (32, 128)), _normal(1, (4, 128)), expect_mode="vectorized",
        modes=modes)


# -- Triton-style masked accesses: one index of the lane-stacked ref -----------------
def _row_program(kernel, shapes, n_rows, out_shape, **kw):
  """One row of every input per grid point (a Squeezed row BlockSpec), as
  JAX's GPU layer_norm/softmax ops lay out their programs."""
  def make(interp):
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(n_rows,),
        in_specs=[pl.BlockSpec((None, *s), lambda i, s=s: (i,) + (0,) * len(s))
                  for s in shapes],
        out_specs=jax.tree_util.tree_map(
            lambda o: pl.BlockSpec((None, *o.shape[1:]),
                                   lambda i, r=len(o.shape) - 1: (i,) + (0,) * r), out_shape),
        interpret=interp, **kw)
  return make


def test_masked_gather_loop_past_the_end_is_batched(modes):
  """``ref.at[col]`` with ``col`` running past the row end (masked off, with
  and without ``other``), masked integer-array stores, a mask that depends
  on the data (so differs per lane) and old values from a masked swap."""
  from jax.experimental.pallas import triton as pltriton
  n, block = 20, 16

  def kernel(x_ref, o_ref, old_ref):
    def body(i, acc):
      col = i * block + jnp.arange(block)
      return acc + pltriton.load(x_ref.at[col], mask=col < n, other=0.0)
    total = lax.fori_loop(0, pl.cdiv(n, block), body, jnp.zeros(block)).sum()
    for i in range(pl.cdiv(n, block)):
      col = i * block + jnp.arange(block)
      x = pltriton.load(x_ref.at[col], mask=col < n, other=0.0)
      pltriton.store(o_ref.at[col], x / total, mask=col < n)
      old_ref[pl.ds(i * block, block)] = jc.pallas_primitives.swap(
          o_ref.at[col], None, x * 2, mask=(col < n) & (x > 0))
  x = _normal(40, (6, n))
  make = _row_program(kernel, [(n,)], 6,
                      (jax.ShapeDtypeStruct((6, n), jnp.float32),
                       jax.ShapeDtypeStruct((6, 2 * block), jnp.float32)))
  o, old = check(make, x, expect_mode="vectorized", modes=modes)
  xn = np.asarray(x)
  want_o = np.where(xn > 0, xn * 2, xn / xn.sum(axis=1, keepdims=True))
  np.testing.assert_allclose(np.asarray(o), want_o, rtol=1e-6)
  # masked-off lanes of a swap return the value offered (Triton's select)
  np.testing.assert_allclose(np.asarray(old)[:, :n],
                             np.where(xn > 0, xn / xn.sum(axis=1, keepdims=True), xn * 2),
                             rtol=1e-6)


def test_masked_2d_tile_and_slice_window_are_batched(modes):
  """A (rows, cols) gather ``ref.at[r[:, None], c[None]]`` and a ``pl.ds``
  window (a view when in bounds; per-element lanes past the end)."""
  from jax.experimental.pallas import triton as pltriton
  m, n = 5, 12

  def kernel(x_ref, o_ref, w_ref):
    r = jnp.arange(8)
    c = jnp.arange(16)
    mask = (r[:, None] < m) & (c[None, :] < n)
    tile = pltriton.load(x_ref.at[r[:, None], c[None]], mask=mask, other=-1.0)
    pltriton.store(o_ref.at[r[:, None], c[None]], tile * 3.0, mask=mask)
    @pl.loop(0, 2)  # in bounds (a view), then past the end (lanes)
    def _(j):
      idx = j * 8 + jnp.arange(8)[None]
      w = pltriton.load(x_ref.at[pl.ds(0, 1), pl.ds(j * 8, 8)], mask=idx < n, other=7.0)
      w_ref[pl.ds(0, 1), pl.ds(j * 8, 8)] = w
      pltriton.store(o_ref.at[pl.ds(m - 1, 1), pl.ds(j * 8, 8)], w + 100.0, mask=idx < n)
  x = _normal(41, (4, m, n))
  make = _row_program(kernel, [(m, n)], 4,
                      (jax.ShapeDtypeStruct((4, m, n), jnp.float32),
                       jax.ShapeDtypeStruct((4, 1, 16), jnp.float32)))
  o, w = check(make, x, expect_mode="vectorized", modes=modes)
  w = np.asarray(w)[:, 0]
  xn = np.asarray(x)
  want = xn * 3.0
  want[:, m - 1] = xn[:, 0] + 100.0
  np.testing.assert_allclose(np.asarray(o), want, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(w)[:, n:], 7.0)


def test_masked_split_integer_indices_stay_correct(modes):
  """Integer indices split by a slice (NumPy moves them to the front): the
  batched pass runs that access lane by lane. interpret=True cannot run a
  masked load mixing slices and arrays, so NumPy is the reference."""
  from jax.experimental.pallas import triton as pltriton

  def kernel(x_ref, o_ref):
    a = jnp.arange(4)
    v = pltriton.load(x_ref.at[a, :, a], mask=jnp.ones((4, 3), bool))
    o_ref[...] = v * 2.0
  x = _normal(42, (3, 4, 3, 4))
  make = _row_program(kernel, [(4, 3, 4)], 3, jax.ShapeDtypeStruct((3, 4, 3), jnp.float32))
  modes.clear()
  got = make(VEC)(x)
  assert modes[-1] == "vectorized"
  assert_same(got, make(SEQ)(x), rtol=0, atol=0)
  xn = np.asarray(x)
  a = np.arange(4)
  np.testing.assert_array_equal(np.asarray(got), xn[:, a, :, a].transpose(1, 0, 2) * 2.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.int8])
def test_masked_accesses_batched_equal_sequential_across_dtypes(modes, dtype):
  """Every masked pattern (integer-array and ``pl.ds`` indices, past-the-end
  lanes, with/without ``other``, masked stores and swaps) in each dtype: the
  batched pass gives bit-for-bit the sequential result and interpret=True's
  on every lane interpret=True defines."""
  from jax.experimental.pallas import triton as pltriton
  n, block = 10, 8

  def kernel(x_ref, o_ref, old_ref):
    @pl.loop(0, pl.cdiv(n, block))  # a traced start: the last window runs past the end
    def _(i):
      col = i * block + jnp.arange(block)
      ok = col < n
      a = pltriton.load(x_ref.at[col], mask=ok, other=jnp.asarray(3, dtype))
      b = pltriton.load(x_ref.at[pl.ds(i * block, block)], mask=ok, other=jnp.asarray(1, dtype))
      pltriton.store(o_ref.at[col], a + b, mask=ok)
      old = jc.pallas_primitives.swap(o_ref.at[pl.ds(i * block, block)], None, a * b,
                                      mask=ok & (a > b))
      old_ref[pl.ds(i * block, block)] = jnp.where(ok, old, jnp.zeros_like(old))
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.integers(-5, 6, size=(5, n)), dtype)
  make = _row_program(kernel, [(n,)], 5,
                      (jax.ShapeDtypeStruct((5, n), dtype),
                       jax.ShapeDtypeStruct((5, 2 * block), dtype)))
  check(make, x, expect_mode="vectorized", modes=modes, rtol=0, atol=0)


def test_masked_on_lane_out_of_bounds_in_a_batched_pass_names_its_grid_point():
  from jax.experimental.pallas import triton as pltriton

  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    col = jnp.arange(16)
    limit = jnp.where(i == 2, 16, 12)  # grid point 2 leaves lanes 12..15 on
    o_ref[...] = pltriton.load(x_ref.at[col], mask=col < limit, other=0.0)
  x = _normal(43, (4, 12))
  with pytest.raises(IndexError, match="masked on") as info:
    pallas_np.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((4, 16), jnp.float32), grid=(4,),
        in_specs=[pl.BlockSpec((None, 12), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((None, 16), lambda i: (i, 0)), interpret=VEC)(x)
  assert info.value.program_ids == (2,)


# -- a bitonic sort, one row per grid step -----------------------------------------
def test_bitonic_one_row_per_step(modes):
  x = _normal(0, (32, 16))

  make = row_blocks(sort_kernel, x, rows=1)
  got = check(make, x, expect_mode="vectorized", modes=modes)
  np.testing.assert_array_equal(np.asarray(got), np.sort(np.asarray(x), axis=-1))


def test_threads_same_result(modes):
  x = _normal(1, (8, 16))

  make = row_blocks(sort_kernel, x, rows=1)
  check(make, x, expect_mode="vectorized", modes=modes, threads=2)


# -- matmuls ----------------------------------------------------------------------
def matmul_kernel(x_ref, y_ref, z_ref):
  z_ref[...] = jnp.maximum(x_ref[...] @ y_ref[...], 0.0)


def test_blockspec_matmul(modes):
  rng = np.random.default_rng(2)
  x = _rng_normal(rng, (64, 32))
  y = _rng_normal(rng, (32, 48))

  def make(interp):
    return pl.pallas_call(
        matmul_kernel, out_shape=jax.ShapeDtypeStruct((64, 48), jnp.float32), grid=(4, 3),
        in_specs=[pl.BlockSpec((16, 32), lambda i, j: (i, 0)),
                  pl.BlockSpec((32, 16), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((16, 16), lambda i, j: (i, j)), interpret=interp)
  check(make, x, y, expect_mode="vectorized", modes=modes, rtol=1e-5, atol=1e-5)


def acc_matmul_kernel(x_ref, y_ref, z_ref, acc_ref):
  k = pl.program_id(2)

  @pl.when(k == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

  @pl.when(k == pl.num_programs(2) - 1)
  def _():
    z_ref[...] = acc_ref[...].astype(z_ref.dtype)


def _acc_matmul(semantics):
  def make(interp):
    kw = {}
    if semantics is not None:
      kw["compiler_params"] = pltpu.CompilerParams(dimension_semantics=semantics)
    return pl.pallas_call(
        acc_matmul_kernel, out_shape=jax.ShapeDtypeStruct((32, 32), jnp.bfloat16),
        grid=(2, 2, 4),
        in_specs=[pl.BlockSpec((16, 8), lambda i, j, k: (i, k)),
                  pl.BlockSpec((8, 16), lambda i, j, k: (k, j))],
        out_specs=pl.BlockSpec((16, 16), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((16, 16), jnp.float32)], interpret=interp, **kw)
  return make


def _bf16_xy():
  rng = np.random.default_rng(3)
  return (_rng_normal(rng, (32, 32)).astype(jnp.bfloat16),
          _rng_normal(rng, (32, 32)).astype(jnp.bfloat16))


def test_scratch_accumulator_parallel_axes_batched(modes):
  # i, j batched; the "arbitrary" k axis stays sequential per lane.
  check(_acc_matmul(("parallel", "parallel", "arbitrary")), *_bf16_xy(),
        expect_mode="vectorized", modes=modes, rtol=1e-2, atol=1e-2)


def test_scratch_without_semantics(modes):
  # Scratch re-initialised at k == 0: the hand-over check proves lanes
  # independent without any dimension_semantics.
  # (on two threads: each thread's lanes keep their own scratch)
  check(_acc_matmul(None), *_bf16_xy(), expect_mode="vectorized", modes=modes,
        rtol=1e-2, atol=1e-2, threads=2)


def test_scratch_carried_across_a_parallel_axis_falls_back(modes):
  # A buggy kernel: scratch initialised only at (0, 0), so every i sees what
  # the previous i left. interpret=True's (sequential) answer must come out.
  make = scratch_reset_only_at_origin(4)
  check(make, jnp.ones((4, 8)), expect_mode="sequential", modes=modes)


def _scratch_kernel_call(kernel, n_out, interp, rows=4, steps=3):
  """(rows, 8) in, ``n_out`` (rows, 8) outputs, grid (rows, steps) declared
  parallel x arbitrary, two (1, 8) f32 scratch buffers."""
  return pl.pallas_call(
      kernel, out_shape=[jax.ShapeDtypeStruct((rows, 8), jnp.float32)] * n_out,
      grid=(rows, steps),
      in_specs=[pl.BlockSpec((1, 8), lambda i, j: (i, 0))],
      out_specs=[pl.BlockSpec((1, 8), lambda i, j: (i, 0))] * n_out,
      scratch_shapes=[pltpu.VMEM((1, 8), jnp.float32)] * 2,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interp)


def test_scratch_read_at_a_later_step_from_the_previous_lane_falls_back(modes):
  # acc is re-initialised at j == 0, but carry is read at j == 1 and written
  # only at j == 2: each i reads what the previous i left. Only the first
  # step is checked twice, so the check must compare all of the scratch.
  def kernel(x_ref, o_ref, acc_ref, carry_ref):
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when((i == 0) & (j == 0))
    def _():
      carry_ref[...] = jnp.full_like(carry_ref, 100.0)

    @pl.when(j == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += x_ref[...]

    @pl.when(j == 1)
    def _():
      acc_ref[...] += carry_ref[...]

    @pl.when(j == 2)
    def _():
      carry_ref[...] = acc_ref[...]

    o_ref[...] = acc_ref[...]

  x = jnp.arange(32.0).reshape(4, 8)
  got = check(lambda interp: _scratch_kernel_call(kernel, 1, interp), x,
              expect_mode="sequential", modes=modes)
  carry = np.full(8, 100.0)
  for i in range(4):  # the sequential semantics, by hand
    acc = 3 * np.asarray(x[i]) + carry
    np.testing.assert_array_equal(np.asarray(got[0][i]), acc)
    carry = acc


def test_scratch_leaked_into_an_output_at_the_first_step_falls_back(modes):
  # At j == 0 each i copies the previous i's scratch into an output, then
  # re-initialises it: the scratch after the first step is the same from any
  # start, only the output tells. The check must compare the output blocks.
  def kernel(x_ref, o_ref, prev_ref, acc_ref, unused_ref):
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when((i == 0) & (j == 0))
    def _():
      acc_ref[...] = jnp.full_like(acc_ref, -1.0)

    @pl.when(j == 0)
    def _():
      prev_ref[...] = acc_ref[...]
      acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += x_ref[...]
    o_ref[...] = acc_ref[...]

  x = jnp.arange(32.0).reshape(4, 8)
  got = check(lambda interp: _scratch_kernel_call(kernel, 2, interp), x,
              expect_mode="sequential", modes=modes)
  prev = np.asarray(got[1])
  np.testing.assert_array_equal(prev[0], np.full(8, -1.0))
  np.testing.assert_array_equal(prev[1:], 3 * np.asarray(x[:-1]))


def test_scratch_hand_over_check_reruns_only_the_first_sequential_step(modes, monkeypatch):
  # A kernel that re-initialises its scratch at j == 0 runs batched: one pass
  # over every sequential point, then the check over the first one only.
  from pallas_np.grid import slab_runner
  passes = []
  orig = slab_runner.SlabRunner.run

  def run(self, index_ops, buffers, scratch_init, first_states=None, seq_points=None):
    passes.append(len(seq_points if seq_points is not None else self.seq_points))
    return orig(self, index_ops, buffers, scratch_init, first_states, seq_points)
  monkeypatch.setattr(slab_runner.SlabRunner, "run", run)

  def kernel(x_ref, o_ref, acc_ref, unused_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += x_ref[...] * (pl.program_id(1) + 1).astype(jnp.float32)
    o_ref[...] = acc_ref[...]

  x = jnp.arange(32.0).reshape(4, 8)
  got = check(lambda interp: _scratch_kernel_call(kernel, 1, interp, steps=5), x,
              expect_mode="vectorized", modes=modes)
  assert passes == [5, 1] * 2, passes  # both lane layouts
  np.testing.assert_array_equal(np.asarray(got[0]), 15 * np.asarray(x))


@pytest.mark.parametrize("steps,expect", [(4, "vectorized"), (1, "sequential")])
def test_auto_mode_batches_scratch_kernels_by_their_check_cost(modes, steps, expect):
  # 64 KiB per lane (16 KiB each for x, y, out, acc): over the limit for a
  # check that is a second whole pass (one sequential point), under it when
  # the check re-runs one of four sequential points. (8 lanes: auto mode
  # batches GEMM kernels only from _AUTO_MIN_GEMM_LANES lanes.)
  rng = np.random.default_rng(12)
  x, y = _rng_normal(rng, (256, 64 * steps)), _rng_normal(rng, (64 * steps, 128))

  def make(interp):
    return pl.pallas_call(
        acc_matmul_kernel, out_shape=jax.ShapeDtypeStruct((256, 128), jnp.float32),
        grid=(4, 2, steps),
        in_specs=[pl.BlockSpec((64, 64), lambda i, j, k: (i, k)),
                  pl.BlockSpec((64, 64), lambda i, j, k: (k, j))],
        out_specs=pl.BlockSpec((64, 64), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((64, 64), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interp)
  seq = make(SEQ)(x, y)
  modes.clear()
  got = make(pallas_np.InterpretParams(check_avals=True))(x, y)
  assert modes[-1] == expect, modes
  assert_same(got, seq, rtol=0, atol=0)
  assert_same(got, make(True)(x, y), rtol=1e-5, atol=1e-4)


def test_output_revisited_along_reduction_axis(modes):
  # No scratch: accumulate in the output block across k. Lanes must own
  # their blocks, so only i (or j) may be batched.
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += x_ref[...] * (pl.program_id(1) + 1).astype(jnp.float32)

  x = _normal(4, (16, 64))

  def make(interp):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32), grid=(2, 2, 4),
        in_specs=[pl.BlockSpec((8, 8), lambda i, j, k: (i, j * 4 + k))],
        out_specs=pl.BlockSpec((8, 8), lambda i, j, k: (i, j)), interpret=interp)
  check(make, x, expect_mode="vectorized", modes=modes)


def test_parallel_axis_that_shares_an_output_block_falls_back(modes):
  # Declared parallel but every grid point adds into one block: the ownership
  # check refuses, the sequential loop gives interpret=True's answer.
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += x_ref[...]

  x = jnp.arange(64.0).reshape(8, 8)

  def make(interp):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((1, 8), jnp.float32), grid=(8,),
        in_specs=[pl.BlockSpec((1, 8), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((1, 8), lambda i: (0, 0)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interp)
  check(make, x, expect_mode="sequential", modes=modes)


def test_vmapped_pallas_call(modes):
  rng = np.random.default_rng(5)
  x = _rng_normal(rng, (3, 32, 16))
  y = _rng_normal(rng, (3, 16, 32))

  def make(interp):
    f = pl.pallas_call(
        matmul_kernel, out_shape=jax.ShapeDtypeStruct((32, 32), jnp.float32), grid=(2,),
        in_specs=[pl.BlockSpec((16, 16), lambda i: (i, 0)),
                  pl.BlockSpec((16, 32), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((16, 32), lambda i: (i, 0)), interpret=interp)
    return jax.vmap(f)
  check(make, x, y, expect_mode="vectorized", modes=modes)
