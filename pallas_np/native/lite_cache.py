"""lite builds as the tier sees them: a loop's generated source compiled
in this process (``lite``, ``lite_jit``), its object code kept in the disk
cache beside the numba libraries, and loaded by the loop's key
(docs/native.md, "lite").

``PALLAS_NP_NATIVE_COMPILER`` picks the compiler: ``auto`` (the default)
and ``lite``: lite first for every build (``"sync"`` ones too), a loop lite
refuses is priced and built by numba; ``numba``: never lite.
"""
from __future__ import annotations

import json
import os

import numpy as np

from pallas_np.native import codegen, disk_cache, lite, lite_jit

ENV = "PALLAS_NP_NATIVE_COMPILER"
CHOICES = ("auto", "lite", "numba")
# Seconds a lite build is priced at (translation ~10-50 ms of Python under
# the GIL, LLVM ~0.1-1 s without it): the cost rule makes it due early.
PRICE = 0.1
FORMAT = 1
_memo: dict = {}  # library key -> loaded lite function
prepared: list = []  # (non-empty once ``prepare`` was queued)


def mode() -> str:
  raw = os.environ.get(ENV, "").strip().lower() or "auto"
  if raw not in CHOICES:
    raise ValueError(f"{ENV}={raw!r}: expected one of {', '.join(CHOICES)}")
  return raw


def enabled() -> bool:
  """Whether builds try lite first (llvmlite's import waits for the
  first build: a loop that is never built does not pay it)."""
  return mode() != "numba"


def prepare() -> None:
  """llvmlite's import and the target machine (the first build's one-off
  part), ahead of it."""
  lite_jit.available()


def arg_descs(kinds, avals, layouts) -> list:
  """Each loop operand as ``lite.translate`` takes it: (kind, dtype,
  static shape, C-contiguous)."""
  out = []
  for kind, aval, layout in zip(kinds, avals, layouts):
    inner = aval.inner_aval if kind == "r" else aval
    dt = codegen.dtype_of(inner)
    if kind != "s" and layout is None:
      raise codegen.Refused("lite: a scalar where an array was expected")
    out.append((kind, dt, tuple(inner.shape), kind == "s" or layout[0]))
  return out


def _paths(k: str) -> tuple[str, str]:
  base = os.path.join(disk_cache.directory(), f"{k}.lite{FORMAT}-{lite_jit.target_name()}")
  return base + ".o", base + ".json"


def load(k: str):
  """The lite function of library key ``k`` (this process's, or from the
  disk cache), or None."""
  fn = _memo.get(k)
  if fn is not None or not lite_jit.available():
    return fn
  obj_path, meta_path = _paths(k)
  try:
    with open(meta_path) as f:
      meta = json.load(f)
    with open(obj_path, "rb") as f:
      obj = f.read()
    consts = []
    if meta["consts"]:
      with np.load(os.path.join(disk_cache.directory(), f"{k}.npz")) as z:
        consts = [np.ascontiguousarray(z[n]) for n in meta["consts"]]
  except (OSError, ValueError, KeyError):
    return None
  fn = _memo[k] = lite_jit.make_callable(obj, meta, consts)
  return fn


def build(k: str, src, descs):
  """Translate, compile and load ``src`` (a ``codegen.Source``), keeping
  its object on disk; raises ``codegen.Refused`` outside lite's subset."""
  if not lite_jit.available():
    raise codegen.Refused("lite: llvmlite is not available")
  text, meta, consts = lite.translate(src, descs)
  obj = lite_jit.compile_ir(text, src.externals)
  meta["consts"] = [name for name, v in src.globals.items() if isinstance(v, np.ndarray)]
  fn = _memo[k] = lite_jit.make_callable(obj, meta, consts)
  if meta["consts"]:
    disk_cache.write_job(k, src.text, src.globals)
  obj_path, meta_path = _paths(k)
  for path, data in ((obj_path, obj), (meta_path, json.dumps(meta).encode())):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  return fn
