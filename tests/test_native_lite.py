"""lite (native/lite.py: the generated loop source compiled in process with
llvmlite) against the NumPy path, bit for bit, and interpret=True: the
elementwise tables of every dtype (wrap-around, division by zero and
INT_MIN / -1, shifts past the width, NaN, -0.0, float->int saturation),
the benchmark loop kernels, the refusal rule (a form lite does not
translate goes to the numba build, with the same bits), and the stats that
show lite compiled (a change that silently stops lite engaging fails
here). ``PALLAS_NP_NATIVE_COMPILER=lite`` makes ``"sync"`` builds lite's."""
import ctypes
import functools
import os
import shutil
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from benchmarks.small_kernels import bitonic_fori_kernel, collatz_kernel, cumsum_fori_kernel
from pallas_np import native
from pallas_np.lru import LRU
from pallas_np.native import build_steps, codegen, disk_cache, lite, lite_cache, lite_jit
from tests.test_native_loops import (N_FLOAT_OPS, N_INT_OPS, _elementwise_call, _float_ops,
                                     _floats, _int_ops, _ints, three_ways)

pytestmark = pytest.mark.skipif(not lite_jit.available(), reason="llvmlite is not installed")


@pytest.fixture
def lite_only(monkeypatch, tmp_path):
  """Sync builds by lite, in a cache of their own (no library a numba
  build left, in memory or on disk, is found instead)."""
  monkeypatch.setenv(lite_cache.ENV, "lite")
  monkeypatch.setattr(disk_cache, "_dir", [str(tmp_path)])
  monkeypatch.setattr(build_steps, "loaded", LRU(256))
  monkeypatch.setattr(build_steps, "prekeys", LRU(1024))
  monkeypatch.setattr(lite_cache, "_memo", {})


def _lite_three_ways(make, *args):
  before = native.stats()
  three_ways(make, *args)
  after = native.stats()
  assert after["lite"] > before["lite"], "lite did not compile the loop"
  assert after["lite_refused"] == before["lite_refused"]


INT_DTYPES = [jnp.int8, jnp.int16, jnp.int32, jnp.int64, jnp.uint8, jnp.uint16, jnp.uint32,
              jnp.uint64]


def _ints64(dt, shape=(8, 128), seed=11):
  """``_ints`` for int64/uint64: edge values (the extremes, 0, +-1, shift
  amounts around 64) and random bits."""
  rng = np.random.default_rng(seed)
  v = rng.integers(0, 2**64, size=shape, dtype=np.uint64).view(dt)
  info = np.iinfo(dt)
  edge = np.array([info.min, info.max, 0, 1, 2, 3, 7, 31, 32, 33, 63, 64, 65, 100, 255,
                   info.max - 1], dtype=object)
  flat = v.reshape(-1)
  flat[:edge.size * 4] = np.array([dt.type(e) for e in np.tile(edge, 4)], dt)
  if dt.kind == "i":
    flat[edge.size * 4:edge.size * 5] = -np.arange(1, edge.size + 1)
  v[seed % 3::3] = rng.integers(0, 70, size=shape).astype(dt)[seed % 3::3]  # shift amounts, divisors
  return jnp.asarray(v)


@pytest.mark.parametrize("dt", INT_DTYPES)
def test_integer_ops_bit_exact(lite_only, dt):
  if np.dtype(dt).itemsize == 8:  # (64-bit values: JAX's x64 mode)
    with jax.enable_x64(True):
      x, y = _ints64(np.dtype(dt)), _ints64(np.dtype(dt), seed=12)
      _lite_three_ways(functools.partial(_elementwise_call, _int_ops, N_INT_OPS, dt), x, y)
    return
  x, y = _ints(np.dtype(dt)), _ints(np.dtype(dt))
  _lite_three_ways(functools.partial(_elementwise_call, _int_ops, N_INT_OPS, dt), x, y)


def test_float32_ops_bit_exact(lite_only):
  x = _floats()
  y = jnp.asarray(np.roll(np.asarray(x), 3, axis=1))
  _lite_three_ways(functools.partial(_elementwise_call, _float_ops, N_FLOAT_OPS, jnp.float32),
                   x, y)


def _bool_ops(x, y):
  a, b = x > 0, y > 0
  return [(a & b).astype(x.dtype), (a | b).astype(x.dtype), (a ^ b).astype(x.dtype),
          (~a).astype(x.dtype), jnp.where(a, x, y), (a == b).astype(x.dtype),
          (a < b).astype(x.dtype), jnp.maximum(a, b).astype(x.dtype)]


def test_bool_ops_bit_exact(lite_only):
  x, y = _ints(np.dtype(np.int32), (2, 128)), _ints(np.dtype(np.int32), (2, 128))
  _lite_three_ways(functools.partial(_elementwise_call, _bool_ops, 8, jnp.int32,
                                     shape=(2, 128)), x, y)


def _kernel_call(kernel, x, interp):
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        interpret=interp)


@pytest.mark.parametrize("kernel,make_x", [
    (collatz_kernel, lambda: jnp.asarray(np.random.default_rng(1).integers(1, 60, (2, 128)),
                                         jnp.int32)),
    (cumsum_fori_kernel, lambda: _floats((64, 128))),
    (bitonic_fori_kernel, lambda: _floats((8, 128))),
])
def test_benchmark_loop_kernels(lite_only, kernel, make_x):
  x = make_x()
  _lite_three_ways(functools.partial(_kernel_call, kernel, x), x)


def test_second_load_from_disk(lite_only):
  """A lite object is kept on disk by its key: with the in-memory tables
  cleared (a second process), the loop is loaded, not compiled again."""
  x = _floats((32, 128))  # (a shape no other test traces: a new plan)
  make = functools.partial(_kernel_call, cumsum_fori_kernel, x)
  _lite_three_ways(make, x)
  build_steps.loaded.clear()
  build_steps.prekeys.clear()
  lite_cache._memo.clear()
  before = native.stats()
  got = make(pallas_np.InterpretParams(native_loops="sync", uninitialized="zero"))(x)
  after = native.stats()
  assert after["lite"] == before["lite"] and after["disk_hits"] > before["disk_hits"]
  assert after["native_calls"] > before["native_calls"]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(make(
      pallas_np.InterpretParams(native_loops="off"))(x)))


def _nested_kernel(x_ref, o_ref):
  """A fori_loop with an array carry inside a while_loop: its carry is a
  ``.copy()`` inside a loop of unknown trip count (lite refuses it)."""
  def cond(c):
    return c[0] < 3

  def body(c):
    k, v = c
    v = lax.fori_loop(0, 2, lambda i, w: w * 2 + 1, v)
    return k + 1, v
  o_ref[...] = lax.while_loop(cond, body, (0, x_ref[...]))[1]


def test_refused_form_goes_to_numba(lite_only):
  """lite refuses a form outside its subset: numba builds the loop, with
  the NumPy path's bits."""
  x = jnp.asarray(np.arange(256, dtype=np.int32).reshape(2, 128))
  before = native.stats()
  three_ways(functools.partial(_kernel_call, _nested_kernel, x), x)
  after = native.stats()
  assert after["lite_refused"] == before["lite_refused"] + 1
  assert after["lite"] == before["lite"]


def test_unknown_forms_are_refused():
  """Direct: forms lite has no rule for raise Refused (never a guess)."""
  class Src:
    globals, externals = {}, {}
    outs = [("s", np.dtype(np.int64))]
  for body in ("    return (0, np.sum(a0))", "    x = a0 is a0\n    return (0, x)",
               "    x = a0 ** 2\n    return (0, x)", "    x = a0 if a0 else 1.5\n    return (0, x)",
               "    return (0, a0 < 1 < 2)"):
    Src.text = f"def native_loop(_st, a0):\n{body}\n"
    with pytest.raises(codegen.Refused):
      lite.translate(Src, [("s", np.dtype(np.int64), (), True)])


# -- forms the emitters may write, lite against numba's own compile of the text ---------------
_SNIPPETS = {
    "floor_divmod": "    return (0, a0 // a1, a0 % a1, np.int32(a0) // np.int32(a1), a1 % 3)",
    "chained": "    return (0, 0 <= a0 < a1, a1 < a0 <= 5 != a1)",
    "unsigned_literal": "    u = np.uint64(a0)\n    return (0, u < 32, u + 1 if u > 3 else 0, u >> np.uint64(a1 & 63))",
    "mixed_float": ("    f = np.float32(a0) * np.float32(0.1)\n"
                    "    return (0, f + a1, np.float32(f) < a1, max(f, a1), min(f, 2), abs(f - a1))"),
    "neg_index": ("    x = np.empty(4, np.int64)\n    for _i in range(4):\n        x[_i] = _i * a1\n"
                  "    return (0, x[-1] + x[a1 % 4 - 4])"),
}


@pytest.mark.parametrize("name", sorted(_SNIPPETS))
def test_snippets_match_numba(name):
  """Edge values through forms with numba's subtler typing (floor division
  and INT_MIN // -1, chained comparisons, uint64 against int literals in
  float64, float32 with ints, negative indices), lite's results against
  numba's own compile of the same text: same types, same bits."""
  nb = _cached[name]
  text = f"def native_loop(_st, a0, a1):\n{_SNIPPETS[name]}\n"
  edge = [0, 1, -1, 2, -7, 7, 3, 5, -(2**63), 2**63 - 1, -(2**31), 2**31 - 1, 100]
  for a0 in edge:
    for a1 in edge:
      args = (np.int64(a0), np.int64(a1))
      want = nb(np.zeros(8, np.int64), *args)
      if name not in _compiled:
        types = nb.nopython_signatures[0].return_type.types[1:]

        class Src:
          globals, externals = {}, {}
          outs = [("s", np.dtype(str(t) if str(t) != "bool" else "bool")) for t in types]
        Src.text = text
        ir_text, meta, consts = lite.translate(Src, [("s", np.dtype(np.int64), (), True)] * 2)
        _compiled[name] = (lite_jit.make_callable(lite_jit.compile_ir(ir_text, {}), meta, consts),
                           [dt for _, dt in Src.outs])
      fn, dts = _compiled[name]
      got = fn(np.zeros(8, np.int64), *args)
      for g, w, dt in zip(got[1:], want[1:], dts):
        assert np.asarray(g).dtype == dt, (name, a0, a1)
        assert np.asarray(g).tobytes() == np.asarray(w, dt).tobytes(), (name, a0, a1, g, w)


_compiled: dict = {}


class _NumbaCache(dict):
  def __missing__(self, name):
    numba = pytest.importorskip("numba")
    from pallas_np.native import aot_worker
    scope = {"np": np, **aot_worker._int_ops()}
    exec(f"def native_loop(_st, a0, a1):\n{_SNIPPETS[name]}\n", scope)  # noqa: S102
    fn = self[name] = numba.njit(error_model="numpy")(scope["native_loop"])
    return fn


_cached = _NumbaCache()


@pytest.mark.parametrize("dt", [jnp.int64, jnp.uint64])
def test_64bit_shifts_of_the_numba_build(lite_only, monkeypatch, dt):
  """The numba build of the same source: 64-bit shifts (the emitters' 0
  of the result's type: numba unified ``uint64 if c else 0`` into float64)."""
  monkeypatch.setenv(lite_cache.ENV, "numba")

  def ops(x, y):
    return [lax.shift_left(x, y), lax.shift_right_logical(x, y), lax.shift_right_arithmetic(x, y)]
  with jax.enable_x64(True):
    x, y = _ints64(np.dtype(dt), (2, 128), seed=13), _ints64(np.dtype(dt), (2, 128), seed=12)
    before = native.stats()
    three_ways(functools.partial(_elementwise_call, ops, 3, dt, shape=(2, 128)), x, y)
    assert native.stats()["lite"] == before["lite"]


def _linked_warm(tmp_path, path_dirs):
  """``lite_worker``'s warm-up module linked with ``PATH`` = ``path_dirs``
  (no ``$CC``), and its ``warm(41)`` called from the library; None where
  it was not linked."""
  from pallas_np.native import lite_worker
  obj = tmp_path / "warm.o"
  obj.write_bytes(lite_jit.compile_ir(lite_worker._WARM_IR, {}))
  lib = tmp_path / f"warm{len(list(tmp_path.iterdir()))}.so"
  env = {k: v for k, v in os.environ.items() if k != "CC"}
  env["PATH"] = os.pathsep.join(map(str, path_dirs))
  with mock.patch.dict(os.environ, env, clear=True):
    if not lite_jit.link_shared(str(obj), str(lib)):
      return None
  fn = ctypes.CDLL(str(lib)).warm
  fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int64]
  return fn(41)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not shutil.which("ld")
                    or not shutil.which("cc"), reason="links with the system linker")
def test_a_library_is_linked_by_ld_and_else_by_cc(tmp_path):
  """lite links a loop's object with the system linker itself (``ld``,
  ~8 ms; the C compiler's driver took ~33 ms, on the path of a fresh
  process's first build), and where that fails with the C compiler."""
  only_ld = tmp_path / "only_ld"
  only_ld.mkdir()
  os.symlink(shutil.which("ld"), only_ld / "ld")  # (no cc on this PATH)
  out = tmp_path / "out"
  out.mkdir()
  assert _linked_warm(out, [only_ld]) == 42
  real = lite_jit._linkers
  with mock.patch.object(lite_jit, "_linkers", lambda: [["false"], *real()]):  # (ld failing)
    assert _linked_warm(out, os.environ["PATH"].split(os.pathsep)) == 42
