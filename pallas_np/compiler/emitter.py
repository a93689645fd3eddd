"""What the compiler emits into: the lines of one generated function.

``Emitter`` holds a generated function's state (globals, fresh names, lines
and what each reads); ``Line`` is one line, ``outs = callee(args)``, kept
structured so it can be rendered to source or run as data; ``Const`` is a
value known at compile time. The passes over a finished emitter are in
``passes``, the zero tracker in ``zeros``.
"""
from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from pallas_np import _compat as jc


def per_dtype(test):
  """``test(dtype)`` as a test of an aval, memoised per dtype: the emitter
  asks it of every operand of every eqn."""
  memo: dict = {}

  def of_aval(aval) -> bool:
    dt = getattr(aval, "dtype", None)
    found = memo.get(dt)
    if found is None:
      found = memo[dt] = test(dt)
    return found
  return of_aval


def np_constant(val, aval) -> Any:
  """A literal/const as the NumPy value the plan will see."""
  dtype = getattr(aval, "dtype", None)
  if isinstance(val, np.ndarray) and val.ndim == 0:
    val = val[()]
  if dtype is not None and not jc.is_semaphore_dtype(dtype):
    if np.ndim(val) == 0:
      return np.dtype(dtype).type(val) if np.dtype(dtype).kind != "V" else np.asarray(val, dtype)
    return np.asarray(val, dtype=dtype)
  return np.asarray(val) if not isinstance(val, np.ndarray) else val


class Const:
  """A value known at compile time (literal, closed-over const, folded)."""
  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value


class Line:
  """One line of a generated function, ``outs = callee(args)``, kept
  structured: rendered to source for compile(), or run as it is by the
  first-calls runner (see ``plan.Plan``). ``flags``: the callee is a (fast,
  exact) pair indexed by whether any of these zero flags is set (see
  ``zeros.zero_select``). An arg that is a 1-tuple ``(name,)`` stands for
  ``name.shape[0]`` (a batched value's lane count)."""
  __slots__ = ("outs", "unpack", "callee", "flags", "args", "dels", "into", "store", "wrote")

  def __init__(self, callee, args=(), outs=(), *, unpack=False, flags=None):
    self.callee = callee
    self.args = args
    self.outs = outs  # names; "_" for an output nobody reads
    self.unpack = unpack  # the callee returns a sequence (multiple results)
    self.flags = flags
    self.dels = ()  # values that die here (see passes.free_dead_values)
    self.into = None  # (ufunc or with_out, arg positions it may write into, check wrapper): see passes.in_place
    self.store = None  # a ref store's (target, plain store, check wrapper): see passes.into_refs
    self.wrote = None  # (arg position, callee before): passes.in_place made it write into that arg

  def render(self) -> str:
    callee = self.callee if self.flags is None else f"{self.callee}[{' or '.join(self.flags)}]"
    args = ", ".join(a if isinstance(a, str) else f"{a[0]}.shape[0]" for a in self.args)
    call = f"{callee}({args})"
    outs = self.outs
    if not outs:
      line = call
    elif self.unpack:
      line = f"{outs[0]}, = {call}" if len(outs) == 1 else f"{', '.join(outs)} = {call}"
    else:
      line = f"{outs[0]} = {call}" if outs[0] != "_" else call
    if self.dels:
      line += "; del " + ", ".join(self.dels)
    return line


class Emitter:
  """Mutable state of one generated function: globals, names, lines."""
  __slots__ = ("env_globals", "counter", "body", "line_eqns", "reads", "zeros", "fresh_values",
               "wrote_into")

  def __init__(self, zeros):
    self.env_globals: dict[str, Any] = {}
    self.counter = itertools.count()
    self.body: list[Line] = []
    self.line_eqns: list[Any] = [None]  # line 1 = def
    self.reads: list[list[str]] = []  # per body line: the value names it reads
    self.zeros = zeros  # a zeros.ZeroTracker
    self.fresh_values: set[str] = set()  # arrays a ufunc (or with_out) line allocated (see in_place)
    self.wrote_into: dict[int, int] = {}  # line -> the operand in_place made it write into

  def fresh(self, prefix):
    return f"{prefix}{next(self.counter)}"

  def const(self, value) -> str:
    g = self.fresh("k")
    self.env_globals[g] = value
    return g
