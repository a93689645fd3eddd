"""Small matmuls on one BLAS thread.

NumPy's OpenBLAS runs every GEMM on all cores. For the small blocks kernels
multiply, waking the BLAS threads costs far more than the product (up to a
thousand times, under load: benchmarks/PERF_LOG.md). So GEMMs below a size run
with the thread count set to 1 for the call (two ~1 us ctypes calls); big
ones keep every thread. Nothing happens
when NumPy's BLAS is not an OpenBLAS we can find (plain ``np.matmul``).

A kernel run sets the count once for all its GEMMs (``kernel_run``): the
get/set pair around each product cost ~4 us, more than a 64x64 GEMM (a
causal attention kernel makes thousands)."""
from __future__ import annotations

import ctypes
import glob
import os
import threading

import numpy as np

from pallas_np.env_switches import env_switch

# Multiply-accumulates above which a GEMM is worth the thread wake-up.
MULTITHREAD_MACS = 1 << 27

_set = _get = None


def numpy_openblas_libraries():
  """The OpenBLAS libraries NumPy's wheel ships (``numpy.libs``), loaded:
  the very code ``np.matmul`` runs (here for its thread count;
  ``native.blas_calls`` for its GEMM entry points)."""
  libdir = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
  for path in sorted(glob.glob(os.path.join(libdir, "*openblas*.so*"))):
    try:
      yield ctypes.CDLL(path)
    except OSError:
      continue


def _find_openblas():
  global _set, _get
  for lib in numpy_openblas_libraries():
    for prefix in ("scipy_openblas", "openblas"):
      for suffix in ("64_", ""):
        s = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
        g = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
        if s is not None and g is not None:
          g.restype = ctypes.c_int
          _set, _get = s, g
          return


try:
  _find_openblas()
except Exception:  # pragma: no cover - any BLAS oddity: keep plain matmul
  _set = _get = None

_lock = threading.Lock()
_runs = 0  # kernel runs in progress (kernel_run): BLAS is on one thread
_threads_before = 1  # the count kernel_run restores


class _KernelRun:
  """Scope of a kernel run: BLAS on one thread throughout, the caller's
  count restored when the last concurrent run ends. (A class, not a
  generator context manager: it is entered on every kernel call, and this
  is ~1 us cheaper.)"""
  __slots__ = ()

  def __enter__(self):
    global _runs, _threads_before
    if _set is None:
      return
    with _lock:
      if _runs == 0:
        _threads_before = _get()
        if _threads_before != 1:
          _set(1)
      _runs += 1
    if not _warmed:
      _warm_buffer()

  def __exit__(self, *exc):
    global _runs
    if _set is None:
      return
    with _lock:
      _runs -= 1
      if _runs == 0 and _threads_before != 1:
        _set(_threads_before)


_warmed = []  # (non-empty once OpenBLAS's buffer was warmed: once per process)
# The warm-up product's shape: (M, K) @ (K, N) on one thread (see _warm_buffer).
WARM_SHAPE = (128, 128, 512)


def _warm_buffer():
  """One float32 GEMM of ``WARM_SHAPE`` on one BLAS thread, at the first
  kernel run of the process. Measured (PERF_LOG [attn]): in a process whose
  GEMMs had all been small, OpenBLAS's one-thread 128 x 128 x 128 sgemm
  took 1.8-2x as long as XLA's dot of that shape, for the life of the
  process; after one GEMM with a wider packed B (this one, ~1.5 ms), as
  long as XLA's. Most likely the sgemm kernel's prefetches past its
  packed panels land on pages of OpenBLAS's packing buffer that no GEMM
  has written yet. The products' bits do not change: the same code on the
  same data (tests/test_blas_warm.py). Once per process: after it, GEMMs
  in every thread ran at the warm speed, new threads' too."""
  _warmed.append(True)
  if not env_switch("PALLAS_NP_BLAS_WARM", True):  # (docs/options.md)
    return
  m, k, n = WARM_SHAPE
  np.matmul(np.ones((m, k), np.float32), np.ones((k, n), np.float32))


_KERNEL_RUN = _KernelRun()


def kernel_run():
  """The scope of a kernel run (``with blas.kernel_run(): ...``)."""
  return _KERNEL_RUN


def _reset_after_fork():
  global _runs
  _runs = 0


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_reset_after_fork)


def _matmul_all_threads(x, y, out=None):
  """A big GEMM inside a kernel run: every thread for this product."""
  if not _runs or _threads_before == 1:
    return np.matmul(x, y, out=out)
  with _lock:
    _set(_threads_before)
    try:
      return np.matmul(x, y, out=out)
    finally:
      _set(1)


def _matmul_one_thread(x, y, out=None):
  if _runs:  # set once for the whole run
    return np.matmul(x, y, out=out)
  with _lock:
    prev = _get()
    if prev == 1:
      return np.matmul(x, y, out=out)
    _set(1)
    try:
      return np.matmul(x, y, out=out)
    finally:
      _set(prev)


def matmul_for(macs: int):
  """A matmul for GEMMs of ``macs`` multiply-accumulates: on one BLAS thread
  below MULTITHREAD_MACS, on all of them above. (The choice depends only on
  the shapes, never on machine load, so results are reproducible.)"""
  if _set is None:
    return np.matmul
  if macs >= MULTITHREAD_MACS:
    return _matmul_all_threads
  return _matmul_one_thread
