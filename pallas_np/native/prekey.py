"""A loop's pre-key: a digest of what its generated source is made from,
cheap enough for a loop's first run (docs/native.md, "The disk cache").

A library is named by the digest of its generated source (``disk_cache.key``);
generating the source costs 1-20 ms of Python, paid when the loop's build is
due (after ~0.6 s of its kernel's calls: ``cost_rule``). The pre-key digests the *inputs* of the
generator instead: the loop eqn (primitives by name, variables numbered in
order of appearance, avals, literals and constants by value, params), the
bounds-check mode, each operand's layout and the code that generates (every
``pallas_np`` source file's size and modification time, ``codegen.MAX_LINES``). The disk cache maps
a pre-key to the library key it generated (``disk_cache.write_prekey``), so a
second process loads a loop's library at its first run, with no codegen.

A value the walk cannot write out completely (a function, an object whose
``repr`` names an address) gives no pre-key: that loop is looked up the usual
way. Two loops with one pre-key generate one source, so a hit is never a
different loop's library.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import os

import numpy as np

from pallas_np import _compat as jc
from pallas_np.native import codegen

_code: list = []


class Unkeyable(Exception):
  """A value with no complete, stable description."""


def code_version() -> str:
  """A digest of the pallas_np sources (size and mtime of each ``.py``):
  a changed generator or emitter never meets a pre-key of the old one."""
  if not _code:
    parts: list = []
    _list_sources(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "", parts)
    _code.append(hashlib.sha256("\n".join(parts).encode()).hexdigest())
  return _code[0]


def _list_sources(path: str, rel: str, parts: list) -> None:
  with os.scandir(path) as it:
    entries = sorted(it, key=lambda e: e.name)
  for e in entries:
    if e.name.endswith(".py") and e.is_file():
      st = e.stat()
      parts.append(f"{rel}{e.name}:{st.st_size}:{st.st_mtime_ns}")
    elif e.is_dir() and e.name != "__pycache__" and not e.name.startswith("."):
      _list_sources(e.path, f"{rel}{e.name}/", parts)


def loop_prekey(eqn, clamp: bool, layouts, uninitialized) -> str | None:
  """The pre-key of the loop ``eqn`` run with ``layouts`` and the
  ``uninitialized`` fill of masked-off loads (see the module doc), or None
  where some value has no stable description."""
  h = hashlib.sha256()
  w = _Writer(h)
  try:
    h.update(f"{code_version()}\n{codegen.MAX_LINES}\n{clamp}\n{uninitialized!r}\n{layouts!r}\n".encode())
    w.eqn(eqn)
  except Exception:  # noqa: BLE001 - Unkeyable, or a value the walk cannot read: no pre-key
    return None
  return h.hexdigest()[:40]


class _Writer:
  """Writes values into a hash, each with its type (no two values alike)."""

  def __init__(self, h):
    self.h = h
    self.numbers: list = []  # one dict per jaxpr being written

  def put(self, *parts) -> None:
    self.h.update(("\x1f".join(map(str, parts)) + "\x1e").encode())

  def aval(self, a) -> None:
    inner = getattr(a, "inner_aval", None)
    if inner is not None:
      self.put("ref", type(a).__name__, repr(getattr(a, "memory_space", None)))
      self.aval(inner)
      return
    shape = getattr(a, "shape", None)
    dtype = getattr(a, "dtype", None)
    if shape is None or dtype is None:
      raise Unkeyable(type(a).__name__)
    self.put("aval", type(a).__name__, tuple(shape), repr(dtype), getattr(dtype, "str", ""),
             getattr(a, "weak_type", None))

  def const(self, c) -> None:
    if isinstance(c, jc.Tracer):
      raise Unkeyable("a tracer")
    a = np.asarray(c)
    if a.dtype == object:
      raise Unkeyable("object array")
    self.put("const", type(c).__name__, a.shape, a.dtype.str, getattr(c, "weak_type", None))
    self.h.update(np.ascontiguousarray(a).tobytes())

  def var(self, v) -> None:
    if isinstance(v, jc.Literal):
      self.put("lit")
      self.const(v.val)
      self.aval(v.aval)
      return
    numbers = self.numbers[-1]
    n = numbers.get(v)
    if n is None:
      n = numbers[v] = len(numbers)
      self.put("new", n)
      self.aval(v.aval)
    else:
      self.put("v", n)

  def jaxpr(self, jaxpr) -> None:
    self.numbers.append({})
    try:
      self.put("jaxpr", len(jaxpr.constvars), len(jaxpr.invars), len(jaxpr.eqns))
      for v in (*jaxpr.constvars, *jaxpr.invars):
        self.var(v)
      for e in jaxpr.eqns:
        self.eqn(e)
      self.put("out")
      for v in jaxpr.outvars:
        self.var(v)
    finally:
      self.numbers.pop()

  def eqn(self, e) -> None:
    if not self.numbers:
      self.numbers.append({})
    self.put("eqn", e.primitive.name, len(e.invars), len(e.outvars), len(e.params))
    for v in e.invars:
      self.var(v)
    for v in e.outvars:
      self.var(v)
    for k in sorted(e.params):
      self.put("param", k)
      self.value(e.params[k])

  def value(self, v) -> None:
    t = type(v)
    if v is None or t in (bool, int, float, str, complex):
      self.put(t.__name__, repr(v))
    elif isinstance(v, jc.ClosedJaxpr) and jc.ClosedJaxpr is not jc.Jaxpr:
      self.put("closed", len(v.consts))
      for c in v.consts:
        self.const(c)
      self.jaxpr(v.jaxpr)
    elif isinstance(v, jc.Jaxpr):
      consts = getattr(v, "consts", None) or ()
      self.put("jaxpr-consts", len(consts))
      for c in consts:
        self.const(c)
      self.jaxpr(v)
    elif isinstance(v, (np.ndarray, np.generic)) or t is jc.ArrayImpl:
      self.const(v)
    elif isinstance(v, np.dtype):
      self.put("dtype", v.str, v.name)
    elif isinstance(v, enum.Enum):
      self.put("enum", t.__module__, t.__qualname__, v.name)
    elif isinstance(v, type):
      self.put("type", v.__module__, v.__qualname__)
    elif dataclasses.is_dataclass(v):
      fields = dataclasses.fields(v)
      self.put("dataclass", t.__module__, t.__qualname__, len(fields))
      for f in fields:
        self.put("field", f.name)
        self.value(getattr(v, f.name))
    elif t is tuple or t is list or (isinstance(v, tuple) and hasattr(v, "_fields")):
      self.put(t.__qualname__, len(v))
      for x in v:
        self.value(x)
    elif t is dict:
      self.put("dict", len(v))
      for k in sorted(v, key=repr):
        self.value(k)
        self.value(v[k])
    elif isinstance(v, (jc.Var, jc.Literal)):  # (a variable in a param)
      self.var(v)
    else:
      r = repr(v)
      if " at 0x" in r or "object at" in r:
        raise Unkeyable(t.__name__)
      self.put("repr", t.__module__, t.__qualname__, r)
