"""What the generated loop source and its compilers agree on, with neither
JAX nor the rest of pallas_np imported: the compile process
(``aot_worker``, ``lite_worker``) translates a loop with ``lite`` and
must import it without JAX. ``codegen`` and ``blas_calls`` re-export these
names where the caller's code reads them (docs/native.md, "lite").
"""
from __future__ import annotations

from pallas_np.native import lite_dtype


def __getattr__(name):
  """``SUPPORTED``: the dtypes the generated code computes in (codegen's
  table), as NumPy dtypes, made at the first read: the compile process,
  which imports no NumPy, reads ``lite_dtype.SUPPORTED`` instead."""
  if name == "SUPPORTED":
    import numpy as np
    globals()["SUPPORTED"] = frozenset(np.dtype(dt.name) for dt in lite_dtype.SUPPORTED)
    return globals()["SUPPORTED"]
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Status slot 0 where the source raised RuntimeError (lite_headers writes
# it, lite_jit raises it).
RUNTIME_ERROR = -7


class Refused(Exception):
  """This loop is not compiled (it keeps running on the NumPy path)."""


# routine -> argument kinds (e: CBLAS enum, an int; i: CBLAS_INT; f/d: a
# float32/float64; p: a pointer) and result kind (v: none, f, d)
ROUTINES = {
    "sgemm": ("eeeiiifpipifpi", "f", "v"), "sgemv": ("eeiifpipifpi", "f", "v"),
    "sdot": ("ipipi", "f", "f"),
    "dgemm": ("eeeiiidpipidpi", "d", "v"), "dgemv": ("eeiidpipidpi", "d", "v"),
    "ddot": ("ipipi", "d", "d"),
}


def cblas_header(bits: int) -> str:
  """The generated module's intrinsics ``_cblas_<routine>(address, *args)``:
  a call through the routine's address (CBLAS_INT of ``bits``)."""
  lines = [
      "from numba import types as _nt",
      "from numba.extending import intrinsic as _intrinsic",
      "import llvmlite.ir as _lir",
      "",
      "def _cblas_sig(kinds, ret):",
      "    nt = {'e': _nt.int64, 'i': _nt.int64, 'f': _nt.float32, 'd': _nt.float64, 'p': _nt.int64,",
      "          'q': _nt.int64}",
      "    rt = {'v': _nt.void, 'f': _nt.float32, 'd': _nt.float64}[ret]",
      "    def codegen(context, builder, sig, llargs):",
      "        i8p = _lir.IntType(8).as_pointer()",
      f"        lt = {{'e': _lir.IntType(32), 'i': _lir.IntType({bits}), 'f': _lir.FloatType(),",
      "              'd': _lir.DoubleType(), 'p': i8p, 'q': _lir.IntType(64)}",
      "        rl = {'v': _lir.VoidType(), 'f': _lir.FloatType(), 'd': _lir.DoubleType()}[ret]",
      "        fnty = _lir.FunctionType(rl, [lt[k] for k in kinds])",
      "        fn = builder.inttoptr(llargs[0], fnty.as_pointer())",
      "        vals = []",
      "        for k, v in zip(kinds, llargs[1:]):",
      "            if k == 'p':",
      "                v = builder.inttoptr(v, i8p)",
      "            elif lt[k] != v.type:",
      "                v = builder.trunc(v, lt[k])",
      "            vals.append(v)",
      "        r = builder.call(fn, vals)",
      "        return context.get_dummy_value() if ret == 'v' else r",
      "    return rt(_nt.int64, *[nt[k] for k in kinds]), codegen",
      "",
  ]
  routines = {**ROUTINES, "loop1": ("ppq", "f", "v")}  # (in, out, n): a float32 loop
  for name, (args, _, ret) in routines.items():
    params = ", ".join(f"a{k}" for k in range(len(args)))
    lines += [f"def _t_{name}(typingctx, fp, {params}):",
              f"    return _cblas_sig({args!r}, {ret!r})",
              f"_cblas_{name} = _intrinsic(_t_{name})", ""]
  return "\n".join(lines) + "\n"
