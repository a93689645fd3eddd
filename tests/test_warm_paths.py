"""Warm-speed fast paths (issue 33), each against interpret=True bit for bit:
integer div/rem by constants and by zero-free divisors, and the loops the
small-kernel benchmark runs (0 iterations, trip counts per grid point)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from pallas_np.grid.kernel_plan import KernelPlan
from tests.helpers import INLINED, assert_identical, run_both
from tests.kernel_fn import both, kernel_call

rng = np.random.default_rng(33)


@pytest.fixture
def modes(monkeypatch):
  """KernelPlan.last_mode of every numpy-mode run."""
  seen = []
  orig = KernelPlan.run

  def run(self, *args, **kw):
    try:
      return orig(self, *args, **kw)
    finally:
      seen.append(self.last_mode)
  monkeypatch.setattr(KernelPlan, "run", run)
  return seen
INT_DTYPES = [np.int8, np.int16, np.int32, np.uint8, np.uint32]


def _dividends(dtype, n=256):
  info = np.iinfo(dtype)
  x = rng.integers(info.min, info.max, n, endpoint=True, dtype=np.int64).astype(dtype)
  specials = [0, 1, 2, 3, 7, info.max, info.min, info.max - 1]
  if info.min < 0:
    specials += [-1, -2, -3, -7, info.min + 1]
  x[:len(specials)] = np.array(specials).astype(dtype)
  return x


def _constants(dtype):
  info = np.iinfo(dtype)
  cs = [1, 2, 3, 7, 64, info.max]
  if info.min < 0:
    cs += [-1, -2, -3, info.min]
  return [dtype(c) for c in cs]


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_div_rem_by_constants(dtype):
  """Constant nonzero divisors take the bare fmod / truncating division
  (compile time); INT_MIN / -1 wraps, negative dividends truncate."""
  x = _dividends(dtype)
  cs = _constants(dtype)

  def fn(a):
    outs = []
    for c in cs:
      outs += [lax.div(a, jnp.full_like(a, c)), lax.rem(a, jnp.full_like(a, c)),
               a // c, a % c]
    # a constant holding a zero keeps the exact rule
    mixed = jnp.where(lax.broadcasted_iota(jnp.int32, a.shape, 0) % 2 == 0,
                      jnp.asarray(0, a.dtype), jnp.asarray(3, a.dtype))
    return outs + [lax.div(a, mixed), lax.rem(a, mixed)]

  got, want = both(fn, x)
  for i, (g, w) in enumerate(zip(got, want)):
    assert g.dtype == w.dtype, i
    np.testing.assert_array_equal(g, w, err_msg=str(i))


@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("zeros", [False, True])
def test_div_rem_by_runtime_divisor(dtype, zeros):
  """Divisors read from a ref: zero-free ones take one check and the bare
  operation, ones with a zero the full rule (x / 0 = -1, x % 0 = x)."""
  x = _dividends(dtype)
  y = np.roll(_dividends(dtype), 3)
  y[y == 0] = 5
  if zeros:
    y[::17] = 0
  got, want = both(lambda a, b: [lax.div(a, b), lax.rem(a, b), a // b, a % b,
                                 lax.div(a[0], b[0]), lax.rem(a[1], b[1])], x, y)
  for i, (g, w) in enumerate(zip(got, want)):
    assert g.dtype == w.dtype, i
    np.testing.assert_array_equal(g, w, err_msg=str(i))


def test_int_min_by_minus_one_runtime():
  x = np.array([np.iinfo(np.int32).min, -7, 7, 0], np.int32)
  y = np.array([-1, -1, -1, -1], np.int32)
  got, want = both(lambda a, b: [lax.div(a, b), lax.rem(a, b)], x, y)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


def _collatz_kernel(x_ref, o_ref):
  def cond(c):
    return jnp.any(c[0] != 1)

  def body(c):
    x, steps = c
    done = x == 1
    nxt = jnp.where(x % 2 == 0, x // 2, 3 * x + 1)
    return jnp.where(done, x, nxt), steps + jnp.where(done, 0, 1)
  x = x_ref[...]
  o_ref[...] = lax.while_loop(cond, body, (x, jnp.zeros_like(x)))[1]


@pytest.mark.parametrize("vectorize,mode", [(None, "vectorized"), (False, "sequential")])
def test_while_trip_counts_per_grid_point(modes, vectorize, mode):
  """A data-dependent while loop per grid point: every row block runs a
  different number of iterations, one (all ones) runs none; batched, the
  lanes still running iterate while the others wait."""
  x = rng.integers(1, 60, (8, 128)).astype(np.int32)
  x[0:2] = 1  # the first block's loop runs 0 iterations
  x[2:4] = 27  # the longest chain below 60
  spec = pl.BlockSpec((2, 128), lambda i: (i, 0))

  def make(interpret):
    if interpret == "numpy":
      interpret = pallas_np.InterpretParams(vectorize=vectorize)
    return pl.pallas_call(_collatz_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
                          in_specs=[spec], out_specs=spec, interpret=interpret)
  got = run_both(make, x)
  assert modes[0] == mode, modes
  assert np.asarray(got)[0:2].max() == 0 and np.asarray(got)[2:4].min() == 111


@pytest.mark.parametrize("n", [0, 1, 5])
def test_fori_zero_and_few_iterations(n):
  """fori_loop over a ref with a static trip count, including 0."""
  x = rng.standard_normal((8, 128)).astype(np.float32)

  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)

    def body(r, acc):
      acc = acc + x_ref[pl.ds(r, 1), :] * 2 - 1
      o_ref[pl.ds(r, 1), :] = acc
      return acc
    lax.fori_loop(0, n, body, jnp.zeros((1, 128), jnp.float32))

  def make(interpret):
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)
  run_both(make, x, rtol=0, atol=0)


def _gather_rows_call(n_rows, interpret):
  from jax.experimental.pallas import tpu as pltpu

  def kernel(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + pl.program_id(0).astype(jnp.float32)

  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((n_rows, 128), jnp.float32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(n_rows,),
          in_specs=[pl.BlockSpec((1, 128), lambda i, idx: (idx[i], 0))],
          out_specs=pl.BlockSpec((1, 128), lambda i, idx: (i, 0))),
      interpret=interpret)


def test_warm_calls_follow_new_scalar_prefetch_values(modes):
  """The vectorized pass's block positions are cached per grid and
  scalar-prefetch values: every warm call with new values (and back to old
  ones) gathers the rows those values name."""
  x = rng.standard_normal((64, 128)).astype(np.float32)
  fn = _gather_rows_call(16, "numpy")
  want_fn = _gather_rows_call(16, True)
  idxs = [rng.integers(0, 64, 16).astype(np.int32) for _ in range(3)]
  for idx in [*idxs, idxs[0], np.arange(16, dtype=np.int32), idxs[1]]:
    modes.clear()
    got = fn(idx, x)
    assert modes == ["vectorized"]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want_fn(idx, x)))


@pytest.mark.parametrize("grid,expect", [((2,), "sequential"), ((4,), "vectorized")])
def test_auto_mode_skips_passes_of_too_few_lanes(modes, grid, expect):
  """Auto mode runs 2-lane grids as a loop (the pass costs more), and
  GEMM kernels below 8 lanes; results as interpret=True's either way."""
  x = rng.standard_normal((8 * grid[0], 64)).astype(np.float32)
  w = rng.standard_normal((64, 64)).astype(np.float32)

  def ew(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] * w_ref[:8, :] + 1.0

  def mm(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

  for kernel, want_mode in [(ew, expect), (mm, "sequential")]:
    def make(interpret, kernel=kernel):
      return pl.pallas_call(
          kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=grid,
          in_specs=[pl.BlockSpec((8, 64), lambda i: (i, 0)),
                    pl.BlockSpec((64, 64), lambda i: (0, 0))],
          out_specs=pl.BlockSpec((8, 64), lambda i: (i, 0)), interpret=interpret)
    modes.clear()
    run_both(make, x, w, rtol=1e-5, atol=1e-5)
    assert modes[0] == want_mode, (kernel.__name__, modes)


def test_scalar_ops_take_numpy_scalar_math():
  """0-d eqns (loop counters, index arithmetic) run as Python operators on
  NumPy scalars: same values and dtypes as the ufuncs, integer wrap-around
  included, silently."""
  import warnings
  ops = {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "and": jnp.bitwise_and,
         "or": jnp.bitwise_or, "xor": jnp.bitwise_xor, "eq": jnp.equal, "ne": jnp.not_equal,
         "lt": jnp.less, "le": jnp.less_equal, "gt": jnp.greater, "ge": jnp.greater_equal,
         "max": jnp.maximum, "min": jnp.minimum,
         "sel": lambda a, b: jnp.where(a < b, a, b), "neg": lambda a, b: -a,
         "not": lambda a, b: ~a}
  for dtype, vals in [(np.int32, [np.iinfo(np.int32).max, np.iinfo(np.int32).min, -7, 3, 0]),
                      (np.uint8, [255, 0, 1, 128]), (np.float32, [np.inf, -0.0, 0.0, np.nan, 1.5, -3e38]),
                      (np.bool_, [True, False])]:
    x = np.array(vals, dtype)
    names = [n for n in ops if not (dtype == np.float32 and n in ("and", "or", "xor", "not"))
             and not (dtype == np.bool_ and n in ("sub", "neg", "add", "mul"))]

    pairs = [(i, j) for i in range(len(vals)) for j in range(len(vals))]

    def fn(a, names=names, pairs=pairs):
      # One output per op: its 0-d results for every pair, stacked.
      return [jnp.stack([ops[n](a[i], a[j]) for i, j in pairs]) for n in names]

    with warnings.catch_warnings():
      warnings.simplefilter("error")
      got = _numpy_mode_both_ways(fn, x)
    # XLA's answer per op, elementwise over the pairs' operands: the same
    # values as its 0-d ops (one interpret=True compile of a few ops, not of
    # hundreds of 0-d ones, which took a minute).
    first, second = (x[[p[k] for p in pairs]] for k in (0, 1))
    want = [np.asarray(w) for w in kernel_call(
        lambda a, b, names=names: [ops[n](a, b) for n in names], first, second, interpret=True)]
    assert len(got) == len(want) == len(names)
    for k, (g, w) in enumerate(zip(got, want)):
      assert g.dtype == w.dtype and g.shape == w.shape == (len(pairs),), k
      for g, w in zip(g, w):
        if dtype == np.float32:
          np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
          assert np.isnan(w) or (g == w and np.signbit(g) == np.signbit(w)), k
        else:
          np.testing.assert_array_equal(g, w, err_msg=str(k))


def _numpy_mode_both_ways(fn, *args):
  """``fn``'s kernel in numpy mode, as a list of arrays; the kernel traced
  with ``fn``'s jit calls inlined must give the same (as ``both`` checks)."""
  got = [np.asarray(g) for g in jax.tree_util.tree_leaves(
      kernel_call(fn, *args, interpret="numpy"))]
  assert_identical(kernel_call(fn, *args, interpret=INLINED), got)
  return got


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int8, np.uint8])
def test_scalar_shifts(dtype):
  """Shifts of 0-d values take NumPy's scalar operators when the amount is
  in range; out-of-range and negative amounts keep XLA's rule."""
  bits = np.iinfo(dtype).bits
  info = np.iinfo(dtype)
  x = np.array([1, info.max, info.min, 5, 0], dtype)
  s = np.array([0, 1, bits - 1, bits, bits + 3] + ([-1] if info.min < 0 else []), dtype)

  pairs = [(i, j) for i in range(len(x)) for j in range(len(s))]
  shifts = (lax.shift_left, lax.shift_right_logical, lax.shift_right_arithmetic)

  def fn(a, b):  # 0-d shifts, one stacked output per shift kind
    return [jnp.stack([f(a[i], b[j]) for i, j in pairs]) for f in shifts]
  got = _numpy_mode_both_ways(fn, x, s)
  # XLA's shifts elementwise over the pairs' operands (see above)
  want = [np.asarray(w) for w in kernel_call(
      lambda a, b: [f(a, b) for f in shifts], x[[i for i, _ in pairs]],
      s[[j for _, j in pairs]], interpret=True)]
  assert len(got) == len(want) == len(shifts)
  for k, (g, w) in enumerate(zip(got, want)):
    assert g.dtype == w.dtype and g.shape == (len(pairs),), k
    np.testing.assert_array_equal(g, w, err_msg=str(k))


def test_single_kernel_program_runs_its_plan_directly_and_owns_outputs():
  """An eager pallas_np.pallas_call is one pallas_call over its inputs: it
  runs the kernel plan directly. Outputs must still never share memory with
  the inputs (an aliased input is copied first): the caller's array is
  unchanged and repeated calls give the same result."""
  from pallas_np import api

  def kernel(x_ref, o_ref):
    o_ref[0:8, :] = x_ref[0:8, :] * 3.0

  x = jnp.asarray(rng.standard_normal((16, 128)).astype(np.float32))
  x_before = np.array(x)
  fn = pallas_np.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                             input_output_aliases={0: 0})
  want = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        input_output_aliases={0: 0}, interpret=True)(x)
  for _ in range(3):
    got = fn(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(x), x_before)
    assert not np.shares_memory(np.asarray(got), np.asarray(x))
  plans = [entry.plan for entry in api._eager_cache.values()]
  assert any(p.kernel is not None for p in plans)


@pytest.mark.parametrize("shape,block", [((100, 70), (32, 32)),
                                         ((4, 3, 8, 128), (None, None, 8, 128))])
def test_warm_calls_of_a_pass_over_two_grid_axes(modes, shape, block):
  """Lanes over a (4, 3) grid: ragged 32x32 blocks (gathered) and (batch,
  head) blocks whose windows merge into one view; how the lanes' blocks are
  cut is decided on the first call. Warm calls with new inputs must match
  interpret=True."""
  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * y_ref[...] + 1.0

  if len(shape) == 2:
    spec = pl.BlockSpec(block, lambda i, j: (i, j))
  else:
    spec = pl.BlockSpec(block, lambda i, j: (i, j, 0, 0))
  kw = dict(grid=(4, 3), in_specs=[spec, spec], out_specs=spec)
  out = jax.ShapeDtypeStruct(shape, jnp.float32)
  fn = pallas_np.pallas_call(kernel, out, **kw)
  want_fn = pl.pallas_call(kernel, out, interpret=True, **kw)
  for _ in range(3):
    x, y = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    modes.clear()
    got = fn(x, y)
    assert modes == ["vectorized"]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want_fn(x, y)), rtol=1e-6, atol=1e-6)
