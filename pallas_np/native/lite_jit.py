"""lite's machine code: the IR ``lite`` writes, optimised and compiled by
llvmlite in this process (a ctypes call: LLVM runs without the GIL), kept
as an object file (the disk cache's), loaded into an MCJIT engine, and
called through ctypes with the pycc library's convention as the tier sees
it: ``fn(st, *args) -> (0, *results)`` (docs/native.md, "lite").
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from pallas_np.native.codegen import Refused

_lock = threading.Lock()  # (LLVM's target machine and engines: one build at a time)
_state: dict = {}
OPT_LEVEL = 3
_CTYPES = {"bool": ctypes.c_bool, "int8": ctypes.c_int8, "int16": ctypes.c_int16,
           "int32": ctypes.c_int32, "int64": ctypes.c_int64, "uint8": ctypes.c_uint8,
           "uint16": ctypes.c_uint16, "uint32": ctypes.c_uint32, "uint64": ctypes.c_uint64,
           "float32": ctypes.c_float, "float64": ctypes.c_double}


def _llvm():
  """llvmlite's binding with the native target (once per process); None
  where llvmlite is missing or this NumPy's array struct is not the one
  the compiled code reads."""
  if "llvm" in _state:
    return _state["llvm"]
  try:
    import llvmlite.binding as llvm
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    tm = _target_machine(llvm)
    probe = np.arange(3, dtype=np.int64)
    addr = ctypes.c_void_p.from_address(id(probe) + 16).value  # (lite.DATA_OFFSET)
    if addr != probe.ctypes.data:
      raise RuntimeError("NumPy's array struct: data is not at offset 16")
    _state["tm"] = tm
    _state["llvm"] = llvm
  except Exception:  # noqa: BLE001 - no lite: the numba build
    _state["llvm"] = None
  return _state["llvm"]


def _target_machine(llvm):
  """A target machine for the host CPU. An MCJIT engine owns (and frees)
  the one it is given: each engine gets its own."""
  target = llvm.Target.from_default_triple()
  return target.create_target_machine(cpu=llvm.get_host_cpu_name(),
                                      features=llvm.get_host_cpu_features().flatten(),
                                      opt=OPT_LEVEL, reloc="default", codemodel="jitdefault")


def available() -> bool:
  return _llvm() is not None


def target_name() -> str:
  """What compiled objects depend on (the disk cache's key): CPU and LLVM."""
  llvm = _llvm()
  return f"{llvm.get_host_cpu_name()}-{'.'.join(map(str, llvm.llvm_version_info))}-o{OPT_LEVEL}"


def compile_ir(text: str, externals: dict) -> bytes:
  """The object code of ``text`` (with the IR modules of its externals
  linked in), optimised as numba optimises (loops vectorized)."""
  llvm = _llvm()
  if llvm is None:
    raise Refused("lite: llvmlite is not available")
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
  """(engine, address of ``native_loop``) of an object file."""
  llvm = _llvm()
  with _lock:
    ee = llvm.create_mcjit_compiler(llvm.parse_assembly(""), _target_machine(llvm))
    ee.add_object_file(llvm.ObjectFileRef.from_data(obj))
    ee.finalize_object()
    addr = ee.get_function_address("native_loop")
  if not addr:
    raise RuntimeError("lite: native_loop not found in its object")
  return ee, addr


def make_callable(obj: bytes, meta: dict, consts: list):
  """``fn(st, *args) -> (0, *results)``, as the pycc library's function:
  ``meta`` (from ``lite.Translator``): the scalar arguments' dtypes (None
  for arrays), the arena's size, each result's (kind, dtype, size)."""
  ee, addr = load(obj)
  argtypes = [ctypes.py_object] * 3
  argtypes += [ctypes.py_object if dt is None else _CTYPES[np.dtype(dt).name] for dt in meta["args"]]
  argtypes += [ctypes.py_object] * len(consts)
  cfunc = ctypes.CFUNCTYPE(ctypes.c_int32, *argtypes)(addr)
  size = meta["arena"]
  outs = [(kind, np.dtype(dt), n) for kind, dt, n in meta["outs"]]
  nout = max(len(outs), 1)
  consts = tuple(consts)
  empty, frombuffer, i64, u8 = np.empty, np.frombuffer, np.int64, np.uint8

  pool = []  # arenas of finished calls (a fresh one per call costs page faults)

  def native_loop(st, *args):
    arena = pool.pop() if pool else empty(size, u8)  # (pop/append: atomic, threads get their own)
    slots = empty(nout, i64)
    rc = cfunc(st, arena, slots, *args, *consts)
    res = [0]
    if not rc:
      for k, (kind, dt, n) in enumerate(outs):
        if kind == "s":
          res.append(frombuffer(slots, dt, 1, 8 * k)[0])
        else:  # (copied out: the arena is used again)
          res.append(frombuffer(arena, dt, n, int(slots[k])).copy())
    pool.append(arena)
    if rc:
      raise IndexError("pallas_np native loop: out-of-bounds ref access")
    return tuple(res)
  native_loop.engine = ee  # (the machine code lives as long as the function)
  return native_loop
