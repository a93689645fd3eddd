"""Grid points on threads (pallas_np.grid.threads): results identical to the
sequential loop and to interpret=True, taken only where legal (and, in auto
mode, only for wide GEMM-free kernels), errors reported at the exact grid
point as in sequential mode."""
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np.grid import threads
from pallas_np.grid import KernelPlan
from tests.conftest import assert_same

SEQ = pallas_np.InterpretParams(vectorize=False, num_threads=1)
AUTO = pallas_np.InterpretParams()
TWO = pallas_np.InterpretParams(vectorize=False, num_threads=2)


@pytest.fixture
def modes(monkeypatch):
  """KernelPlan.last_mode of every run; chunks run, with their thread."""
  seen, chunks = [], []
  orig_run, orig_chunk = KernelPlan.run, threads._run_chunk

  def run(self, *args):
    try:
      return orig_run(self, *args)
    finally:
      seen.append(self.last_mode)

  def run_chunk(kp, grid, index_ops, buffers, points, progress):
    chunks.append((threading.current_thread().name, list(points)))
    return orig_chunk(kp, grid, index_ops, buffers, points, progress)
  monkeypatch.setattr(KernelPlan, "run", run)
  monkeypatch.setattr(threads, "_run_chunk", run_chunk)
  monkeypatch.setattr(threads, "cores", lambda: 2)  # auto mode as on CI
  return _Modes(seen, chunks)


class _Modes:
  def __init__(self, seen, chunks):
    self.seen, self.chunks = seen, chunks

  def clear(self):
    self.seen.clear(); self.chunks.clear()

  @property
  def last(self):
    return self.seen[-1]


def _wide_kernel(x_ref, o_ref):
  # Long NumPy calls (128K elements each): what auto mode threads.
  x = x_ref[...]
  y = jnp.maximum(x, 0.5 * x) + jnp.sin(x)
  o_ref[...] = jnp.where(y > 0.2, y * y, -y)


def _wide_call(interpret, rows=512, n=1024, rb=128):
  return pl.pallas_call(
      _wide_kernel, out_shape=jax.ShapeDtypeStruct((rows, n), jnp.float32),
      grid=(rows // rb,), in_specs=[pl.BlockSpec((rb, n), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((rb, n), lambda i: (i, 0)), interpret=interpret)


def _x(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def test_auto_threads_a_wide_kernel_and_matches_sequential_and_interpret(modes):
  x = _x((512, 1024))
  got = _wide_call(AUTO)(x)
  assert modes.last == "threaded"
  # Two chunks, on two threads, covering the grid once, each in grid order.
  names = {name for name, _ in modes.chunks}
  assert len(modes.chunks) == 2 and len(names) == 2
  pts = [p for _, ps in modes.chunks for p in ps]
  assert sorted(pts) == [(i,) for i in range(4)]
  for _, ps in modes.chunks:
    assert ps == sorted(ps)
  seq = _wide_call(SEQ)(x)
  assert modes.last == "sequential"
  np.testing.assert_array_equal(np.asarray(got), np.asarray(seq))
  assert_same(got, _wide_call(True)(x))


def test_threaded_under_jit_and_eager_entry_point(modes):
  x = _x((512, 1024), seed=1)
  want = _wide_call(True)(x)
  assert_same(jax.jit(_wide_call(AUTO))(x), want)
  assert modes.last == "threaded"
  eager = pallas_np.pallas_call(
      _wide_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
      in_specs=[pl.BlockSpec((128, 1024), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((128, 1024), lambda i: (i, 0)))
  assert_same(eager(x), want)
  assert modes.last == "threaded"


def _accumulate_kernel(x_ref, o_ref):
  # No scratch: the output block itself accumulates over the k axis.
  @pl.when(pl.program_id(1) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[...] += x_ref[...] * (pl.program_id(1) + 1).astype(jnp.float32)


def test_sequential_axis_stays_in_order_inside_a_lane(modes):
  # Grid (i, k): output block i is revisited over k, so lanes are i and each
  # thread walks its lanes' k in order.
  x = _x((64, 96), seed=2)

  def call(interpret):
    return pl.pallas_call(
        _accumulate_kernel, out_shape=jax.ShapeDtypeStruct((64, 32), jnp.float32),
        grid=(4, 3), in_specs=[pl.BlockSpec((16, 32), lambda i, k: (i, k))],
        out_specs=pl.BlockSpec((16, 32), lambda i, k: (i, 0)), interpret=interpret)
  got = call(TWO)(x)
  assert modes.last == "threaded"
  for _, ps in modes.chunks:
    lanes = {p[0] for p in ps}
    assert ps == sorted(ps) and len(ps) == 3 * len(lanes)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(call(SEQ)(x)))
  assert_same(got, call(True)(x))


def test_scalar_prefetch_index_maps_decide_ownership(modes):
  # A permutation from SMEM: every grid point still owns its block.
  perm = jnp.array([3, 0, 2, 1, 5, 4], jnp.int32)
  x = _x((96, 128), seed=3)

  def kernel(p_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + p_ref[pl.program_id(0)].astype(jnp.float32)

  def call(interpret):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(6,),
            in_specs=[pl.BlockSpec((16, 128), lambda i, p: (p[i], 0))],
            out_specs=pl.BlockSpec((16, 128), lambda i, p: (p[i], 0))),
        interpret=interpret)
  got = call(TWO)(perm, x)
  assert modes.last == "threaded"
  assert_same(got, call(True)(perm, x))
  # A map sending two grid points to one block: no owner, sequential.
  same = jnp.array([0, 1, 1, 2, 3, 4], jnp.int32)
  got = call(TWO)(same, x)
  assert modes.last == "sequential"
  assert_same(got, call(True)(same, x))


def test_shared_output_block_runs_sequentially(modes):
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += x_ref[...]

  x = _x((64, 128), seed=4)

  def call(interpret):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32), grid=(4,),
        in_specs=[pl.BlockSpec((16, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((16, 128), lambda i: (0, 0)), interpret=interpret)
  got = call(TWO)(x)
  assert modes.last == "sequential" and not modes.chunks
  assert_same(got, call(True)(x))


def _bad_kernel(x_ref, o_ref):
  i = pl.program_id(0)
  # BUG: out of bounds from grid point 5 on (of 8).
  o_ref[...] = x_ref[pl.ds(jnp.where(i >= 5, i * 16 + 40, i * 16), 16), :]


def test_error_in_a_thread_names_the_first_failing_grid_point(modes):
  x = _x((128, 128), seed=5)

  def call(interpret):
    return pl.pallas_call(
        _bad_kernel, out_shape=jax.ShapeDtypeStruct((128, 128), jnp.float32), grid=(8,),
        in_specs=[pl.BlockSpec((128, 128), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((16, 128), lambda i: (i, 0)), interpret=interpret)
  with pytest.raises(IndexError) as seq_err:
    call(SEQ)(x)
  modes.clear()
  with pytest.raises(IndexError) as thr_err:
    call(TWO)(x)
  assert modes.chunks  # the threaded run was tried (and failed) first
  assert thr_err.value.program_ids == seq_err.value.program_ids == (5,)
  assert str(thr_err.value) == str(seq_err.value)


def test_not_threaded_where_state_or_order_matters(modes):
  x = _x((64, 128), seed=6)

  def scratch_kernel(x_ref, o_ref, acc_ref):
    acc_ref[...] = x_ref[...] + 1.0
    o_ref[...] = acc_ref[...] * 2.0

  def printing_kernel(x_ref, o_ref):
    pl.debug_print("block {}", pl.program_id(0))
    o_ref[...] = x_ref[...] + 1.0

  def call(kernel, interpret, scratch=()):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
        in_specs=[pl.BlockSpec((16, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((16, 128), lambda i: (i, 0)),
        scratch_shapes=scratch, interpret=interpret)
  scratch = [pltpu.VMEM((16, 128), jnp.float32)]
  assert_same(call(scratch_kernel, TWO, scratch)(x), call(scratch_kernel, True, scratch)(x))
  assert modes.last == "sequential" and not modes.chunks
  assert_same(call(printing_kernel, TWO)(x), x + 1.0)
  assert modes.last == "sequential" and not modes.chunks


def _plan_of(make_call, *args):
  """The KernelPlan the last numpy-mode call of ``make_call`` ran."""
  plans = []
  orig = KernelPlan.run

  def run(self, *a):
    plans.append(self)
    return orig(self, *a)
  KernelPlan.run = run
  try:
    make_call(*args)
  finally:
    KernelPlan.run = orig
  return plans[-1]


def test_auto_mode_keeps_narrow_and_gemm_kernels_on_one_thread(monkeypatch):
  monkeypatch.setattr(threads, "cores", lambda: 2)
  x = _x((64, 128), seed=7)
  narrow = _plan_of(_wide_call(pallas_np.InterpretParams(vectorize=False), 64, 128, 16), x)
  assert narrow.last_mode == "sequential"
  assert "too short" in narrow._threads.reason

  def mm_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...]) + jnp.sin(x_ref[...])

  a, b = _x((1024, 256), seed=8), _x((256, 256), seed=9)

  def mm(interpret):
    return pl.pallas_call(
        mm_kernel, out_shape=jax.ShapeDtypeStruct((1024, 256), jnp.float32), grid=(2,),
        in_specs=[pl.BlockSpec((512, 256), lambda i: (i, 0)),
                  pl.BlockSpec((256, 256), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((512, 256), lambda i: (i, 0)), interpret=interpret)
  plan = _plan_of(lambda *args: mm(AUTO)(*args), a, b)
  assert plan.last_mode == "sequential" and "GEMM" in plan._threads.reason
  # Asked for explicitly, GEMM kernels run threaded too, with the same result.
  two = _plan_of(lambda *args: mm(TWO)(*args), a, b)
  assert two.last_mode == "threaded"
  assert_same(mm(TWO)(a, b), mm(True)(a, b), rtol=1e-4, atol=1e-4)
  # One core: auto never threads.
  monkeypatch.setattr(threads, "cores", lambda: 1)
  one = _plan_of(_wide_call(pallas_np.InterpretParams(uninitialized="zero")),
                 _x((512, 1024)))
  assert one.last_mode == "sequential"


def test_one_point_grid_skips_the_thread_analysis(monkeypatch):
  """A grid of one point has nothing to spread: it takes the one-point path
  (no thread plan at all); the kernel is walked once, for whether it needs
  the BLAS scope (kernel_plan.may_use_blas), not for threads."""
  walked = []
  orig = threads.lanes.all_eqns
  monkeypatch.setattr(threads.lanes, "all_eqns", lambda j: walked.append(j) or orig(j))
  x = _x((16, 128), seed=10)
  plan = _plan_of(lambda v: pl.pallas_call(
      lambda x_ref, o_ref: o_ref.__setitem__(..., jnp.sin(x_ref[...])),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=TWO)(v), x)
  assert plan.last_mode == "sequential" and plan._threads is None and plan._single
  assert len(walked) == 1


def test_num_threads_must_be_positive():
  with pytest.raises(ValueError, match="num_threads"):
    pallas_np.InterpretParams(num_threads=0)



@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:os.fork")  # JAX's warning; the child uses no JAX
def test_forked_child_gets_its_own_pool(modes):
  # The parent's pool threads do not exist in a forked child: it must not
  # hand them work (it would wait forever). The child runs the kernel plan
  # directly on NumPy arrays (JAX itself is not fork-safe).
  import os
  import select
  x = np.asarray(_x((512, 1024), seed=10))
  want = np.asarray(_wide_call(SEQ)(x))
  plan = _plan_of(_wide_call(AUTO), x)
  assert plan.last_mode == "threaded" and threads._POOL is not None
  r, w = os.pipe()
  pid = os.fork()
  if pid == 0:  # child: report and exit without running pytest's teardown
    ok = False
    try:
      ok = threads._POOL is None
      (got,) = plan.run(x)
      ok = ok and plan.last_mode == "threaded" and np.array_equal(got, want)
    finally:
      os.write(w, b"1" if ok else b"0")
      os._exit(0)
  os.close(w)
  ready = []
  try:
    ready, _, _ = select.select([r], [], [], 60)
    assert ready, "the forked child hung"
    assert os.read(r, 1) == b"1"
  finally:
    if not ready:
      os.kill(pid, 9)
    os.waitpid(pid, 0)
    os.close(r)


def test_one_progress_bar_counts_every_threads_points(modes, monkeypatch, capsys):
  from pallas_np import debugging
  monkeypatch.setattr(debugging, "PROGRESS_AFTER_S", 0.0)
  monkeypatch.setattr(debugging, "_tqdm", lambda: None)  # the stderr line, tqdm installed or not
  monkeypatch.delenv("PALLAS_NP_PROGRESS", raising=False)
  x = _x((512, 1024), seed=11)
  _wide_call(pallas_np.InterpretParams(num_threads=2, uninitialized="zero"))(x)
  assert modes.last == "threaded" and len(modes.chunks) == 2
  err = capsys.readouterr().err
  assert "pallas_np _wide_kernel: [" in err and "4/4 grid points" in err


def test_aliased_output_and_edge_blocks_threaded(modes):
  # input_output_aliases (the output starts as the input) and a partial last
  # block (padding read, writes clipped) behave as in the sequential loop.
  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = o_ref[...] * 0.5 + jnp.sin(x_ref[...]) * y_ref[...]

  x, y = _x((100, 128), seed=12), _x((100, 128), seed=13)

  def call(interpret):
    spec = pl.BlockSpec((32, 128), lambda i: (i, 0))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
        in_specs=[spec, spec], out_specs=spec, input_output_aliases={1: 0},
        interpret=interpret)
  got = call(TWO)(x, y)
  assert modes.last == "threaded"
  np.testing.assert_array_equal(np.asarray(got), np.asarray(call(SEQ)(x, y)))
  assert_same(got, call(True)(x, y))
