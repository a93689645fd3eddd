"""pltpu primitives added in JAX 0.12 (issue 28): ``has_memory_space``, ``conv``,
the MXU staging/FIFO/accumulator primitives."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np  # noqa: F401  (installs interpret="numpy")

needs_has_memory_space = pytest.mark.skipif(
    not hasattr(pltpu, "has_memory_space"), reason="pltpu.has_memory_space is JAX >= 0.12")


@needs_has_memory_space
@pytest.mark.parametrize("space,want", [("HBM", 1.0), ("VMEM", 7.0)])
def test_has_memory_space_of_an_any_ref(space, want):
  """A pl.ANY operand lives in HBM here, as TPU interpret mode places it.
  No JAX oracle: neither interpret=True nor TPU interpret mode can lower
  has_memory_space on CPU ("MLIR translation rule ... not found")."""
  def kernel(x_hbm, o_ref):
    def copy():
      pltpu.sync_copy(x_hbm, o_ref)

    def fill():
      o_ref[...] = jnp.full(o_ref.shape, 7.0, o_ref.dtype)
    jax.lax.cond(pltpu.has_memory_space(x_hbm, getattr(pltpu, space)), copy, fill)
  x = jnp.ones((8, 128), jnp.float32)

  def run(interpret):
    return np.asarray(pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)], interpret=interpret)(x))
  np.testing.assert_array_equal(run("numpy"), np.full(x.shape, want, np.float32))
  with pytest.raises(NotImplementedError, match="has_memory_space"):
    run(pltpu.InterpretParams())  # if this starts to run, make it the oracle


needs_conv = pytest.mark.skipif(not hasattr(pltpu, "conv"), reason="pltpu.conv is JAX >= 0.12")


@needs_conv
@pytest.mark.parametrize("with_acc", [False, True])
def test_conv_nhwc_matches_xla(with_acc):
  """pltpu.conv inside a kernel vs lax.conv_general_dilated compiled by XLA
  outside it (no interpreter runs pltpu.conv: neither interpret=True nor TPU
  interpret mode has a CPU rule for it)."""
  # (NumPy's generator: jax.random compiles an XLA program per shape)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 9, 10, 8), np.float32))
  w = jnp.asarray(np.random.default_rng(1).standard_normal((3, 2, 8, 16), np.float32))
  acc = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 9, 16), np.float32))
  kw = dict(dimension_numbers=("NHWC", "HWIO", "NHWC"), window_strides=(2, 1),
            padding=((1, 1), (0, 1)), rhs_dilation=(1, 2))

  def kernel(x_ref, w_ref, a_ref, o_ref):
    a = a_ref[...] if with_acc else None
    o_ref[...] = pltpu.conv(x_ref[...], w_ref[...], a, **kw)
  got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(acc.shape, jnp.float32),
                       interpret="numpy")(x, w, acc)
  want = jax.lax.conv_general_dilated(x, w, precision=jax.lax.Precision.HIGHEST, **kw)
  if with_acc:
    want = want + acc
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


@needs_conv
def test_grouped_conv_is_unsupported():
  x = jnp.ones((1, 4, 4, 4), jnp.float32)
  w = jnp.ones((1, 1, 2, 4), jnp.float32)

  def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = pltpu.conv(x_ref[...], w_ref[...], dimension_numbers=("NHWC", "HWIO", "NHWC"),
                            feature_group_count=2)
  with pytest.raises(pallas_np.UnsupportedError, match="feature/batch groups"):
    pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1, 4, 4, 4), jnp.float32),
                   interpret="numpy")(x, w)


needs_fifo = pytest.mark.skipif(not hasattr(pltpu, "matmul_lhs_fifo"),
                                reason="the MXU FIFO primitives are JAX >= 0.12")


@pytest.fixture
def chip_with_accumulators():
  """Tracing checks the chip's MXUs: assume a 7x, then the v5e the other tests assume."""
  pallas_np.assume_tpu_chip("7x")
  yield
  pallas_np.assume_tpu_chip("v5e")


@needs_fifo
def test_mxu_fifo_and_accumulator_matmuls(chip_with_accumulators):
  """Explicit MXU programming: a RHS pushed to a staging register, loaded by
  the first matmul and reused by the next; results through the FIFO and
  through an accumulator (pltpu.ACC). No interpreter of JAX runs these on
  CPU: the reference is NumPy's matmul."""
  k = pltpu.get_tpu_info().mxu_column_size
  a = jnp.asarray(np.random.default_rng(0).standard_normal((16, k), np.float32))
  b = jnp.asarray(np.random.default_rng(1).standard_normal((k, k), np.float32))

  def kernel(a_ref, b_ref, f1_ref, f2_ref, acc_out, acc):
    pltpu.matmul_push_rhs(b_ref[...], staging_register=0, mxu_index=0)
    pltpu.matmul_lhs_fifo(a_ref[...], 0, load_staged_rhs=0)
    pltpu.matmul_lhs_fifo(a_ref[...] * 2, 0)  # the same RHS, still loaded
    f1_ref[...] = pltpu.matmul_pop_fifo((16, k), jnp.float32, 0)
    f2_ref[...] = pltpu.matmul_pop_fifo((16, k), jnp.float32, 0)
    pltpu.matmul_push_rhs(b_ref[...], staging_register=1, mxu_index=1, transpose=True)
    pltpu.matmul_acc_lhs(acc, a_ref[...], load_staged_rhs=1)
    pltpu.matmul_acc_lhs(acc, a_ref[...])  # accumulates
    acc_out[...] = pltpu.matmul_pop(acc)
  out = [jax.ShapeDtypeStruct((16, k), jnp.float32)] * 3
  f1, f2, acc = pl.pallas_call(kernel, out_shape=out, interpret="numpy",
                               scratch_shapes=[pltpu.ACC(1)((16, k), jnp.float32)])(a, b)
  an, bn = np.asarray(a), np.asarray(b)
  np.testing.assert_allclose(np.asarray(f1), an @ bn, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(f2), 2 * an @ bn, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(acc), 2 * an @ bn.T, rtol=1e-5, atol=1e-4)


@needs_fifo
def test_popping_an_empty_mxu_fifo_raises(chip_with_accumulators):
  k = pltpu.get_tpu_info().mxu_column_size

  def kernel(o_ref):
    o_ref[...] = pltpu.matmul_pop_fifo((8, k), jnp.float32, 0)
  with pytest.raises(RuntimeError, match="FIFO of MXU 0 is empty"):
    pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, k), jnp.float32),
                   interpret="numpy")()


needs_bitcast_dim = pytest.mark.skipif(
    "dim" not in __import__("inspect").signature(pltpu.bitcast).parameters,
    reason="pltpu.bitcast(dim=) is JAX >= 0.12")


@needs_bitcast_dim
@pytest.mark.parametrize("dim,src,dst", [(-1, jnp.int32, jnp.int16), (-1, jnp.int8, jnp.int32),
                                         (-2, jnp.int32, jnp.int8), (1, jnp.int16, jnp.int32)])
def test_bitcast_along_dim_matches_interpret_mode(dim, src, dst):
  """pltpu.bitcast(x, ty, dim=): dim -1 is ndarray.view, -2 packs
  consecutive rows; oracle: interpret=True (JAX's lowering runs on CPU)."""
  def kernel(x_ref, o_ref):
    o_ref[...] = pltpu.bitcast(x_ref[...], dst, dim=dim)
  x = jnp.asarray(np.random.RandomState(5).randint(-100, 100, size=(4, 8, 16)).astype(src))
  shape = list(x.shape)
  shape[dim] = shape[dim] * np.dtype(src).itemsize // np.dtype(dst).itemsize

  def run(interpret):
    return np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(tuple(shape), dst),
                                     interpret=interpret)(x))
  np.testing.assert_array_equal(run("numpy"), run(True))


needs_pack_elementwise = pytest.mark.skipif(not hasattr(pltpu, "pack_elementwise"),
                                            reason="pltpu.pack_elementwise is JAX >= 0.12")


def pack_reference(xs, bits, to_bits):
  """Python ints: xs[k]'s low ``bits`` bits (``to_bits`` converts) at bit k*bits."""
  out = np.zeros(np.shape(xs[0]), np.int64)
  for idx in np.ndindex(out.shape):
    word = 0
    for k, x in enumerate(xs):
      word |= (to_bits(x[idx]) & ((1 << bits) - 1)) << (k * bits)
    out[idx] = word
  return out


def sign_extend(v, bits):
  return v - (1 << bits) if v >= 1 << (bits - 1) else v


@needs_pack_elementwise
@pytest.mark.parametrize("src,packed,word", [(jnp.int32, jnp.int8, jnp.uint32),
                                             (jnp.int16, jnp.uint8, jnp.uint16),
                                             (jnp.int8, jnp.int4, jnp.uint8),
                                             (jnp.float32, jnp.bfloat16, jnp.uint32)])
def test_pack_and_unpack_elementwise(src, packed, word):
  """pltpu.pack_elementwise / unpack_elementwise, against Python-int
  references written from the tpu.pack_elementwise doc (xs[0] in the lowest
  bits; integers truncated, signed ones sign-extended on unpacking; f32 to
  bf16 rounds to nearest even). No JAX oracle: interpret=True cannot lower
  them (checked below)."""
  from pallas_np.dtypes import bit_width
  bits = bit_width(np.dtype(packed))
  factor = bit_width(np.dtype(src)) // bits
  rng = np.random.RandomState(6)
  if src == jnp.float32:
    xs = [rng.randn(8, 128).astype(np.float32) * 3 for _ in range(factor)]
  else:
    info = np.iinfo(src)
    xs = [rng.randint(info.min, info.max, size=(8, 128)).astype(src) for _ in range(factor)]
  unpacked = src  # as wide as the word

  def kernel(*refs):
    x_refs, (w_ref, u_ref) = refs[:factor], refs[factor:]
    w = pltpu.pack_elementwise([r[...] for r in x_refs], packed_dtype=packed)
    w_ref[...] = w
    for k in range(factor):
      u_ref[k] = pltpu.unpack_elementwise(w, index=k, packed_dtype=packed,
                                          unpacked_dtype=unpacked)
  run = lambda interpret: pl.pallas_call(
      kernel, out_shape=(jax.ShapeDtypeStruct((8, 128), word),
                         jax.ShapeDtypeStruct((factor, 8, 128), unpacked)),
      interpret=interpret)(*xs)
  got_word, got_unpacked = [np.asarray(a) for a in run("numpy")]
  if src == jnp.float32:
    to_bits = lambda v: int(np.array(v, np.float32).astype(jnp.bfloat16).view(np.uint16))
    from_bits = lambda v: float(np.array(v, np.uint16).view(jnp.bfloat16))
  else:
    to_bits = int
    signed = jnp.issubdtype(packed, jnp.signedinteger)
    from_bits = lambda v: sign_extend(v, bits) if signed else v
  want_word = pack_reference(xs, bits, to_bits)
  np.testing.assert_array_equal(got_word.astype(np.int64), want_word)
  for k in range(factor):
    want = np.vectorize(lambda w: from_bits((int(w) >> (k * bits)) & ((1 << bits) - 1)),
                        otypes=[np.float64])(want_word)
    np.testing.assert_array_equal(got_unpacked[k].astype(np.float64), want)
  with pytest.raises(Exception):
    run(True)  # if this starts to run, make it the oracle
