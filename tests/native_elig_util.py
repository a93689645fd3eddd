"""Shared by the tests of what compiled loops hold (tests/test_native_elig*.py):
a kernel run with ``native_loops="sync"`` (the loop compiled at its first
run) against ``"off"`` (the NumPy path) and interpret=True."""
import ctypes

import jax
import numpy as np

import pallas_np
from pallas_np import native
from pallas_np.native import blas_calls, codegen

SYNC = pallas_np.InterpretParams(native_loops="sync")
OFF = pallas_np.InterpretParams(native_loops="off")


def bits(a):
  """The bits of ``a``, every NaN as one NaN (docs/performance.md: which NaN
  an addition or a max returns when NaNs of different sign meet)."""
  a = np.asarray(a)
  if a.dtype.kind != "f":
    return a
  a = np.where(np.isnan(a), np.array(np.nan, a.dtype), a)
  return a.view(f"uint{a.dtype.itemsize * 8}")


def compiled_equals_numpy(make, *args, rtol=1e-5, atol=1e-5):
  """``make(interpret)`` -> the pallas_call'd function: the compiled loop
  ran (``native.stats()``), and agrees with the NumPy path bit for bit and
  with interpret=True within ``rtol``/``atol``."""
  before = native.stats()["native_calls"]
  got = make(SYNC)(*args)
  ran = native.stats()["native_calls"] - before
  off = make(OFF)(*args)
  want = make(True)(*args)
  for g, o, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(off),
                     jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(bits(g), bits(o))
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)
  assert ran > 0, "the compiled loop did not run"
  return got


def loop_source_of(make, *args) -> str:
  """The generated source of the first loop in ``make(True)``'s kernel (to
  read what a compiled loop does: which BLAS call, which path)."""
  closed = jax.make_jaxpr(make(True))(*args)
  eqn = next(e for e in closed.jaxpr.eqns if e.primitive.name == "pallas_call")
  loop = next(e for e in eqn.params["jaxpr"].eqns if e.primitive.name in ("while", "scan"))
  return codegen.loop_source(loop, False, "nan").text


def copying_gemm(real, dt, calls=None):
  """A Python ?gemm (``dt``: float32 or float64) that copies a ``TRANS``
  operand into C order and passes it ``NO_TRANS`` to ``real`` (NumPy's own
  routine, ctypes): what the NumPy rule does, so the copy's bits by
  construction, whatever this CPU's OpenBLAS kernels do with ``TRANS``.
  Each call's (m, n, k, transA, transB) is appended to ``calls`` if given."""
  ctype = ctypes.c_float if dt == np.float32 else ctypes.c_double
  size = np.dtype(dt).itemsize

  def gemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    if calls is not None:
      calls.append((m, n, k, ta, tb))
    keep = []

    def c_order(ptr, rows, cols, ld):  # the (rows, cols) matrix stored transposed
      stored = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctype)),
                                     shape=((cols - 1) * ld + rows,))
      copy = np.ascontiguousarray(
          np.lib.stride_tricks.as_strided(stored, (rows, cols), (size, ld * size)))
      keep.append(copy)
      return copy.ctypes.data
    if ta == blas_calls.TRANS:
      a, lda, ta = c_order(a, m, k, lda), k, blas_calls.NO_TRANS
    if tb == blas_calls.TRANS:
      b, ldb, tb = c_order(b, k, n, ldb), n, blas_calls.NO_TRANS
    real(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
  return gemm


def free_lite_builds(monkeypatch):
  """Background builds by lite's compile process due as soon as the cost
  rule allows (``cost_rule.HOT_RUNS``): every price zeroed, lite chosen,
  its process at normal priority (a niced one may wait minutes on a busy
  machine)."""
  from pallas_np.native import cost_rule, lite_cache, scheduler
  monkeypatch.setenv(lite_cache.ENV, "lite")
  for name in ("LOOKUP_PRICE", "SETUP_PRICE", "PRESTART_PRICE"):
    monkeypatch.setattr(cost_rule, name, 0.0)
  for name in ("COMPILE_WEIGHT", "CALLER_PRICE", "NEIGHBOUR_SHARE"):
    monkeypatch.setattr(scheduler, name, 0.0)
  monkeypatch.setattr(scheduler, "lite_compiler", scheduler.Compiler(nice=False, lite=True))


def made_loops(monkeypatch) -> list:
  """The ``NativeLoop``s (and kernel bodies) made from now on, in order."""
  from pallas_np.native import tier
  loops = []
  init = tier.NativeLoop.__init__
  monkeypatch.setattr(tier.NativeLoop, "__init__",
                      lambda self, *a, **k: loops.append(self) or init(self, *a, **k))
  return loops
