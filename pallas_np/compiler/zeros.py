"""The zero tracker: float max/min take their fast path where no zero can
reach them.

NumPy's float maximum/minimum may return either zero for (+0.0, -0.0); the
exact rule checks its operands for zeros first. ``ZeroTracker`` follows
which values are copies of which sources, so many zero-sensitive ops share
one check per source per run (``zero_select`` emits the guarded line).
"""
from __future__ import annotations

import math

import numpy as np

from pallas_np import _compat as jc
from pallas_np.compiler.emitter import Const, Line, per_dtype
from pallas_np.dtypes import is_low_precision_float


def _is_float_dtype(dt) -> bool:
  if dt is None or jc.is_semaphore_dtype(dt):
    return False
  try:
    dt = np.dtype(dt)
  except TypeError:  # extended dtypes (PRNG keys)
    return False
  return dt.kind == "f" or is_low_precision_float(dt)


is_float = per_dtype(_is_float_dtype)


def _has_zero(x) -> bool:
  # all() is one reduction (-0.0 is falsy, NaN truthy); np.any(x == 0)
  # makes a mask first and costs more on the small blocks of a grid step.
  return not x.all()


def zero_select(em, g, if_no_zeros, exact) -> str:
  """The callee of a zero-guarded line: ``g_nz``, a (fast, exact) pair the
  line indexes by its (Python bool) zero flags, ``g_nz[z3 or z7](...)``.
  Python compiles a subscript faster than ``(g if cond else g_nz)``,
  and plans have hundreds."""
  em.env_globals[g] = exact
  em.env_globals[g + "_nz"] = (if_no_zeros, exact)
  return g + "_nz"


class ZeroTracker:
  """Which values of a generated function are, element for element, copies
  of which *source* values (through reshapes, slices, concatenates, max/min,
  ... registered with ``data_movement=True``). A zero-sensitive op (float max/min)
  whose operands come from a few sources checks those sources for zeros once
  per run and takes its fast path when there are none: a bitonic sort's
  hundreds of compare-exchanges share one check of the input block. Not
  when the sources are much bigger than the op (a max of a small slice of a
  big block): its own check is then cheaper."""
  __slots__ = ("sources", "flags", "sizes")
  MAX_SOURCES = 8
  MAX_SOURCE_RATIO = 4

  def __init__(self):
    self.sources: dict[str, frozenset] = {}  # value name -> source names
    self.flags: dict[str, str] = {}  # source name -> its has-zero flag
    self.sizes: dict[str, int] = {}  # value name -> element count

  def note_size(self, name, aval):
    shape = getattr(aval, "shape", None)
    if shape is not None:
      self.sizes[name] = math.prod(shape)

  def guard_sources(self, atoms, avals, out_aval):
    """Sources whose zero check can stand in for a zero-sensitive op's own,
    or None: unknown, all-constant operands, or much bigger than the op."""
    srcs = self.union(atoms, avals)
    if not srcs:
      return None
    if any(s in self.flags for s in srcs):
      return srcs  # some are checked anyway
    total = sum(self.sizes.get(s, 0) for s in srcs)
    if total > self.MAX_SOURCE_RATIO * max(1, math.prod(getattr(out_aval, "shape", ()))):
      return None
    return srcs

  def of_name(self, name) -> frozenset:
    return self.sources.get(name) or frozenset((name,))

  def of(self, atom, aval):
    """Source names of a float operand; None if it may hold a zero that no
    run-time check can rule out (a constant with a zero)."""
    if isinstance(atom, Const):
      return None if _has_zero(atom.value) else frozenset()
    return self.of_name(atom[0])

  def union(self, atoms, avals):
    found = frozenset()
    for a, aval in zip(atoms, avals):
      if not is_float(aval):
        continue
      s = self.of(a, aval)
      if s is None:
        return None
      found |= s
    return found if len(found) <= self.MAX_SOURCES else None

  def moved(self, eqn, atoms, out_names):
    a = atoms[0]
    if len(atoms) == 1 and not isinstance(a, Const):  # reshape, slice, ...
      srcs = self.of_name(a[0])
    else:
      srcs = self.union(atoms, [v.aval for v in eqn.invars])
      if srcs is None:
        return
    for o, n in zip(eqn.outvars, out_names):
      if n != "_" and is_float(o.aval):
        self.sources[n] = srcs

  def guard(self, em, srcs, eqn) -> tuple:
    """Flags, one of them set when some source holds a zero; emits the flag
    of each source not checked yet (once per run, where first needed)."""
    conds = []
    for s in sorted(srcs):
      flag = self.flags.get(s)
      if flag is None:
        flag = self.flags[s] = em.fresh("z")
        em.env_globals["_has_zero"] = _has_zero
        em.body.append(Line("_has_zero", (s,), (flag,)))
        em.reads.append([s])
        em.line_eqns.append(eqn)
      conds.append(flag)
    return tuple(conds)
