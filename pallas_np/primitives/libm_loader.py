"""Loads a compiled float loop's object code (an x86-64 ELF relocatable
object, as ``libm.py`` has LLVM emit it) into executable memory, without
LLVM.

Why: the object code of a loop is cached on disk (``libm_cache.py``) so that
a second process does not compile it again; but loading it through llvmlite
would still import llvmlite, whose 180 MB shared library takes ~0.12 s to
load, most of a first softmax call's cost. The objects ``libm.py`` emits are
simple on purpose (LLVM's *large* code model, static relocation model): a
``.ltext`` section of code, constant pools, and relocations that are all
``R_X86_64_64`` (an absolute 64-bit address: a constant pool's, or a C
library function's such as ``sinf``, resolved with ``dlsym``). So loading is:
lay the allocated sections out in one anonymous mapping, patch the absolute
addresses, make the mapping read+execute (never writable and executable at
once). Anything else in the object (another relocation type, an undefined
symbol the process lacks) raises ``LoadError`` and ``libm`` compiles with
llvmlite's MCJIT instead: nothing is guessed.

The mappings are never unmapped (the loops live as long as the process, as
MCJIT's did). Linux x86-64 only (``available()``); elsewhere ``libm`` keeps
MCJIT.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import platform
import struct
import sys


class LoadError(Exception):
  """The object is not one this loader handles (``libm`` then uses MCJIT)."""


def available() -> bool:
  return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


_SHT_SYMTAB, _SHT_RELA, _SHT_NOBITS = 2, 4, 8
_SHF_ALLOC = 0x2
_SHN_UNDEF, _SHN_ABS = 0, 0xFFF1
_R_X86_64_NONE, _R_X86_64_64 = 0, 1
_PROT_READ, _PROT_WRITE, _PROT_EXEC = 1, 2, 4
_MAP_PRIVATE, _MAP_ANONYMOUS = 0x02, 0x20

_libc = None
_libraries: list = []  # the C math library and the process, searched for undefined symbols


def _c():
  global _libc
  if _libc is None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libm = ctypes.util.find_library("m")
    _libraries.extend(([ctypes.CDLL(libm)] if libm else []) + [libc])
    _libc = libc
  return _libc


def _resolve(name: str) -> int:
  for lib in _libraries:
    try:
      return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    except AttributeError:
      continue
  raise LoadError(f"undefined symbol {name!r} not found in the process")


def _sections(obj: bytes):
  if obj[:4] != b"\x7fELF" or obj[4] != 2 or obj[5] != 1:
    raise LoadError("not a 64-bit little-endian ELF object")
  e_type, e_machine = struct.unpack_from("<HH", obj, 16)
  if e_type != 1 or e_machine != 62:
    raise LoadError(f"not an x86-64 relocatable object (type {e_type}, machine {e_machine})")
  shoff, = struct.unpack_from("<Q", obj, 40)
  shentsize, shnum = struct.unpack_from("<HH", obj, 58)
  return [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + k * shentsize) for k in range(shnum)]


def _strings(obj: bytes, sec, at: int) -> str:
  start = sec[4] + at
  return obj[start:obj.index(b"\0", start)].decode()


def load(obj: bytes) -> dict[str, int]:
  """Maps ``obj`` into executable memory; its defined global symbols ->
  their addresses."""
  libc = _c()
  secs = _sections(obj)
  # name, type, flags, addr, offset, size, link, info, addralign, entsize
  shstr = secs[struct.unpack_from("<H", obj, 62)[0]]
  layout, size = {}, 0
  for k, s in enumerate(secs):
    # (.eh_frame: unwind tables, which nothing registers with an unwinder
    # here, as nothing unwinds through these loops)
    if s[2] & _SHF_ALLOC and s[5] and _strings(obj, shstr, s[0]) != ".eh_frame":
      align = max(s[8], 1)
      size = (size + align - 1) // align * align
      layout[k] = size
      size += s[5]
  image = bytearray(size)
  for k, at in layout.items():
    s = secs[k]
    if s[1] != _SHT_NOBITS:
      image[at:at + s[5]] = obj[s[4]:s[4] + s[5]]
  symtab = [k for k, s in enumerate(secs) if s[1] == _SHT_SYMTAB]
  if len(symtab) != 1:
    raise LoadError("expected one symbol table")
  st = secs[symtab[0]]
  names = secs[st[6]]
  symbols = [struct.unpack_from("<IBBHQQ", obj, st[4] + k * 24) for k in range(st[5] // 24)]

  length = max((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE, mmap.PAGESIZE)
  base = libc.mmap(None, length, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
  if base in (None, ctypes.c_void_p(-1).value):
    raise LoadError(f"mmap failed (errno {ctypes.get_errno()})")

  def address(sym) -> int:
    name_at, _, _, shndx, value, _ = sym
    if shndx == _SHN_UNDEF:
      return _resolve(_strings(obj, names, name_at))
    if shndx == _SHN_ABS:
      return value
    if shndx not in layout:
      raise LoadError(f"a relocation refers to section {shndx}, which is not loaded")
    return base + layout[shndx] + value

  for s in secs:
    if s[1] != _SHT_RELA or s[7] not in layout:
      continue  # relocations of sections not loaded (none expected)
    for k in range(s[5] // 24):
      offset, info, addend = struct.unpack_from("<QQq", obj, s[4] + k * 24)
      kind = info & 0xFFFFFFFF
      if kind == _R_X86_64_NONE:
        continue
      if kind != _R_X86_64_64:
        raise LoadError(f"relocation type {kind} (only R_X86_64_64: the large code model)")
      struct.pack_into("<Q", image, layout[s[7]] + offset,
                       (address(symbols[info >> 32]) + addend) & 0xFFFFFFFFFFFFFFFF)
  ctypes.memmove(base, bytes(image), size)
  if libc.mprotect(base, length, _PROT_READ | _PROT_EXEC) != 0:
    raise LoadError(f"mprotect to read+execute failed (errno {ctypes.get_errno()})")
  found = {}
  for sym in symbols:
    name_at, info, _, shndx, value, _ = sym
    if info >> 4 == 1 and shndx not in (_SHN_UNDEF, _SHN_ABS) and shndx in layout:  # global
      found[_strings(obj, names, name_at)] = base + layout[shndx] + value
  return found
