"""lite's side of the compile process (``aot_worker``): a loop's generated
source translated to LLVM IR (``lite``), compiled by llvmlite
(``lite_jit``) and linked into a shared library by the C compiler, written
into the disk cache for the caller to load (``lite_cache.load``: a
``dlopen``). The caller's process pays none of it: neither llvmlite's
import and target machine nor the translation's Python (which held its
GIL) nor LLVM (docs/native.md, "lite").

Imported without JAX, NumPy or pallas_np's package (``aot_worker`` makes
stand-in packages for ``pallas_np`` and ``pallas_np.native``): lite's
modules read only ``contract`` and ``lite_dtype`` (dtypes and the job's
constants without NumPy, whose import was a third of this process's
start) beside llvmlite.

A job (one JSON line): ``{"kind": "lite", "src", "consts", "descs",
"outs", "scratch", "externals", "out"}``: the source file and its
constants (an ``.npz``: 0-d arrays are the source's scalar constants), each
loop operand's ``[kind, dtype, shape, contiguous]``, the results' ``[kind,
dtype]``, the scratch arrays' ``[dtype, size]``, the IR of called
externals, and the path the build is written to, less its suffix:
``.so`` (or ``.o`` where no C compiler links it) and then ``.json`` (its
``lite_jit.callable_at`` meta), written last, so that a reader that finds
the meta finds the code. The reply: ``{"ok": true}``, or ``{"ok": false,
"refused": why}`` outside lite's subset (numba builds that loop).
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import types

from pallas_np.native import lite, lite_dtype, lite_jit
from pallas_np.native.contract import Refused


def _write(path: str, data: bytes) -> None:
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "wb") as f:
    f.write(data)
  os.replace(tmp, path)


def build(job: dict) -> dict:
  with open(job["src"]) as f:
    text = f.read()
  constants = lite_dtype.constants(job["consts"])
  src = types.SimpleNamespace(
      text=text, globals=constants, externals=dict(job.get("externals") or {}),
      outs=[(kind, lite_dtype.dtype(dt)) for kind, dt in job["outs"]],
      scratch=[(lite_dtype.dtype(dt), n) for dt, n in job.get("scratch") or ()])
  descs = [(kind, lite_dtype.dtype(dt), tuple(shape), bool(contiguous))
           for kind, dt, shape, contiguous in job["descs"]]
  try:
    ir_text, meta, _ = lite.translate(src, descs)
  except Refused as e:
    return {"ok": False, "refused": str(e)}
  binding_set_up()
  obj = lite_jit.compile_ir(ir_text, src.externals)
  meta["consts"] = [name for name, v in constants.items() if isinstance(v, lite_dtype.ConstArray)]
  base = job["out"]
  with tempfile.TemporaryDirectory(prefix="pallas_np-lite-") as tmp:
    obj_path = os.path.join(tmp, "loop.o")
    with open(obj_path, "wb") as f:
      f.write(obj)
    lib = f"{base}.{os.getpid()}.so.tmp"  # (linked beside its place: renamed into it)
    if lite_jit.link_shared(obj_path, lib):
      os.replace(lib, f"{base}.so")
    else:
      if os.path.exists(lib):
        os.unlink(lib)
      _write(f"{base}.o", obj)
  _write(f"{base}.json", json.dumps(meta).encode())
  return {"ok": True}


_binding: list = []  # the thread setting llvmlite's binding up (``ready``)


def ready() -> None:
  """What a build needs, begun when the process starts (``aot_worker
  --warm --lite``, which then says it is ready): lite's modules (imported
  with this one, llvmlite's IR builder: the translation's) and, on a
  thread, llvmlite's binding with a target machine (~0.06 s, mostly a
  ``dlopen`` without the GIL), so that the caller's source generation and
  a job's translation overlap it; a build waits for it before LLVM runs
  (``binding_set_up``), as does the process's exit."""
  if not _binding:
    thread = threading.Thread(target=lite_jit.ready, name="llvmlite-binding", daemon=True)
    thread.start()
    _binding.append(thread)


def binding_set_up(pending=lambda: False) -> bool:
  """Waits for ``ready``'s thread, or until a job is ``pending``; whether
  the binding is set up."""
  for thread in _binding:
    while thread.is_alive():
      if pending():
        return False
      thread.join(0.005)
  return True


_WARM_IR = "define i64 @warm(i64 %x) {\n  %y = add i64 %x, 1\n  ret i64 %y\n}\n"


def warm_up(pending=lambda: False) -> None:
  """What the first build does once per process, done before it arrives:
  LLVM's pipeline on a small module and the linker's first run (its files
  read from disk). Cut short where a job is ``pending`` (its build does
  the same work: waiting for the warm-up would only delay it)."""
  if not binding_set_up(pending) or pending():
    return
  obj = lite_jit.compile_ir(_WARM_IR, {})
  if pending():
    return
  with tempfile.TemporaryDirectory(prefix="pallas_np-lite-warm-") as tmp:
    obj_path = os.path.join(tmp, "warm.o")
    with open(obj_path, "wb") as f:
      f.write(obj)
    lite_jit.link_shared(obj_path, os.path.join(tmp, "warm.so"))
