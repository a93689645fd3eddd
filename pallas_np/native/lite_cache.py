"""lite builds as the tier sees them: a loop's generated source handed to
the compile process (``aot_worker``, whose ``lite_worker`` translates,
compiles and links it), the shared library it writes kept in the disk
cache beside the numba libraries, and loaded by the loop's key with a
``dlopen`` (``lite_jit.load_library``): the caller's process never imports
llvmlite, unless a build could only be kept as an object (no C compiler
linked it: MCJIT loads it) (docs/native.md, "lite").

``PALLAS_NP_NATIVE_COMPILER`` picks the compiler: ``auto`` (the default)
and ``lite``: lite first for every build (``"sync"`` ones too), a loop lite
refuses is priced and built by numba; ``numba``: never lite.
"""
from __future__ import annotations

import json
import os

import numpy as np

from pallas_np.native import codegen, disk_cache, lite_jit

ENV = "PALLAS_NP_NATIVE_COMPILER"
CHOICES = ("auto", "lite", "numba")
# Seconds of the compile process a lite build takes: translation
# ~0.05-0.2 s and LLVM ~0.1-1 s, in the compile process, started at the
# loop's first run. The caller pays none of them where a core is idle
# (``scheduler.lite_weight``): only its own part, the source's generation
# and the library's load, ``scheduler.CALLER_PRICE``.
PRICE = 0.3
# Seconds more where lite's compile process was not started at the loop's
# first run (no core was idle then): Python and llvmlite's import and its
# warm-up, ~0.2 s, started with the build (``tier._price``).
START_PRICE = 0.2
FORMAT = 2  # (1: objects loaded by MCJIT in the caller)
_memo: dict = {}  # library key -> loaded lite function


def mode() -> str:
  raw = os.environ.get(ENV, "").strip().lower() or "auto"
  if raw not in CHOICES:
    raise ValueError(f"{ENV}={raw!r}: expected one of {', '.join(CHOICES)}")
  return raw


def enabled() -> bool:
  """Whether builds try lite first."""
  return mode() != "numba" and lite_jit.available()


def arg_descs(kinds, avals, layouts) -> list:
  """Each loop operand as ``lite.translate`` takes it: [kind, dtype,
  static shape, C-contiguous] (JSON, for the compile process)."""
  out = []
  for kind, aval, layout in zip(kinds, avals, layouts):
    inner = aval.inner_aval if kind == "r" else aval
    dt = codegen.dtype_of(inner)
    if kind != "s" and layout is None:
      raise codegen.Refused("lite: a scalar where an array was expected")
    out.append([kind, dt.str, list(inner.shape), bool(kind == "s" or layout[0])])
  return out


def _base(k: str) -> str:
  return os.path.join(disk_cache.directory(), f"{k}.lite{FORMAT}-{lite_jit.target_name()}")


def load(k: str):
  """The lite function of library key ``k`` (this process's, or from the
  disk cache), or None."""
  fn = _memo.get(k)
  if fn is not None or not lite_jit.available():
    return fn
  base = _base(k)
  try:
    with open(base + ".json") as f:
      meta = json.load(f)
    consts = []
    if meta["consts"]:
      with np.load(os.path.join(disk_cache.directory(), f"{k}.npz")) as z:
        consts = [np.ascontiguousarray(z[n]) for n in meta["consts"]]
    if os.path.exists(base + ".so"):
      fn = lite_jit.callable_at(*lite_jit.load_library(base + ".so"), meta, consts)
    else:
      with open(base + ".o", "rb") as f:
        fn = lite_jit.make_callable(f.read(), meta, consts)
  except (OSError, ValueError, KeyError):
    return None
  _memo[k] = fn
  return fn


def job(k: str, src, descs) -> dict:
  """The compile process's job for ``src`` (a ``codegen.Source``): its
  text and constants written beside the build (``disk_cache.write_job``)."""
  srcfile, consts = disk_cache.write_job(k, src.text, src.globals)
  return {"kind": "lite", "src": srcfile, "consts": consts, "descs": descs,
          "outs": [[kind, np.dtype(dt).str] for kind, dt in src.outs],
          "scratch": [[np.dtype(dt).str, int(n)] for dt, n in getattr(src, "scratch", ())],
          "externals": dict(src.externals or {}), "out": _base(k)}
