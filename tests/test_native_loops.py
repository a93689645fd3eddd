"""The native tier (pallas_np.native): hot loops compiled with numba.

Each test runs one kernel three ways: with ``native_loops="sync"`` (the
loop compiled at its first run, checked to have run compiled:
``native.stats()``) and ``"off"`` (the NumPy path), compared BIT FOR BIT,
and ``interpret=True`` (JAX): bit for bit for integers and bools, within
``tests.conftest.assert_same``'s tolerance for floats (XLA's CPU backend
contracts ``x * y + z`` into an FMA and flushes denormal results, which the
NumPy rules do not reproduce; the native tier follows the NumPy rules).
A numba compile takes seconds: kernels are small, each test compiles one."""
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from benchmarks.small_kernels import bitonic_fori_kernel as bitonic_kernel
from benchmarks.small_kernels import collatz_kernel
from pallas_np import native

SYNC = pallas_np.InterpretParams(native_loops="sync")
OFF = pallas_np.InterpretParams(native_loops="off")


def _bits(a):
  """The bits of ``a``, every NaN as one NaN: where two NaNs of different
  signs meet (``NaN + -NaN``) the hardware returns the first operand's, and
  LLVM may commute an addition (docs/performance.md, "The native tier")."""
  a = np.asarray(a)
  if a.dtype.kind == "f":
    a = np.where(np.isnan(a), np.array(np.nan, a.dtype), a)
    return a.view(f"uint{a.dtype.itemsize * 8}")
  return a


def three_ways(make, *args):
  """``make(interpret)`` -> the pallas_call'd function: the compiled loop,
  the NumPy path and interpret=True agree bit for bit, and the compiled
  loop ran."""
  before = native.stats()["native_calls"]
  got = make(SYNC)(*args)
  ran = native.stats()["native_calls"] - before
  off = make(OFF)(*args)
  want = make(True)(*args)
  for g, o, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(off),
                     jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(_bits(g), _bits(o))
    if np.asarray(g).dtype.kind == "f":
      g, w = np.asarray(g), np.asarray(w)
      finite = np.isfinite(w) & (np.abs(w) > 1e-30)  # (XLA flushes denormals)
      np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
      np.testing.assert_allclose(g[finite], w[finite], rtol=1e-5)
    else:
      np.testing.assert_array_equal(g, w)
  assert ran > 0, "the compiled loop did not run"
  return got


_rng = np.random.default_rng(7)


def _ints(dt, shape=(8, 128)):
  info = np.iinfo(dt)
  edge = np.array([info.min, info.max, 0, 1, -1 if info.min < 0 else 2, 2, 3, 7,
                   info.min + 1, info.max - 1, 31, 32, 33, 8, 100, 255], np.int64)
  v = _rng.integers(info.min, int(info.max) + 1, size=shape, dtype=np.int64)
  v.flat[:edge.size * 4] = np.tile(edge, 4).astype(dt).astype(np.int64)
  small = _rng.integers(-40 if info.min < 0 else 0, 40, size=shape)
  v[::3] = small[::3]  # small values: shift amounts, divisors, equal pairs
  return jnp.asarray(v.astype(dt))


# -- elementwise families ------------------------------------------------------------
def _int_ops(x, y):
  dt = x.dtype
  return [x + y, x - y, x * y, lax.div(x, y), lax.rem(x, y), -x, jnp.abs(x), lax.sign(x),
          jnp.maximum(x, y), jnp.minimum(x, y), x & y, x | y, x ^ y, ~x,
          lax.shift_left(x, y), lax.shift_right_logical(x, y),
          lax.shift_right_arithmetic(x, y), jnp.where(x < y, x, y),
          (x == y).astype(dt), (x != y).astype(dt), (x <= y).astype(dt), (x > y).astype(dt),
          x.astype(jnp.int8).astype(dt), x.astype(jnp.uint16).astype(dt),
          x.astype(jnp.float32).astype(dt), jnp.floor_divide(x, y), jnp.remainder(x, y),
          x // 3, x % 5, jnp.clip(x, -7, 9).astype(dt), x * x,
          ((x > 0) & (y > 0)).astype(dt), ((x > 0) ^ (y > 0)).astype(dt)]


N_INT_OPS = len(_int_ops(jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32)))


def _elementwise_kernel(ops, x_ref, y_ref, o_ref):
  def body(i, carry):
    x, y = carry
    for k, v in enumerate(ops(x, y)):
      o_ref[k] = v
    return y, x  # two trips: each operand order
  lax.fori_loop(0, 2, body, (x_ref[...], y_ref[...]))


def _elementwise_call(ops, n_ops, dt, interpret, shape=(8, 128)):
  return pl.pallas_call(functools.partial(_elementwise_kernel, ops),
                        out_shape=jax.ShapeDtypeStruct((n_ops, *shape), dt),
                        interpret=interpret)


def _int_core_ops(x, y):
  """The integer semantics most easily got wrong (CI; every op: slow)."""
  dt = x.dtype
  return [x * y + x, lax.div(x, y), lax.rem(x, y), -x, lax.shift_left(x, y),
          lax.shift_right_logical(x, y), lax.shift_right_arithmetic(x, y),
          jnp.maximum(x, y), x.astype(jnp.int8).astype(dt)]


N_INT_CORE = 9


@pytest.mark.parametrize("dt", [jnp.int32, jnp.uint8])
def test_integer_core_ops_bit_exact(dt):
  """Wraparound, XLA's division/remainder (by zero, INT_MIN/-1), shifts by
  >= the width and by negative amounts, unsigned types, casts."""
  x, y = _ints(np.dtype(dt), (2, 128)), _ints(np.dtype(dt), (2, 128))
  three_ways(functools.partial(_elementwise_call, _int_core_ops, N_INT_CORE, dt, shape=(2, 128)),
             x, y)


@pytest.mark.slow
@pytest.mark.parametrize("dt", [jnp.int32, jnp.uint32, jnp.int8])
def test_integer_ops_bit_exact(dt):
  """Every integer op of the table (a long numba compile)."""
  x, y = _ints(np.dtype(dt)), _ints(np.dtype(dt))
  three_ways(functools.partial(_elementwise_call, _int_ops, N_INT_OPS, dt), x, y)


def _float_ops(x, y):
  i32 = jnp.int32
  return [x + y, x - y, x * y, x / y, lax.rem(x, y), -x, jnp.abs(x), lax.sign(x),
          jnp.maximum(x, y), jnp.minimum(x, y), jnp.sqrt(x), jnp.floor(x), jnp.ceil(x),
          jnp.where(x < y, x, y), jnp.where(x == y, 1.0, 0.0).astype(x.dtype),
          (x != y).astype(x.dtype), (x >= y).astype(x.dtype), jnp.isfinite(x).astype(x.dtype),
          x.astype(i32).astype(x.dtype), lax.bitcast_convert_type(x.astype(i32), jnp.float32)
          if False else x.astype(jnp.uint8).astype(x.dtype), x.astype(jnp.bool_).astype(x.dtype),
          (x * 1e-38).astype(jnp.bool_).astype(x.dtype), x * x]


N_FLOAT_OPS = len(_float_ops(jnp.zeros(2, jnp.float32), jnp.zeros(2, jnp.float32)))


def _floats(shape=(8, 128)):
  edge = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30,
                   3.4e38, -3.4e38, 2.5, -2.5, 0.5, 2147483648.0, -2147483904.0, 255.9, 300.0],
                  np.float32)
  v = (_rng.standard_normal(shape) * 100).astype(np.float32)
  v.flat[:edge.size * 8 // (1 if v.size > 300 else 4)] = np.repeat(edge, 8 if v.size > 300 else 2)
  return jnp.asarray(v)


def _float_core_ops(x, y):
  return [x * y + x, x / y, jnp.maximum(x, y), jnp.minimum(x, y), lax.sign(x),
          x.astype(jnp.int32).astype(x.dtype), (x * 1e-38).astype(jnp.bool_).astype(x.dtype),
          jnp.where(x < y, x, jnp.sqrt(y))]


def test_float32_core_ops_bit_exact():
  """float32 stays float32 (no double rounding, no FMA); NaN in
  comparisons and max/min, -0.0 < +0.0; np.sign's zeros; float->int
  saturation, NaN -> 0; float32->bool reads denormals as zero."""
  x = _floats((2, 128))
  y = jnp.asarray(np.roll(np.asarray(x), 3, axis=1))  # edge values meet each other
  three_ways(functools.partial(_elementwise_call, _float_core_ops, 8, jnp.float32,
                               shape=(2, 128)), x, y)


@pytest.mark.slow
def test_float32_ops_bit_exact():
  """Every float op of the table (a long numba compile)."""
  x = _floats()
  y = jnp.asarray(np.roll(np.asarray(x), 3, axis=1))
  three_ways(functools.partial(_elementwise_call, _float_ops, N_FLOAT_OPS, jnp.float32), x, y)


# -- the loop kernels of benchmarks/small_kernels.py: shapes, reductions, refs ------------
def test_while_loop_collatz():
  """A data-dependent while_loop (reduce_or condition, jnp's floor_divide
  and remainder, broadcasts, selects)."""
  x = jnp.asarray(_rng.integers(1, 60, (2, 128)), jnp.int32)
  three_ways(lambda interp: pl.pallas_call(
      collatz_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interp), x)


@pytest.mark.parametrize("vectorize", [None, False])
def test_nested_fori_bitonic(vectorize):
  """Nested loops (a while inside a scan), jnp.roll (concatenate,
  dynamic_slice), iota; float max/min with NaN and -0.0; the vectorized
  grid (each lane runs the compiled loop) and the sequential one."""
  x = _floats((16, 32))
  spec = pl.BlockSpec((8, 32), lambda i: (i, 0))

  def make(interp):
    if interp is not True:
      interp = pallas_np.InterpretParams(native_loops=interp.native_loops, vectorize=vectorize)
    return pl.pallas_call(bitonic_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(2,), in_specs=[spec], out_specs=spec, interpret=interp)
  three_ways(make, x)


def cumsum_kernel(x_ref, o_ref):
  def body(r, acc):
    acc = acc + x_ref[pl.ds(r, 1), :]
    o_ref[pl.ds(r, 1), :] = acc
    o_ref[pl.ds(r, 1), pl.ds(0, 8)] += acc[:, 8:16]
    return acc
  lax.fori_loop(0, x_ref.shape[0], body, jnp.zeros((1, x_ref.shape[1]), jnp.float32))


def _cumsum_call(interp, x, bounds_check="raise", rows=None):
  if interp is not True:
    interp = pallas_np.InterpretParams(native_loops=interp.native_loops,
                                       bounds_check=bounds_check)
  return pl.pallas_call(cumsum_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        interpret=interp)


def test_ref_reads_and_writes_in_loop():
  """get/swap/addupdate with a dynamic pl.ds start in a compiled loop."""
  x = _floats((16, 128))
  three_ways(lambda interp: _cumsum_call(interp, x), x)


def oob_kernel(x_ref, o_ref):
  def body(i, acc):
    return acc + x_ref[pl.ds(i * 3, 2), :]
  o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros((2, 128), jnp.float32))


def _oob_call(interp, x):
  return pl.pallas_call(oob_kernel, out_shape=jax.ShapeDtypeStruct((2, 128), x.dtype),
                        interpret=interp)


def test_out_of_bounds_index_raises_the_numpy_error():
  """A dynamic pl.ds past the ref's end in a compiled loop raises the NumPy
  path's IndexError (same message: primitive, kernel line, what JAX does)."""
  x = _floats((8, 128))
  messages = []
  for mode in ("sync", "off"):
    before = native.stats()["compiled"]
    with pytest.raises(IndexError) as info:
      _oob_call(pallas_np.InterpretParams(native_loops=mode), x)(x)
    messages.append(str(info.value))
    if mode == "sync":
      assert native.stats()["compiled"] > before
  assert messages[0] == messages[1]
  assert "get" in messages[0] and "test_native_loops.py" in messages[0]


def test_out_of_bounds_clamped_like_jax():
  """bounds_check="clamp" clamps the start as interpret=True does."""
  x = _floats((8, 128))
  x = jnp.round(x)  # (sums of integers: exact in any order)
  got = _oob_call(pallas_np.InterpretParams(native_loops="sync", bounds_check="clamp"), x)(x)
  off = _oob_call(pallas_np.InterpretParams(native_loops="off", bounds_check="clamp"), x)(x)
  want = _oob_call(True, x)(x)
  np.testing.assert_array_equal(_bits(got), _bits(off))
  np.testing.assert_array_equal(_bits(got), _bits(want))


def exp_kernel(x_ref, o_ref):
  o_ref[...] = lax.fori_loop(0, 3, lambda i, x: jnp.sin(x) * 0.5, x_ref[...])


@pytest.mark.parametrize("dt", [jnp.float32, jnp.bfloat16])
def test_refused_loops_run_on_numpy(dt):
  """A transcendental computed by the C library (sin) or a bf16 loop is not compiled:
  it runs on the NumPy path, with its results."""
  x = _floats((2, 128)).astype(dt)
  x = jnp.where(jnp.isfinite(x), x / 1000, 0).astype(dt)
  before = native.stats()
  make = lambda interp: pl.pallas_call(exp_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, dt),
                                       interpret=interp)
  got = make(SYNC)(x)
  after = native.stats()
  assert after["refused"] == before["refused"] + 1
  assert after["native_calls"] == before["native_calls"]
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(make(OFF)(x), np.float32))


def test_loops_over_the_line_cap_run_on_numpy(monkeypatch):
  """A loop whose generated source is longer than ``codegen.MAX_LINES`` (its
  compile would take minutes) is refused: it keeps the NumPy path's
  results. The Collatz loop is ~70 lines; a cap of 20 refuses it."""
  from pallas_np.native import codegen
  monkeypatch.setattr(codegen, "MAX_LINES", 20)
  x = jnp.asarray(_rng.integers(1, 60, (2, 128)), jnp.int32)
  make = lambda interp: pl.pallas_call(
      collatz_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interp)
  pallas_np.clear_caches()  # (no plan an earlier test compiled, whatever its params)
  before = native.stats()
  got = make(pallas_np.InterpretParams(native_loops="sync", uninitialized="zero"))(x)
  after = native.stats()
  assert after["refused"] == before["refused"] + 1
  assert after["native_calls"] == before["native_calls"]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(make(True)(x)))


def test_under_jit():
  x = jnp.asarray(_rng.integers(1, 60, (2, 128)), jnp.int32)
  three_ways(lambda interp: jax.jit(pl.pallas_call(
      collatz_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interp)), x)


def test_numba_not_imported_by_import_or_first_call():
  """numba is imported only when a hot loop compiles: not by ``import
  pallas_np``, nor by the first call of a loop kernel (default mode)."""
  code = (
      "import sys, jax, jax.numpy as jnp\n"
      "from jax.experimental import pallas as pl\n"
      "import pallas_np\n"
      "assert 'numba' not in sys.modules\n"
      "from benchmarks.small_kernels import collatz_kernel\n"
      "x = jnp.full((2, 128), 7, jnp.int32)\n"
      "pl.pallas_call(collatz_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),\n"
      "               interpret='numpy')(x)\n"
      "assert 'numba' not in sys.modules\n"
      "print('ok')\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={**__import__("os").environ,
                                         "PALLAS_NP_CHECK_AVALS": "0"})
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().endswith("ok")


def shapes_kernel(x_ref, o_ref, s_ref):
  def body(i, carry):
    x, total = carry
    t = x.T                                               # transpose
    r = lax.rev(x, (1,))                                  # rev
    s = lax.slice(x, (0, 1), (8, 8), (2, 3))              # strided slice
    u = lax.dynamic_update_slice(x, s[:, :2] * 3, (i * 3, i * 5))  # clamped starts
    d = lax.dynamic_slice(x, (i - 1, 2 * i), (4, 4))      # clamped (negative) starts
    b = jnp.broadcast_to(x[:, :1], (8, 8)) + jnp.broadcast_to(x[:1, :], (8, 8))
    sums = jnp.sum(x, axis=0) + jnp.max(x, axis=1) - jnp.min(x, axis=0)
    y = lax.cond(i % 2 == 0, lambda v: v + r, lambda v: v - t, x)   # cond
    flag = jnp.any(x > 1000) | jnp.all(x < 5000)
    total = total + jnp.sum(x) + flag.astype(jnp.int32)
    x = y + u - b + jnp.tile(d, (2, 2)) + sums[None, :] + jnp.tile(jnp.concatenate([s[:, 1:], s[:, :1]], 1)[:, :1], (2, 8))
    return x % 1000, total
  x, total = lax.fori_loop(0, 4, body, (x_ref[...], jnp.int32(0)))
  o_ref[...] = x
  s_ref[0] = total


def test_shape_ops_reductions_and_cond():
  """transpose, rev, strided slice, dynamic_update_slice/dynamic_slice
  (XLA's start clamping), broadcasts, integer sum/max/min reductions,
  any/all, cond, concatenate, a scalar carry and a scalar ref store."""
  x = jnp.asarray(_rng.integers(-500, 500, (8, 8)), jnp.int32)
  three_ways(lambda interp: pl.pallas_call(
      shapes_kernel, out_shape=(jax.ShapeDtypeStruct((8, 8), jnp.int32),
                                jax.ShapeDtypeStruct((1,), jnp.int32)),
      interpret=interp), x)


def transcendental_kernel(x_ref, o_ref):
  def body(i, x):
    e = jnp.exp(x * 0.5 - 1.0)
    l = jnp.log(jnp.abs(x) + 0.25)
    t = jnp.tanh(x * 3.0)
    return jnp.where(i % 2 == 0, e - l + t, t * 2.0 - e * 0.125)
  o_ref[...] = lax.fori_loop(0, 3, body, x_ref[...])


def test_exp_log_tanh_bit_exact():
  """float32 exp/log/tanh: XLA's formulas, the same IR on both paths
  (native/transcendental.py), edge values included (0, denormals, huge,
  NaN)."""
  x = _rng.standard_normal((8, 128)).astype(np.float32) * 4
  x.flat[:12] = [0.0, -0.0, 1e-40, -1e-40, 88.0, -104.0, 1e30, -1e30, 3e38, -3e38,
                 np.nan, 3e-8]
  three_ways(lambda interp: pl.pallas_call(
      transcendental_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      interpret=interp), jnp.asarray(x))


def broadcast_to_kernel(x_ref, o_ref):
  """``state.primitives.broadcast_to`` (what Triton-style kernels emit):
  right-aligned, from a row, a column and a scalar."""
  from pallas_np import _compat as jc  # (the primitive is internal to JAX)
  bt = jc.state_primitives.broadcast_to

  def body(i, x):
    row = bt(x[0], (8, 128))                  # (128,) -> (8, 128)
    col = bt(x[:, :1], (8, 128))              # (8, 1) -> (8, 128)
    s = bt(x[1, 2] * 0 + i, (8, 128))         # scalar -> (8, 128)
    return row * 3 + col - s
  o_ref[...] = lax.fori_loop(0, 3, body, x_ref[...])


def test_state_broadcast_to():
  x = jnp.asarray(_rng.integers(-50, 50, (8, 128)), jnp.int32)
  three_ways(lambda interp: pl.pallas_call(
      broadcast_to_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      interpret=interp), x)


def int_dot_kernel(a_ref, b_ref, c_ref, o_ref, w_ref):
  """Integer dot_generals in a loop: int8 x int8 -> int32, int32 x int32
  wrapping (a transposed contraction), a batched one, uint8 -> uint32."""
  def body(i, acc):
    a, b = a_ref[...], b_ref[...]
    p = jnp.dot(a, b, preferred_element_type=jnp.int32)                   # (16, 8)
    big = c_ref[...] * (i + 7919)
    q = lax.dot_general(big, big, (((1,), (1,)), ((), ())))                # (16, 16) wraps
    r = lax.dot_general(a.reshape(2, 8, 32), jnp.concatenate([b[None], (b * 3)[None]]),
                        (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.int32)
    u = jnp.dot(a.astype(jnp.uint8), b.astype(jnp.uint8), preferred_element_type=jnp.uint32)
    return acc + p + q[:, :8] + r.reshape(16, 8) + u.astype(jnp.int32)
  o_ref[...] = lax.fori_loop(0, 2, body, jnp.zeros((16, 8), jnp.int32))
  w_ref[...] = jnp.zeros_like(w_ref)


def test_integer_dot_general_bit_exact():
  a = jnp.asarray(_rng.integers(-128, 128, (16, 32)), jnp.int8)
  b = jnp.asarray(_rng.integers(-128, 128, (32, 8)), jnp.int8)
  c = jnp.asarray(_rng.integers(-2**31, 2**31, (16, 24), dtype=np.int64).astype(np.int32))
  three_ways(lambda interp: pl.pallas_call(
      int_dot_kernel, out_shape=(jax.ShapeDtypeStruct((16, 8), jnp.int32),
                                 jax.ShapeDtypeStruct((1,), jnp.int32)),
      interpret=interp), a, b, c)


def _row_kernel(s_ref, x_ref, o_ref):
  """Rows read from a start the data gives: in bounds or not by input."""
  start = s_ref[0, 0]

  def body(i, acc):
    return acc + x_ref[pl.ds(start + i, 1), :]
  o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros((1, 128), jnp.int32))


def test_one_status_array_per_loop_fresh_after_an_error(monkeypatch):
  """A compiled loop without DMA call sites reuses its status array across
  calls (no fresh copy a call); after a bounds-check error it takes a new
  one, and the next calls give the NumPy path's bits again."""
  from pallas_np.native import tier
  x = jnp.asarray(_rng.integers(-99, 99, (8, 128)), jnp.int32)

  def make(interp):
    return pl.pallas_call(_row_kernel, out_shape=jax.ShapeDtypeStruct((1, 128), jnp.int32),
                          interpret=interp)
  fn, off = make(SYNC), make(OFF)
  ok, bad = jnp.full((1, 1), 2, jnp.int32), jnp.full((1, 1), 6, jnp.int32)
  np.testing.assert_array_equal(np.asarray(fn(ok, x)), np.asarray(off(ok, x)))  # (built)
  made = []
  real = tier.NativeLoop.new_status  # (blas_calls.status where the loop reads addresses)
  monkeypatch.setattr(tier.NativeLoop, "new_status", lambda self: made.append(1) or real(self))
  before = native.stats()["native_calls"]
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(fn(ok, x)), np.asarray(off(ok, x)))
  assert native.stats()["native_calls"] - before == 3 and not made
  with pytest.raises(IndexError):
    fn(bad, x)
  assert made  # (a fresh status array for the next call)
  for s in (ok, jnp.full((1, 1), 4, jnp.int32)):
    np.testing.assert_array_equal(np.asarray(fn(s, x)), np.asarray(off(s, x)))


def _window_sum(x_ref, o_ref):
  """Rows of a fixed-size window of a ref whose width is not in the loop's
  source: the same generated text for (64, 40) and (64, 48) refs."""
  def body(i, acc):
    return acc + x_ref[pl.ds(i * 8, 8), pl.ds(0, 32)] * (i + 1).astype(jnp.float32)
  o_ref[...] = lax.fori_loop(0, 8, body, jnp.zeros((8, 32), jnp.float32))


@pytest.mark.parametrize("widths", [(40, 48), (48, 40)])
def test_one_source_on_refs_of_two_shapes(widths):
  """A loop whose source does not change with its ref's width, run on two
  widths in one process: each gets a library of its own (lite compiles the
  operands' static shapes in; one library keyed by the source alone read
  the second ref with the first one's row stride: a wrong answer)."""
  rng = np.random.default_rng(sum(widths) + widths[0])
  for width in widths:
    x = jnp.asarray(rng.standard_normal((64, width)), jnp.float32)

    def make(interp):
      return pl.pallas_call(_window_sum, out_shape=jax.ShapeDtypeStruct((8, 32), jnp.float32),
                            interpret=interp)
    before = native.stats()["native_calls"]
    got = make(SYNC)(x)
    assert native.stats()["native_calls"] > before
    np.testing.assert_array_equal(_bits(got), _bits(make(OFF)(x)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(make(True)(x)), rtol=1e-6, atol=1e-6)
