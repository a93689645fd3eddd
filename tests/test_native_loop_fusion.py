"""Elementwise loops that compute lazy operands in place and store into
refs (pallas_np/native/loop_fusion.py; iota and broadcasts: shapes.py; ref
blocks read in place: ``shapes.ref_in_place``). Each kernel is compared bit
for bit with ``native_loops="off"`` and within tolerance with
interpret=True (``compiled_equals_numpy``), on shapes where a wrong axis, a
wrong stride or a store interleaved with a read of another element gives
other values; the structural checks fail without the change (every iota
and broadcast written out, every ref block copied, every store a copy
loop of its own)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from pallas_np import native
from pallas_np.native import loop_fusion
from tests.native_elig_util import compiled_equals_numpy, loop_source_of


def _floats(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _call(kernel, shape, interp, n_in=1, **kw):
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(shape, jnp.float32),
                        interpret=interp, **kw)


def _copy_loops(src: str, ref: str = r"a\d+") -> list:
  """The lines of ``src`` that copy a block of ref operand ``ref`` into a
  buffer (``v[..] = aK[..]``): what a block read in place no longer has."""
  return re.findall(r"^\s*v\d+\[[^\]]*\] = " + ref + r"\[.*$", src, re.M)


def iota_kernel(x_ref, o_ref):
  def body(i, acc):
    shape = acc.shape
    rows = lax.broadcasted_iota(jnp.int32, shape, 0) + i
    cols = lax.broadcasted_iota(jnp.int32, shape, 1) * 3
    row_vec = jnp.max(x_ref[...], axis=1)[:, None]  # (16, 1): a row broadcast
    col_vec = x_ref[0:1, :]  # (1, 32): a column broadcast
    mask = cols <= rows * 2
    return acc + jnp.where(mask, row_vec, col_vec) + rows.astype(jnp.float32) * 0.5
  o_ref[...] = lax.fori_loop(0, 3, body, jnp.zeros(o_ref.shape, jnp.float32))


def test_iota_and_broadcasts_read_in_the_loop():
  """Row and column iotas and row/column broadcasts of a non-square block:
  computed in the elementwise loop (a nest: rows, then columns), never
  written out; a swapped axis or stride gives other values."""
  x = _floats((16, 32))
  make = lambda interp: _call(iota_kernel, (16, 32), interp)  # noqa: E731
  compiled_equals_numpy(make, x)
  src = loop_source_of(make, x)
  assert "for _fr in range(16):" in src and "for _fc in range(32):" in src
  assert "np.int32(_fr)" in src and "np.int32(_fc)" in src
  assert not re.search(r"\] = np\.int32\(j\d+\)", src)  # (no iota written out)


def rank3_kernel(x_ref, y_ref, o_ref):
  def body(i, acc):
    shape = acc.shape
    a = lax.broadcasted_iota(jnp.float32, shape, 0) * 100.0
    b = lax.broadcasted_iota(jnp.float32, shape, 1) * 10.0
    c = lax.broadcasted_iota(jnp.float32, shape, 2)
    xb = jnp.broadcast_to(x_ref[...], shape)  # (3, 1, 16) stretched along axis 1
    yb = jnp.broadcast_to(y_ref[...], shape)  # (1, 5, 1) along axes 0 and 2
    return acc + (a + b + c) * xb - yb * (i + 1).astype(jnp.float32)
  o_ref[...] = lax.fori_loop(0, 2, body, jnp.zeros(o_ref.shape, jnp.float32))


def test_rank3_indices_from_the_row_counter():
  """A rank-3 nest: each axis' index from the row counter (``//``, ``%``)
  and the inner loop's; iotas along all three axes and broadcasts along
  leading, middle and trailing axes."""
  x, y = _floats((3, 1, 16), 1), _floats((1, 5, 1), 2)
  make = lambda interp: _call(rank3_kernel, (3, 5, 16), interp)  # noqa: E731
  compiled_equals_numpy(make, x, y)
  assert "for _fr in range(15):" in loop_source_of(make, x, y)


def reshaped_kernel(x_ref, o_ref):
  def body(i, acc):
    a = acc.reshape(16, 16) + lax.broadcasted_iota(jnp.float32, (16, 16), 0)
    b = a.reshape(8, 32) * 2.0 + lax.broadcasted_iota(jnp.float32, (8, 32), 1)
    return b + x_ref[...]
  o_ref[...] = lax.fori_loop(0, 3, body, jnp.zeros(o_ref.shape, jnp.float32))


def test_lazy_operand_of_another_shape_in_one_loop():
  """An iota of shape (8, 32) read in a loop over (16, 16) (one size, one
  loop): its indices from the flat index, not the nest's counters."""
  x = _floats((8, 32))
  make = lambda interp: _call(reshaped_kernel, (8, 32), interp)  # noqa: E731
  compiled_equals_numpy(make, x)
  assert "np.float32((_i % 32))" in loop_source_of(make, x)


def narrow_kernel(x_ref, o_ref):
  def body(i, acc):
    return acc + lax.broadcasted_iota(jnp.float32, acc.shape, 0) * x_ref[...] + \
        lax.broadcasted_iota(jnp.float32, acc.shape, 1)
  o_ref[...] = lax.fori_loop(0, 2, body, jnp.zeros(o_ref.shape, jnp.float32))


def test_narrow_last_axis_stays_flat():
  """A last axis under ``NEST_MIN``: a flat loop, indices from ``_i``."""
  x = _floats((64, 4))
  make = lambda interp: _call(narrow_kernel, (64, 4), interp)  # noqa: E731
  compiled_equals_numpy(make, x)
  src = loop_source_of(make, x)
  assert 4 < loop_fusion.NEST_MIN and "_fr" not in src and "(_i // 4)" in src


def scale_kernel(x_ref, acc_ref, o_ref):
  acc_ref[...] = x_ref[...]
  o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)

  def body(i, c):
    acc = acc_ref[...]
    acc_ref[...] = jnp.where(acc > 0, acc * 1.5, acc) + 1.0  # (jnp.where: a jit eqn)
    o_ref[...] += acc_ref[...] * 0.5
    return c
  lax.fori_loop(0, 3, body, 0)


def test_ref_blocks_read_in_place_and_stored_in_the_loop():
  """``acc[...] = where(acc > 0, acc * 1.5, acc) + 1`` and ``o[...] += acc *
  0.5``: each block read in place by the elementwise loop that stores back
  into it (one ref, one index expression a loop), no copies."""
  x = _floats((16, 128), 3)
  make = lambda interp: pl.pallas_call(  # noqa: E731
      scale_kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
      scratch_shapes=[pallas_np_vmem((16, 128))], interpret=interp)
  compiled_equals_numpy(make, x)
  src = loop_source_of(make, x)
  assert _copy_loops(src) == []
  loops = src.split("for _fr in range(16):")[1:]
  for ref in ("a0", "a1"):  # (acc, then o: each stored in a loop that reads it)
    assert any(f"{ref}[_fr, _fc] = " in loop and f"= {ref}[_fr, _fc]" in loop for loop in loops)


def two_scratch_kernel(x_ref, o_ref, m_ref, l_ref):
  m_ref[...] = x_ref[...]
  l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

  def body(i, c):
    m_next = jnp.maximum(m_ref[...], x_ref[...] * (i + 1).astype(jnp.float32))
    l_ref[...] = l_ref[...] * 0.5 + m_next
    m_ref[...] = m_next
    return c
  lax.fori_loop(0, 3, body, 0)
  o_ref[...] = m_ref[...] + l_ref[...]


def test_private_refs_stored_in_one_loop():
  """Two VMEM scratch refs (private: no other ref shares their memory)
  stored in the loop that reads both and an input block: one loop."""
  x = _floats((16, 128), 9)
  make = lambda interp: pl.pallas_call(  # noqa: E731
      two_scratch_kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
      scratch_shapes=[pallas_np_vmem((16, 128)), pallas_np_vmem((16, 128))], interpret=interp)
  compiled_equals_numpy(make, x)
  src = loop_source_of(make, x)
  loops = src.split("for _fr in range(16):")[1:]
  stored = set(re.findall(r"^\s*(a\d+)\[_fr, _fc\] = ", loops[0], re.M))
  assert len(loops) == 1 and len(stored) == 2


def pallas_np_vmem(shape):
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.VMEM(shape, jnp.float32)


def shift_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]

  def body(i, c):
    o_ref[pl.ds(1, 8), :] = o_ref[pl.ds(0, 8), :] + 1.0
    return c
  lax.fori_loop(0, 3, body, 0)


def test_store_to_other_elements_of_the_read_ref_not_interleaved():
  """``o[1:9] = o[0:8] + 1``: the block read and the block written overlap
  shifted by a row. Read and written in one loop, row r would read row r
  already written by row r - 1 (the NumPy path reads all rows first)."""
  x = _floats((9, 128), 5)
  make = lambda interp: _call(shift_kernel, (9, 128), interp)  # noqa: E731
  compiled_equals_numpy(make, x)
  src = loop_source_of(make, x)
  loops = src.split("for _fr in range(8):")[1:]
  assert not any("= a1[" in loop and re.search(r"a1\[1 \+", loop) for loop in loops)


def aliased_kernel(x_hbm, o_hbm):
  def body(i, c):
    o_hbm[pl.ds(1, 8), :] = x_hbm[pl.ds(0, 8), :] + 1.0
    return c
  lax.fori_loop(0, 3, body, 0)


def test_aliased_refs_not_read_and_written_in_one_loop():
  """An input and its aliased output in memory space ANY are one buffer
  (``grid/buffers.shared_aliases``): reading one ref and storing into the
  other, shifted by a row, in one loop would read rows already written."""
  x = _floats((9, 128), 6)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  make = lambda interp: pl.pallas_call(  # noqa: E731
      aliased_kernel, out_shape=jax.ShapeDtypeStruct((9, 128), jnp.float32),
      in_specs=[any_spec], out_specs=any_spec, input_output_aliases={0: 0}, interpret=interp)
  before = native.stats()["native_calls"]
  got = make(pallas_np.InterpretParams(native_loops="sync"))(x)
  assert native.stats()["native_calls"] > before
  off = make(pallas_np.InterpretParams(native_loops="off"))(x)
  want = np.asarray(x).copy()  # (one buffer: interpret=True's CPU run keeps two)
  for _ in range(3):
    want[1:9] = want[0:8] + np.float32(1.0)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(off))
  np.testing.assert_array_equal(np.asarray(got), want)


def write_between_kernel(x_ref, o_ref):
  o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)

  def body(i, c):
    old = o_ref[...]
    o_ref[...] = old + x_ref[...]

    @pl.when(i % 2 == 0)
    def _():
      o_ref[...] = o_ref[...] * 2.0
    o_ref[...] += old * 3.0  # (old: the block before both writes)
    return c
  lax.fori_loop(0, 4, body, 0)


def test_block_written_before_its_last_reader_is_copied():
  """A block read before a store (and a ``pl.when`` that stores) and read
  again after them is the block as it was at the ``get``: copied, not read
  in place."""
  x = _floats((8, 128), 7)
  make = lambda interp: _call(write_between_kernel, (8, 128), interp)  # noqa: E731
  compiled_equals_numpy(make, x)
  assert len(_copy_loops(loop_source_of(make, x), "a0")) == 1  # (o_ref: a0)


def oob_kernel(x_ref, o_ref):
  def body(i, acc):
    return acc * 0.5 + x_ref[pl.ds(i * 3, 2), :]  # (read in place: its check at the get)
  o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros((2, 128), jnp.float32))


def test_out_of_bounds_block_read_in_place_raises_the_numpy_error():
  x = _floats((8, 128), 8)
  make = lambda interp: _call(oob_kernel, (2, 128), interp)  # noqa: E731
  assert _copy_loops(loop_source_of(make, x), "a0") == []
  messages = []
  for mode in ("sync", "off"):
    before = native.stats()["compiled"]
    with pytest.raises(IndexError) as info:
      make(pallas_np.InterpretParams(native_loops=mode))(x)
    messages.append(str(info.value))
    if mode == "sync":
      assert native.stats()["compiled"] > before
  assert messages[0] == messages[1] and "get" in messages[0]


def transcendental_kernel(x_ref, o_ref):
  def body(i, x):
    e = jnp.exp(x * 0.5 - 1.0)  # (operands computed in the open loop: the formula joins it)
    l = jnp.log(jnp.abs(x) + 0.25)
    t = jnp.tanh(x * 3.0)
    e2 = jnp.exp2(x * 0.25)
    return jnp.where(i % 2 == 0, e - l + t, t * 2.0 - e * 0.125) + jnp.exp(x) * 1e-3 + e2
  o_ref[...] = lax.fori_loop(0, 3, body, x_ref[...])


def test_transcendentals_per_element_in_the_open_loop():
  """exp/log/tanh/exp2 of 1024-element operands computed in the open
  elementwise loop: XLA's formula per element in that loop (LLVM inlines
  the linked IR), the bits of the NumPy rules' vectorised loop, edge values
  included; an operand with a buffer of its own (the carry) still goes
  through that loop by its address."""
  x = np.random.default_rng(10).standard_normal((8, 128)).astype(np.float32) * 4
  x.flat[:12] = [0.0, -0.0, 1e-40, -1e-40, 88.0, -104.0, 1e30, -1e30, 3e38, -3e38,
                 np.nan, 3e-8]
  make = lambda interp: _call(transcendental_kernel, x.shape, interp)  # noqa: E731
  compiled_equals_numpy(make, jnp.asarray(x), rtol=2e-5, atol=1e-30)
  src = loop_source_of(make, jnp.asarray(x))
  for fn in ("xla_expf", "xla_logf", "xla_tanhf"):
    assert f"_ext_{fn}(" in src or f"_ext_{fn}_split(" in src
  assert src.count("_cblas_loop1(") == 1  # (exp(x) of the carry)
