"""The per-call fast paths (issue 33, the per-call floor), each against
interpret=True bit for bit, and each checked to be the path taken:

* eager ``pallas_np.pallas_call`` keyed by the flat arguments' signature
  (shape, dtype, weak type) — back-to-back calls of one wrapper with other
  shapes/dtypes, NumPy and jax.Array arguments, inputs mutated between calls;
* one-point grids (``KernelPlan._run_single_point``): fresh outputs every call,
  aliased inputs, options changed between calls, errors at the grid point;
* the grid loop's steps kept per grid (``KernelPlan._grid_schedule``);
* a vectorized pass declined before it ran hands its buffers to the loop.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np import api
from pallas_np.errors import KernelError
from pallas_np.grid.kernel_plan import KernelPlan
from tests.conftest import assert_same
from tests.helpers import assert_identical

rng = np.random.default_rng(330)


def _f32(*shape):
  return rng.standard_normal(shape).astype(np.float32)


def head_kernel(x_ref, o_ref):
  """Reads the first 8 rows whatever the input's shape, and its row count:
  a plan or entry reused for another shape or dtype gives another result."""
  o_ref[...] = x_ref[:8, :].astype(jnp.float32) * 2.0 + float(x_ref.shape[0])


def _head(interpret):
  out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  if interpret is True:
    return pl.pallas_call(head_kernel, out, interpret=True)
  return pallas_np.pallas_call(head_kernel, out, interpret=interpret)


@pytest.fixture
def entries(monkeypatch):
  """Every eager_entry lookup (the slow path of an eager call)."""
  seen = []
  orig = api.eager_entry

  def eager_entry(*args, **kw):
    seen.append(1)
    return orig(*args, **kw)
  monkeypatch.setattr(api, "eager_entry", eager_entry)
  return seen


def test_one_wrapper_many_signatures_back_to_back(entries):
  fn, want_fn = _head(pallas_np.InterpretParams()), _head(True)
  args = [jnp.asarray(_f32(8, 128)), jnp.asarray(_f32(16, 128)),
          jnp.asarray(_f32(8, 128)).astype(jnp.bfloat16),
          jnp.asarray(rng.integers(-9, 9, (8, 128)), jnp.int32),
          _f32(24, 128), jnp.asarray(_f32(16, 128))]
  for _ in range(3):
    for x in args:
      assert_identical(fn(x), want_fn(x))
  # One slow lookup per distinct signature (the (16, 128) f32 jax.Array and
  # NumPy (24, 128) are distinct; the repeated (16, 128) is not), then none.
  assert len(entries) == 5


def test_weak_typed_and_converted_arguments(entries):
  """A weak-typed jax.Array, and NumPy float64/int64 arguments (converted
  to the traced float32/int32) take their own entries."""
  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + y_ref[...]
  out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  fn = pallas_np.pallas_call(kernel, out)
  want_fn = pl.pallas_call(kernel, out, interpret=True)
  y = jnp.asarray(_f32(8, 128))
  weak = jnp.broadcast_to(jnp.asarray(1.5), (8, 128))  # float32, weak_type=True
  assert weak.weak_type
  x64 = rng.standard_normal((8, 128))  # NumPy float64
  for x in (weak, x64, jnp.asarray(_f32(8, 128)), weak, x64):
    assert_identical(fn(x, y), want_fn(jnp.asarray(x, jnp.float32), y))
  assert len(entries) == 3


def test_outputs_are_fresh_every_call():
  """Outputs never alias one another across calls (nor an input)."""
  fn = _head(pallas_np.InterpretParams())
  x1, x2 = jnp.asarray(_f32(8, 128)), jnp.asarray(_f32(8, 128))
  r1 = fn(x1)
  keep = np.array(r1)
  r2 = fn(x2)
  r3 = fn(x1)
  for a, b in ((r1, r2), (r1, r3), (r2, r3), (r1, x1)):
    assert not np.shares_memory(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(r1), keep)
  assert_identical(r2, _head(True)(x2))


@pytest.mark.parametrize("grid", [(), (4,)])
def test_numpy_inputs_mutated_between_calls(grid):
  """Nothing derived from an input's data is kept: a NumPy input changed in
  place between calls gives the new result (one-point grid, and a grid
  whose steps are kept)."""
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.abs(x_ref[...]) * 2.0 - 1.0  # exact in both modes
  x = _f32(32, 128)
  out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
  kw = {} if not grid else dict(
      grid=grid, in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))
  fn = pallas_np.pallas_call(kernel, out, interpret=pallas_np.InterpretParams(vectorize=False),
                             **kw)
  want_fn = pl.pallas_call(kernel, out, interpret=True, **kw)
  for step in range(3):
    got = fn(x)
    assert_identical(got, want_fn(jnp.asarray(x)))
    x *= -1.5  # in place: the same NumPy array, new data
    x[step] = 7.0
    assert not np.array_equal(np.asarray(got), np.asarray(want_fn(jnp.asarray(x))))


@pytest.mark.parametrize("grid", [(), (2,)])
def test_aliased_input_stays_the_callers(grid):
  def kernel(x_ref, o_ref):
    o_ref[0:4, :] = x_ref[0:4, :] * 3.0
  x = jnp.asarray(_f32(16, 128))
  before = np.array(x)
  out = jax.ShapeDtypeStruct(x.shape, x.dtype)
  kw = {} if not grid else dict(
      grid=grid, in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))
  fn = pallas_np.pallas_call(kernel, out, input_output_aliases={0: 0}, **kw)
  want = pl.pallas_call(kernel, out, input_output_aliases={0: 0}, interpret=True, **kw)(x)
  for _ in range(3):
    got = fn(x)
    assert_identical(got, want)
    np.testing.assert_array_equal(np.asarray(x), before)
    assert not np.shares_memory(np.asarray(got), np.asarray(x))


def test_options_changed_between_calls():
  """One kernel function under several InterpretParams back to back: an
  unwritten output half is NaN (as interpret=True) or zero, per the
  options of each call; forced options take precedence."""
  def kernel(x_ref, o_ref):
    o_ref[0:4, :] = x_ref[0:4, :]
  x = jnp.asarray(_f32(8, 128))
  out = jax.ShapeDtypeStruct(x.shape, x.dtype)
  nan_fn = pallas_np.pallas_call(kernel, out)
  zero_fn = pallas_np.pallas_call(kernel, out,
                                  interpret=pallas_np.InterpretParams(uninitialized="zero"))
  want_nan = pl.pallas_call(kernel, out, interpret=True)(x)
  want_zero = np.zeros((8, 128), np.float32)  # NumPy reference of uninitialized="zero"
  want_zero[:4] = np.asarray(x)[:4]
  for _ in range(2):
    assert_identical(nan_fn(x), want_nan)
    assert_identical(zero_fn(x), want_zero)
    with pallas_np.force_numpy_interpret(pallas_np.InterpretParams(uninitialized="zero")):
      assert_identical(nan_fn(x), want_zero)
    assert_identical(nan_fn(x), want_nan)


def test_one_point_grid_takes_its_path(monkeypatch):
  ran_grid = []
  orig = KernelPlan.run_grid
  monkeypatch.setattr(KernelPlan, "run_grid",
                      lambda self, *a, **k: ran_grid.append(1) or orig(self, *a, **k))
  fn = _head(pallas_np.InterpretParams())
  x = jnp.asarray(_f32(8, 128))
  for _ in range(2):
    assert_identical(fn(x), _head(True)(x))
  assert ran_grid == []
  # Race detection keeps the grid loop (its per-step records).
  racy = _head(pallas_np.InterpretParams(detect_races=True, parallel_axes=()))
  assert_identical(racy(x), _head(True)(x))
  assert ran_grid == [1]


def test_one_point_grid_error_names_the_point():
  def kernel(i_ref, x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(i_ref[0], 8), :]
  x = jnp.asarray(_f32(16, 128))
  fn = pallas_np.pallas_call(
      kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec()])
  ok = jnp.asarray([8], jnp.int32)
  want = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec()],
                        interpret=True)(ok, x)
  for _ in range(2):
    assert_identical(fn(ok, x), want)
    with pytest.raises(KernelError, match=r"grid point \(\)") as info:
      fn(jnp.asarray([12], jnp.int32), x)
    assert isinstance(info.value.original, IndexError)


# The plain grid loop, nothing kept between runs: no vectorizing, and race
# detection (with no parallel axis: nothing to report), which keeps the loop
# evaluating every index map at every step.
LOOP = pallas_np.InterpretParams(vectorize=False, detect_races=True, parallel_axes=())


def _acc_matmul(interpret, grid_k=4):
  def kernel(x_ref, y_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
      o_ref[...] = acc_ref[...]
  b = 32
  call = pl.pallas_call if interpret is True else pallas_np.pallas_call
  return call(kernel, jax.ShapeDtypeStruct((64, 64), jnp.float32), grid=(2, 2, grid_k),
              in_specs=[pl.BlockSpec((b, b), lambda i, j, k: (i, k)),
                        pl.BlockSpec((b, b), lambda i, j, k: (k, j))],
              out_specs=pl.BlockSpec((b, b), lambda i, j, k: (i, j)),
              scratch_shapes=[pltpu.VMEM((b, b), jnp.float32)], interpret=interpret)


def test_grid_steps_kept_per_grid(monkeypatch):
  """A sequential grid (4 lanes with a GEMM: auto mode declines to batch)
  over several input shapes back to back: the kept steps are the loop's,
  the index maps are evaluated on the first run of each grid only, and the
  declined pass's buffers are the loop's (one _prepare per run)."""
  prepared, maps = [], []
  orig_prepare = KernelPlan._prepare
  monkeypatch.setattr(KernelPlan, "_prepare",
                      lambda self, args: prepared.append(self.params.detect_races)
                      or orig_prepare(self, args))
  orig_build = KernelPlan._build_schedule
  monkeypatch.setattr(KernelPlan, "_build_schedule",
                      lambda self, *a: maps.append(1) or orig_build(self, *a))
  fns = {k: (_acc_matmul("numpy", k), _acc_matmul(True, k)) for k in (2, 4)}
  for _ in range(3):
    for k, (fn, want_fn) in fns.items():
      x, y = jnp.asarray(_f32(64, 32 * k)), jnp.asarray(_f32(32 * k, 64))
      # BLAS and XLA sum a product in different orders: a tolerance, and
      # bits against the same kernel run through the plain grid loop.
      got = fn(x, y)
      assert_same(got, want_fn(x, y), rtol=1e-5, atol=1e-4)
      assert_identical(got, _acc_matmul(LOOP, k)(x, y))
  assert prepared.count(False) == 6 and len(maps) == 2


def test_dynamic_grid_steps_per_grid_size():
  """A grid size read at run time: the steps are kept per grid, never
  reused for another size."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + pl.program_id(0).astype(jnp.float32)

  def run(interpret, n, x):
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    call = pl.pallas_call if interpret is True else pallas_np.pallas_call
    return call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(n,), in_specs=[spec],
                out_specs=spec, interpret=interpret)(x)
  x = jnp.asarray(_f32(32, 128))
  fn = jax.jit(lambda n, x: run(pallas_np.InterpretParams(vectorize=False), n, x))
  want_fn = jax.jit(lambda n, x: run(True, n, x))
  for n in (4, 2, 3, 4, 2):
    assert_identical(fn(n, x), want_fn(n, x))


def test_out_of_bounds_block_raises_every_call():
  """An index map pointing past the array: no steps are kept, and every call
  raises at the grid point the loop reaches."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  x = jnp.asarray(_f32(16, 128))
  fn = pallas_np.pallas_call(
      kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32), grid=(3,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (jnp.minimum(i, 1), 0)),
      interpret=pallas_np.InterpretParams(vectorize=False))
  for _ in range(2):
    with pytest.raises(KernelError, match=r"grid point \(2,\)"):
      fn(x)


def test_jit_calls_back_to_back_shapes_and_forced_options():
  """Eager calls of one jax.jit function (their traced programs remembered
  by argument avals/shardings and trace context, whole_program's memo):
  other shapes and dtypes back to back, and the forced options changing
  between calls, each against interpret=True or the semantics' reference."""
  from pallas_np import whole_program

  def kernel(x_ref, o_ref):
    o_ref[0:4, :] = (x_ref[0:4, :] * 2).astype(o_ref.dtype)

  def make(interpret):
    return jax.jit(lambda x: pl.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, jnp.float32), interpret=interpret)(x))
  fn, want_fn = make(pallas_np.InterpretParams()), make(True)
  args = [jnp.asarray(_f32(8, 128)), jnp.asarray(_f32(16, 128)),
          jnp.asarray(rng.integers(-9, 9, (8, 128)), jnp.int32),
          jnp.broadcast_to(jnp.asarray(1.5), (8, 128))]
  for _ in range(3):
    for x in args:
      assert_identical(fn(x), want_fn(x))
  assert len(whole_program._jit_params_memo) >= len(args)
  # Forced options are part of the trace context: a forced run never reuses
  # the program (or options) of another.
  x = args[0]
  tpu_fn = make(False)  # TPU lowering: runs only when forced
  zero = pallas_np.InterpretParams(uninitialized="zero")
  want_zero = np.zeros((8, 128), np.float32)
  want_zero[:4] = np.asarray(x)[:4] * 2
  for _ in range(3):
    with pallas_np.force_numpy_interpret(zero):
      assert_identical(tpu_fn(x), want_zero)
    with pallas_np.force_numpy_interpret():
      assert_identical(tpu_fn(x), want_fn(x))
    assert_identical(fn(x), want_fn(x))


def test_jit_calls_with_x64_toggled():
  """The trace context (here jax_enable_x64) is part of what a remembered
  program is keyed by: toggling it between eager jit calls retraces."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0

  def make(interpret):
    return jax.jit(lambda x: (pl.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x),
        jnp.arange(4)))
  fn, want_fn = make(pallas_np.InterpretParams()), make(True)
  x = jnp.asarray(_f32(8, 128))
  was_x64 = bool(jnp.arange(1).dtype == np.int64)
  try:
    for x64 in (False, True, False, True, False):
      jax.config.update("jax_enable_x64", x64)
      got, want = fn(x), want_fn(x)
      assert got[1].dtype == (np.int64 if x64 else np.int32)
      assert_identical(got, want)
  finally:
    jax.config.update("jax_enable_x64", was_x64)
