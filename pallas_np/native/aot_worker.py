"""The native tier's compile process: builds one loop's generated source
into a shared library with numba's ahead-of-time compiler (``numba.pycc``),
in a process of its own, so that numba's import, typing and LLVM never hold
the caller's GIL (docs/native.md).

Run as a script (``python aot_worker.py``; it imports neither pallas_np
nor JAX, only NumPy and numba, or for lite's jobs ``{"kind": "lite", ...}``
llvmlite and lite's own modules: ``lite_worker``): it reads one job a line
on stdin, a JSON
object ``{"src", "consts", "args", "ret", "out"}`` (the source file, its
constants as an ``.npz``, the argument and result types, the library to
write), builds it and answers one line ``{"ok": bool, "error", "seconds"}``
on stdout (``setup_seconds``: the part of ``seconds`` spent on one-off work
a later build does not repeat, numba's import and pycc's C helpers). It
exits at the end of its input (its parent's exit). A background lite
process (``--warm --lite``) first writes ``{"ready": true}`` once lite's
modules are imported and llvmlite's binding is being set up, before its
warm-up (the caller's tier
waits for it before it generates a loop's source: ``scheduler``).

Every library is one extension module named ``MODULE``: pycc's C helpers
(``modulemixin.c`` and NumPy/NRT glue, ~9 s of a C compiler) depend only on
that name, so they are compiled once per cache directory (``mixins/``) and
linked into every loop's library. Libraries of the same name are loaded
under distinct paths (``tier``), never into ``sys.modules``. The written
library is renamed into place, so a concurrent process sees all or nothing.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import tempfile
import time
import types

MODULE = "pallas_np_native_loop"


def _types(numba, desc):
  """A numba type from its description: ``["s", dtype]`` (a scalar),
  ``["a", dtype, ndim, contiguous, writeable]`` (an array)."""
  dt = numba.from_dtype(__import__("numpy").dtype(desc[1]))
  if desc[0] == "s":
    return dt
  return numba.types.Array(dt, desc[2], "C" if desc[3] else "A", readonly=not desc[4])


def _patch_error_model(pycc_compiler):
  """pycc compiles with numba's default flags, whose ``error_model`` is
  Python's (x/0 raises); the NumPy path's (and jit's ``error_model="numpy"``)
  gives IEEE results. Only this process is patched."""
  base = pycc_compiler.Flags

  class NumpyErrors(base):
    def __init__(self, *a, **k):
      super().__init__(*a, **k)
      self.error_model = "numpy"
  pycc_compiler.Flags = NumpyErrors


_setup = [0.0]  # seconds of one-off work in the current build (see main)


# pycc's C helpers are compiled without debug information and at -O1 (the
# generated loops call only NRT's allocator among them, a few times a call):
# 6 s instead of 11 s on 2 cores, once per cache directory.
MIXIN_CFLAGS = ["-O1", "-g0"]


def _compile_mixins(cc, build_dir) -> list:
  """pycc's ``_compile_mixins``, its sources compiled two at a time (this
  process is niced: a busy caller's core is not taken)."""
  from concurrent.futures import ThreadPoolExecutor
  sources = cc._get_mixin_sources()  # noqa: SLF001 - pycc has no public split
  macros = cc._get_mixin_defines()  # noqa: SLF001
  include_dirs = cc._toolchain.get_python_include_dirs()  # noqa: SLF001

  def compile_one(k):
    out = os.path.join(build_dir, f"mixin{k}")
    # (normalised: distutils puts the object at out + the source's path and,
    # with older setuptools (65.5, a fresh venv's), keeps its "pycc/../core"
    # steps, which the assembler cannot open where "pycc" is not made under
    # ``out`` too, as in a call of one source)
    return cc._toolchain.compile_objects(  # noqa: SLF001
        [os.path.normpath(sources[k])], out, include_dirs=include_dirs, macros=macros,
        extra_cflags=MIXIN_CFLAGS)
  with ThreadPoolExecutor(2) as pool:
    return [o for objs in pool.map(compile_one, range(len(sources))) for o in objs]


def _mixins(cc, cache_dir, build_dir):
  """pycc's C helper objects, compiled once per cache directory."""
  mix_dir = os.path.join(cache_dir, "mixins")
  found = sorted(glob.glob(os.path.join(mix_dir, "*.o")))
  if found:
    return found
  t0 = time.perf_counter()
  objs = _compile_mixins(cc, build_dir)
  _setup[0] += time.perf_counter() - t0
  tmp = tempfile.mkdtemp(dir=cache_dir, prefix="mixins-")
  for k, o in enumerate(objs):
    shutil.copy(o, os.path.join(tmp, f"{k:02d}_{os.path.basename(o)}"))
  try:
    os.rename(tmp, mix_dir)
  except OSError:  # (another process was first)
    shutil.rmtree(tmp, ignore_errors=True)
  return sorted(glob.glob(os.path.join(mix_dir, "*.o")))


def _external(symbol: str, ir: str):
  """A float32 -> float32 function the generated code calls by the name
  ``_ext_<symbol>``: a call of ``symbol``, whose IR module (``ir``) is
  linked into the library the call is compiled into (once per library)."""
  import llvmlite.binding as llvm
  import llvmlite.ir as lir
  from numba import types
  from numba.core import cgutils
  from numba.extending import intrinsic
  linked = set()

  @intrinsic
  def call(typingctx, x):
    def codegen(context, builder, signature, args):
      library = context.active_code_library
      if id(library) not in linked:
        library.add_llvm_module(llvm.parse_assembly(ir))
        linked.add(id(library))
      fnty = lir.FunctionType(lir.FloatType(), [lir.FloatType()])
      fn = cgutils.get_or_insert_function(builder.module, fnty, symbol)
      return builder.call(fn, args)
    return types.float32(types.float32), codegen
  return call


_INT_OPS: dict = {}  # (made once per process: its builds share their typing)


def _int_ops() -> dict:
  """``_sdiv``/``_srem``: LLVM's truncating signed division and remainder
  of two integers of one type (XLA's ``div``/``rem``; the generated code
  never passes 0 or -1 as the divisor). numba's ``//`` and ``%`` floor
  (the generated code would undo that with branches per element) and its
  ``np.fmod`` of signed integers is an unsigned remainder."""
  if _INT_OPS:
    return _INT_OPS
  from numba import types
  from numba.extending import intrinsic

  def make(op):
    @intrinsic
    def fn(typingctx, a, b):
      if not (isinstance(a, types.Integer) and isinstance(b, types.Integer) and a.signed):
        return None

      def codegen(context, builder, signature, args):
        return getattr(builder, op)(args[0], context.cast(builder, args[1], b, a))
      return a(a, b), codegen
    return fn
  _INT_OPS.update(_sdiv=make("sdiv"), _srem=make("srem"))
  return _INT_OPS


def build(job: dict) -> None:
  t0 = time.perf_counter()
  fresh = "numba" not in sys.modules
  import numba
  import numpy as np
  from numba.pycc import CC
  from numba.pycc import compiler as pycc_compiler
  if fresh:
    _setup[0] += time.perf_counter() - t0
  if not getattr(pycc_compiler.Flags, "_pallas_np", False):
    _patch_error_model(pycc_compiler)
    pycc_compiler.Flags._pallas_np = True
  scope = {"np": np, **_int_ops()}
  with np.load(job["consts"]) as consts:
    for k in consts.files:
      v = consts[k]
      scope[k] = v[()] if v.ndim == 0 else v
  for symbol, ir in (job.get("externals") or {}).items():
    scope[f"_ext_{symbol}"] = _external(symbol, ir)
  with open(job["src"]) as f:
    exec(compile(f.read(), job["src"], "exec"), scope)  # noqa: S102 - our generated code
  args = tuple(_types(numba, d) for d in job["args"])
  ret = numba.types.Tuple(tuple(
      _types(numba, d) for d in job["ret"]))
  out = job["out"]
  cache_dir = os.path.dirname(out)
  build_dir = tempfile.mkdtemp(prefix="pallas_np-native-")
  try:
    cc = CC(MODULE)
    cc.target_cpu = "host"  # (the cache directory is per CPU: disk_cache)
    cc.output_dir = build_dir
    cc.output_file = "loop.so"
    cc.export("native_loop", ret(*args))(scope["native_loop"])
    objs, exports = cc._compile_object_files(build_dir)  # noqa: SLF001
    objs += _mixins(cc, cache_dir, build_dir)
    tc = cc._toolchain  # noqa: SLF001
    lib = os.path.join(build_dir, "loop.so")
    tc.link_shared(lib, objs, tc.get_python_libraries(), tc.get_python_library_dirs(),
                   export_symbols=exports, extra_ldflags=cc._get_extra_ldflags())  # noqa: SLF001
    tmp = f"{out}.{os.getpid()}.tmp"
    shutil.move(lib, tmp)
    os.replace(tmp, out)
  finally:
    shutil.rmtree(build_dir, ignore_errors=True)


_WARM_SOURCE = """
def native_loop(_st, a, b, c):
    x = np.empty(4, np.float32)
    y = np.empty(4, np.int32)
    z = np.empty(4, np.bool_)
    w = np.empty(4, np.float64)
    u = np.empty(4, np.int64)
    for _c in range(4):
        x[_c] = np.float32(a[_c] + a[_c]) if a[_c] > 0 else a[_c]
        y[_c] = np.int32(_sdiv(b[_c], np.int32(3)) + _srem(b[_c], np.int32(5)))
        z[_c] = c[_c] | (a[_c] > 0)
        w[_c] = np.float64(a[_c])
        u[_c] = np.int64(b[_c])
    return (0, x, y, z, w, u)
"""


def warm_up() -> None:
  """What every build does once per process, done before the first build
  arrives (``--warm``: the tier starts this process when a loop is priced,
  ahead of its build): numba's import, its typing and lowering registries,
  and the overloads the generated code calls (``np.empty`` of the common
  dtypes), through pycc's own compile of a small loop (not linked)."""
  import numba
  import numpy as np
  from numba.pycc import CC
  from numba.pycc import compiler as pycc_compiler
  if not getattr(pycc_compiler.Flags, "_pallas_np", False):
    _patch_error_model(pycc_compiler)
    pycc_compiler.Flags._pallas_np = True
  scope = {"np": np, **_int_ops()}
  exec(compile(_WARM_SOURCE, "<warm-up>", "exec"), scope)  # noqa: S102 - our own source
  arr = lambda dt: numba.types.Array(numba.from_dtype(np.dtype(dt)), 1, "C")
  args = (arr("int64"), arr("float32"), arr("int32"), arr("bool"))
  ret = numba.types.Tuple((numba.int64, arr("float32"), arr("int32"), arr("bool"),
                           arr("float64"), arr("int64")))
  build_dir = tempfile.mkdtemp(prefix="pallas_np-native-warm-")
  _warming[:] = [build_dir]
  try:
    cc = CC(MODULE)
    cc.target_cpu = "host"
    cc.output_dir = build_dir
    cc.export("native_loop", ret(*args))(scope["native_loop"])
    cc._compile_object_files(build_dir)  # noqa: SLF001
  finally:
    _warming.clear()
    shutil.rmtree(build_dir, ignore_errors=True)


_warming: list = []  # the warm-up's build directory while it runs


def _orphan_watch(parent: int) -> None:
  """Ends this process if its parent exits during the warm-up (which reads
  no input, so it would not see the end of it): a warm-up for a process
  that is gone is CPU for nothing."""
  while True:
    time.sleep(0.2)
    if not _warming:
      return
    if os.getppid() != parent:
      if _warming[0] is not None:
        shutil.rmtree(_warming[0], ignore_errors=True)
      os._exit(0)


def _input_pending() -> bool:
  """Whether a job line (or the end of the input) is waiting on stdin."""
  try:
    import select
    return bool(select.select([sys.stdin], [], [], 0)[0])
  except (OSError, ValueError):
    return False


def _lite():
  """``lite_worker`` (lite's builds), imported under stand-in packages
  for ``pallas_np`` and ``pallas_np.native``: their ``__init__`` (JAX) is
  never run here, only lite's own modules."""
  if "pallas_np.native.lite_worker" not in sys.modules:
    here = os.path.dirname(os.path.abspath(__file__))
    for name, path in (("pallas_np", os.path.dirname(here)), ("pallas_np.native", here)):
      if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [path]
        sys.modules[name] = pkg
  import importlib
  return importlib.import_module("pallas_np.native.lite_worker")


def main() -> None:
  # Lowest CPU priority (background builds): on a machine with no idle core
  # the build waits for the caller, not the other way round. A build the
  # caller waits for ("sync") runs in a process at normal priority.
  if "--nice" in sys.argv:
    at = sys.argv.index("--nice") + 1  # (a level may follow: 19 by default)
    level = int(sys.argv[at]) if at < len(sys.argv) and sys.argv[at].isdigit() else 19
    try:
      os.nice(level)
    except (AttributeError, OSError):
      pass
  # The protocol keeps the original stdout; everything else written to
  # fd 1 (distutils' log, the C compiler) goes to stderr.
  proto = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)
  sys.stdout = sys.stderr
  if "--warm" in sys.argv:
    import threading
    _warming[:] = [None]
    # (the parent's pid from the command line: it may have exited already)
    at = sys.argv.index("--warm") + 1
    parent = int(sys.argv[at]) if at < len(sys.argv) and sys.argv[at].isdigit() else os.getppid()
    threading.Thread(target=_orphan_watch, args=(parent,), daemon=True).start()
    if "--lite" in sys.argv:
      # (ready for a build once lite's modules are imported and llvmlite's binding is being
      # set up, ``lite_worker.ready``: the caller's tier generates a loop's source only then,
      # ``tier``; the warm-up follows. The line is written whatever failed: the caller waits)
      try:
        _lite().ready()
      except Exception:  # noqa: BLE001 - the first build does it again, and reports
        pass
      proto.write(json.dumps({"ready": True}) + "\n")
      proto.flush()
    try:
      _lite().warm_up(_input_pending) if "--lite" in sys.argv else warm_up()
    except Exception:  # noqa: BLE001 - the first build does it again, and reports
      pass
    _warming.clear()
  for line in sys.stdin:
    if not line.strip():
      continue
    t0 = time.perf_counter()
    _setup[0] = 0.0
    try:
      job = json.loads(line)
      if job.get("kind") == "lite":
        reply = _lite().build(job)
      else:
        build(job)
        reply = {"ok": True}
    except Exception as e:  # noqa: BLE001 - reported to the parent
      reply = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    reply["seconds"] = time.perf_counter() - t0
    reply["setup_seconds"] = _setup[0]
    proto.write(json.dumps(reply) + "\n")
    proto.flush()
  if "pallas_np.native.lite_worker" in sys.modules:  # (no exit under LLVM's set-up on a thread)
    sys.modules["pallas_np.native.lite_worker"].binding_set_up()


if __name__ == "__main__":
  main()
