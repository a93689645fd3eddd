"""Memory: allocating the buffers a run works on, the values uninitialised
memory is filled with, alignment for zero-copy handoff to XLA, and glibc
malloc tuning. A leaf: it imports nothing of pallas_np but ``_compat`` and
``env_switches``.

glibc malloc tuning, opt-in (``PALLAS_NP_TUNE_MALLOC=1``): applied when the
first kernel plan is built (``tune_once``).

A plan allocates and frees block-sized temporaries (hundreds of KiB) at every
eqn. glibc serves those with mmap/munmap and trims the heap top back to the
OS as soon as 128 KiB to 1 MiB is free, so a run keeps page-faulting fresh
memory (a first call some 15% slower: benchmarks/PERF_LOG.md). Keeping up to
32 MiB allocations on the heap and trimming only past 256 MiB free trades
some retained memory for that.

Opt-in because ``mallopt`` is process-wide and cannot be scoped to a kernel
run: glibc has no call that reads the thresholds back, and setting one turns
off glibc's dynamic mmap threshold for good, so the rest of the program (JAX,
the user's code) would run with a retuned allocator it did not ask for.
Only with glibc on Linux.
"""
from __future__ import annotations

import ctypes
import functools
import math
import sys

import numpy as np

from pallas_np import _compat as jc
from pallas_np.env_switches import env_switch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit
TRIM_THRESHOLD = 256 << 20

_done = False
tuned = False  # whether the thresholds were set (for tests/diagnostics)


def tune_once():
  """Raise glibc's malloc thresholds once per process, if the user opted in
  with ``PALLAS_NP_TUNE_MALLOC=1`` (read at the first kernel plan)."""
  global _done, tuned
  if _done:
    return
  _done = True
  if not env_switch("PALLAS_NP_TUNE_MALLOC", False) or not sys.platform.startswith("linux"):
    return
  try:
    mallopt = ctypes.CDLL("libc.so.6").mallopt
  except (OSError, AttributeError):  # not glibc (musl, ...)
    return
  mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
      mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


# XLA's CPU client aliases a NumPy array handed to it (jax.Array results
# without a copy) only when its data is 64-byte aligned; NumPy aligns to 16.
XLA_ALIGNMENT = 64
_ALIGN_MIN_BYTES = 1 << 14  # below this a copy costs about what the check does
TEMPLATE_MAX_BYTES = 64 << 10  # allocator(): buffers up to this copy a filled template


def aligned_empty(shape, dtype) -> np.ndarray:
  """``np.empty`` whose data XLA can alias (see ``XLA_ALIGNMENT``): for
  kernel outputs, which the eager path hands to JAX zero-copy."""
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  if nbytes < _ALIGN_MIN_BYTES:
    return np.empty(shape, dtype)
  raw = np.empty(nbytes + XLA_ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % XLA_ALIGNMENT
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def fill_value(dtype, params) -> np.ndarray:
  """The 0-d value uninitialised memory of ``dtype`` holds under
  ``params.uninitialized`` (an InterpretParams)."""
  return _fill_value(np.dtype(jc.physical_dtype(dtype)), params.uninitialized)


@functools.lru_cache(maxsize=None)
def _fill_value(dtype, uninitialized):
  """Cached: every grid run allocates outputs and scratch."""
  if uninitialized == "zero":
    return np.zeros((), dtype)
  return jc.uninitialized_value_np(dtype)


# Allocators of non-numeric scratch types (Mosaic GPU barriers), by the
# extended dtype's class: ``fn(shape, dtype) -> np.ndarray`` (object arrays).
_SPECIAL_ALLOCATORS: dict = {}


def register_allocator(dtype_class, fn):
  _SPECIAL_ALLOCATORS[dtype_class] = fn


def _late_allocator(dtype):
  """The allocator of a non-NumPy dtype whose family registers on first use
  (Mosaic GPU barriers: ``_compat.families``), or None."""
  if isinstance(dtype, np.dtype) or not jc.load_imported_families():
    return None
  return _SPECIAL_ALLOCATORS.get(type(dtype))


def allocate(shape, dtype, params) -> np.ndarray:
  """A fresh buffer (aligned, see ``aligned_empty``) filled with the
  uninitialised value; semaphores are zeroed int64 counters."""
  special = _SPECIAL_ALLOCATORS.get(type(dtype)) or _late_allocator(dtype)
  if special is not None:
    return special(shape, dtype)
  if jc.is_semaphore_dtype(dtype):
    # Semaphores count DMA bytes: int64 cells (see pallas_np.state.dma).
    return np.zeros(shape, np.int64)
  dtype = np.dtype(jc.physical_dtype(dtype))
  buf = aligned_empty(shape, dtype)
  buf[...] = fill_value(dtype, params)
  return buf


def allocator(shape, dtype, params):
  """``allocate(shape, dtype, params)`` as a zero-argument function with the
  dtype lookups done once: for buffers a plan allocates on every call."""
  special = _SPECIAL_ALLOCATORS.get(type(dtype)) or _late_allocator(dtype)
  if special is not None or jc.is_semaphore_dtype(dtype):
    return functools.partial(allocate, shape, dtype, params)
  dtype = np.dtype(jc.physical_dtype(dtype))
  fill = fill_value(dtype, params)
  shape = tuple(shape)
  if math.prod(shape) * dtype.itemsize > TEMPLATE_MAX_BYTES:
    def fresh():
      buf = aligned_empty(shape, dtype)
      buf[...] = fill
      return buf
    return fresh
  # Small buffers: a copy of a filled template (one call; about half the
  # cost of empty + fill, the per-call floor). The template is read-only,
  # its copies are fresh and writable. Not aligned for XLA: up to
  # TEMPLATE_MAX_BYTES, copy + XLA's copy of an output cost less than an
  # aligned buffer handed over zero-copy (PERF_LOG 103).
  template = np.empty(shape, dtype)
  template[...] = fill
  template.flags.writeable = False
  return template.copy


def lanes_last_empty(n, shape, dtype) -> np.ndarray:
  """An uninitialised (n, *shape) array laid out lane-minor: the lane axis
  is the contiguous one (see pallas_np.grid.vectorize: the lanes-last layout)."""
  return np.moveaxis(np.empty((*shape, n), dtype), -1, 0)
