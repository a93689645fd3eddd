"""NumPy's own CBLAS routines, called from a compiled loop, so that a float
``dot_general`` there has the NumPy path's bits.

The NumPy rule multiplies with ``np.matmul``, which hands each matrix
product to the BLAS NumPy is linked with (sgemm, sgemv or sdot by shape,
``native/dots.py`` repeats its choice); BLAS's summation order is its own
(blocking, SIMD accumulators, per CPU kernel) and cannot be written out.
The generated code therefore calls the very same routines: their addresses
in this process are read with ctypes from NumPy's OpenBLAS and passed to
the compiled loop in its status array (``status()``, slots ``SLOT`` on),
which calls through them (the intrinsics of ``HEADER``, defined in the
generated module: numba is imported only by the compile process). A
library from the disk cache is loaded into another process: the addresses
are never compiled in.

Found only where NumPy's BLAS is an OpenBLAS whose CBLAS symbols can be
resolved (a wheel's ``numpy.libs/*openblas*``) and passes ``_self_check``
(the routines, called as ``dots`` calls them, give ``np.matmul``'s bits);
elsewhere float dots keep the NumPy path (refused, with the reason).
"""
from __future__ import annotations

import ctypes
import time

import numpy as np

from pallas_np import blas
from pallas_np.native.codegen import MAX_LEAVES
from pallas_np.native.contract import ROUTINES, cblas_header  # (re-exported: lite reads them without JAX)
from pallas_np.primitives import libm

# Status array slots: [0] error site, [1 : 1 + MAX_LEAVES] index values,
# then the routines' addresses.
SLOT = 1 + MAX_LEAVES
NAMES = tuple(ROUTINES)
# The NumPy rules' own float32 loops (``libm.address``: ``out[i] = f(in[i])``
# over n contiguous floats), after the BLAS routines in the status array:
# a compiled loop calls the very code the NumPy path runs.
LOOPS = ("xla_expf", "xla_expf_split", "xla_logf", "xla_tanhf")
# After them: the address of the callback through which a compiled loop
# runs its DMAs and semaphore operations (``dma_calls``; set by its runner)
# and the scalar operands of one such call.
PYCALL = SLOT + len(NAMES) + len(LOOPS)
PYCALL_OPERANDS = 12
PYCALL_EXTRA = 14  # the compiled DMA queue's slots (dma_queue.MODE ...)
# Last: one word per dot site of a loop that may hand ?gemm an operand
# transposed (``TRANS``, read in place from a ref block), site j's at
# ``TRANSPOSED + j``: 1 where ?gemm so called gives, for that site's shape,
# the bits of ?gemm given the C-order copy the NumPy rule makes
# (``transposed_ok``); the loop then skips the copy (``dots._in_place``).
# Filled per loop (``status(sites)``, the sites' keys recorded with the
# loop: ``codegen.Source.transposed``); an array without them (a
# ``status()`` of no sites) makes every such site copy.
TRANSPOSED = PYCALL + 1 + PYCALL_OPERANDS + PYCALL_EXTRA
ROW_MAJOR, COL_MAJOR, NO_TRANS, TRANS = 101, 102, 111, 112

_found: list = []  # [(addresses by name, CBLAS_INT bits) or None] once looked up
_fns: list = []  # [the ctypes routines] once found (``transposed_ok``'s checks)
_status = [np.zeros(SLOT, np.int64)]
# transposed_key -> whether it passed ``_shape_check`` in this process
_transposed_ok: dict = {}
# Tests only (``forced_transposed``): key (or None: every key) -> the answer
_forced: dict = {}


def _symbols():
  """(library, name pattern, CBLAS_INT bits) of NumPy's OpenBLAS, or None."""
  for lib in blas.numpy_openblas_libraries():
    for prefix, suffix, bits in (("scipy_", "64_", 64), ("", "64_", 64), ("scipy_", "", 32),
                                 ("", "", 32)):
      if hasattr(lib, f"{prefix}cblas_sgemm{suffix}"):
        return lib, f"{prefix}cblas_{{}}{suffix}", bits
  return None


def _ctypes_routines(lib, pattern, bits):
  cint = ctypes.c_int64 if bits == 64 else ctypes.c_int32
  kinds = {"e": ctypes.c_int, "i": cint, "f": ctypes.c_float, "d": ctypes.c_double,
           "p": ctypes.c_void_p, "v": None}
  out = {}
  for name, (args, _, ret) in ROUTINES.items():
    fn = getattr(lib, pattern.format(name))
    fn.argtypes = [kinds[k] for k in args]
    fn.restype = kinds[ret]
    out[name] = fn
  return out


def ctypes_routines():
  """NumPy's BLAS routines as ctypes functions by name, or None."""
  sym = _symbols()
  return None if sym is None else _ctypes_routines(*sym)


def _self_check(fns) -> bool:
  """The routines, called as the generated code calls them (``matmul``),
  give ``np.matmul``'s bits for a few shapes of each kind."""
  rng = np.random.default_rng(0)
  for dt in (np.float32, np.float64):
    for m, k, n in ((5, 37, 9), (1, 37, 9), (5, 37, 1), (1, 37, 1), (3, 1, 4)):
      x = rng.standard_normal((m, k)).astype(dt)
      y = rng.standard_normal((k, n)).astype(dt)
      got = np.empty((m, n), dt)
      if not matmul(fns, x, y, got):
        continue
      if not np.array_equal(got.view(f"u{got.itemsize}"), np.matmul(x, y).view(f"u{got.itemsize}")):
        return False
  return True


def _shape_check(fns, p: str, m: int, k: int, n: int, ta: bool, tb: bool, rng) -> bool:
  """?gemm (``p``: s or d) of an (m, k) @ (k, n) product with A transposed
  where ``ta`` (``TRANS``), B where ``tb``, and with both where both (a site
  may read either operand in place, or both), each a strided block with a
  leading dimension past its width and one equal to it, gives ?gemm's bits
  on the C-order copies; values of mixed scales. OpenBLAS packs either
  layout into the same panels for its one kernel, but a build with
  per-layout small-matrix kernels sums a transposed operand in another
  order for some shapes (this VM's: (4, 128, 64) fails, (128, 128, 128)
  passes): hence one answer per shape."""
  dt = np.float32 if p == "s" else np.float64
  scale = np.exp2(rng.integers(-20, 20, (1, k))).astype(dt)
  x = rng.standard_normal((m, k), dtype=dt) * scale
  y = rng.standard_normal((k, n), dtype=dt) * scale.T
  want, got = np.empty((m, n), dt), np.empty((m, n), dt)
  gemm = fns[p + "gemm"]
  gemm(ROW_MAJOR, NO_TRANS, NO_TRANS, m, n, k, 1.0, x.ctypes.data, k, y.ctypes.data, n,
       0.0, want.ctypes.data, n)
  combos = [(ta_, tb_) for ta_ in (TRANS, NO_TRANS) for tb_ in (TRANS, NO_TRANS)
            if (ta_ == TRANS or tb_ == TRANS) and (ta or ta_ != TRANS) and (tb or tb_ != TRANS)]
  for pad in (0, 3):
    xt = np.zeros((k + 3, m + 2 * pad), dt)  # x transposed, in a wider array
    yt = np.zeros((n + 2, k + 3 * pad), dt)  # y transposed, likewise
    xv, yv = xt[1:1 + k, pad:pad + m], yt[1:1 + n, pad:pad + k]
    xv[...], yv[...] = x.T, y.T
    lda, ldb = xt.shape[1], yt.shape[1]
    for ta_, tb_ in combos:
      a, la = (xv.ctypes.data, lda) if ta_ == TRANS else (x.ctypes.data, k)
      b, lb = (yv.ctypes.data, ldb) if tb_ == TRANS else (y.ctypes.data, n)
      got[...] = np.nan
      gemm(ROW_MAJOR, ta_, tb_, m, n, k, 1.0, a, la, b, lb, 0.0, got.ctypes.data, n)
      if not np.array_equal(got.view(f"u{dt().itemsize}"), want.view(f"u{dt().itemsize}")):
        return False
  return True


# (m, k, n) of ``_transposed_check``: shapes of each kind (float64: the last three)
_TRANSPOSED_SHAPES = ((128, 128, 128), (4, 128, 64), (16, 64, 128), (33, 200, 17), (2, 5, 3))


def _transposed_check(fns) -> bool:
  """``_shape_check`` for every shape of ``_TRANSPOSED_SHAPES``, either
  operand and both transposed (a whole-BLAS answer; the loops ask per
  shape: ``transposed_ok``)."""
  rng = np.random.default_rng(1)
  return all(_shape_check(fns, p, m, k, n, True, True, rng)
             for p, shapes in (("s", _TRANSPOSED_SHAPES), ("d", _TRANSPOSED_SHAPES[-3:]))
             for m, k, n in shapes)


def transposed_key(dt, m: int, k: int, n: int, ta: bool, tb: bool) -> tuple:
  """The key of a dot site's ``transposed_ok`` (a JSON-able tuple: a
  loop's pre-key record holds its sites' keys)."""
  return ("s" if np.dtype(dt) == np.float32 else "d", int(m), int(k), int(n), bool(ta), bool(tb))


def transposed_ok(key) -> bool:
  """Whether ?gemm reading the operands ``key`` says in place (``TRANS``)
  gives the C-order copy's bits for that shape (``_shape_check``, run once
  per key per process, one thread as the loops call it); False where no
  BLAS is found."""
  key = tuple(key)
  forced = _forced.get(key, _forced.get(None))
  if forced is not None:
    return bool(forced)
  ok = _transposed_ok.get(key)
  if ok is None:
    ok = False
    if found() is not None:
      try:
        with blas.kernel_run():
          ok = _shape_check(_fns[0], *key, np.random.default_rng(1))
      except (ValueError, OSError):
        ok = False
    _transposed_ok[key] = ok
  return ok


class forced_transposed:
  """Tests: while active, ``transposed_ok`` answers ``answer`` for ``key``
  (None: every key), whatever the check says; status arrays made meanwhile
  keep it."""

  def __init__(self, answer, key=None):
    self.key, self.answer = None if key is None else tuple(key), answer

  def __enter__(self):
    self._was = _forced.get(self.key, "unset")
    _forced[self.key] = self.answer
    return self

  def __exit__(self, *exc):
    if self._was == "unset":
      _forced.pop(self.key, None)
    else:
      _forced[self.key] = self._was


def matmul(fns, x, y, out) -> bool:
  """``out = x @ y`` (C-contiguous 2-D) by the routine ``np.matmul`` picks
  (ctypes; the self-check); False for the shapes it computes without BLAS."""
  m, k = x.shape
  n = y.shape[1]
  p = "s" if x.dtype == np.float32 else "d"
  kind = routine(m, k, n)
  if kind == "gemm":
    fns[p + "gemm"](ROW_MAJOR, NO_TRANS, NO_TRANS, m, n, k, 1.0, x.ctypes.data, k,
                    y.ctypes.data, n, 0.0, out.ctypes.data, n)
  elif kind == "gemv_row":
    fns[p + "gemv"](ROW_MAJOR, TRANS, k, n, 1.0, y.ctypes.data, n, x.ctypes.data, 1, 0.0,
                    out.ctypes.data, 1)
  elif kind == "gemv_col":
    fns[p + "gemv"](COL_MAJOR, TRANS, k, m, 1.0, x.ctypes.data, k, y.ctypes.data, 1, 0.0,
                    out.ctypes.data, 1)
  elif kind == "dot":
    out[0, 0] = 0.0 + float(fns[p + "dot"](k, x.ctypes.data, 1, y.ctypes.data, 1))
  else:
    return False
  return True


def routine(m: int, k: int, n: int) -> str:
  """What ``np.matmul`` does with C-contiguous (m, k) @ (k, n) operands
  (NumPy's ``matmul.c.src``): ``dot`` (row @ column: ``?dot``, summed into
  a double from 0.0), ``gemv_row`` (vector @ matrix), ``gemv_col`` (matrix
  @ vector), ``gemm``, or ``noblas`` (k == 1: its own loop, each element
  0 + the products in order)."""
  if m == 1 and n == 1:
    return "noblas" if k == 1 else "dot"
  if k == 1:
    return "noblas"
  if m == 1:
    return "gemv_row"
  if n == 1:
    return "gemv_col"
  return "gemm"


def found():
  """(addresses by routine name, CBLAS_INT bits) of NumPy's BLAS, or None
  (not an OpenBLAS found here, or failing the self-check)."""
  if not _found:
    result = None
    try:
      sym = _symbols()
      if sym is not None:
        fns = _ctypes_routines(*sym)
        if _self_check(fns):
          addrs = {name: ctypes.cast(fn, ctypes.c_void_p).value for name, fn in fns.items()}
          result = (addrs, sym[2])
          _fns.append(fns)
    except (AttributeError, OSError, ValueError):
      result = None
    _found.append(result)
    st = np.zeros(TRANSPOSED, np.int64)
    if result is not None:
      st[SLOT:SLOT + len(NAMES)] = [result[0][n] for n in NAMES]
    _status[0] = st
  return _found[0]


def loop_slot(name: str) -> int:
  """The status-array slot of the NumPy rule's float32 loop ``name`` (its
  address filled in by ``status``)."""
  return SLOT + len(NAMES) + LOOPS.index(name)


def status(sites=(), loops: bool = True) -> np.ndarray:
  """A fresh status array for one call of a compiled loop: the BLAS
  addresses and the float32 loops' (looked up on the first call, whether
  or not this process generated the loop's source: a library may come
  from the disk cache), then one ``transposed_ok`` word per key of
  ``sites`` (the loop's dot sites that may read an operand in place).
  ``loops=False``: a loop that reads no float32 loop
  (``tier.LIBM_PRIMITIVES``) gets BLAS's addresses without libm's loops
  being loaded (~3.6 ms of its first call); their slots may be zero."""
  if not loops:
    found()
    return _with_sites(sites)
  if len(_status) == 1:
    found()
    st = _status[0]
    for name in LOOPS:
      st[loop_slot(name)] = libm.address(name)[0]
    _status.append(True)
  return _with_sites(sites)


def _with_sites(sites) -> np.ndarray:
  """A copy of the status template with ``sites``' ``transposed_ok`` words."""
  if not sites:
    return _status[0].copy()
  st = np.empty(TRANSPOSED + len(sites), np.int64)
  st[:TRANSPOSED] = _status[0]
  st[TRANSPOSED:] = [transposed_ok(k) for k in sites]
  return st


def header_bits() -> int:
  """CBLAS_INT's bits for ``header`` (64 where no BLAS is found: then only
  the float32 loops are called)."""
  f = found()
  return f[1] if f is not None else 64


def header(bits: int) -> str:
  """The generated module's intrinsics (``contract.cblas_header``)."""
  return cblas_header(bits)


class timed_routines:
  """Profiling (``benchmarks/native_library.py --profile``): while active,
  compiled loops call each BLAS routine through a ctypes wrapper that
  forwards to NumPy's own routine and adds the seconds it took to
  ``seconds`` (and the call to ``calls``), by routine name. The wrapper
  costs a Python call per product: time the loops without it."""

  def __init__(self):
    self.seconds = dict.fromkeys(NAMES, 0.0)
    self.calls = dict.fromkeys(NAMES, 0)
    self._wrappers = []
    self._saved = None

  def __enter__(self):
    status()
    found_ = found()
    if found_ is None:
      return self
    sym = _symbols()
    real = _ctypes_routines(*sym)
    cint = ctypes.c_int64 if sym[2] == 64 else ctypes.c_int32
    kinds = {"e": ctypes.c_int, "i": cint, "f": ctypes.c_float, "d": ctypes.c_double,
             "p": ctypes.c_void_p, "v": None}
    template = _status[0]
    self._saved = template.copy()
    for k, name in enumerate(NAMES):
      args, _, ret = ROUTINES[name]

      def wrapper(*a, _fn=real[name], _name=name):
        t0 = time.perf_counter()
        r = _fn(*a)
        self.seconds[_name] += time.perf_counter() - t0
        self.calls[_name] += 1
        return r
      cfn = ctypes.CFUNCTYPE(kinds[ret], *[kinds[c] for c in args])(wrapper)
      self._wrappers.append(cfn)
      template[SLOT + k] = ctypes.cast(cfn, ctypes.c_void_p).value
    return self

  def __exit__(self, *exc):
    if self._saved is not None:
      _status[0][:] = self._saved
