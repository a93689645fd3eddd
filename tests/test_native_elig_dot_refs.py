"""A float dot's operand read from a ref (pallas_np/native/dots.py's
``RefView``): a ``get`` whose one reader is a dot (directly or through one
``transpose``) is not copied. BLAS reads the ref block in place with its
row stride as the leading dimension — the call the NumPy rule makes on its
view (``primitives/dot.blas_operand``) —, or, transposed, the block is
gathered from the ref straight into the C-order copy the NumPy rule makes.
Each kernel is compared bit for bit with ``native_loops="off"``; the
structural tests read the generated source (no copy of the block, the ref's
own address and row stride in the sgemm call): they fail without the
change, which copied every block first."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from pallas_np.native import blas_calls
from tests.native_elig_util import compiled_equals_numpy, loop_source_of

needs_blas = pytest.mark.skipif(blas_calls.found() is None,
                                reason="NumPy's BLAS is not an OpenBLAS found here")


def _attention(q_ref, k_ref, v_ref, o_ref):
  """q @ k.T (k's block transposed) and p @ v (v's block in place), the
  blocks at a dynamic row offset of refs wider than the block."""
  def body(j, acc):
    k = k_ref[pl.ds(j * 16, 16), pl.ds(0, 32)]  # (16, 32) of a (64, 48) ref
    v = v_ref[pl.ds(j * 16, 16), pl.ds(8, 24)]  # (16, 24) of a (64, 40) ref: ld 40
    s = lax.dot_general(q_ref[:, pl.ds(0, 32)], k, (((1,), (1,)), ((), ())))  # (8, 16)
    return acc + jnp.dot(jnp.exp(s * 0.1), v)
  o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros(o_ref.shape, jnp.float32))


def _attention_args():
  rng = np.random.default_rng(7)
  return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((8, 40), (64, 48), (64, 40)))


def _make_attention(interp):
  return pl.pallas_call(_attention, out_shape=jax.ShapeDtypeStruct((8, 24), jnp.float32),
                        interpret=interp)


@needs_blas
def test_dot_operands_from_refs_bit_exact():
  compiled_equals_numpy(_make_attention, *_attention_args(), rtol=1e-4)


@needs_blas
def test_dot_reads_ref_blocks_in_place():
  """The generated loop never copies k's or v's block into a buffer of
  its own shape: v is read in place (the ref's address and row stride
  passed to sgemm), k gathered once, transposed, from the ref."""
  text = loop_source_of(_make_attention, *_attention_args())
  # k (ref a1) is read by exactly one element loop: its transposed gather
  k_reads = re.findall(r"^\s+(\w+)\[[^\]]*\] = (?:np\.float32\()?a1\[", text, re.M)
  assert len(k_reads) == 1, text
  # v (ref a2): its address and strides feed the sgemm call; its only
  # element-wise read is the fallback copy for a non-BLAS layout
  assert re.search(r"np\.int64\(a2\.ctypes\.data\)", text), text
  assert re.search(r"a2\.strides\[0\]", text), text
  sgemms = re.findall(r"_cblas_sgemm\(([^\n]*)\)", text)
  assert len(sgemms) == 2
  assert re.search(r"\bld\d+\b", sgemms[1]), sgemms  # the runtime leading dimension
  v_reads = [l for l in text.splitlines() if re.search(r"= a2\[", l)]
  assert len(v_reads) == 1, v_reads
  fallback = text.splitlines().index(v_reads[0])
  assert any(l.strip() == "else:" for l in text.splitlines()[fallback - 4:fallback]), text


def _written_between(x_ref, w_ref, o_ref):
  """x's block is read, then x's ref is overwritten, then the dot reads the
  value read before: it must not be read from the ref at the dot."""
  def body(i, acc):
    x = x_ref[...]
    x_ref[...] = x * 2.0 + 1.0
    return acc + jnp.dot(x, w_ref[...])
  o_ref[...] = lax.fori_loop(0, 3, body, jnp.zeros(o_ref.shape, jnp.float32))


@needs_blas
def test_ref_written_between_get_and_dot_bit_exact():
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)

  def make(interp):
    return pl.pallas_call(_written_between, out_shape=jax.ShapeDtypeStruct((8, 8), jnp.float32),
                          interpret=interp)
  compiled_equals_numpy(make, x, w, rtol=1e-4)
  text = loop_source_of(make, x, w)
  assert "a0.ctypes.data" not in text  # (copied at the get)
  assert "a1.ctypes.data" in text  # (w_ref[...] read in place: nothing written after it)


def _strided_rows(x_ref, w_ref, o_ref):
  """A block with strided columns (``pl.ds(..., stride=2)``): not a BLAS
  operand, copied to C order on both paths (the fallback branch)."""
  def body(i, acc):
    x = x_ref[:, pl.ds(0, 16, stride=2)]  # (8, 16)
    w = w_ref[pl.ds(i * 16, 16), :]  # (16, 8), in place
    return acc + jnp.dot(x, w)
  o_ref[...] = lax.fori_loop(0, 2, body, jnp.zeros(o_ref.shape, jnp.float32))


@needs_blas
def test_strided_block_copied_as_numpy_does_bit_exact():
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)

  def make(interp):
    return pl.pallas_call(_strided_rows, out_shape=jax.ShapeDtypeStruct((8, 8), jnp.float32),
                          interpret=interp)
  compiled_equals_numpy(make, x, w, rtol=1e-4)


def _decode_qk(q_ref, k_ref, v_ref, o_ref):
  """GPU decode attention's ``q @ k.T`` (a ``transpose`` eqn between the
  ``get`` and the dot), then ``p @ v``, at a dynamic row offset."""
  def body(j, acc):
    k = k_ref[pl.ds(j * 16, 16), :]  # (16, 32)
    s = jnp.dot(q_ref[...], k.T)  # (8, 16)
    return acc + jnp.dot(jnp.exp(s * 0.1), v_ref[pl.ds(j * 16, 16), :])
  o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros(o_ref.shape, jnp.float32))


def _make_decode_qk(interp):
  return pl.pallas_call(_decode_qk, out_shape=jax.ShapeDtypeStruct((8, 24), jnp.float32),
                        interpret=interp)


def _decode_qk_args():
  rng = np.random.default_rng(10)
  return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((8, 32), (64, 32), (64, 24)))


_TILED_GATHER = re.compile(
    r"for (j\d+) in range\((\d+)\):\n\s+for (j\d+) in range\((\d+)\):\n"
    r"\s+for (j\d+) in range\(8\):\n\s+for (j\d+) in range\(8\):\n"
    r"\s+\w+\[[^\]\n]*\] = (?:np\.float32\()?a0\[v\d+ \+ \((j\d+) \* 8 \+ (j\d+)\) \* 1, "
    r"0 \+ \((j\d+) \* 8 \+ (j\d+)\) \* 1\]")


@needs_blas
@pytest.mark.parametrize("make,args", [(_make_decode_qk, _decode_qk_args),
                                       (_make_attention, _attention_args)],
                         ids=["transpose_eqn", "contracting_dims"])
def test_transposed_block_gathered_in_tiles(make, args):
  """k's block, needed transposed by sgemm, is copied from the ref in 8 x 8
  tiles, each read row by row (reading the ref down its columns cost GQA
  decode ~0.2 ms a call; row by row, the copy's writes were the strided
  ones: PERF_LOG); the copy holds the same elements, so the bits equal
  the NumPy path's and interpret=True's."""
  compiled_equals_numpy(make, *args(), rtol=1e-4)
  text = loop_source_of(make, *args())
  found = _TILED_GATHER.findall(text)
  assert len(found) == 1, text
  tile_r, rows, tile_c, cols, in_r, in_c, row_t, row_i, col_t, col_i = found[0]
  assert (rows, cols) == ("2", "4"), found  # (a 16 x 32 block)
  assert (row_t, row_i, col_t, col_i) == (tile_r, in_r, tile_c, in_c), found
