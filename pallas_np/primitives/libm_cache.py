"""The on-disk cache of the compiled float loops' object code (``libm.py``).

Why: compiling one loop costs a process ~0.15-0.25 s the first time (importing
llvmlite ~0.12 s, LLVM's -O2 and code generation tens of ms per loop); with
the object code on disk, a later process loads it without LLVM
(``libm_loader.py``) in well under a millisecond.

Where: ``$XDG_CACHE_HOME/pallas_np/libm/``, or ``~/.cache/pallas_np/libm/``
where ``XDG_CACHE_HOME`` is unset (the XDG convention). Off:
``PALLAS_NP_LIBM_CACHE=0`` (nothing is read or written; every process
compiles). A directory that cannot be written just means no caching.

Key: the SHA-256 of everything the object code depends on: the loop's LLVM
IR text, llvmlite's version (which fixes LLVM's), the target (triple, CPU
level, code model, optimisation level) and this format's version. The CPU
level is chosen from the CPU's features (``target_cpu``: ``x86-64-v3``
with AVX2 and FMA, ...), so machines sharing a home directory share an
entry only when they can all run it. Each file holds the object's own
SHA-256 before the object, so a truncated or altered file is recompiled,
never run. Files are written whole (a temporary file, then renamed).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from pallas_np.env_switches import env_switch

FORMAT = 1  # bump when the way objects are emitted or loaded changes


def directory() -> Path | None:
  """The cache directory, or None when ``PALLAS_NP_LIBM_CACHE`` is off."""
  if not env_switch("PALLAS_NP_LIBM_CACHE", True):
    return None
  xdg = os.environ.get("XDG_CACHE_HOME")
  root = Path(xdg) if xdg else Path(os.path.expanduser("~")) / ".cache"
  return root / "pallas_np" / "libm"


# x86-64 micro-architecture levels (the psABI's), by the CPU's feature names
# as Linux lists them in /proc/cpuinfo; the highest the CPU has all of.
_X86_LEVELS = [
    ("x86-64-v3", {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}),
    ("x86-64-v2", {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}),
]


def target_cpu() -> str:
  """The LLVM CPU name the loops are compiled for on Linux x86-64: the
  highest x86-64 level whose features the CPU has (AVX2 + FMA: x86-64-v3).
  A fixed level rather than the host's exact model: the same object serves
  every CPU of that level, and the key needs no LLVM to compute."""
  flags: set = set()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          flags = set(line.split(":", 1)[1].split())
          break
  except OSError:
    pass
  for name, needs in _X86_LEVELS:
    if needs <= flags:
      return name
  return "x86-64"


def key(*parts: str) -> str:
  h = hashlib.sha256(f"pallas_np libm object format {FORMAT}".encode())
  for p in parts:
    h.update(b"\0" + p.encode())
  return h.hexdigest()


def read(k: str, suffix: str = ".o") -> bytes | None:
  """The cached object (or other ``suffix``) of key ``k``, or None (absent,
  off, or damaged)."""
  d = directory()
  if d is None:
    return None
  try:
    data = (d / f"{k}{suffix}").read_bytes()
  except OSError:
    return None
  digest, obj = data[:32], data[32:]
  return obj if hashlib.sha256(obj).digest() == digest else None


def write(k: str, obj: bytes, suffix: str = ".o") -> None:
  """Stores ``obj`` under ``k`` (atomically); failures are ignored (no cache)."""
  d = directory()
  if d is None:
    return
  try:
    d.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=suffix)
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(hashlib.sha256(obj).digest() + obj)
      os.replace(tmp, d / f"{k}{suffix}")
    except BaseException:
      os.unlink(tmp)
      raise
  except OSError:
    pass
