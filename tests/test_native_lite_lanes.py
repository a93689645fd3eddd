"""lite compiles the lane loop of a vectorized pass (native/lanes.py): an
operand's ``.shape`` (its lane count read from the array struct), the
lane's sub-array view (``a[i]`` of an N-d array: pointer and stride
arithmetic), ``np.empty`` of a run-time size (the arena grown and the call
run again where it is too small), results whose sizes are known only at
run time, and ``.copy()`` inside a ``for`` of unknown trip count (each
iteration's copies in the same part of the arena). Each form: the kernels
through the tier bit for bit against ``off`` and interpret=True (and the
out-of-bounds IndexError of a lane), and snippets against numba's own
compile of the same text, with the stats showing lite built the loop."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from benchmarks.small_kernels import bitonic_fori_kernel
from pallas_np import native
from pallas_np.native import codegen, lite, lite_jit
from tests.native_elig_util import bits
from tests.test_native_lite import lite_only  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(not lite_jit.available(), reason="llvmlite is not installed")
_rng = np.random.default_rng(4142)


def _params(mode, vectorize=None):
  return pallas_np.InterpretParams(native_loops=mode, vectorize=vectorize)


def _lite_built(before):
  after = native.stats()
  assert after["lite"] > before["lite"], "lite did not build the lane loop"
  assert after["lite_refused"] == before["lite_refused"], "lite refused the lane loop"


def _bitonic(interp, x, rows=8):
  spec = pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))
  return pl.pallas_call(bitonic_fori_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(x.shape[0] // rows,), in_specs=[spec], out_specs=spec,
                        interpret=interp)


@pytest.mark.parametrize("rows", [32, 48])
def test_bitonic_lane_loop_built_by_lite(lite_only, rows):  # noqa: F811
  """bitonic_fori's vectorized pass: lite (not numba) builds its lane
  loop; bits of off (vectorized or not) and interpret=True's sort."""
  x = _rng.standard_normal((rows, 128)).astype(np.float32)
  x.reshape(-1)[:6] = [np.nan, -0.0, 0.0, np.inf, -np.inf, -np.nan]
  x = jnp.asarray(x)
  before = native.stats()
  fn = _bitonic(_params("sync"), x)
  got = [np.asarray(fn(x)) for _ in range(3)]
  _lite_built(before)
  assert native.stats()["native_calls"] - before["native_calls"] >= rows // 8
  want = [np.asarray(_bitonic(_params("off"), x)(x)), np.asarray(_bitonic(_params("off", False), x)(x)),
          np.asarray(_bitonic(True, x)(x))]
  for g in got:
    for w in want:
      np.testing.assert_array_equal(bits(g), bits(w))


def _lane_loop_kernel(x_ref, n_ref, o_ref):
  """Per-lane and shared operands, ref reads at a dynamic row. (The same
  body as test_native_lanes' kernel, written here on purpose: its source
  lines make its own plan, so this file's lite build is not a plan the
  other file's run already holds a compiled loop in.)"""
  pid = pl.program_id(0)

  def body(i, c):
    acc, cnt = c
    row = lax.rem(i + pid, 8)
    return acc * 0.5 + x_ref[pl.ds(row, 1), :] * n_ref[...], cnt + i
  acc, cnt = lax.fori_loop(0, 5, body, (jnp.zeros((1, 128), jnp.float32), jnp.int32(0)))
  o_ref[...] = jnp.broadcast_to(acc + cnt.astype(jnp.float32), o_ref.shape)


def test_lane_stacked_refs_and_scalars_by_lite(lite_only):  # noqa: F811
  x = jnp.asarray(_rng.standard_normal((32, 128)).astype(np.float32))
  n = jnp.asarray(_rng.standard_normal((4, 128)).astype(np.float32))

  def make(interp):
    return pl.pallas_call(
        _lane_loop_kernel, out_shape=jax.ShapeDtypeStruct((32, 128), jnp.float32), grid=(4,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0)),
                  pl.BlockSpec((1, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), interpret=interp)
  before = native.stats()
  got = [np.asarray(make(_params("sync"))(x, n)) for _ in range(2)]
  _lite_built(before)
  want = np.asarray(make(_params("off"))(x, n))
  for g in got:
    np.testing.assert_array_equal(bits(g), bits(want))
  np.testing.assert_allclose(got[0], np.asarray(make(True)(x, n)), rtol=1e-5, atol=1e-5)


def _oob_lane_kernel(x_ref, o_ref):
  """Lanes 2 and 3 read rows 7..8 of 8 at the last iteration."""
  late = (pl.program_id(0) >= 2).astype(jnp.int32)

  def body(i, acc):
    return acc + x_ref[pl.ds(i * 2 + late, 2), :]
  o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros((2, 128), jnp.float32))


def test_out_of_bounds_lane_by_lite(lite_only):  # noqa: F811
  """A bounds check failing in lane 2 (read through the lane's view):
  the NumPy path's IndexError with that lane's values."""
  x = jnp.asarray(_rng.standard_normal((32, 128)).astype(np.float32))

  def make(interp):
    return pl.pallas_call(
        _oob_lane_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), grid=(4,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((2, 128), lambda i: (i, 0)), interpret=interp)
  before = native.stats()
  messages = []
  for mode in ("sync", "sync", "off"):
    with pytest.raises(IndexError) as info:
      make(_params(mode))(x)
    messages.append(str(info.value))
  _lite_built(before)
  assert messages[0] == messages[1] == messages[2]
  assert "7" in messages[0]


# -- the forms, lite against numba's own compile of the same text ---------------------------------
_ARR = ("a", np.dtype(np.int64), (0, 3), True)  # (a lane-stacked operand: its lane count unknown)
_SNIPPETS = {
    # a.shape[k], a view a[i] (negative: from the end), np.empty of a run-time size returned
    "lanes": ("    n = a0.shape[0]\n    o = np.empty(n * 3, np.int64)\n"
              "    for i in range(n):\n        row = a0[i]\n        prev = a0[i - 1]\n"
              "        for c in range(3):\n            o[i * 3 + c] = row[c] * 10 + prev[-1 - c] + a0.shape[-1]\n"
              "    return (0, o, a1 + n)"),
    # .copy() in a loop of a run-time trip count, a run-time sized buffer read back
    "copies": ("    n = a0.shape[0]\n    t = np.empty(n, np.int64)\n    s = 0\n"
               "    for i in range(n):\n        r = a0[i]\n        c = r.copy()\n"
               "        for k in range(3):\n            c[k] = c[k] * 2 + a1\n"
               "        t[i] = c[0] + c[1] * 3 + c[2] * 7\n        s = s + c[1]\n"
               "    return (0, t, s)"),
    # an index past the end raises (the generated code's check) from inside the view loop
    "raise": ("    n = a0.shape[0]\n    o = np.empty(n, np.int64)\n"
              "    for i in range(n):\n        row = a0[i]\n        if a1 >= 3:\n"
              "            raise IndexError('past the end')\n        o[i] = row[a1]\n"
              "    return (0, o, a1)"),
}


class _Src:
  globals, externals = {}, {}


def _lite_fn(text, outs, contiguous=True):
  src = _Src()
  src.text, src.outs = text, outs
  arr = (*_ARR[:3], contiguous)
  ir_text, meta, consts = lite.translate(src, [arr, ("s", np.dtype(np.int64), (), True)])
  return lite_jit.make_callable(lite_jit.compile_ir(ir_text, {}), meta, consts)


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("name", sorted(_SNIPPETS))
def test_lane_forms_match_numba(name, contiguous):
  if name == "copies" and not contiguous:
    with pytest.raises(codegen.Refused, match="strided"):  # (.copy() of a strided view)
      _lite_fn(f"def native_loop(_st, a0, a1):\n{_SNIPPETS[name]}\n",
               [("a", np.dtype(np.int64)), ("s", np.dtype(np.int64))], contiguous)
    return
  """Each form on arrays of 0..9 lanes (the arena grown and the call run
  again where it is too small, in either order of sizes), C-contiguous or
  strided (views through the byte strides): the types and bits of numba's
  compile of the same text, its IndexError."""
  numba = pytest.importorskip("numba")
  text = f"def native_loop(_st, a0, a1):\n{_SNIPPETS[name]}\n"
  scope = {"np": np}
  exec(text, scope)  # noqa: S102
  nb = numba.njit(error_model="numpy")(scope["native_loop"])
  fn = _lite_fn(text, [("a", np.dtype(np.int64)), ("s", np.dtype(np.int64))], contiguous)
  for lanes_ in (0, 1, 9, 2, 5):
    a0 = _rng.integers(-2**40, 2**40, (lanes_, 3) if contiguous else (lanes_ * 2, 7))
    if not contiguous:  # (rows and columns strided)
      a0 = a0[::2, 1::2]
    for a1 in (0, 2, 3, -5):
      st = np.zeros(8, np.int64)
      try:
        want = nb(st, a0, np.int64(a1))
      except IndexError:
        with pytest.raises(IndexError):
          fn(np.zeros(8, np.int64), a0, np.int64(a1))
        continue
      got = fn(np.zeros(8, np.int64), a0, np.int64(a1))
      for g, w in zip(got[1:], want[1:]):
        assert np.asarray(g).dtype == np.asarray(w).dtype, (name, lanes_, a1)
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), (name, lanes_, a1, g, w)


def test_negative_run_time_size_raises_numbas_error():
  fn = _lite_fn("def native_loop(_st, a0, a1):\n    o = np.empty(a1, np.int64)\n"
                "    for i in range(a1):\n        o[i] = a0[0, 0]\n    return (0, o, a1)\n",
                [("a", np.dtype(np.int64)), ("s", np.dtype(np.int64))])
  a0 = np.arange(6).reshape(2, 3)
  np.testing.assert_array_equal(fn(np.zeros(8, np.int64), a0, np.int64(4))[1], [0] * 4)
  with pytest.raises(ValueError, match="negative dimensions"):
    fn(np.zeros(8, np.int64), a0, np.int64(-1))


@pytest.mark.parametrize("body", [
    # a copy of one iteration read in the next (its part of the arena is reused)
    "    c = a0[0].copy()\n    for i in range(a1):\n        d = c\n        c = a0[i].copy()\n"
    "        d[0] = 1\n    return (0, c, a1)",
    # a run-time sized buffer after a store to an operand (the call may run again)
    "    a0[0, 0] = 1\n    o = np.empty(a1, np.int64)\n    return (0, o, a1)",
    # ... or inside a branch
    "    if a1 > 0:\n        o = np.empty(a1, np.int64)\n    else:\n        o = np.empty(a1 + 1, np.int64)\n"
    "    return (0, o, a1)",
    # an element store of a row (numba broadcasts it), .shape of the status array other than
    # the prologues' _st.shape[0] (lite_headers)
    "    a0[0] = 1\n    return (0, a0[0].copy(), a1)",
    "    return (0, a0[0].copy(), _st.shape[1])",
    # .copy() of an array of a run-time shape
    "    c = a0.copy()\n    return (0, a0[0].copy(), c[1, 0])",
])
def test_lane_forms_outside_the_subset_are_refused(body):
  with pytest.raises(codegen.Refused):
    _lite_fn(f"def native_loop(_st, a0, a1):\n{body}\n",
             [("a", np.dtype(np.int64)), ("s", np.dtype(np.int64))])


# -- a kernel body's scratch arrays and their constant slices ----------------------------------------
@pytest.mark.parametrize("name", ["rsqrt", "masked"])
def test_kernel_body_with_scratch_built_by_lite(lite_only, name):  # noqa: F811
  """A compiled kernel body takes its buffers as constant slices of
  scratch arrays (``codegen.finish``): lite builds it; the bits of off and
  interpret=True's values (test_native_bodies' kernels)."""
  from tests import test_native_bodies as tb
  x = np.abs(_rng.standard_normal((8, 128)).astype(np.float32)) * 100
  x.reshape(-1)[:6] = [0.0, -0.0, -1.0, np.inf, np.nan, 1e-30]
  before = native.stats()
  if name == "rsqrt":
    x = jnp.asarray(x)
    make = lambda interp: pl.pallas_call(
        tb._rsqrt_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interp)
    tb.compiled_body_equals_numpy(make, x, steps=1)
  else:
    x = jnp.asarray(x[0, :50])
    import functools
    make = lambda interp: pl.pallas_call(
        functools.partial(tb._masked_kernel, n=50), out_shape=jax.ShapeDtypeStruct((50,), x.dtype),
        interpret=interp)
    tb.compiled_body_equals_numpy(make, x, steps=1)
  _lite_built(before)


def test_kernel_body_out_of_bounds_by_lite(lite_only):  # noqa: F811
  """A body built by lite reading a ref past its end: the NumPy plan's
  IndexError."""
  from tests import test_native_bodies as tb
  x = jnp.asarray(_rng.standard_normal((32, 128)).astype(np.float32))
  before = native.stats()
  tb.compiled_body_equals_numpy(tb._gather_call, jnp.asarray([8], jnp.int32), x, steps=1)
  _lite_built(before)
  bad = jnp.asarray([30], jnp.int32)
  with pytest.raises(IndexError) as native_error:
    tb._gather_call(tb.SYNC)(bad, x)
  with pytest.raises(IndexError) as numpy_error:
    tb._gather_call(tb.OFF)(bad, x)
  assert str(native_error.value) == str(numpy_error.value)


def test_constant_slices_match_numba():
  """``a[lo:hi]`` of a 1-d operand and of an arena buffer, written and
  returned: numba's bits; bounds past the array are refused."""
  numba = pytest.importorskip("numba")
  text = ("def native_loop(_st, a0, a1):\n    v = a0[2:7]\n    w = np.empty(8, np.int64)\n"
          "    u = w[1:6]\n    for i in range(5):\n        u[i] = v[i] * a1 + v[-1 - i]\n"
          "    return (0, w[1:6].copy(), u[4])\n")
  scope = {"np": np}
  exec(text, scope)  # noqa: S102
  nb = numba.njit(error_model="numpy")(scope["native_loop"])
  src = _Src()
  src.text, src.outs = text, [("a", np.dtype(np.int64)), ("s", np.dtype(np.int64))]
  arr = ("a", np.dtype(np.int64), (9,), True)
  ir_text, meta, consts = lite.translate(src, [arr, ("s", np.dtype(np.int64), (), True)])
  fn = lite_jit.make_callable(lite_jit.compile_ir(ir_text, {}), meta, consts)
  a0 = _rng.integers(-2**40, 2**40, 9)
  for a1 in (0, 3, -7):
    want, got = nb(np.zeros(8, np.int64), a0, np.int64(a1)), fn(np.zeros(8, np.int64), a0, np.int64(a1))
    for g, w in zip(got[1:], want[1:]):
      assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
  src.text = text.replace("a0[2:7]", "a0[2:10]")
  with pytest.raises(codegen.Refused):
    lite.translate(src, [arr, ("s", np.dtype(np.int64), (), True)])


def test_a_copy_keeps_its_rank():
  """``.copy()`` of a 2-d array is 2-d (numba's): ``c[1]`` is a row there,
  so lite refuses it as a scalar; ``c[1, 2]`` is the element."""
  src = _Src()
  src.outs = [("s", np.dtype(np.int64))]
  arr = ("a", np.dtype(np.int64), (2, 3), True)
  src.text = "def native_loop(_st, a0):\n    c = a0.copy()\n    return (0, c[1])\n"
  with pytest.raises(codegen.Refused):
    lite.translate(src, [arr])
  src.text = "def native_loop(_st, a0):\n    c = a0.copy()\n    a0[1, 2] = 0\n    return (0, c[1, 2])\n"
  ir_text, meta, consts = lite.translate(src, [arr])
  fn = lite_jit.make_callable(lite_jit.compile_ir(ir_text, {}), meta, consts)
  a0 = np.arange(6).reshape(2, 3)
  assert fn(np.zeros(8, np.int64), a0)[1] == 5 and a0[1, 2] == 0


def test_same_size_view_matches_numba():
  """``x.view(np.uint32)`` of float32 buffers (the bfloat16 rounding's
  form, native/narrow.py), read and written through: numba's bits; a view
  of another item size is refused."""
  numba = pytest.importorskip("numba")
  text = ("def native_loop(_st, a0, a1):\n    x = np.empty(4, np.float32)\n    out = np.empty(4, np.float32)\n"
          "    for _i in range(4):\n        x[_i] = a0[_i] * np.float32(a1)\n"
          "    ub = x.view(np.uint32)\n    ob = out.view(np.uint32)\n"
          "    for _i in range(4):\n        b = np.uint64(ub[_i])\n"
          "        ob[_i] = np.uint32((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000)\n"
          "    return (0, out.copy(), ub[3])\n")
  scope = {"np": np}
  exec(text, scope)  # noqa: S102
  nb = numba.njit(error_model="numpy")(scope["native_loop"])
  src = _Src()
  src.text, src.outs = text, [("a", np.dtype(np.float32)), ("s", np.dtype(np.uint32))]
  arr = ("a", np.dtype(np.float32), (4,), True)
  ir_text, meta, consts = lite.translate(src, [arr, ("s", np.dtype(np.int64), (), True)])
  fn = lite_jit.make_callable(lite_jit.compile_ir(ir_text, {}), meta, consts)
  a0 = np.array([1.00390625, -3.1, np.inf, 1e-39], np.float32)
  for a1 in (1, 3, -7):
    want, got = nb(np.zeros(8, np.int64), a0, np.int64(a1)), fn(np.zeros(8, np.int64), a0, np.int64(a1))
    assert str(nb.nopython_signatures[0].return_type.types[2]) == "uint32"  # (numba's type)
    for g, w in zip(got[1:], want[1:]):
      g = np.asarray(g)
      assert g.tobytes() == np.asarray(w, g.dtype).tobytes()
  src.text = text.replace("x.view(np.uint32)", "x.view(np.uint16)")
  with pytest.raises(codegen.Refused):
    lite.translate(src, [arr, ("s", np.dtype(np.int64), (), True)])


def test_bf16_rounding_loop_built_by_lite(lite_only):  # noqa: F811
  """A loop rounding float32 to bfloat16 (its bits through ``.view``):
  lite builds it; NaN payloads, ties, denormals and overflow give off's
  bits and interpret=True's."""
  from tests import test_native_elig_dma_narrow as tn
  rng = np.random.default_rng(5)
  pattern = np.concatenate([np.array(tn.PROBES, np.uint32),
                            rng.integers(0, 1 << 32, 1024 - len(tn.PROBES), dtype=np.uint32)])
  x = jnp.asarray(pattern.view(np.float32).reshape(8, 128))
  make = lambda interp: pl.pallas_call(tn._round_kernel, out_shape=jax.ShapeDtypeStruct(
      (8, 128), jnp.float32), interpret=interp)
  before = native.stats()
  got = [np.asarray(make(tn.SYNC)(x)) for _ in range(2)]
  _lite_built(before)
  off, interpreted = np.asarray(make(tn.OFF)(x)), np.asarray(make(True)(x))
  for g in got:
    np.testing.assert_array_equal(g.view(np.uint32), off.view(np.uint32))
    # (values: XLA folds the loop's 0.0 + x to x, keeping -0.0 where off and lite give 0.0)
    np.testing.assert_array_equal(g, interpreted)
