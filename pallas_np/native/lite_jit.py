"""lite's machine code: the IR ``lite`` writes, optimised and compiled by
llvmlite in the compile process (``lite_worker``), kept as a shared
library (the object linked by the C compiler; where that fails, the object
itself, loaded into an MCJIT engine), and called as a CPython builtin with
the pycc library's convention as the tier sees it: ``fn(st, *args) -> (0,
*results)`` (docs/native.md, "lite"). The caller loads a library with
``ctypes.CDLL``: it never imports llvmlite unless a library could not be
linked.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
import threading

from pallas_np.native.contract import RUNTIME_ERROR, Refused

_lock = threading.Lock()  # (LLVM's target machine and engines: one build at a time)
_state: dict = {}
OPT_LEVEL = 3
EXIT_WAIT = 60.0  # seconds an exiting process waits for LLVM on another thread (~0.1-1 s)
LINK_TIMEOUT = 60.0  # seconds the C compiler may take to link one object
_CTYPES = {"bool": ctypes.c_bool, "int8": ctypes.c_int8, "int16": ctypes.c_int16,
           "int32": ctypes.c_int32, "int64": ctypes.c_int64, "uint8": ctypes.c_uint8,
           "uint16": ctypes.c_uint16, "uint32": ctypes.c_uint32, "uint64": ctypes.c_uint64,
           "float32": ctypes.c_float, "float64": ctypes.c_double}


def _layout_ok() -> bool:
  """Whether this NumPy's array and scalar structs are the ones the
  compiled code reads (a few ctypes reads, once per process)."""
  if "layout" in _state:
    return _state["layout"]
  ok = True
  try:
    import numpy as np  # (the caller's: the compile process imports no NumPy)
    probe = np.arange(3, dtype=np.int64)
    addr = ctypes.c_void_p.from_address(id(probe) + 16).value  # (lite_arrays.DATA_OFFSET)
    ok &= addr == probe.ctypes.data
    probe = np.arange(6, dtype=np.int32).reshape(2, 3).T
    strides = ctypes.c_void_p.from_address(id(probe) + 40).value  # (lite_arrays.STRIDES_OFFSET)
    ok &= (ctypes.c_int64 * 2).from_address(strides)[:] == list(probe.strides)
    dims = ctypes.c_void_p.from_address(id(probe) + 32).value  # (lite_arrays.DIMS_OFFSET)
    ok &= (ctypes.c_int64 * 2).from_address(dims)[:] == list(probe.shape)
    for name in _CTYPES:  # (a NumPy scalar's value right after its header)
      v = np.dtype(name).type(5)
      ok &= ctypes.string_at(id(v) + 16, v.itemsize) == v.tobytes()
  except Exception:  # noqa: BLE001 - no lite: the numba build
    ok = False
  _state["layout"] = bool(ok)
  return _state["layout"]


def _llvm():
  """llvmlite's binding with the native target (once per process: the
  compile process's, or the caller's where a library is an object); None
  where llvmlite is missing. (NumPy's structs, as the compiled code reads
  them, are the caller's to check: ``available``.)"""
  if "llvm" in _state:
    return _state["llvm"]
  try:
    import llvmlite.binding as llvm
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    _state["tm"] = _target_machine(llvm)
    _state["llvm"] = llvm
  except Exception:  # noqa: BLE001 - no lite: the numba build
    _state["llvm"] = None
  return _state["llvm"]


def ready() -> bool:
  """Whether llvmlite's binding and a target machine are set up here
  (set up now: the compile process's start, ``lite_worker.ready``)."""
  return _llvm() is not None


def _target_machine(llvm):
  """A target machine for the host CPU, position-independent code (the
  object is linked into a shared library). An MCJIT engine owns (and
  frees) the one it is given: each engine gets its own."""
  target = llvm.Target.from_default_triple()
  return target.create_target_machine(cpu=llvm.get_host_cpu_name(),
                                      features=llvm.get_host_cpu_features().flatten(),
                                      opt=OPT_LEVEL, reloc="pic", codemodel="jitdefault")


def _llvmlite_version() -> str | None:
  """llvmlite's version without importing it (~50 ms): its dist-info
  directory's name; None where it is not installed."""
  if "version" not in _state:
    spec = importlib.util.find_spec("llvmlite")
    version = None
    if spec is not None and spec.origin:
      site = os.path.dirname(os.path.dirname(spec.origin))
      # (listed, not globbed: a glob's pattern compiled costs ~0.2 ms of the caller's)
      found = sorted(name for name in os.listdir(site)
                     if name.startswith("llvmlite-") and name.endswith(".dist-info"))
      version = (found[-1][len("llvmlite-"):-len(".dist-info")] if found
                 else str(int(os.stat(spec.origin).st_mtime)))
    _state["version"] = version
  return _state["version"]


def available() -> bool:
  """Whether lite can build here (llvmlite installed, for the compile
  process, and NumPy's structs as the compiled code reads them), without
  importing llvmlite."""
  return _llvmlite_version() is not None and _layout_ok()


def target_name() -> str:
  """What compiled code depends on beside the disk cache directory's CPU
  id: llvmlite's (so LLVM's) version and the optimisation level."""
  return f"llvmlite{_llvmlite_version()}-o{OPT_LEVEL}"


def compile_ir(text: str, externals: dict) -> bytes:
  """The object code of ``text`` (with the IR modules of its externals
  linked in), optimised as numba optimises (loops vectorized)."""
  llvm = _llvm()
  if llvm is None:
    raise Refused("lite: llvmlite is not available")
  if "exit_guard" not in _state:
    _state["exit_guard"] = True
    atexit.register(_wait_for_llvm)
  with _lock:
    tm = _state["tm"]
    mod = llvm.parse_assembly(text)
    for ir_text in externals.values():
      mod.link_in(llvm.parse_assembly(ir_text))
    mod.triple = tm.triple
    mod.data_layout = str(tm.target_data)
    mod.verify()
    _optimize(llvm, tm, mod)
    return bytes(tm.emit_object(mod))


def _linkers() -> list:
  """The commands tried in turn to link an object into a shared library:
  ``$CC`` where set; else, on Linux, the system linker itself (``ld``,
  ~8 ms: the C compiler's driver, which runs it after its own start, took
  ~33 ms, on the critical path of a loop's first build) and then ``cc``."""
  cc = os.environ.get("CC", "").split()
  if cc:
    return [[*cc, "-shared"]]
  # (no libc named: its linker script and static part cost ld ~20 ms; the
  # library is only ever loaded into a CPython process, which has libc)
  found = [["ld", "-shared"]] if sys.platform.startswith("linux") and shutil.which("ld") else []
  return [*found, ["cc", "-shared"]]


def link_shared(obj_path: str, lib_path: str) -> bool:
  """Links an object into a shared library (``_linkers``; libm for what
  LLVM lowers to calls); False where none links it (the object is then
  loaded by MCJIT)."""
  for cmd in _linkers():
    try:
      done = subprocess.run([*cmd, "-o", lib_path, obj_path, "-lm"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, timeout=LINK_TIMEOUT, check=False)
    except (OSError, subprocess.SubprocessError):
      continue
    if done.returncode == 0 and os.path.exists(lib_path):
      return True
  return False


def _wait_for_llvm() -> None:
  """At exit: a build still in LLVM on another thread is waited for, and
  none starts after: exit's C++ destructors under a running pass aborted
  the process ("An asserting value handle still pointed to this value!")."""
  _lock.acquire(timeout=EXIT_WAIT)


def _optimize(llvm, tm, mod) -> None:
  """The module pipeline at ``OPT_LEVEL``, loops vectorized as numba's
  are, not unrolled: unrolling doubled a build's time (bitonic: 0.2 s ->
  0.55 s) for no faster loop (PERF_LOG, "[lite]")."""
  pto = llvm.create_pipeline_tuning_options(speed_level=OPT_LEVEL)
  pto.loop_vectorization = True
  pto.slp_vectorization = True
  pto.loop_unrolling = False
  pb = llvm.create_pass_builder(tm, pto)
  pb.getModulePassManager().run(mod, pb)


def load(obj: bytes):
  """(engine, address of ``lite_entry``) of an object file (MCJIT: the
  fallback where no library was linked)."""
  llvm = _llvm()
  if llvm is None:
    raise RuntimeError("lite: llvmlite is not available to load an object")
  if "exit_guard" not in _state:
    _state["exit_guard"] = True
    atexit.register(_wait_for_llvm)
  with _lock:
    ee = llvm.create_mcjit_compiler(llvm.parse_assembly(""), _target_machine(llvm))
    ee.add_object_file(llvm.ObjectFileRef.from_data(obj))
    ee.finalize_object()
    addr = ee.get_function_address("lite_entry")
  if not addr:
    raise RuntimeError("lite: lite_entry not found in its object")
  return ee, addr


def load_library(path: str):
  """(library, address of ``lite_entry``) of a linked shared library
  (``ctypes.CDLL``: a ``dlopen``, no llvmlite)."""
  lib = ctypes.CDLL(path)
  addr = ctypes.cast(lib.lite_entry, ctypes.c_void_p).value
  if not addr:
    raise RuntimeError(f"lite: lite_entry not found in {path}")
  return lib, addr


class _MethodDef(ctypes.Structure):
  _fields_ = [("name", ctypes.c_char_p), ("meth", ctypes.c_void_p), ("flags", ctypes.c_int),
              ("doc", ctypes.c_char_p)]


METH_FASTCALL = 0x0080
_new_function = ctypes.pythonapi.PyCFunction_NewEx
_new_function.restype = ctypes.py_object
_new_function.argtypes = [ctypes.POINTER(_MethodDef), ctypes.c_void_p, ctypes.c_void_p]


def _builtin(addr):
  """A builtin function object calling the METH_FASTCALL function at
  ``addr``, and what must outlive it (its method definition)."""
  mdef = _MethodDef(b"lite_entry", addr, METH_FASTCALL, None)
  return _new_function(ctypes.byref(mdef), None, None), mdef


def make_callable(obj: bytes, meta: dict, consts: list):
  """``callable_at`` of an object file's code (MCJIT)."""
  return callable_at(*load(obj), meta, consts)


def callable_at(engine, addr: int, meta: dict, consts: list):
  """``fn(st, *args) -> (0, *results)``, as the pycc library's function,
  of the ``lite_entry`` at ``addr`` (``engine``: what holds its code):
  ``meta`` (from ``lite.Translator``): the scalar arguments' dtypes (None
  for arrays), the arena's size, each result's (kind, dtype, size; None:
  reported by the call). A call that needs a larger arena (run-time sized
  buffers) says so and runs again in one."""
  import numpy as np  # (the caller's: the compile process imports no NumPy)
  cfunc, keep = _builtin(addr)
  scalars = [(k, np.dtype(dt).type) for k, dt in enumerate(meta["args"]) if dt is not None]
  size = meta["arena"]
  outs = [(kind, np.dtype(dt), n) for kind, dt, n in meta["outs"]]
  nout = max(len(outs), 1)
  consts = tuple(consts)
  empty, frombuffer, i64, u8 = np.empty, np.frombuffer, np.int64, np.uint8

  pool = []  # (arena, slots, readers) of finished calls: a fresh arena per call costs page faults

  def fresh():
    arena, slots = empty(size, u8), empty(2 * nout, i64)
    readers = []
    for k, (kind, dt, n) in enumerate(outs):
      if kind == "s":  # (the scalar's bits at the start of its 8-byte slot)
        readers.append((True, slots.view(dt), 8 * k // dt.itemsize))
      else:
        readers.append((False, dt, n))
    return arena, slots, readers

  def native_loop(st, *args):
    if scalars:  # (the entry reads a scalar's value from its NumPy type's layout)
      args = list(args)
      for k, t in scalars:
        if args[k].__class__ is not t:
          args[k] = t(args[k])
    entry = pool.pop() if pool else fresh()  # (pop/append: atomic, threads get their own)
    arena, slots, readers = entry
    done = cfunc(st, arena, slots, *args, *consts)
    while done is slots:  # (too small an arena: the bytes needed in slots[0])
      arena = empty(max(int(slots[0]), 2 * arena.size), u8)
      entry = (arena, slots, readers)
      done = cfunc(st, arena, slots, *args, *consts)
    if done is not st:
      pool.append(entry)
      if done is arena:
        if st[0] == RUNTIME_ERROR:  # (lite_headers: the prologue's missing addresses)
          raise RuntimeError("pallas_np native loop: no BLAS or loop addresses in its status")
        raise IndexError("pallas_np native loop: out-of-bounds ref access")
      raise ValueError("negative dimensions are not allowed")
    res = [0]
    for k, (scalar, a, b) in enumerate(readers):
      # (arrays copied out: the arena is used again)
      res.append(a[b] if scalar else frombuffer(arena, a, b if b is not None else int(slots[nout + k]),
                                                int(slots[k])).copy())
    pool.append(entry)
    return tuple(res)
  native_loop.lite = True
  native_loop.engine = (engine, keep)  # (the machine code lives as long as the function)
  return native_loop
