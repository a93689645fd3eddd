"""Grid vectorization: the batched pass must give exactly what the sequential
grid loop and interpret=True give, and must really be taken where the
analysis says the grid points are independent (and not where they aren't)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np import _compat as jc
from pallas_np.grid import KernelPlan
from tests.conftest import assert_same
from tests.tpu_helpers import scratch_reset_only_at_origin

def _normal(seed, shape):
  # NumPy's generator: jax.random would compile an XLA program per shape.
  return _rng_normal(np.random.default_rng(seed), shape)


def _rng_normal(rng, shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


VEC = pallas_np.InterpretParams(vectorize=True, check_avals=True)
SEQ = pallas_np.InterpretParams(vectorize=False, check_avals=True)


@pytest.fixture
def modes(monkeypatch):
  """Records KernelPlan.last_mode of every run."""
  seen = []
  orig = KernelPlan.run

  def run(self, *args):
    try:
      return orig(self, *args)
    finally:
      seen.append(self.last_mode)
  monkeypatch.setattr(KernelPlan, "run", run)
  return seen



def row_blocks(kernel, x, rows=1):
  """``make(interp)`` for a kernel over blocks of ``rows`` rows of ``x`` (one
  output block per grid point: the shape vectorization batches)."""
  def make(interp):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // rows,),
        in_specs=[pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0)), interpret=interp)
  return make

def check(make_call, *args, expect_mode, modes, rtol=1e-5, atol=1e-5, threads=None):
  """numpy vectorized == numpy sequential == interpret=True, with the lanes
  of a batched pass laid out first and last (vectorize.LANES_LAST); and the
  vectorized run took the expected path."""
  from pallas_np.grid import vectorize
  vec = VEC if threads is None else pallas_np.InterpretParams(
      vectorize=True, check_avals=True, num_threads=threads)
  seq = make_call(SEQ)(*args)
  assert modes[-1] == "sequential"
  want = make_call(True)(*args)
  for layout in (False, True):
    modes.clear()
    vectorize.LANES_LAST = layout
    try:
      got = make_call(vec)(*args)
    finally:
      vectorize.LANES_LAST = None
    assert modes and modes[-1] == expect_mode, (layout, modes)
    for g, s, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(seq),
                       jax.tree_util.tree_leaves(want)):
      assert_same(g, s, rtol=0, atol=0)  # same NumPy ops, lane by lane
      assert_same(g, w, rtol=rtol, atol=atol)
  return got


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
def _bitonic_rows(x):
  """Sort the last axis (power of two) with compare-exchange stages."""
  n = x.shape[-1]
  lead = x.shape[:-1]
  k = 2
  while k <= n:
    j = k // 2
    while j >= 1:
      y = x.reshape(*lead, n // (2 * j), 2, j)
      a, b = y[..., 0, :], y[..., 1, :]
      lo, hi = jnp.minimum(a, b), jnp.maximum(a, b)
      blk = lax.broadcasted_iota(jnp.int32, a.shape, len(lead))
      desc = ((blk * 2 * j) // k) % 2 == 1
      first = jnp.where(desc, hi, lo)
      second = jnp.where(desc, lo, hi)
      x = jnp.concatenate([first[..., None, :], second[..., None, :]], axis=-2).reshape(*lead, n)
      j //= 2
    k *= 2
  return x


def sort_kernel(x_ref, o_ref):
  o_ref[...] = _bitonic_rows(x_ref[...])


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
