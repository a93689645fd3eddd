"""lite (native/lite.py with native/lite_headers.py) builds the generated
sources that carry module headers: float dots through NumPy's own CBLAS
routines (``blas_calls.header``: sgemm, sgemv both ways, sdot), the NumPy
rules' float32 loops (``_cblas_loop1``), the pairwise sum's ``@_njit``
leaf, ``_math.copysign`` (float max/min), and kernel bodies with their
scratch arrays. Each is checked three ways bit for bit (lite's build, the
NumPy path ``native_loops="off"``, interpret=True within float tolerance)
and that lite, not numba, built it (the stats: without lite_headers these
sources were refused and built by numba, which fails here)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from benchmarks import small_kernels
from pallas_np import native
from pallas_np.native import blas_calls, lite, lite_headers, lite_jit
from pallas_np.native.codegen import Refused
from tests.test_native_lite import _lite_three_ways, lite_only  # noqa: F401  (the fixture)
from tests.test_native_loops import OFF, SYNC, _bits

pytestmark = [pytest.mark.skipif(not lite_jit.available(), reason="llvmlite is not installed"),
              pytest.mark.usefixtures("lite_only")]
needs_blas = pytest.mark.skipif(blas_calls.found() is None, reason="NumPy's OpenBLAS not found")


def _floats(*shape, seed=3):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _dot_loop(m, k, n, trips=3):
  """A fori_loop whose body multiplies by a (k, n) matrix: ``x`` (m, k)
  -> (m, n) each trip (k == n), a float dot in a compiled loop."""
  def kernel(x_ref, w_ref, o_ref):
    w = w_ref[...]

    def body(i, acc):
      return jnp.dot(acc, w, preferred_element_type=jnp.float32) * 0.5 + 1.0
    o_ref[...] = lax.fori_loop(0, trips, body, x_ref[...])

  def make(interp):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
                          interpret=interp)
  return make


@needs_blas
@pytest.mark.parametrize("m,k", [(16, 32), (1, 32), (1, 1)], ids=["sgemm", "sgemv_row", "noblas"])
def test_blas_routines_in_a_loop(m, k):
  make = _dot_loop(m, k, k)
  _lite_three_ways(make, _floats(m, k), _floats(k, k, seed=4) * 0.2)


@needs_blas
def test_sgemv_matrix_by_vector_in_a_loop():
  def kernel(x_ref, w_ref, o_ref):
    w = w_ref[...]

    def body(i, v):
      return jnp.dot(w, v, preferred_element_type=jnp.float32) * 0.25
    o_ref[...] = lax.fori_loop(0, 3, body, x_ref[...])

  def make(interp):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32, 1), jnp.float32),
                          interpret=interp)
  _lite_three_ways(make, _floats(32, 1), _floats(32, 32, seed=5))


@needs_blas
def test_sdot_row_by_column_in_a_loop():
  def kernel(x_ref, w_ref, o_ref):
    x, w = x_ref[...], w_ref[...]

    def body(i, acc):
      return jnp.dot(x * acc, w, preferred_element_type=jnp.float32) * 0.5
    o_ref[...] = lax.fori_loop(0, 3, body, jnp.ones((1, 1), jnp.float32))

  def make(interp):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1, 1), jnp.float32),
                          interpret=interp)
  _lite_three_ways(make, _floats(1, 32), _floats(32, 1, seed=6))


def test_pairwise_sum_helper_and_float32_loop():
  """A float sum over the last axis (NumPy's pairwise sum: the ``@_njit``
  leaf) and exp over a whole block (the NumPy rule's own float32 loop,
  called by address) in a loop."""
  def kernel(x_ref, o_ref):
    def body(i, acc):
      x = x_ref[...]
      s = jnp.sum(x, axis=-1, keepdims=True)
      return jnp.exp(x * 0.5 - s * 0.01) + acc * 0.5
    o_ref[...] = lax.fori_loop(0, 3, body, jnp.zeros_like(x_ref))

  def make(interp):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 300), jnp.float32),
                          interpret=interp)
  _lite_three_ways(make, _floats(8, 300))


def test_float_max_copysign():
  """max over an axis with -0.0 and +0.0 among the elements
  (``_math.copysign``: -0.0 < +0.0 as the NumPy path orders them)."""
  def kernel(x_ref, o_ref):
    def body(i, x):
      return x - jnp.max(x, axis=0, keepdims=True) * 0.0 - jnp.min(x, axis=1, keepdims=True)
    o_ref[...] = lax.fori_loop(0, 2, body, x_ref[...])

  def make(interp):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                          interpret=interp)
  x = np.array(_floats(8, 128))
  x[:, :4] = [0.0, -0.0, np.nan, -0.0]
  x[3, :] = -0.0
  _lite_three_ways(make, jnp.asarray(x))


@pytest.mark.parametrize("name", ["layer_norm_block", "matmul_acc", "int8_matmul", "quant_matmul"])
def test_library_bodies(name):
  """Kernel bodies (native/bodies.py: scratch arrays, BLAS operands read
  in place through a ref's strides) of the user-view benchmark."""
  if name in ("matmul_acc", "layer_norm_block") and blas_calls.found() is None:
    pytest.skip("NumPy's OpenBLAS not found")
  case = small_kernels.all_cases()[name]()
  before = native.stats()
  got = case.make(SYNC)(*case.args)
  after = native.stats()
  assert after["lite"] > before["lite"] and after["lite_refused"] == before["lite_refused"]
  assert after["native_calls"] > before["native_calls"]
  off = case.make(OFF)(*case.args)
  want = case.make(True)(*case.args)
  np.testing.assert_array_equal(_bits(got), _bits(off))
  # (interpret=True: XLA's own dot sums in another order: the case's tolerance)
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                             atol=case.tol, rtol=case.tol)


class _Src:
  def __init__(self, text):
    self.text, self.globals, self.outs, self.externals = text, {}, [], {}


def test_unknown_header_refused():
  """A header lite does not know (a DMA call site's ``_pycall``), a module
  statement or a helper without ``@_njit`` is refused: numba builds it."""
  body = "def native_loop(_st):\n    return (0,)\n"
  for head in ("import os\n", "X = 1\n", "def _f(a):\n    return a\n",
               "from numba import types as _nt\n"):
    with pytest.raises(Refused):
      lite.translate(_Src(head + body), [])
  lite.translate(_Src(lite_headers.NJIT + blas_calls.header(64) + body), [])


def test_missing_addresses_raise_runtime_error():
  """The prologue's check (no BLAS address in the status) raises
  RuntimeError, as numba's build does, not an IndexError."""
  text = (blas_calls.header(64)
          + "def native_loop(_st):\n"
          + "    if _st.shape[0] < 15 or _st[9] == 0: raise RuntimeError('no addresses')\n"
          + "    return (0,)\n")
  ir_text, meta, consts = lite.translate(_Src(text), [])
  fn = lite_jit.make_callable(lite_jit.compile_ir(ir_text, {}), meta, consts)
  with pytest.raises(RuntimeError):
    fn(np.zeros(20, np.int64))
  with pytest.raises(RuntimeError):
    fn(np.ones(3, np.int64))  # (too short)
  assert fn(np.ones(20, np.int64)) == (0,)
