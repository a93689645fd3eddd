"""Differential suite: each kernel runs with interpret="numpy" and with
interpret=True (JAX's HLO interpreter, the oracle); integer and boolean
results must agree bit for bit, floats to a tight tolerance.

Sizes are small on purpose: the oracle's XLA compile dominates the run time.
"""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from tests.helpers import is_inlined, run_both

_rng = np.random.default_rng(0)


def randn(*shape, dtype=np.float32):
  return jnp.asarray(_rng.standard_normal(shape).astype(dtype))


def randint(*shape, lo=-100, hi=100, dtype=np.int32):
  return jnp.asarray(_rng.integers(lo, hi, size=shape).astype(dtype))


def sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def call(kernel, out_shape, **kw):
  """make_call for run_both: the same pallas_call with the given interpret
  (``INLINED``: through ``pallas_np.pallas_call``)."""
  def make_call(interpret):
    entry = pallas_np.pallas_call if is_inlined(interpret) else pl.pallas_call
    return entry(kernel, out_shape=out_shape, interpret=interpret, **kw)
  make_call.inlined = True
  return make_call


# -- elementwise ------------------------------------------------------------
def test_float_unary_math():
  def k(x_ref, o_ref):
    x = x_ref[...]
    o_ref[0] = jnp.exp(x) + jnp.sin(x) * jnp.tanh(x)
    o_ref[1] = jnp.sqrt(jnp.abs(x)) - jnp.log1p(jnp.abs(x))
    o_ref[2] = jax.nn.sigmoid(x) * lax.rsqrt(1.0 + x * x)
    o_ref[3] = jnp.floor(x * 3) + jnp.round(x * 2.5) + jnp.ceil(x) + x ** 3
  x = randn(8, 128)
  run_both(call(k, sds((4, 8, 128), jnp.float32)), x, rtol=1e-6, atol=1e-6)


def test_int_arithmetic_truncating_division():
  def k(x_ref, y_ref, o_ref):
    x, y = x_ref[...], y_ref[...]
    o_ref[0] = lax.div(x, y)
    o_ref[1] = lax.rem(x, y)
    o_ref[2] = x * y - x
    o_ref[3] = jnp.maximum(x, y) ^ (x & y) | jnp.minimum(x, -y)
    o_ref[4] = lax.shift_left(x, 3) + lax.shift_right_arithmetic(x, 2)
    o_ref[5] = lax.shift_right_logical(x, 28)
    o_ref[6] = x // y  # jnp floor division is built from lax ops
    o_ref[7] = x % y
  x = randint(8, 128)
  y = randint(8, 128, lo=1, hi=9) * jnp.where(randint(8, 128, lo=0, hi=2) > 0, 1, -1)
  run_both(call(k, sds((8, 8, 128), jnp.int32)), x, y)


def test_unsigned_and_small_ints():
  def k(a_ref, b_ref, o8_ref, o32_ref):
    a, b = a_ref[...], b_ref[...]
    o8_ref[...] = a + b * a  # uint8 wraps
    wide = a.astype(jnp.uint32) << 20
    o32_ref[...] = (wide // (b.astype(jnp.uint32) + 1)) ^ wide
  a = randint(16, 128, lo=0, hi=256, dtype=np.uint8)
  b = randint(16, 128, lo=0, hi=256, dtype=np.uint8)
  run_both(call(k, (sds((16, 128), jnp.uint8), sds((16, 128), jnp.uint32))), a, b)


def test_compare_select_bool_logic():
  def k(x_ref, y_ref, o_ref, m_ref):
    x, y = x_ref[...], y_ref[...]
    m = (x > y) & ~(x == 0) | (y <= -1.0)
    o_ref[...] = jnp.where(m, x, y * 2.0)
    m_ref[...] = (m ^ (x >= 0.5)).astype(jnp.int32)
  x, y = randn(8, 128), randn(8, 128)
  run_both(call(k, (sds((8, 128), jnp.float32), sds((8, 128), jnp.int32))), x, y)


def test_convert_element_type():
  def k(x_ref, i_ref, u_ref, f_ref, b_ref):
    x = x_ref[...] * 1000.0
    i_ref[...] = x.astype(jnp.int32)
    u_ref[...] = x.astype(jnp.uint8)  # out of range: saturates like XLA
    f_ref[...] = i_ref[...].astype(jnp.float32) / 7
    b_ref[...] = x.astype(jnp.bfloat16)
  x = randn(8, 128)
  run_both(call(k, (sds((8, 128), jnp.int32), sds((8, 128), jnp.uint8),
                    sds((8, 128), jnp.float32), sds((8, 128), jnp.bfloat16))), x)


def test_bf16_arithmetic():
  def k(x_ref, y_ref, o_ref, s_ref):
    x, y = x_ref[...], y_ref[...]
    o_ref[...] = jnp.exp(x) * y + x / (jnp.abs(y) + 1)
    s_ref[...] = jnp.sum(x * y, axis=1, keepdims=True).astype(jnp.float32)
  x = randn(16, 128, dtype=ml_dtypes.bfloat16)
  y = randn(16, 128, dtype=ml_dtypes.bfloat16)
  run_both(call(k, (sds((16, 128), jnp.bfloat16), sds((16, 1), jnp.float32))), x, y,
           rtol=1e-2, atol=1e-2)


def test_integer_pow_clamp_pow():
  def k(x_ref, o_ref):
    x = x_ref[...]
    o_ref[0] = lax.integer_pow(x, 5) - lax.integer_pow(x, -2)
    o_ref[1] = jnp.clip(x, -0.5, 0.25)
    o_ref[2] = jnp.abs(x) ** 1.7
  x = randn(8, 128)
  run_both(call(k, sds((3, 8, 128), jnp.float32)), x, rtol=1e-5)


# -- shapes -----------------------------------------------------------------
def test_iota_2d_with_grid():
  def k(o_ref):
    i = pl.program_id(0)
    rows = lax.broadcasted_iota(jnp.int32, (8, 128), 0)
    cols = lax.broadcasted_iota(jnp.int32, (8, 128), 1)
    o_ref[...] = (rows + i * 8) * 1000 + cols
  run_both(call(k, sds((32, 128), jnp.int32), grid=(4,),
                out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0))))


def test_reshape_transpose_broadcast():
  def k(x_ref, o_ref, t_ref):
    x = x_ref[...]  # (8, 128)
    r = x.reshape(4, 2, 128).transpose(1, 0, 2).reshape(8, 128)
    o_ref[...] = r + x[:, :1] + x[:1, :]
    t_ref[...] = x.T * 2
  x = randn(8, 128)
  run_both(call(k, (sds((8, 128), jnp.float32), sds((128, 8), jnp.float32))), x)


def test_concatenate_slice_flip():
  def k(x_ref, o_ref):
    x = x_ref[...]
    a = jnp.concatenate([x[:, 64:], x[:, :64]], axis=1)
    b = jnp.flip(x, axis=1)
    c = jnp.concatenate([x[4:], x[:4]], axis=0)
    o_ref[...] = a + 10 * b + 100 * c + x[:, ::2].repeat(2, axis=1) * 0
  x = randint(8, 128)
  run_both(call(k, sds((8, 128), jnp.int32)), x)


def test_ref_indexers_mixing_static_and_dynamic_dims():
  """Ref indexers whose static dims are built once and dynamic ones per call
  (one dynamic dim at the front, middle or end; two dynamic dims; a static
  int next to a dynamic slice), read and written, in raise and clamp mode."""
  def k(x_ref, o_ref, p_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    a = x_ref[i, :, pl.ds(j * 4, 4)]  # (16, 4): dynamic first and last
    b = x_ref[pl.ds(i, 1), 3, pl.ds(j * 4, 4)]  # (1, 4): static int in the middle
    c = x_ref[1, pl.ds(j, 12), 0:4]  # (12, 4): one dynamic dim in the middle
    o_ref[0, :, pl.ds(0, 4)] = a + b
    o_ref[0, pl.ds(0, 12), pl.ds(4, 4)] = c
    o_ref[0, pl.ds(12, 4), pl.ds(4, 4)] = jnp.zeros((4, 4), jnp.float32)
    p_ref[pl.ds(0, 1), pl.ds(j, 1)] = jnp.full((1, 1), (i * 10 + j).astype(jnp.float32))
  x = randn(4, 16, 16)
  for params in (None, dict(bounds_check="clamp")):
    interp = lambda it: (pallas_np.InterpretParams(**params) if params and it == "numpy"
                         else it)
    run_both(lambda it: pl.pallas_call(
        k, out_shape=(sds((4, 16, 8 * 4), jnp.float32), sds((1, 4), jnp.float32)),
        grid=(4, 4),
        in_specs=[pl.BlockSpec((4, 16, 16), lambda i, j: (0, 0, 0))],
        out_specs=[pl.BlockSpec((1, 16, 8), lambda i, j: (i, 0, j)),
                   pl.BlockSpec((1, 4), lambda i, j: (0, 0))],
        interpret=interp(it)), x)


def test_dynamic_slice_and_update_values():
  def k(x_ref, o_ref):
    i = pl.program_id(0)
    x = x_ref[...]  # (16, 128)
    win = lax.dynamic_slice(x, (i * 4, 0), (8, 128))
    upd = lax.dynamic_update_slice(jnp.zeros((16, 128), jnp.float32), win * 2,
                                   (i * 2 + 1, 0))
    # A start past the end is clamped by XLA; both sides must clamp.
    clamped = lax.dynamic_slice(x, (i + 12, 0), (8, 128))
    o_ref[0] = upd[:8] + clamped
    o_ref[1] = upd[8:]
  x = randn(16, 128)
  run_both(call(k, sds((4, 2, 8, 128), jnp.float32), grid=(4,),
                in_specs=[pl.BlockSpec((16, 128), lambda i: (0, 0))],
                out_specs=pl.BlockSpec((None, 2, 8, 128), lambda i: (i, 0, 0, 0))), x)


# -- reductions -------------------------------------------------------------
def test_reductions():
  def k(x_ref, i_ref, s_ref, m_ref, a_ref, b_ref):
    x = x_ref[...]
    s_ref[...] = jnp.stack([x.sum(0), x.max(0), x.min(0), jnp.prod(x[:4], 0)])
    xi = i_ref[...]
    m_ref[...] = jnp.stack([xi.sum(1), xi.max(1), xi.min(1), jnp.bitwise_xor.reduce(xi, 1)])
    a_ref[...] = jnp.stack([jnp.argmax(x, 0), jnp.argmin(x, 0)]).astype(jnp.int32)
    b_ref[...] = jnp.stack([jnp.any(xi > 90, 1), jnp.all(xi > -100, 1)]).astype(jnp.int32)
  x, xi = randn(8, 128), randint(8, 128)
  run_both(call(k, (sds((4, 128), jnp.float32), sds((4, 8), jnp.int32),
                    sds((2, 128), jnp.int32), sds((2, 8), jnp.int32))), x, xi)


def test_cumsum_and_int_sum_wraps_in_int32():
  def k(x_ref, i_ref, c_ref, s_ref):
    c_ref[...] = jnp.cumsum(x_ref[...], axis=1)
    s_ref[...] = jnp.sum(i_ref[...], axis=1, keepdims=True)  # overflows int32
  x = randn(8, 128)
  xi = randint(8, 128, lo=2**28, hi=2**30)
  run_both(call(k, (sds((8, 128), jnp.float32), sds((8, 1), jnp.int32))), x, xi,
           rtol=1e-5, atol=1e-4)


# -- dot_general ------------------------------------------------------------
def test_dot_batch_dims():
  def k(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.einsum("bij,bjk->bik", x_ref[...], y_ref[...])
  x, y = randn(2, 32, 64), randn(2, 64, 16)
  run_both(call(k, sds((2, 32, 16), jnp.float32)), x, y, rtol=1e-5, atol=1e-4)


def test_dot_transposed_contraction_and_batch_not_leading():
  def k(x_ref, y_ref, o_ref):
    # contract lhs dim 0 with rhs dim 2; batch lhs dim 2 with rhs dim 0
    o_ref[...] = lax.dot_general(x_ref[...], y_ref[...],
                                 (((0,), (2,)), ((2,), (0,))))
  x, y = randn(16, 8, 4), randn(4, 24, 16)
  run_both(call(k, sds((4, 8, 24), jnp.float32)), x, y, rtol=1e-5, atol=1e-4)


def test_dot_bf16_preferred_f32():
  def k(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)
  x = randn(32, 128, dtype=ml_dtypes.bfloat16)
  y = randn(128, 64, dtype=ml_dtypes.bfloat16)
  run_both(call(k, sds((32, 64), jnp.float32)), x, y, rtol=1e-5, atol=1e-4)


def test_dot_int8_preferred_int32():
  def k(x_ref, y_ref, o_ref):
    o_ref[...] = lax.dot_general(x_ref[...], y_ref[...], (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.int32)
  x = randint(32, 128, lo=-128, hi=128, dtype=np.int8)
  y = randint(128, 32, lo=-128, hi=128, dtype=np.int8)
  run_both(call(k, sds((32, 32), jnp.int32)), x, y)


# -- grid and BlockSpec semantics ------------------------------------------
def test_partial_edge_blocks_1d():
  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + pl.program_id(0).astype(jnp.float32)
  x = randn(100)
  run_both(call(k, sds((100,), jnp.float32), grid=(pl.cdiv(100, 32),),
                in_specs=[pl.BlockSpec((32,), lambda i: (i,))],
                out_specs=pl.BlockSpec((32,), lambda i: (i,))), x)


def test_partial_edge_blocks_2d_transposed_index_map():
  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...].T + 1
  x = randint(70, 130)
  run_both(call(k, sds((130, 70), jnp.int32), grid=(3, 5),
                in_specs=[pl.BlockSpec((32, 32), lambda i, j: (i, j))],
                out_specs=pl.BlockSpec((32, 32), lambda i, j: (j, i))), x)


def test_edge_block_reads_padding_only_where_masked():
  # The padding is garbage (NaN) on both sides; a kernel that masks it out
  # with a bounds check gets identical sums.
  def k(x_ref, o_ref):
    i = pl.program_id(0)
    idx = i * 16 + lax.broadcasted_iota(jnp.int32, (16,), 0)
    v = jnp.where(idx < 40, x_ref[...], 0.0)
    o_ref[...] = jnp.broadcast_to(jnp.sum(v), (1,))
  x = randn(40)
  run_both(call(k, sds((3,), jnp.float32), grid=(3,),
                in_specs=[pl.BlockSpec((16,), lambda i: (i,))],
                out_specs=pl.BlockSpec((1,), lambda i: (i,))), x)


def test_scratch_accumulation_arbitrary_axis():
  bm, bn, bk = 16, 32, 32

  def k(x_ref, y_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
      o_ref[...] = acc_ref[...].astype(o_ref.dtype)
  x, y = randn(32, 96), randn(96, 64)
  run_both(call(k, sds((32, 64), jnp.float32),
                grid_spec=pltpu.PrefetchScalarGridSpec(
                    num_scalar_prefetch=0, grid=(2, 2, 3),
                    in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                              pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
                    out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
                    scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)]),
                compiler_params=pltpu.CompilerParams(
                    dimension_semantics=("parallel", "parallel", "arbitrary"))),
           x, y, rtol=1e-5, atol=1e-4)


def test_scalar_prefetch_in_index_map():
  # Gather rows of x in the order given by a prefetched index vector.
  def k(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] * (idx_ref[pl.program_id(0)] + 1).astype(jnp.float32)
  order = jnp.array([3, 0, 2, 2, 1], jnp.int32)
  x = randn(4, 8, 128)
  run_both(call(k, sds((5, 8, 128), jnp.float32),
                grid_spec=pltpu.PrefetchScalarGridSpec(
                    num_scalar_prefetch=1, grid=(5,),
                    in_specs=[pl.BlockSpec((None, 8, 128), lambda i, idx: (idx[i], 0, 0))],
                    out_specs=pl.BlockSpec((None, 8, 128), lambda i, idx: (i, 0, 0)))),
           order, x)


def test_two_scalar_prefetch_operands_block_sparse():
  # Block-sparse style: per grid step, a row block and a column block.
  def k(rows_ref, cols_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] + rows_ref[pl.program_id(0)] * 100 + cols_ref[pl.program_id(0)]
  rows = jnp.array([1, 0, 1, 0], jnp.int32)
  cols = jnp.array([0, 1, 1, 0], jnp.int32)
  x = randint(16, 256)
  run_both(call(k, sds((4, 8, 128), jnp.int32),
                grid_spec=pltpu.PrefetchScalarGridSpec(
                    num_scalar_prefetch=2, grid=(4,),
                    in_specs=[pl.BlockSpec((8, 128), lambda i, r, c: (r[i], c[i]))],
                    out_specs=pl.BlockSpec((None, 8, 128), lambda i, r, c: (i, 0, 0)))),
           rows, cols, x)


def test_element_dims_overlapping_windows():
  # Element: the index map returns element offsets, so windows may overlap.
  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...][:8] + x_ref[...][8:]
  x = randn(40, 128)
  run_both(call(k, sds((32, 128), jnp.float32), grid=(4,),
                in_specs=[pl.BlockSpec((pl.Element(16), 128), lambda i: (i * 8, 0))],
                out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0))), x)


def test_element_dims_with_padding():
  # A 1-D stencil: Element padding supplies a halo on both ends.
  def k(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = x[:16] + x[1:17] * 2 + x[2:18]
  x = randn(64)
  run_both(call(k, sds((64,), jnp.float32), grid=(4,),
                in_specs=[pl.BlockSpec((pl.Element(18, (1, 1)),), lambda i: (i * 16,))],
                out_specs=pl.BlockSpec((16,), lambda i: (i,))),
           x)


def test_squeezed_dims_none_and_pl_squeezed():
  def k(x_ref, o_ref):
    # x block (8, 128) with the leading batch dim squeezed away
    o_ref[...] = jnp.sum(x_ref[...], axis=0)
  x = randn(3, 8, 128)
  run_both(call(k, sds((3, 128), jnp.float32), grid=(3,),
                in_specs=[pl.BlockSpec((None, 8, 128), lambda b: (b, 0, 0))],
                out_specs=pl.BlockSpec((pl.Squeezed(), 128), lambda b: (b, 0))), x)


def test_no_blockspec_means_whole_array_every_step():
  def k(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[pl.ds(i * 8, 8), :] = x_ref[pl.ds(i * 8, 8), :] + x_ref[0:8, :]
  x = randn(32, 128)
  run_both(call(k, sds((32, 128), jnp.float32), grid=(4,)), x)


def test_any_memory_space_ref():
  def k(x_hbm_ref, y_ref, o_ref):
    i = pl.program_id(0)
    # The ANY ref is the whole array, indexed by hand.
    o_ref[...] = x_hbm_ref[pl.ds(i * 8, 8), :] * y_ref[...]
  x, y = randn(16, 128), randn(8, 128)
  run_both(call(k, sds((16, 128), jnp.float32), grid=(2,),
                in_specs=[pl.BlockSpec(memory_space=pl.ANY),
                          pl.BlockSpec((8, 128), lambda i: (0, 0))],
                out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0))), x, y)


def test_input_output_aliases():
  def k(x_ref, y_ref, o_ref):
    # Only half the blocks are written; the rest keep the aliased input.
    @pl.when(pl.program_id(0) % 2 == 0)
    def _():
      o_ref[...] = x_ref[...] + y_ref[...]
  x, y = randn(32, 128), randn(32, 128)
  run_both(call(k, sds((32, 128), jnp.float32), grid=(4,),
                in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))] * 2,
                out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                input_output_aliases={0: 0}), x, y)


def test_scratch_persists_across_grid_steps():
  # A running (prefix) sum over grid steps kept in a scratch buffer.
  def k(x_ref, o_ref, run_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      run_ref[...] = jnp.zeros_like(run_ref)
    run_ref[...] += x_ref[...]
    o_ref[...] = run_ref[...]
  x = randint(48, 128)
  run_both(call(k, sds((48, 128), jnp.int32), grid=(6,),
                in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                scratch_shapes=[pltpu.VMEM((8, 128), jnp.int32)]), x)


def test_grid_3d_program_ids_and_num_programs():
  def k(o_ref):
    i, j, l = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    val = (i * 100 + j * 10 + l) * 1000 + pl.num_programs(0) * 100 \
        + pl.num_programs(1) * 10 + pl.num_programs(2)
    o_ref[...] = jnp.full((1, 1, 8), val, jnp.int32)
  run_both(call(k, sds((2, 3, 32), jnp.int32), grid=(2, 3, 4),
                out_specs=pl.BlockSpec((1, 1, 8), lambda i, j, l: (i, j, l))))


def test_multiple_outputs_pytree():
  def k(x_ref, o_ref):
    x = x_ref[...]
    o_ref["sum"][...] = x + 1
    o_ref["neg"][...] = (-x).astype(jnp.int32)
  x = randn(8, 128) * 10
  run_both(call(k, {"sum": sds((8, 128), jnp.float32), "neg": sds((8, 128), jnp.int32)}), x)


def test_input_written_by_kernel_is_private():
  # A kernel may use an input ref as workspace; the caller's array is intact.
  def k(x_ref, o_ref):
    x_ref[...] = x_ref[...] * 2
    o_ref[...] = x_ref[...] + 1
  x = randn(8, 128)
  x_before = np.asarray(x).copy()
  run_both(call(k, sds((8, 128), jnp.float32)), x)
  np.testing.assert_array_equal(np.asarray(x), x_before)


# -- refs and indexing ------------------------------------------------------
def test_ref_addupdate_and_strided_ds():
  def k(x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += x_ref[pl.ds(0, 8, stride=2), :]
    o_ref[pl.ds(2, 4), :] += x_ref[pl.ds(1, 4), :] * 3
    o_ref[:, pl.ds(64, 64)] += x_ref[0:8, 0:64]
  x = randint(16, 128)
  run_both(call(k, sds((8, 128), jnp.int32)), x)


def test_run_scoped_scratch():
  def k(x_ref, o_ref):
    def body(tmp_ref):
      tmp_ref[...] = x_ref[...] * 2
      tmp_ref[0:4, :] = tmp_ref[4:8, :] + 1
      o_ref[...] = tmp_ref[...]
    pl.run_scoped(body, pltpu.VMEM((8, 128), jnp.float32))
  x = randn(8, 128)
  run_both(call(k, sds((8, 128), jnp.float32)), x)


# -- control flow -----------------------------------------------------------
def test_fori_loop_over_ref_rows():
  def k(x_ref, o_ref):
    o_ref[0, :] = x_ref[0, :]

    def body(r, carry):
      o_ref[r, :] = o_ref[r - 1, :] * 0.5 + x_ref[r, :]
      return carry
    lax.fori_loop(1, 16, body, 0)
  x = randn(16, 128)
  run_both(call(k, sds((16, 128), jnp.float32)), x)


def test_fori_loop_carry_and_dynamic_ds():
  def k(x_ref, o_ref):
    def body(r, acc):
      row = x_ref[pl.ds(r, 1), :]
      o_ref[pl.ds(r, 1), :] = acc + row
      return acc + row
    lax.fori_loop(0, 16, body, jnp.zeros((1, 128), jnp.int32))
  x = randint(16, 128)
  run_both(call(k, sds((16, 128), jnp.int32)), x)


def test_while_loop_collatz_steps():
  def k(x_ref, o_ref):
    def steps(n):
      def cond(c):
        return c[0] != 1

      def body(c):
        v, s = c
        return jnp.where(v % 2 == 0, v // 2, 3 * v + 1), s + 1
      return lax.while_loop(cond, body, (n, jnp.int32(0)))[1]

    def row(r, _):
      for j in range(8):
        o_ref[r, j] = steps(x_ref[r, j])
      return 0
    lax.fori_loop(0, 4, row, 0)
  x = randint(4, 8, lo=1, hi=200)
  run_both(call(k, sds((4, 8), jnp.int32)), x)


def test_scan_inside_kernel():
  def k(x_ref, o_ref, c_ref):
    def step(carry, row):
      new = carry * 0.9 + row
      return new, new.sum()
    final, sums = lax.scan(step, jnp.zeros((128,), jnp.float32), x_ref[...])
    o_ref[...] = final[None, :]
    c_ref[...] = sums[None, :]
  x = randn(8, 128)
  run_both(call(k, (sds((1, 128), jnp.float32), sds((1, 8), jnp.float32))), x,
           rtol=1e-5, atol=1e-5)


def test_reverse_scan_with_unroll():
  def k(x_ref, o_ref):
    def step(carry, row):
      return carry + row, carry
    _, ys = lax.scan(step, jnp.zeros((128,), jnp.int32), x_ref[...], reverse=True,
                     unroll=2)
    o_ref[...] = ys
  x = randint(8, 128)
  run_both(call(k, sds((8, 128), jnp.int32)), x)


def test_cond_and_when():
  def k(x_ref, o_ref):
    i = pl.program_id(0)
    v = lax.cond(x_ref[0, 0] > 0, lambda x: x * 2, lambda x: -x, x_ref[...])
    o_ref[...] = v

    @pl.when(i == 1)
    def _():
      o_ref[...] += 100
  x = randn(24, 128)
  run_both(call(k, sds((24, 128), jnp.float32), grid=(3,),
                in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0))), x)


def test_switch_three_branches():
  def k(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = lax.switch(i, [lambda x: x + 1, lambda x: x * x, lambda x: x - 7],
                            x_ref[...])
  x = randint(32, 128)
  run_both(call(k, sds((32, 128), jnp.int32), grid=(4,),  # index 3 clamps to 2
                in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0))), x)


def test_nested_jit_and_custom_jvp_inside_kernel():
  @jax.jit
  def helper(x):
    return jax.nn.softplus(x) + jax.nn.relu(x)  # custom_jvp inside a jit

  def k(x_ref, o_ref):
    o_ref[...] = helper(x_ref[...]) * 2
  x = randn(8, 128)
  run_both(call(k, sds((8, 128), jnp.float32)), x, rtol=1e-6, atol=1e-6)


def test_softmax_rows_blocked():
  def k(x_ref, o_ref):
    x = x_ref[...]
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - m)
    o_ref[...] = e / jnp.sum(e, axis=-1, keepdims=True)
  x = randn(64, 256)
  run_both(call(k, sds((64, 256), jnp.float32), grid=(4,),
                in_specs=[pl.BlockSpec((16, 256), lambda i: (i, 0))],
                out_specs=pl.BlockSpec((16, 256), lambda i: (i, 0))), x,
           rtol=1e-6, atol=1e-7)


def test_vmap_of_kernel_with_grid():
  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] * (pl.program_id(0) + 1).astype(jnp.float32)

  def make(interpret):
    f = pl.pallas_call(k, out_shape=sds((16, 128), jnp.float32), grid=(2,),
                       in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                       out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                       interpret=interpret)
    return jax.vmap(f)
  run_both(make, randn(3, 16, 128))


def test_vmap_with_scalar_prefetch():
  def k(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] + idx_ref[pl.program_id(0)].astype(jnp.float32)

  def make(interpret):
    return jax.vmap(pl.pallas_call(
        k, out_shape=sds((8, 128), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(2,),
            in_specs=[pl.BlockSpec((4, 128), lambda i, idx: (idx[i], 0))],
            out_specs=pl.BlockSpec((4, 128), lambda i, idx: (i, 0))),
        interpret=interpret))
  idx = jnp.array([[1, 0], [0, 1], [1, 1]], jnp.int32)
  run_both(make, idx, randn(3, 8, 128))


def test_accumulate_into_revisited_output_block():
  # No scratch: the output block stays resident across the "arbitrary" axis.
  def k(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += x_ref[...] @ y_ref[...]
  x, y = randn(32, 64), randn(64, 32)
  run_both(call(k, sds((32, 32), jnp.float32), grid=(2, 4),
                in_specs=[pl.BlockSpec((16, 16), lambda i, kk: (i, kk)),
                          pl.BlockSpec((16, 32), lambda i, kk: (kk, 0))],
                out_specs=pl.BlockSpec((16, 32), lambda i, kk: (i, 0)),
                compiler_params=pltpu.CompilerParams(
                    dimension_semantics=("parallel", "arbitrary"))),
           x, y, rtol=1e-5, atol=1e-4)


def test_bool_and_float16_refs():
  def k(x_ref, m_ref, h_ref, o_ref, b_ref):
    m = m_ref[...]
    h = h_ref[...]
    o_ref[...] = jnp.where(m, h * h + 1, -h)
    b_ref[...] = m ^ (x_ref[...] > 0)
  x = randn(8, 128)
  m = jnp.asarray(_rng.integers(0, 2, (8, 128)).astype(bool))
  h = randn(8, 128, dtype=np.float16)
  run_both(call(k, (sds((8, 128), jnp.float16), sds((8, 128), jnp.bool_))), x, m, h,
           rtol=1e-3, atol=1e-3)


def test_smem_scalar_scratch_counter_and_program_id_in_loop():
  def k(x_ref, o_ref, count_ref, acc_ref):
    i = pl.program_id(0)

    @pl.when(i == 0)
    def _():
      count_ref[0] = 0
      acc_ref[...] = jnp.zeros_like(acc_ref)

    def body(r, c):
      @pl.when(r % 2 == i % 2)
      def _():
        acc_ref[r, :] += x_ref[r, :]
      return c + jnp.where(r % 2 == i % 2, 1, 0)
    count_ref[0] += lax.fori_loop(0, 8, body, jnp.int32(0))
    o_ref[...] = acc_ref[...] + count_ref[0].astype(jnp.float32)
  x = randn(24, 128)
  run_both(call(k, sds((24, 128), jnp.float32), grid=(3,),
                in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                scratch_shapes=[pltpu.SMEM((1,), jnp.int32), pltpu.VMEM((8, 128), jnp.float32)]),
           x)
