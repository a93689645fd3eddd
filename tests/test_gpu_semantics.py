"""GPU/Triton-path kernel features in numpy mode: masked loads/stores whose
masked-off lanes point out of bounds, atomics, pl.dot transposes, hints and
Triton compiler params; and that real GPU lowering is left to JAX."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import pallas_np
from pallas_np import _compat as jc
from pallas_np import api
from tests.conftest import assert_same
from tests.helpers import run_both

BLOCK = 8


def _numpy_and_true(make_call, *args):
  return make_call("numpy")(*args), make_call(True)(*args)


# -- masked loads and stores ---------------------------------------------------
def add_one_kernel(x_ref, o_ref, *, n):
  """Triton-style: whole arrays, one program per BLOCK, tail lanes masked."""
  pid = pl.program_id(0)
  idx = pid * BLOCK + jnp.arange(BLOCK)
  mask = idx < n
  x = pltriton.load(x_ref.at[pl.ds(pid * BLOCK, BLOCK)], mask=mask, other=-5.0)
  pltriton.store(o_ref.at[pl.ds(pid * BLOCK, BLOCK)], x + 1.0, mask=mask)


def _add_one(interpret, n=13):
  return lambda x: pl.pallas_call(
      functools.partial(add_one_kernel, n=n),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(pl.cdiv(n, BLOCK),),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret)(x)


def test_masked_tail_past_end_load_and_store():
  x = jnp.arange(13, dtype=jnp.float32)
  got = run_both(_add_one, x)
  np.testing.assert_array_equal(np.asarray(got), np.arange(13) + 1.0)


def test_masked_load_other_fills_masked_off_lanes():
  def kernel(x_ref, o_ref):
    idx = jnp.arange(16)
    start = pl.program_id(0) + 8  # dynamic: JAX rejects static OOB slices
    o_ref[...] = pltriton.load(x_ref.at[pl.ds(start, 16)], mask=idx < 5, other=-1.0)

  def make(interpret):
    return lambda x: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), grid=(1,),
        interpret=interpret)(x)
  x = jnp.arange(13, dtype=jnp.float32)
  got = run_both(make, x)
  want = np.concatenate([np.arange(8, 13), np.full(11, -1.0)]).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_masked_2d_tile_rows_and_cols_past_end():
  m, n = 10, 12

  def kernel(x_ref, o_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    rows = i * 8 + jnp.arange(8)
    cols = j * 8 + jnp.arange(8)
    mask = (rows[:, None] < m) & (cols[None, :] < n)
    x = pltriton.load(x_ref.at[pl.ds(i * 8, 8), pl.ds(j * 8, 8)], mask=mask, other=0.0)
    pltriton.store(o_ref.at[pl.ds(i * 8, 8), pl.ds(j * 8, 8)], jnp.sin(x) * 2, mask=mask)

  def make(interpret):
    return lambda x: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32), grid=(2, 2),
        interpret=interpret)(x)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((m, n), np.float32))
  got = run_both(make, x)
  np.testing.assert_allclose(np.asarray(got), np.sin(np.asarray(x)) * 2, rtol=1e-6)


def test_masked_gather_with_integer_array_index():
  """layer_norm's pattern: ``ref.at[col_idx]`` with col_idx past the end."""
  n = 20

  def kernel(x_ref, o_ref):
    def body(i, acc):
      col = i * 16 + jnp.arange(16)
      return acc + pltriton.load(x_ref.at[col], mask=col < n, other=0.0)
    total = jax.lax.fori_loop(0, pl.cdiv(n, 16), body, jnp.zeros(16)).sum()
    for i in range(pl.cdiv(n, 16)):
      col = i * 16 + jnp.arange(16)
      pltriton.store(o_ref.at[col], pltriton.load(x_ref.at[col], mask=col < n) / total,
               mask=col < n)

  def make(interpret):
    return lambda x: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.float32),
        interpret=interpret)(x)
  x = jnp.arange(1, n + 1, dtype=jnp.float32)
  got = run_both(make, x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(x) / np.asarray(x).sum(), rtol=1e-6)


def test_masked_window_starting_before_zero():
  """A sliding window ``pl.ds(i - 3, 8)`` masked to ``idx >= 0``: Triton
  semantics (interpret=True's dynamic_slice would shift the window instead)."""
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    idx = i * 4 - 3 + jnp.arange(8)
    w = pltriton.load(x_ref.at[pl.ds(i * 4 - 3, 8)], mask=(idx >= 0) & (idx < 12), other=0.0)
    o_ref[pl.ds(i, 1)] = jnp.sum(w, keepdims=True)

  x = np.arange(1, 13, dtype=np.float32)
  got = pallas_np.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((3,), jnp.float32),
                              grid=(3,))(x)
  want = [sum(x[j] for j in range(i * 4 - 3, i * 4 + 5) if 0 <= j < 12) for i in range(3)]
  np.testing.assert_array_equal(np.asarray(got), want)


def test_masked_off_lanes_without_other_read_memory_like_interpret_true():
  def kernel(x_ref, o_ref):
    o_ref[...] = pltriton.load(x_ref, mask=jnp.arange(8) % 2 == 0) * 3.0

  def make(interpret):
    return lambda x: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
        interpret=interpret)(x)
  run_both(make, jnp.arange(8, dtype=jnp.float32))


def test_masked_swap_returns_old_values():
  def kernel(x_ref, o_ref, old_ref):
    o_ref[...] = jnp.zeros(8)
    mask = jnp.arange(8) < 3
    old_ref[...] = jc.pallas_primitives.swap(o_ref, None,
                           x_ref[...], mask=mask)

  def make(interpret):
    return lambda x: pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((8,), jnp.float32),) * 2,
        interpret=interpret)(x)
  o, old = run_both(make, jnp.arange(1, 9, dtype=jnp.float32))
  np.testing.assert_array_equal(np.asarray(o), [1, 2, 3, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(np.asarray(old)[:3], np.zeros(3))


def test_unmasked_out_of_bounds_still_raises():
  def kernel(x_ref, o_ref):
    # 8..15 of a 13-array
    o_ref[...] = pltriton.load(x_ref.at[pl.ds(pl.program_id(0) + 8, 8)])

  f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                     grid=(1,), interpret="numpy")
  with pytest.raises(Exception, match="out-of-bounds ref access"):
    jax.block_until_ready(f(jnp.arange(13, dtype=jnp.float32)))


def test_masked_on_out_of_bounds_lane_raises():
  # mask is off by one: lane 13 is on but points past the end.
  x = jnp.arange(13, dtype=jnp.float32)
  with pytest.raises(IndexError, match="masked on"):
    pallas_np.pallas_call(
        functools.partial(add_one_kernel, n=14),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,))(x)


def test_masked_out_of_bounds_store_raises():
  def kernel(x_ref, o_ref):
    pltriton.store(o_ref.at[pl.ds(pl.program_id(0) + 4, 8)], x_ref[...],
                   mask=jnp.arange(8) < 7)

  with pytest.raises(IndexError, match="masked on"):
    pallas_np.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((10,), jnp.float32),
                          grid=(1,))(
        jnp.ones(8, jnp.float32))


def test_clamp_mode_treats_out_of_bounds_lanes_as_masked_off():
  x = jnp.arange(13, dtype=jnp.float32)
  got = pallas_np.pallas_call(
      functools.partial(add_one_kernel, n=14),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
      interpret=pallas_np.InterpretParams(bounds_check="clamp"))(x)
  np.testing.assert_array_equal(np.asarray(got), np.arange(13) + 1.0)


def _overlapping_store_kernel(x_ref, o_ref, *, step):
  pid = pl.program_id(0)
  lanes = pid * step + jnp.arange(BLOCK)
  pltriton.store(o_ref.at[pl.ds(pid * step, BLOCK)], pltriton.load(
      x_ref.at[pl.ds(pid * step, BLOCK)], mask=lanes < 13), mask=lanes < 13)


@pytest.mark.parametrize("step,racy", [(BLOCK, False), (BLOCK - 2, True)])
def test_race_detector_sees_masked_lanes(step, racy):
  """Triton grids are parallel: programs whose masked stores overlap race,
  while masked-off lanes past the end never count."""
  x = jnp.arange(13, dtype=jnp.float32)
  call = pallas_np.pallas_call(
      functools.partial(_overlapping_store_kernel, step=step),
      out_shape=jax.ShapeDtypeStruct((13,), jnp.float32), grid=(2,),
      compiler_params=pltriton.CompilerParams(num_warps=4),
      interpret=pallas_np.InterpretParams(detect_races=True))
  if racy:
    with pytest.raises(pallas_np.RaceError):
      call(x)
  else:
    np.testing.assert_array_equal(np.asarray(call(x)), np.arange(13))


# -- atomics -------------------------------------------------------------------
def _sum_all_kernel(x_ref, o_ref):
  @pl.when(pl.program_id(0) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)
  pltriton.atomic_add(o_ref, slice(None), x_ref[...].sum(axis=0))


def test_atomic_add_accumulates_across_programs():
  def make(interpret):
    return lambda x: pl.pallas_call(
        _sum_all_kernel, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32),
        grid=(5,), in_specs=[pl.BlockSpec((2, 4), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((4,), lambda i: (0,)), interpret=interpret)(x)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((10, 4), np.float32))
  got = run_both(make, x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(x).sum(0), rtol=1e-5)


@pytest.mark.parametrize("op", ["max", "min"])
def test_atomic_max_min_return_old_value(op):
  atomic = getattr(pltriton, f"atomic_{op}")

  def kernel(x_ref, o_ref, old_ref):
    o_ref[...] = jnp.full((8,), 2, jnp.int32)
    old_ref[...] = atomic(o_ref, slice(None), x_ref[...])

  def make(interpret):
    return lambda x: pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((8,), jnp.int32),) * 2,
        interpret=interpret)(x)
  x = jnp.arange(8, dtype=jnp.int32) - 2
  o, old = run_both(make, x)
  np.testing.assert_array_equal(np.asarray(o), getattr(np, f"{op}imum")(np.asarray(x), 2))
  np.testing.assert_array_equal(np.asarray(old), np.full(8, 2))


@pytest.mark.parametrize("op,ref", [("xchg", lambda a, b: b), ("and", np.bitwise_and),
                                    ("or", np.bitwise_or), ("xor", np.bitwise_xor),
                                    ("add", np.add)])
def test_masked_atomics_vs_numpy(op, ref):
  # interpret=True cannot discharge masked or bitwise atomics: NumPy reference.
  atomic = getattr(pltriton, f"atomic_{op}")

  def kernel(x_ref, o_ref, old_ref):
    o_ref[...] = jnp.full((12,), 6, jnp.int32)
    lanes = jnp.arange(16)
    old_ref[...] = atomic(o_ref, pl.ds(pl.program_id(0) + 4, 16), x_ref[...],
                          mask=lanes < 8)

  x = np.arange(16, dtype=np.int32) + 3
  o, old = pallas_np.pallas_call(
      kernel, out_shape=(jax.ShapeDtypeStruct((12,), jnp.int32),
                         jax.ShapeDtypeStruct((16,), jnp.int32)), grid=(1,))(x)
  want = np.full(12, 6, np.int32)
  want[4:12] = ref(want[4:12], x[:8])
  np.testing.assert_array_equal(np.asarray(o), want)
  np.testing.assert_array_equal(np.asarray(old)[:8], np.full(8, 6))


def test_atomic_add_repeated_indices_all_count():
  def kernel(idx_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    pltriton.atomic_add(o_ref, idx_ref[...], jnp.ones(8, jnp.float32))

  idx = np.array([0, 1, 1, 3, 3, 3, 0, 2], np.int32)
  got = pallas_np.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32))(idx)
  np.testing.assert_array_equal(np.asarray(got), np.bincount(idx, minlength=4))


def test_atomic_cas_spin_lock_counter():
  """Each program takes a CAS lock, bumps a counter, releases the lock."""
  def kernel(o_ref, lock_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
      lock_ref[...] = jnp.zeros_like(lock_ref)
    got = pltriton.atomic_cas(lock_ref, jnp.int32(0), jnp.int32(1))
    o_ref[0] += jnp.where(got == 0, 1, 100)  # lock was free
    o_ref[1] = pltriton.atomic_cas(lock_ref, jnp.int32(0), jnp.int32(7))  # held: no-op
    pltriton.atomic_xchg(lock_ref, (), jnp.int32(0))

  o, lock = pallas_np.pallas_call(
      kernel, out_shape=(jax.ShapeDtypeStruct((2,), jnp.int32),
                         jax.ShapeDtypeStruct((), jnp.int32)), grid=(6,))()
  np.testing.assert_array_equal(np.asarray(o), [6, 1])
  assert int(lock) == 0


# -- dot, hints, compiler params ------------------------------------------------
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False),
                                             (False, True), (True, True)])
def test_pl_dot_transposes(trans_a, trans_b):
  def kernel(a_ref, b_ref, o_ref):
    a = a_ref[...]
    o_ref[...] = pltriton.dot(a, b_ref[...], trans_a=trans_a, trans_b=trans_b)

  a = jnp.asarray(np.random.default_rng(2).standard_normal((16, 32) if not trans_a else (32, 16), np.float32))
  b = jnp.asarray(np.random.default_rng(3).standard_normal((32, 8) if not trans_b else (8, 32), np.float32))

  def make(interpret):
    return lambda a, b: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((16, 8), jnp.float32),
        interpret=interpret)(a, b)
  got = run_both(make, a, b, rtol=1e-5, atol=1e-5)
  a_, b_ = np.asarray(a), np.asarray(b)
  want = (a_.T if trans_a else a_) @ (b_.T if trans_b else b_)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_hints_debug_barrier_and_approx_tanh():
  def kernel(x_ref, o_ref, t_ref):
    pid = pl.program_id(0)
    start = pl.multiple_of(pid * 16, 16)
    offs = pltriton.max_contiguous(start + jnp.arange(16), [16])
    pltriton.debug_barrier()
    x = pltriton.load(x_ref.at[offs])
    pltriton.store(o_ref.at[pl.ds(start, 16)], x * 2)
    pltriton.store(t_ref.at[pl.ds(start, 16)], pltriton.approx_tanh(x))

  x = jax.random.normal(jax.random.key(4), (32,))
  o, t = pallas_np.pallas_call(
      kernel, out_shape=(jax.ShapeDtypeStruct((32,), jnp.float32),) * 2, grid=(2,),
      compiler_params=pltriton.CompilerParams(num_warps=8, num_stages=1))(x)
  np.testing.assert_array_equal(np.asarray(o), np.asarray(x) * 2)
  # PTX tanh.approx.f32 has a max relative error of ~2**-11.
  np.testing.assert_allclose(np.asarray(t), np.tanh(np.asarray(x)), rtol=2**-10, atol=1e-6)


def test_other_inline_asm_is_unsupported():
  def kernel(x_ref, o_ref):
    [o_ref[...]] = pltriton.elementwise_inline_asm(
        "mov.b32 $0, $1;", args=[x_ref[...]], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct((8,), jnp.float32)])

  with pytest.raises(pallas_np.UnsupportedError, match="inline assembly"):
    pallas_np.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32))(
        jnp.ones(8, jnp.float32))


# -- real GPU lowering is JAX's -------------------------------------------------
def _double_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...] * 2


def _double(interpret):
  return lambda x: pl.pallas_call(
      _double_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret)(x)


def test_interpret_false_on_cpu_still_raises_jax_error():
  with pytest.raises(ValueError, match="Only interpret mode is supported on CPU"):
    jax.block_until_ready(_double(False)(jnp.ones(16, jnp.float32)))


def test_non_numpy_interpret_delegates_to_jax_rule():
  from jax._src.pallas import pallas_call as jax_pallas_call
  assert api._jax_lowering is jax_pallas_call._pallas_call_lowering


def test_cuda_lowering_is_unchanged_by_pallas_np():
  """Cross-lower for CUDA on this CPU host, with our rule installed and with
  JAX's own rule: the Triton custom call must be byte-identical."""
  x = jnp.ones(16, jnp.float32)

  def lower_text():
    f = jax.jit(_double(False))
    with jc.cuda_lowering_target():
      return f.trace(x).lower(lowering_platforms=("cuda",)).as_text()

  from pallas_np import _compat as jc
  ours = lower_text()
  jc.register_pallas_call_lowering(api._jax_lowering)
  try:
    theirs = lower_text()
  finally:
    jc.register_pallas_call_lowering(api._pallas_call_lowering)
  assert "__gpu$xla.gpu.triton" in ours
  assert "num_warps = 4" in ours
  assert ours == theirs
