"""The per-call floor of small sequential grids (issue 41): a warm call of a
static grid that runs as the plain grid loop goes straight to the loop's
steps (``grid.loop_front.LoopFront``), without asking again whether to
batch, thread or detect races and without ``KernelPlan.run_grid``'s set-up.

Each test checks which path ran (``run_grid`` and ``_run_vectorized``
counted) and compares with interpret=True, or with the full path: fresh
buffers with their fill at every call, an error at its grid point with the
full path's message, the front stepping aside when the vectorizer decides
again, and no front where a run must do more (race detection, a trace
callback, scalar prefetch).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from benchmarks.small_kernels import matmul_acc_kernel
import pallas_np
from pallas_np.grid import loop_front, run_strategies
from pallas_np.grid.kernel_plan import KernelPlan
from tests.helpers import assert_identical

OFF = pallas_np.InterpretParams(native_loops="off")
rng = np.random.default_rng(4144)


@pytest.fixture
def full_path(monkeypatch):
  """Counts of the full path's steps: ``run_grid`` and ``_run_vectorized``."""
  counts = {"run_grid": 0, "vectorized": 0}
  real_grid, real_vec = KernelPlan.run_grid, run_strategies._run_vectorized

  def run_grid(self, *a, **k):
    counts["run_grid"] += 1
    return real_grid(self, *a, **k)

  def vectorized(kp, args):
    counts["vectorized"] += 1
    return real_vec(kp, args)
  monkeypatch.setattr(KernelPlan, "run_grid", run_grid)
  monkeypatch.setattr(run_strategies, "_run_vectorized", vectorized)
  return counts


@pytest.fixture
def fronts(monkeypatch):
  """(kernel plan, front or None) of every front looked for."""
  found = []
  real = loop_front.LoopFront.of.__func__

  def of(cls, kp):
    front = real(cls, kp)
    found.append((kp, front))
    return front
  monkeypatch.setattr(loop_front.LoopFront, "of", classmethod(of))
  return found


def _ints(*shape):  # (integer values: sums and products exact in any order)
  return jnp.asarray(rng.integers(-4, 5, shape).astype(np.float32))


def _matmul(interp, n=64, b=32, call=pallas_np.pallas_call):
  return call(
      matmul_acc_kernel, jax.ShapeDtypeStruct((n, n), jnp.float32), grid=(n // b,) * 3,
      in_specs=[pl.BlockSpec((b, b), lambda i, j, k: (i, k)),
                pl.BlockSpec((b, b), lambda i, j, k: (k, j))],
      out_specs=pl.BlockSpec((b, b), lambda i, j, k: (i, j)),
      scratch_shapes=[pltpu.VMEM((b, b), jnp.float32)], interpret=interp)


def first_block_kernel(x_ref, o_ref):
  @pl.when(pl.program_id(0) == 0)
  def _():
    o_ref[...] = x_ref[...] * 2.0


def _first_block(interp):
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  return pallas_np.pallas_call(first_block_kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32),
                               grid=(2,), in_specs=[spec], out_specs=spec, interpret=interp)


def shifted_kernel(n_ref, x_ref, o_ref):
  o_ref[...] = x_ref[pl.ds(n_ref[0] * pl.program_id(0), 8), :]


def _shifted(interp):
  return pallas_np.pallas_call(
      shifted_kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32), grid=(2,),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec((16, 128), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), interpret=interp)


def test_warm_calls_take_the_front_bit_equal(full_path, fronts):
  """A 2x2x2 grid with a scratch accumulator (the vectorizer declines a
  GEMM kernel with this few lanes): from the second call on, neither
  ``run_grid`` nor ``_run_vectorized`` runs; bits of interpret=True,
  eager and in an eagerly called ``jax.jit`` (numpy mode's whole program)."""
  x, y = _ints(64, 64), _ints(64, 64)
  want = _matmul(True, call=pl.pallas_call)(x, y)
  for fn in (_matmul(OFF), jax.jit(_matmul(OFF, call=pl.pallas_call))):
    first = fn(x, y)
    assert fronts and fronts[-1][1] is not None
    before = dict(full_path)
    got = [fn(x, y) for _ in range(3)]
    assert full_path == before, f"warm calls took the full path: {before} -> {full_path}"
    for g in (first, *got):
      assert_identical(g, want)


def test_fresh_buffers_with_their_fill_at_every_call(full_path, fronts, monkeypatch):
  """An output block the kernel never writes holds the uninitialised fill
  at every call through the front, as through the full path (a fresh
  buffer each call, not the last call's); the written block has this
  call's values."""
  x1, x2 = _ints(16, 128), _ints(16, 128)
  fn = _first_block(OFF)
  fn(x1)
  assert fronts[-1][1] is not None
  before = dict(full_path)
  got1, got2 = np.asarray(fn(x1)), np.asarray(fn(x2))
  assert full_path == before
  monkeypatch.setattr(loop_front.LoopFront, "of", classmethod(lambda cls, kp: None))
  pallas_np.clear_caches()
  full = _first_block(OFF)
  for got, x in ((got1, x1), (got2, x2)):
    want = np.asarray(full(x))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(got[:8], np.asarray(x)[:8] * 2)


def test_an_error_at_a_grid_point_as_the_full_path_raises_it(full_path, fronts, monkeypatch):
  """An index out of bounds at grid point 1 of a warm call (n = 9 after
  n = 8) raises from the front the full path's error, word for word."""
  x = _ints(16, 128)
  eight, nine = jnp.asarray([8], jnp.int32), jnp.asarray([9], jnp.int32)
  fn = _shifted(OFF)
  assert_identical(fn(eight, x), x)
  assert fronts[-1][1] is not None
  before = dict(full_path)
  with pytest.raises(Exception) as front_error:
    fn(nine, x)
  assert full_path == before, "the failing call did not go through the front"
  monkeypatch.setattr(loop_front.LoopFront, "of", classmethod(lambda cls, kp: None))
  pallas_np.clear_caches()
  with pytest.raises(Exception) as full_error:
    _shifted(OFF)(nine, x)
  assert type(front_error.value) is type(full_error.value)
  assert str(front_error.value) == str(full_error.value)
  assert "grid point (1,)" in str(front_error.value)


def test_the_front_steps_aside_when_the_vectorizer_decides_again(full_path, fronts):
  """With the grid no longer in ``declined_grids`` the call goes the full
  path (which declines again and builds a new front); same bits."""
  x, y = _ints(64, 64), _ints(64, 64)
  fn = _matmul(OFF)
  want = fn(x, y)
  kp, front = fronts[-1]
  assert front is not None and front.gv is kp.vectorizer
  kp.vectorizer.declined_grids.clear()
  before = dict(full_path)
  assert_identical(fn(x, y), want)
  assert full_path["vectorized"] == before["vectorized"] + 1
  assert full_path["run_grid"] == before["run_grid"] + 1
  assert isinstance(kp.loop_front, loop_front.LoopFront) and kp.loop_front is not front


@pytest.mark.parametrize("what", ["detect_races", "trace"])
def test_no_front_where_a_run_does_more(full_path, fronts, what):
  """Race detection and a trace callback keep the full path (every call
  runs ``run_grid``; the trace sees every grid point of every call)."""
  seen = []
  params = (pallas_np.InterpretParams(native_loops="off", detect_races=True, parallel_axes=(0,))
            if what == "detect_races" else
            pallas_np.InterpretParams(native_loops="off", trace=lambda name, p: seen.append(p)))
  x = _ints(16, 128)
  fn = _first_block(params)
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(fn(x))[:8], np.asarray(x)[:8] * 2)
  assert full_path["run_grid"] == 3
  assert all(front is None for _, front in fronts)
  if what == "trace":
    assert seen == [(0,), (1,)] * 3


def test_no_front_for_scalar_prefetch(full_path, fronts):
  """Index maps reading scalar prefetch: the steps depend on the values."""
  def kernel(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0
  idx = jnp.asarray([3, 0, 2], jnp.int32)
  x = _ints(4, 128)
  fn = pallas_np.pallas_call(
      kernel, jax.ShapeDtypeStruct((3, 128), jnp.float32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(3,),
          in_specs=[pl.BlockSpec((1, 128), lambda i, idx: (idx[i], 0))],
          out_specs=pl.BlockSpec((1, 128), lambda i, idx: (i, 0))),
      interpret=pallas_np.InterpretParams(native_loops="off", vectorize=False))
  for _ in range(2):
    np.testing.assert_array_equal(np.asarray(fn(idx, x)), np.asarray(x)[[3, 0, 2]] * 2)
  assert full_path["run_grid"] == 2
  assert fronts and all(front is None for _, front in fronts)
