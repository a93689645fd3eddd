"""Small matmuls on one BLAS thread.

NumPy's OpenBLAS runs every GEMM on all cores. For the small blocks kernels
multiply, waking the BLAS threads costs far more than the product (measured
on the 2-core dev machine under load: 36 ms instead of 40 us for a 128x64 @
64x128 product made between other Python work). So GEMMs below a size run
with the thread count set to 1 for the call (two ~1 us ctypes calls); big
ones keep every thread. Nothing happens
when NumPy's BLAS is not an OpenBLAS we can find (plain ``np.matmul``)."""
from __future__ import annotations

import ctypes
import glob
import os
import threading

import numpy as np

# Multiply-accumulates above which a GEMM is worth the thread wake-up.
MULTITHREAD_MACS = 1 << 27

_set = _get = None


def _find_openblas():
  global _set, _get
  libdir = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
  for path in sorted(glob.glob(os.path.join(libdir, "*openblas*.so*"))):
    try:
      lib = ctypes.CDLL(path)
    except OSError:
      continue
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


def _matmul_one_thread(x, y):
  with _lock:
    prev = _get()
    if prev == 1:
      return np.matmul(x, y)
    _set(1)
    try:
      return np.matmul(x, y)
    finally:
      _set(prev)


def matmul_for(macs: int):
  """A matmul for GEMMs of ``macs`` multiply-accumulates: on one BLAS thread
  below MULTITHREAD_MACS, on all of them above. (The choice depends only on
  the shapes, never on machine load, so results are reproducible.)"""
  if _set is None or macs >= MULTITHREAD_MACS:
    return np.matmul
  return _matmul_one_thread
