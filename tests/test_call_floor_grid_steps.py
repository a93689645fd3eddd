"""The sequential grid loop's per-run work (issue 41 (c): JAX's TPU paged
attention runs its grid point by point, its index maps reading scalar
prefetch, so no schedule is precomputed):

- the NumPy index of each block is remembered per block indices
  (``BlockGeometry.index_of``): a warm run cuts its blocks without
  computing one (``block_index`` is not called), an index out of bounds
  still raises its error at every run;
- scratch buffers come from allocators built on the first run
  (``KernelPlan.fresh_scratch``): fresh at every run, filled with the
  uninitialised value, never the previous run's.

Both compared with interpret=True or a NumPy reference; the counts fail
without the change."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np import memory
from pallas_np.errors import KernelError
from pallas_np.grid import run_strategies
from pallas_np.grid.blocks import BlockGeometry

SEQ = pallas_np.InterpretParams(vectorize=False, native_loops="off")
rng = np.random.default_rng(41)


def _gather_rows(idx_ref, x_ref, o_ref):
  o_ref[...] = x_ref[...] * 2.0 + pl.program_id(0).astype(jnp.float32)


def _gather(interp, n=6):
  return pl.pallas_call(
      _gather_rows,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(n,),
          in_specs=[pl.BlockSpec((8, 128), lambda i, idx: (idx[i], 0))],
          out_specs=pl.BlockSpec((8, 128), lambda i, idx: (i, 0))),
      out_shape=jax.ShapeDtypeStruct((8 * n, 128), jnp.float32), interpret=interp)


@pytest.fixture
def block_index_calls(monkeypatch):
  count = [0]
  real = BlockGeometry.block_index

  def counted(self, block_indices, clamp):
    count[0] += 1
    return real(self, block_indices, clamp)
  monkeypatch.setattr(BlockGeometry, "block_index", counted)
  return count


def test_warm_run_cuts_blocks_without_computing_them(block_index_calls):
  x = jnp.asarray(rng.standard_normal((32, 128)), jnp.float32)
  idx = jnp.asarray([3, 0, 2, 3, 1, 0], jnp.int32)
  fn = _gather(SEQ)
  first = fn(idx, x)
  assert block_index_calls[0] > 0
  calls = block_index_calls[0]
  second = fn(idx, x)
  assert block_index_calls[0] == calls, "a warm run computed block indices again"
  idx2 = jnp.asarray([1, 1, 0, 2, 3, 2], jnp.int32)  # (new indices: computed once)
  third = fn(idx2, x)
  want = _gather(True)
  np.testing.assert_array_equal(np.asarray(first), np.asarray(want(idx, x)))
  np.testing.assert_array_equal(np.asarray(second), np.asarray(first))
  np.testing.assert_array_equal(np.asarray(third), np.asarray(want(idx2, x)))


def test_out_of_bounds_block_raises_every_run():
  x = jnp.asarray(rng.standard_normal((32, 128)), jnp.float32)
  good = jnp.asarray([0, 1, 2, 3, 0, 1], jnp.int32)
  bad = jnp.asarray([0, 1, 7, 3, 0, 1], jnp.int32)
  fn = _gather(SEQ)
  fn(good, x)
  for _ in range(2):
    with pytest.raises(KernelError, match="out of bounds"):
      fn(bad, x)
  np.testing.assert_array_equal(np.asarray(fn(good, x)), np.asarray(_gather(True)(good, x)))


def _scratch_reader(x_ref, o_ref, acc_ref):
  # the scratch read before it is written: the uninitialised value; then
  # written, so a reused buffer would show this run's values next run
  o_ref[...] = acc_ref[...]
  acc_ref[...] = x_ref[...]


def test_scratch_fresh_every_run(monkeypatch):
  calls = [0]
  real = run_strategies.allocate

  def counted(*a, **k):
    calls[0] += 1
    return real(*a, **k)
  monkeypatch.setattr(run_strategies, "allocate", counted)
  params = pallas_np.InterpretParams(vectorize=False, native_loops="off", uninitialized="nan")
  fn = pl.pallas_call(
      _scratch_reader, grid=(2,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
      scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)], interpret=params)
  x = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)
  fill = memory.fill_value(np.dtype(np.float32), params)
  for _ in range(3):
    out = np.asarray(fn(x))
    want = np.concatenate([np.full((8, 128), fill, np.float32), np.asarray(x)[:8]])
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
  assert calls[0] == 0, "scratch allocated through allocate() at every run"


# -- a compiled loop's operand checks, unrolled (native/guards.py) -----------------
def _reference_fits(guard, args):
  """The checks as ``tier.NativeLoop._fits`` wrote them before: a loop."""
  for pos, dt, ndim, contiguous, written in guard:
    a = args[pos]
    if (a.__class__ is not np.ndarray or a.dtype != dt or a.ndim != ndim
        or (contiguous and not a.flags.c_contiguous) or (written and not a.flags.writeable)):
      return False
  return True


def _operands():
  base = np.zeros((4, 8), np.float32)
  ro = base.copy()
  ro.flags.writeable = False
  return {"ok": base, "read-only": ro, "strided": base[:, ::2], "int32": base.astype(np.int32),
          "rank 1": base.ravel(), "scalar": np.float32(1.0), "subclass": base.view(np.ma.MaskedArray),
          "list": [[0.0] * 8] * 4, "f64": base.astype(np.float64)}


@pytest.mark.parametrize("contiguous,written", [(True, True), (True, False), (False, True),
                                                (False, False)])
def test_unrolled_checks_match_the_loop(contiguous, written):
  from pallas_np.native import guards
  guard = ((1, np.dtype(np.float32), 2, contiguous, written),
           (3, np.dtype(np.int32), 1, True, False))
  fits = guards.checker(guard)
  ops = _operands()
  for name1, a1 in ops.items():
    for name3, a3 in (("ok", np.zeros(5, np.int32)), ("int64", np.zeros(5, np.int64)),
                      ("strided", np.zeros(10, np.int32)[::2])):
      args = (None, a1, 7, a3)
      assert fits(args) == _reference_fits(guard, args), (name1, name3)


def _count_loop(x_ref, o_ref):
  def body(i, acc):
    return acc + x_ref[i]
  o_ref[...] = jax.lax.fori_loop(0, 8, body, jnp.zeros((128,), jnp.float32))


def test_native_loop_checks_built_once(monkeypatch):
  """A compiled loop's calls check their operands through the unrolled
  checks, built at its first call and reused."""
  from pallas_np import native
  from pallas_np.native import guards
  built = [0]
  real = guards.checker

  def counted(guard):
    built[0] += 1
    return real(guard)
  monkeypatch.setattr(guards, "checker", counted)
  fn = pl.pallas_call(_count_loop, out_shape=jax.ShapeDtypeStruct((128,), jnp.float32),
                      interpret=pallas_np.InterpretParams(native_loops="sync"))
  x = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)
  before = native.stats()["native_calls"]
  outs = [np.asarray(fn(x)) for _ in range(3)]
  assert native.stats()["native_calls"] - before == 3
  assert built[0] == 1
  want = np.asarray(pl.pallas_call(_count_loop, out_shape=jax.ShapeDtypeStruct((128,), jnp.float32),
                                   interpret=True)(x))
  for out in outs:
    np.testing.assert_array_equal(out, want)


def test_race_detector_lookup_has_a_default():
  """``races.current`` (asked at every call of a compiled DMA loop) finds
  None through the per-thread state's class default, not a failed lookup;
  a detector set in one thread is not seen by another."""
  import threading
  from pallas_np import races
  assert type(races._state).detector is None
  assert races.current() is None
  marker = object()
  seen = []
  races._state.detector = marker
  try:
    t = threading.Thread(target=lambda: seen.append(races.current()))
    t.start()
    t.join()
    assert races.current() is marker
  finally:
    races._state.detector = None
  assert seen == [None]
