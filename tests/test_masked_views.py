"""Masked Triton accesses through a ref view that runs past the end of the
ref (issue 27, item 5): ``x_ref.at[pl.ds(228, 64)]`` of a 256-row ref, loaded
or stored with a mask that is off for rows >= 256. On a GPU masked-off lanes
are never dereferenced, so this is valid (ragged kernels, grouped matmul).

interpret=True is *wrong* here: it clamps the view's start (228 -> 192) and
returns rows 192..255 in the masked-on lanes. These tests therefore check
against NumPy references computed from the semantics."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import pallas_np

SEQ = pallas_np.InterpretParams(vectorize=False, num_threads=1, check_avals=True)
VEC = pallas_np.InterpretParams(vectorize=True, check_avals=True)
MODES = pytest.mark.parametrize("interp", [SEQ, VEC], ids=["seq", "vec"])
ROWS, COLS, BLOCK = 256, 8, 64


def _x():
  return jnp.arange(ROWS * COLS, dtype=jnp.float32).reshape(ROWS, COLS)


def test_the_issue_example():
  """Program 3 views rows 228..291 of 256; rows >= 256 are masked off."""
  def kernel(x_ref, o_ref):
    start = pl.program_id(0) * 76
    view = x_ref.at[pl.ds(start, BLOCK)]
    rows = start + jnp.arange(BLOCK)
    o_ref[...] = pltriton.load(view.at[pl.ds(0, BLOCK)], mask=(rows < ROWS)[:, None],
                               other=0.0)

  got = pl.pallas_call(kernel, jax.ShapeDtypeStruct((BLOCK, COLS), jnp.float32), grid=(4,),
                       out_specs=pl.BlockSpec((BLOCK, COLS), lambda i: (0, 0)),
                       interpret=SEQ)(_x())
  ref = np.zeros((BLOCK, COLS), np.float32)
  ref[:ROWS - 228] = np.asarray(_x())[228:]  # the last program's block
  np.testing.assert_array_equal(np.asarray(got), ref)


def _ragged_kernel(starts_ref, ends_ref, x_ref, acc0_ref, o_ref, acc_ref):
  """Grouped-matmul style: program g handles rows [starts[g], ends[g]) in
  one BLOCK-row tile starting at starts[g] (the tile may run past the
  array); it writes 2*x + g into those rows of ``o`` and atomically adds
  the rows' column sums into acc[g]."""
  g = pl.program_id(0)
  start, end = starts_ref[g], ends_ref[g]
  rows = start + jnp.arange(BLOCK)
  mask = (rows < end)[:, None]
  tile = x_ref.at[pl.ds(start, BLOCK), pl.ds(0, COLS)]
  x = pltriton.load(tile.at[pl.ds(0, BLOCK), :], mask=mask, other=0.0)
  pltriton.store(o_ref.at[pl.ds(start, BLOCK)].at[pl.ds(0, BLOCK), :],
                 x * 2.0 + g.astype(jnp.float32), mask=mask)
  pltriton.atomic_add(acc_ref.at[g], pl.ds(0, COLS), jnp.sum(x, axis=0))


def _ragged_call(interpret):
  return pl.pallas_call(
      _ragged_kernel,
      out_shape=(jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
                 jax.ShapeDtypeStruct((4, COLS), jnp.float32)),
      grid=(4,), input_output_aliases={2: 0, 3: 1},
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret)


def _ragged_reference(starts, ends, x):
  out, acc = np.array(x), np.zeros((4, COLS), np.float32)
  for g, (s, e) in enumerate(zip(starts, ends)):
    out[s:e] = x[s:e] * 2.0 + g
    acc[g] = x[s:e].sum(axis=0)
  return out, acc


@MODES
def test_ragged_groups_load_store_and_atomic_through_views(interp):
  # The last group's tile starts at 228: rows 256..291 are masked off.
  starts = np.array([0, 40, 100, 228], np.int32)
  ends = np.array([40, 100, 160, 256], np.int32)
  x = np.asarray(_x())
  out, acc = _ragged_call(interp)(starts, ends, x,
                                  jnp.zeros((4, COLS), jnp.float32))
  want_out, want_acc = _ragged_reference(starts, ends, x)
  np.testing.assert_array_equal(np.asarray(out), want_out)
  np.testing.assert_allclose(np.asarray(acc), want_acc, rtol=1e-6)


def test_masked_store_through_view_past_the_end():
  def kernel(x_ref, o_ref):
    start = pl.program_id(0) * 100  # 0, 100, 200: the last view ends at 264
    rows = start + jnp.arange(BLOCK)
    view = o_ref.at[pl.ds(start, BLOCK)]
    pltriton.store(view, pltriton.load(x_ref.at[pl.ds(start, BLOCK)], mask=rows < ROWS),
                   mask=rows < ROWS)

  x = jnp.arange(ROWS, dtype=jnp.float32)
  got = pl.pallas_call(kernel, jax.ShapeDtypeStruct((ROWS,), jnp.float32), grid=(3,),
                       input_output_aliases={0: 0}, interpret=SEQ)(x)
  np.testing.assert_array_equal(np.asarray(got), np.arange(ROWS, dtype=np.float32))


def test_int_index_then_view_past_the_end():
  """``x_ref.at[row]`` (an int) then a slice view past the end."""
  def kernel(x_ref, o_ref):
    c0 = 4 + 0 * pl.program_id(0)  # dynamic: JAX rejects a static slice past the end
    cols = c0 + jnp.arange(8)
    o_ref[...] = pltriton.load(x_ref.at[pl.program_id(0) + 1].at[pl.ds(c0, 8)].at[pl.ds(0, 8)],
                               mask=cols < COLS, other=-1.0)[None]

  x = _x()
  got = pl.pallas_call(kernel, jax.ShapeDtypeStruct((2, 8), jnp.float32), grid=(2,),
                       out_specs=pl.BlockSpec((1, 8), lambda i: (i, 0)), interpret=SEQ)(x)
  ref = np.full((2, 8), -1.0, np.float32)
  ref[0, :4] = np.asarray(x)[1, 4:]
  ref[1, :4] = np.asarray(x)[2, 4:]
  np.testing.assert_array_equal(np.asarray(got), ref)


@pytest.mark.parametrize("what", ["load", "store", "atomic"])
def test_masked_on_lane_past_the_end_of_a_view_still_raises(what):
  def kernel(x_ref, o_ref):
    start = pl.program_id(0) * 228
    rows = start + jnp.arange(BLOCK)
    mask = rows < ROWS + 1  # BUG: off by one, lane 28 of program 1 is row 256
    view = x_ref.at[pl.ds(start, BLOCK)].at[pl.ds(0, BLOCK)]
    if what == "load":
      o_ref[...] = pltriton.load(view, mask=mask, other=0.0)
    elif what == "store":
      o_ref[...] = jnp.zeros_like(o_ref)
      pltriton.store(o_ref.at[pl.ds(start, BLOCK)].at[pl.ds(0, BLOCK)],
                     jnp.ones((BLOCK,), jnp.float32), mask=mask)
    else:
      o_ref[...] = jnp.zeros_like(o_ref)
      pltriton.atomic_add(o_ref.at[pl.ds(start, BLOCK)], pl.ds(0, BLOCK),
                          jnp.ones((BLOCK,), jnp.float32), mask=mask)

  out_rows = BLOCK if what == "load" else ROWS
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((out_rows,), jnp.float32), grid=(2,),
                     out_specs=pl.BlockSpec((out_rows,), lambda i: (0,)), interpret=SEQ)
  with pytest.raises(IndexError, match=r"lane \(28,\) is masked on but points at index "
                                       r"\(256,\) of a ref of shape \(256,\)") as info:
    f(jnp.arange(ROWS, dtype=jnp.float32))
  assert info.value.program_ids == (1,)


def test_clamp_mode_treats_lanes_past_the_end_of_a_view_as_masked_off():
  def kernel(x_ref, o_ref):
    rows = 228 + jnp.arange(BLOCK)
    view = x_ref.at[pl.ds(pl.program_id(0) + 228, BLOCK)]
    o_ref[...] = pltriton.load(view, mask=rows < ROWS + 1, other=-1.0)

  got = pl.pallas_call(kernel, jax.ShapeDtypeStruct((BLOCK,), jnp.float32), grid=(1,),
                       interpret=pallas_np.InterpretParams(bounds_check="clamp"))(
      jnp.arange(ROWS, dtype=jnp.float32))
  ref = np.full(BLOCK, -1.0, np.float32)
  ref[:28] = np.arange(228, 256)
  ref[28] = np.nan  # masked on but outside: the padding fill, as interpret=True reads
  np.testing.assert_array_equal(np.asarray(got), ref)
