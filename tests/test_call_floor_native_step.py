"""The per-call floor of kernels with compiled loops (issue 41): once a
loop's library is swapped in, its runs go through one generated function
(``native.loop_step``) instead of ``NativeLoop.__call__``, ``run``,
``_fits`` and ``_run`` / ``lanes.run``.

Each test checks which path ran (``NativeLoop.__call__`` counted) and that
the results, errors and fallbacks are those of the general path: bits
equal to ``native_loops="off"``, the same out-of-bounds message (and the
next in-bounds run still compiled), operands the library was not compiled
for and a library dropped since going back to ``__call__``.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from benchmarks.small_kernels import bitonic_fori_kernel, cumsum_fori_kernel
from pallas_np import native
from pallas_np.native import lanes, loop_step, tier

SYNC = pallas_np.InterpretParams(native_loops="sync")
OFF = pallas_np.InterpretParams(native_loops="off")
rng = np.random.default_rng(4143)


@pytest.fixture
def general_calls(monkeypatch):
  """The runs that went through ``NativeLoop.__call__`` (the general path)."""
  calls = []
  real = tier.NativeLoop.__call__

  def call(self, ctx, *args):
    calls.append(self)
    return real(self, ctx, *args)
  monkeypatch.setattr(tier.NativeLoop, "__call__", call)
  return calls


@pytest.fixture
def steps(monkeypatch):
  """(loop, step) of every loop swapped in during the test."""
  built = []
  real = loop_step.build

  def build(loop, fn):
    step = real(loop, fn)
    built.append((loop, step))
    return step
  monkeypatch.setattr(loop_step, "build", build)
  return built


def _cumsum(params, rows=128, block=64):
  spec = pl.BlockSpec((block, 128), lambda i: (i, 0))
  return pallas_np.pallas_call(cumsum_fori_kernel, jax.ShapeDtypeStruct((rows, 128), jnp.float32),
                               grid=(rows // block,), in_specs=[spec], out_specs=spec,
                               interpret=params)


def _bitonic(params, vectorize=None):
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  params = pallas_np.InterpretParams(native_loops=params.native_loops, vectorize=vectorize)
  return pallas_np.pallas_call(bitonic_fori_kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32),
                               grid=(4,), in_specs=[spec], out_specs=spec, interpret=params)


def strided_kernel(n_ref, x_ref, o_ref):
  """Rows i*n, i*n+1 summed over 4 steps: n = 3 reads rows 9..10 of 8."""
  n = n_ref[0]

  def body(i, acc):
    return acc + x_ref[pl.ds(i * n, 2), :]
  o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros((2, 128), jnp.float32))


def _strided(params):
  return pallas_np.pallas_call(strided_kernel, jax.ShapeDtypeStruct((2, 128), jnp.float32),
                               interpret=params)


def _f32(*shape):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def test_warm_runs_take_the_step_bit_equal(general_calls, steps):
  """A sequential grid's compiled loop (cumsum, two grid steps): after the
  run that compiled it, no run goes through ``__call__``; bits of off."""
  x = _f32(128, 128)
  fn = _cumsum(SYNC)
  first = np.asarray(fn(x))
  assert steps and all(step is not None for _, step in steps)
  del general_calls[:]
  before = native.stats()["native_calls"]
  got = [np.asarray(fn(x)) for _ in range(3)]
  assert native.stats()["native_calls"] - before == 6, "the compiled loop did not run"
  assert not general_calls, f"{len(general_calls)} runs through NativeLoop.__call__"
  want = np.asarray(_cumsum(OFF)(x))
  for g in (first, *got):
    np.testing.assert_array_equal(g.view(np.uint32), want.view(np.uint32))


def test_lanes_take_the_step_bit_equal(general_calls, monkeypatch):
  """A vectorized grid's loop (bitonic, 4 lanes in one call): warm runs
  reach neither ``__call__`` nor ``lanes.run``; bits of off."""
  x = _f32(32, 128)
  fn = _bitonic(SYNC)
  np.asarray(fn(x))
  passes = []
  real = lanes.run
  monkeypatch.setattr(lanes, "run", lambda *a: passes.append(1) or real(*a))
  del general_calls[:]
  before = native.stats()["native_calls"]
  got = np.asarray(fn(x))
  assert native.stats()["native_calls"] - before == 4, "not one compiled pass of 4 lanes"
  assert not general_calls and not passes
  for want in (_bitonic(OFF)(x), _bitonic(OFF, False)(x)):
    np.testing.assert_array_equal(got.view(np.uint32), np.asarray(want).view(np.uint32))


def test_out_of_bounds_through_the_step_raises_the_numpy_error(general_calls):
  """An index out of bounds on a warm run (n = 3 after n = 1 compiled the
  loop) raises from the step the NumPy path's IndexError, word for word;
  the next in-bounds run is compiled again (a fresh status array)."""
  x = _f32(8, 128)
  fn, off = _strided(SYNC), _strided(OFF)
  one, three = jnp.asarray([1], jnp.int32), jnp.asarray([3], jnp.int32)
  want = np.asarray(off(one, x))
  np.testing.assert_array_equal(np.asarray(fn(one, x)), want)
  del general_calls[:]
  with pytest.raises(IndexError) as got:
    fn(three, x)
  assert not general_calls, "the out-of-bounds run did not go through the step"
  with pytest.raises(IndexError) as numpy_error:
    off(three, x)
  assert str(got.value) == str(numpy_error.value)
  before = native.stats()["native_calls"]
  np.testing.assert_array_equal(np.asarray(fn(one, x)), want)
  assert native.stats()["native_calls"] - before == 1 and not general_calls


def test_operands_not_compiled_for_go_to_the_general_path(general_calls, steps):
  """The step's operand checks: a Fortran-ordered block where the library
  needs C order goes to ``__call__`` (which runs the NumPy path); so does
  a run after the library was dropped (``native`` reset)."""
  x = _f32(64, 128)
  np.asarray(_cumsum(SYNC, rows=64, block=32)(x))  # (a loop of its own: not compiled before)
  (loop, step), = steps
  pos = next(p for p, _dt, _nd, contiguous, _w in loop.guard
             if contiguous and min(loop.invars[p].shape) > 1)
  calls = []
  loop.numpy_fn = lambda ctx, *args: calls.append(args) or ("numpy",)
  args = [np.zeros(a.shape, a.dtype) if a.shape else a.dtype.type(0) for a in loop.invars]
  args[pos] = np.asfortranarray(args[pos])
  assert not args[pos].flags.c_contiguous
  del general_calls[:]
  assert step(None, *args) == ("numpy",)
  assert general_calls == [loop] and len(calls) == 1
  args[pos] = np.ascontiguousarray(args[pos])
  loop.native = None
  assert step(None, *args) == ("numpy",)
  assert general_calls == [loop, loop] and len(calls) == 2


def test_loops_calling_back_into_python_get_no_step():
  """A loop with DMA/semaphore call sites (``pycalls``) keeps ``__call__``."""
  class Loop:
    pycalls = object()
  assert loop_step.build(Loop(), lambda *a: None) is None
