"""The C math library's float32 functions over whole arrays, as XLA calls them.

XLA's CPU backend does not expand every transcendental itself: ``sin``,
``cos``, ``tan``, ``atan``, ``atan2`` (so ``asin``/``acos``), ``cbrt`` and
``pow`` in float32 (and bf16/f16, computed in float32) become calls to the
process's C library (``sinf``, ``cosf``, ...: glibc on Linux), one element at
a time. NumPy's float32 ufuncs for the same functions take a SIMD code path
chosen by the CPU and NumPy version (its own AVX2/AVX-512 kernels, or Intel's
SVML on AVX-512 machines), which can differ from the C library by an ulp or
more, so they are bit-exact with XLA on one machine and not on the next.
Here the C library's own function runs over the array in a loop compiled
once per process with llvmlite (numba's code generator, a dependency
already): bit for bit what XLA computes on the same machine, whatever the
CPU, and free of NumPy's dispatch. A denormal operand is read as it is (XLA
runs with denormals flushed: docs/limits.md).

The loops are built on first use (~0.1 s, under a lock); each call is one
ctypes call per array (the GIL is released while it runs).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading

import numpy as np

# C name -> number of float operands.
FUNCTIONS = {"sinf": 1, "cosf": 1, "tanf": 1, "atanf": 1, "cbrtf": 1, "atan2f": 2, "powf": 2}

_lock = threading.Lock()
_loops: dict = {}
_engine = None  # kept alive: the compiled code lives in it


def _ir() -> str:
  lines = []
  for name, nargs in FUNCTIONS.items():
    params = ", ".join(["float"] * nargs)
    lines.append(f"declare float @{name}({params})")
    ins = ", ".join(f"float* %in{k}" for k in range(nargs))
    loads = "\n".join(
        f"  %p{k} = getelementptr float, float* %in{k}, i64 %i\n  %v{k} = load float, float* %p{k}"
        for k in range(nargs))
    args = ", ".join(f"float %v{k}" for k in range(nargs))
    lines.append(f"""
define void @loop_{name}({ins}, float* %out, i64 %n) {{
entry:
  %empty = icmp sle i64 %n, 0
  br i1 %empty, label %done, label %body
body:
  %i = phi i64 [0, %entry], [%next, %body]
{loads}
  %r = call float @{name}({args})
  %po = getelementptr float, float* %out, i64 %i
  store float %r, float* %po
  %next = add i64 %i, 1
  %more = icmp slt i64 %next, %n
  br i1 %more, label %body, label %done
done:
  ret void
}}""")
  return "\n".join(lines)


def _build():
  global _engine
  import llvmlite.binding as llvm  # (lazily: only these ops pay for it)
  llvm.initialize_native_target()
  llvm.initialize_native_asmprinter()
  libm = ctypes.util.find_library("m")
  if libm:
    llvm.load_library_permanently(libm)
  module = llvm.parse_assembly(_ir())
  module.verify()
  # -O0 code generation: the loop calls the library function as written (no
  # libcall simplification may replace it by another formula).
  machine = llvm.Target.from_default_triple().create_target_machine(opt=0)
  engine = llvm.create_mcjit_compiler(module, machine)
  engine.finalize_object()
  loops = {}
  for name, nargs in FUNCTIONS.items():
    proto = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * (nargs + 1), ctypes.c_int64)
    loops[name] = proto(engine.get_function_address(f"loop_{name}"))
  _engine = engine
  return loops


def _loop(name):
  if not _loops:
    with _lock:
      if not _loops:
        _loops.update(_build())
  return _loops[name]


def call(name: str, *operands) -> np.ndarray:
  """``name`` (a C float function of FUNCTIONS) elementwise over the
  broadcast float32 operands; a float32 array (0-d for scalars)."""
  loop = _loop(name)
  ops = np.broadcast_arrays(*[np.asarray(v, np.float32) for v in operands])
  ops = [np.ascontiguousarray(v) for v in ops]
  out = np.empty(ops[0].shape, np.float32)
  if out.size:
    loop(*[v.ctypes.data for v in ops], out.ctypes.data, out.size)
  return out


def unary(name: str):
  return lambda x: call(name, x)


def binary(name: str):
  return lambda x, y: call(name, x, y)
