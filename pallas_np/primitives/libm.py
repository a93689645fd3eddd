"""Compiled float32 loops: the C library's functions as XLA calls them, and
XLA's own formulas written in LLVM IR.

XLA's CPU backend does not expand every transcendental itself: ``sin``,
``cos``, ``tan``, ``atan``, ``atan2`` (so ``asin``/``acos``), ``cbrt`` and
``pow`` in float32 (and bf16/f16, computed in float32) become calls to the
process's C library (``sinf``, ``cosf``, ...: glibc on Linux), one element at
a time. NumPy's float32 ufuncs for the same functions take a SIMD code path
chosen by the CPU and NumPy version (its own AVX2/AVX-512 kernels, or Intel's
SVML on AVX-512 machines), which can differ from the C library by an ulp or
more, so they were bit-exact with XLA on one machine and not on the next.
Here the C library's own function runs over the array in a loop compiled
once per process with llvmlite (numba's code generator, a dependency
already): bit for bit what XLA computes on the same machine, whatever the
CPU, and free of NumPy's dispatch. A denormal operand is read as it is (XLA
runs with denormals flushed: docs/limits.md).

The C library's double functions for expm1, sinh, asinh, acosh and atanh
(``DOUBLE_FUNCTIONS``) loop the same way over float64 arrays: the rules
that compute those in float64 and round once (``special.in_float64``) call
them instead of NumPy's float64 ufuncs, whose loops also have CPU-chosen
AVX-512 variants.

The same machinery compiles the formulas XLA emits itself (``exp``, ``log``:
``xla_math.py`` writes them with ``define``: exp, log, tanh) with their FMAs as
``llvm.fma.f32``, whose result is the exactly rounded FMA on every CPU: one
vectorised pass, faster than NumPy's own float32 exp/log.

Each loop is built on its first use (under a lock): on Linux x86-64 its
object code comes from an on-disk cache (``libm_cache.py``, keyed by the IR,
llvmlite's version and the CPU level; ``PALLAS_NP_LIBM_CACHE=0`` turns it
off) and is loaded without LLVM (``libm_loader.py``), so only the first
process on a machine pays llvmlite's import and LLVM's compile (~0.2 s);
elsewhere llvmlite's MCJIT compiles it in each process. Each call is one
ctypes call per array (the GIL is released while it runs); other compiled
code can call a loop by its address (``address``).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading

import numpy as np

from pallas_np.primitives import libm_cache, libm_loader

# C name -> number of float operands.
FUNCTIONS = {"sinf": 1, "cosf": 1, "tanf": 1, "atanf": 1, "cbrtf": 1, "atan2f": 2, "powf": 2}
# C name -> number of double operands: the C library's double functions,
# for the primitives whose float32 result is computed in float64 and
# rounded once (``special.in_float64``): NumPy's float64 loops for these
# take a SIMD path chosen by the CPU too (AVX-512 ones, ``numpy.lib.
# introspect.opt_func_info``), the C library's scalar code does not.
DOUBLE_FUNCTIONS = {"expm1": 1, "sinh": 1, "asinh": 1, "acosh": 1, "atanh": 1}
# Functions written here in LLVM IR (XLA's own formulas, xla_math.py):
# name -> (number of float operands, the IR of ``float @name(float ...)``).
DEFINED: dict = {}
_INTRINSICS = """declare float @llvm.fma.f32(float, float, float)
declare float @llvm.floor.f32(float)
declare float @llvm.fabs.f32(float)
declare float @llvm.copysign.f32(float, float)"""


def define(name: str, nargs: int, ir: str):
  """Adds a scalar float function in LLVM IR, looped like the C library's
  (before the first call)."""
  assert not _loops, "define() after the loops were built"
  DEFINED[name] = (nargs, ir)

_lock = threading.Lock()
_loops: dict = {}  # name -> its compiled loop (ctypes), built on first use
_addresses: dict = {}  # name -> its loop's address
_engine = None  # (MCJIT engine, target machine) where the object loader does not apply
_X86_64 = platform.machine() in ("x86_64", "AMD64")


def _type(name: str) -> str:
  """The loop's element type in LLVM IR: ``double`` or ``float``."""
  return "double" if name in DOUBLE_FUNCTIONS else "float"


def _loop_ir(name, nargs) -> str:
  """``out[i] = name(in0[i], ...)`` for i < n. Its loads and stores are one
  access group, the loop's iterations declared independent
  (``llvm.loop.parallel_accesses``): true whether ``out`` is one of the
  inputs or apart from all (``call`` never passes a partial overlap), so the
  vectoriser needs no overlap check; without it, LLVM's check sent the
  in-place case (``out`` an input, softmax's exp) to the scalar loop."""
  ty = _type(name)
  ins = ", ".join(f"{ty}* %in{k}" for k in range(nargs))
  loads = "\n".join(
      f"  %p{k} = getelementptr {ty}, {ty}* %in{k}, i64 %i\n"
      f"  %v{k} = load {ty}, {ty}* %p{k}, !llvm.access.group !1"
      for k in range(nargs))
  args = ", ".join(f"{ty} %v{k}" for k in range(nargs))
  return f"""
define internal void @each_{name}({ins}, {ty}* %out, i64 %n) nounwind noinline {{
entry:
  %empty = icmp sle i64 %n, 0
  br i1 %empty, label %done, label %body
body:
  %i = phi i64 [0, %entry], [%next, %body]
{loads}
  %r = call {ty} @{name}({args})
  %po = getelementptr {ty}, {ty}* %out, i64 %i
  store {ty} %r, {ty}* %po, !llvm.access.group !1
  %next = add i64 %i, 1
  %more = icmp slt i64 %next, %n
  br i1 %more, label %body, label %done, !llvm.loop !0
done:
  ret void
}}
!0 = distinct !{{!0, !2}}
!1 = distinct !{{}}
!2 = !{{!"llvm.loop.parallel_accesses", !1}}
{_flush_denormals(name, nargs)}"""


# MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6) bits.
_FTZ_DAZ = (1 << 15) | (1 << 6)


def _flush_denormals(name, nargs) -> str:
  """``loop_name``: the loop run as XLA runs its CPU code, with denormals
  flushed (XLA sets MXCSR's FTZ and DAZ around a computation, and the C
  library functions it calls run under them too: ``cbrtf`` of a denormal is
  not what it is without). The caller's MXCSR (its flags included) is
  restored after. The loop is a separate function, not inlined, so no
  float operation moves across the switch. x86-64 only; elsewhere the loop
  runs in the caller's mode (denormals kept, docs/limits.md)."""
  ty = _type(name)
  params = ", ".join([f"{ty}* %in{k}" for k in range(nargs)] + [f"{ty}* %out", "i64 %n"])
  args = ", ".join([f"{ty}* %in{k}" for k in range(nargs)] + [f"{ty}* %out", "i64 %n"])
  if not _X86_64:
    return f"""define void @loop_{name}({params}) nounwind {{
  call void @each_{name}({args})
  ret void
}}"""
  return f"""declare void @llvm.x86.sse.stmxcsr(ptr)
declare void @llvm.x86.sse.ldmxcsr(ptr)
define void @loop_{name}({params}) nounwind {{
  %saved = alloca i32
  %flushed = alloca i32
  call void @llvm.x86.sse.stmxcsr(ptr %saved)
  %mode = load i32, ptr %saved
  %flush = or i32 %mode, {_FTZ_DAZ}
  store i32 %flush, ptr %flushed
  call void @llvm.x86.sse.ldmxcsr(ptr %flushed)
  call void @each_{name}({args})
  call void @llvm.x86.sse.ldmxcsr(ptr %saved)
  ret void
}}"""


def _module_ir(name: str) -> tuple[str, bool]:
  """The IR of ``name``'s loop (a DEFINED formula with its function, or a C
  library call), and whether it gets LLVM's -O2 pipeline (formulas only)."""
  if name in DEFINED:
    nargs, ir = DEFINED[name]
    return "\n".join([_INTRINSICS, ir, _loop_ir(name, nargs)]), True
  nargs, ty = _nargs(name), _type(name)
  return (f"declare {ty} @{name}({', '.join([ty] * nargs)}) nounwind\n"
          + _loop_ir(name, nargs)), False


def _nargs(name: str) -> int:
  if name in DEFINED:
    return DEFINED[name][0]
  return FUNCTIONS[name] if name in FUNCTIONS else DOUBLE_FUNCTIONS[name]


def _optimise(llvm, module, machine):
  """LLVM's -O2 pipeline (loop vectorisation) for the IR-defined formulas:
  without fast-math flags every rounding stays as written (no contraction
  beyond the FMAs written, no reassociation). The C library loops get none:
  each calls the library function as written (no libcall simplification
  may swap in another formula)."""
  pto = llvm.create_pipeline_tuning_options(speed_level=2)
  pto.loop_vectorization = True
  builder = llvm.create_pass_builder(machine, pto)
  builder.getModulePassManager().run(module, builder)


def _llvm():
  import llvmlite.binding as llvm  # (lazily: ~0.12 s, paid only on a compile)
  llvm.initialize_native_target()
  llvm.initialize_native_asmprinter()
  return llvm


def _object_address(name: str) -> int:
  """``name``'s loop from its object code: the on-disk cache's
  (``libm_cache``) or compiled now and cached, loaded without LLVM
  (``libm_loader``). The object targets an x86-64 level (``x86-64-v3``
  with AVX2 and FMA) in LLVM's large code model, the form the loader
  handles."""
  import llvmlite  # its version only (cheap; llvmlite.binding is not imported)
  ir, optimise = _module_ir(name)
  cpu = libm_cache.target_cpu()
  key = libm_cache.key(ir, llvmlite.__version__, "x86_64-linux-elf", cpu, "large",
                       "O2" if optimise else "codegen")
  obj = libm_cache.read(key)
  if obj is None:
    llvm = _llvm()
    machine = llvm.Target.from_triple("x86_64-unknown-linux-gnu").create_target_machine(
        cpu=cpu, features="", opt=2, reloc="static", codemodel="large")
    module = llvm.parse_assembly(ir)
    module.verify()
    if optimise:
      _optimise(llvm, module, machine)
    obj = machine.emit_object(module)
    libm_cache.write(key, obj)
  return libm_loader.load(obj)[f"loop_{name}"]


def _mcjit_address(name: str) -> int:
  """``name``'s loop compiled by llvmlite's MCJIT for the host CPU (one
  engine for the process, kept alive: the code lives in it): where the
  object loader does not apply (not Linux x86-64)."""
  global _engine
  llvm = _llvm()
  if _engine is None:
    libm = ctypes.util.find_library("m")
    if libm:
      llvm.load_library_permanently(libm)
    # The host's CPU features: llvm.fma.f32 becomes the FMA instruction (its
    # result is the exactly rounded FMA on every CPU, in software without).
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=2)
    _engine = (llvm.create_mcjit_compiler(llvm.parse_assembly(""), machine), machine)
  engine, machine = _engine
  ir, optimise = _module_ir(name)
  module = llvm.parse_assembly(ir)
  module.verify()
  if optimise:
    _optimise(llvm, module, machine)
  engine.add_module(module)
  engine.finalize_object()
  return engine.get_function_address(f"loop_{name}")


def _build(name: str):
  """Compiles (or loads from the disk cache) ``name``'s loop alone, on its
  first use: a kernel pays only for the functions it calls."""
  address = None
  if libm_loader.available():
    try:
      address = _object_address(name)
    except libm_loader.LoadError:
      address = None  # an object the loader does not handle: MCJIT
  if address is None:
    address = _mcjit_address(name)
  _addresses[name] = address
  proto = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * (_nargs(name) + 1), ctypes.c_int64)
  return proto(address)


def names() -> list[str]:
  """Every loop ``address`` can give: the C library's and XLA's formulas."""
  return sorted(FUNCTIONS) + sorted(DOUBLE_FUNCTIONS) + sorted(DEFINED)


def address(name: str) -> tuple[int, int]:
  """A stable accessor for other compiled code (numba's, ``pallas_np/native``):
  ``(address, nin)`` of ``name``'s loop (one of ``names()``; built or loaded
  on this call if needed), a C function
  ``void loop(const float *in_0, ..., const float *in_{nin-1}, float *out, int64_t n)``
  computing ``out[i] = name(in_0[i], ...)`` for ``0 <= i < n`` (contiguous
  float32; ``double`` throughout for DOUBLE_FUNCTIONS; ``out`` may be one
  of the inputs). It holds no Python state and
  needs no GIL; the code stays mapped for the process's life."""
  _loop(name)
  return _addresses[name], _nargs(name)


def _loop(name):
  loop = _loops.get(name)
  if loop is None:
    with _lock:
      loop = _loops.get(name)
      if loop is None:
        loop = _loops[name] = _build(name)
  return loop


def call(name: str, *operands, out=None) -> np.ndarray:
  """``name`` (a C float function of FUNCTIONS, or DEFINED) elementwise over the
  broadcast float32 operands; a float32 array (0-d for scalars). For
  DOUBLE_FUNCTIONS, float64 operands and result. ``out``: a
  float32 array of the result's shape to write into, as a ufunc's ``out=``
  (it may be an operand: each element is read before it is written), so the
  compiler can chain these into a dying operand (``passes.in_place``)."""
  loop = _loop(name)
  dt = np.float64 if name in DOUBLE_FUNCTIONS else np.float32
  if out is not None and len(operands) == 1 and operands[0] is out and type(out) is np.ndarray:
    # In place into its own operand (passes.in_place: softmax's exp): what
    # the general path below does for it, without its broadcast and copies
    # (the per-call floor).
    flags = out.flags
    if out.dtype == dt and flags.c_contiguous and flags.writeable:
      if out.size:
        data = out.ctypes.data
        loop(data, data, out.size)
      return out
  ops = np.broadcast_arrays(*[np.asarray(v, dt) for v in operands])
  ops = [np.ascontiguousarray(v) for v in ops]
  shape = ops[0].shape
  # (the loop's iterations are independent only if ``out`` is an operand
  # itself or apart from every operand: a partial overlap goes through a
  # fresh array)
  direct = out is not None and out.dtype == dt and out.shape == shape \
      and out.flags.c_contiguous and out.flags.writeable and all(
          v.ctypes.data == out.ctypes.data or not np.may_share_memory(v, out) for v in ops)
  result = out if direct else np.empty(shape, dt)
  if result.size:
    loop(*[v.ctypes.data for v in ops], result.ctypes.data, result.size)
  if out is not None and not direct:
    np.copyto(out, result)
    return out
  return result


def unary(name: str):
  fn = lambda x, out=None: call(name, x, out=out)  # noqa: E731
  fn.ufunc_like, fn.nin, fn.nout = True, 1, 1  # see compiler.Compiler's ufunc lines
  return fn


def binary(name: str):
  fn = lambda x, y, out=None: call(name, x, y, out=out)  # noqa: E731
  fn.ufunc_like, fn.nin, fn.nout = True, 2, 1
  return fn
