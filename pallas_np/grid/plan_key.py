"""Structural keys of kernel params: the plan caches' key where identity
misses.

A program that is re-traced on every call (a ``shard_map`` body, a function
jitted afresh) binds a new jaxpr and ``GridMapping`` each time: keyed by
identity, its plans would be rebuilt on every call. ``structural_key`` walks
the params once (a few microseconds per eqn; printing the jaxpr would cost
milliseconds) and gives a hashable value equal for two params exactly when
they describe the same kernel: the same eqns over the same variables (numbered
in order of appearance), the same avals, literals, nested jaxprs and their
constants (by value), and the same static params. Values it cannot compare by
value (a function in a param, an object hashed by identity) compare by
identity: a re-trace that makes new ones misses, which is slower, never wrong.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from pallas_np import _compat as jc


class Unkeyable(Exception):
  """A param value with no structural key (unhashable, not walkable)."""


def structural_key(params: dict, skip=("interpret",)) -> tuple | None:
  """A hashable structural key of a kernel eqn's ``params`` (without the
  ``skip`` entries), or None where a value has none (then only the identity
  key applies)."""
  try:
    return tuple((k, _key(params[k])) for k in sorted(params) if k not in skip)
  except Unkeyable:
    return None


def _key(v):
  if isinstance(v, jc.ClosedJaxpr) and jc.ClosedJaxpr is not jc.Jaxpr:
    return ("closed", _jaxpr_key(v.jaxpr), tuple(_const_key(c) for c in v.consts))
  if isinstance(v, jc.Jaxpr):  # (newer JAX: a Jaxpr may carry its consts)
    return ("jaxpr", _jaxpr_key(v),
            tuple(_const_key(c) for c in (getattr(v, "consts", None) or ())))
  t = type(v)
  if t is tuple or t is list:
    return (t.__name__, *(_key(x) for x in v))
  if t is dict:
    return ("dict", *((k, _key(x)) for k, x in sorted(v.items(), key=lambda kv: repr(kv[0]))))
  if isinstance(v, (np.ndarray, np.generic)) or t is jc.ArrayImpl:
    return _const_key(v)
  if dataclasses.is_dataclass(v) and not isinstance(v, type):
    # Walked field by field: a dataclass may hold jaxprs (GridMapping's index
    # maps) whose own equality is by identity.
    return (t, *(_key(getattr(v, f.name)) for f in dataclasses.fields(v)))
  try:
    hash(v)
  except TypeError as e:
    raise Unkeyable(t.__name__) from e
  return v


def _const_key(c):
  """A constant by value: type, shape, dtype and a digest of its bytes."""
  if isinstance(c, jc.Tracer):  # (a newer JAX's jaxpr may hold one among its consts)
    raise Unkeyable("a tracer")
  a = np.asarray(c)
  if a.dtype == object:
    raise Unkeyable("object array")
  digest = hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=16).digest()
  return ("const", type(c).__name__, a.shape, a.dtype.str, digest,
          getattr(c, "weak_type", None))


def _jaxpr_key(jaxpr):
  numbers: dict = {}

  def var(v):
    if isinstance(v, jc.Literal):
      return ("lit", _const_key(v.val), v.aval)
    n = numbers.get(v)
    if n is None:
      n = numbers[v] = len(numbers)
    return n

  def binders(vs):
    return tuple((var(v), v.aval) for v in vs)

  def effects(effs):
    # A set (no order); ref effects name their ref by index or by Var.
    keys = []
    for eff in effs:
      idx = getattr(eff, "input", getattr(eff, "input_index", None))
      if idx is not None:
        keys.append((type(eff), idx if isinstance(idx, int) else ("var", var(idx))))
      else:
        keys.append(_key(eff))
    return tuple(sorted(keys, key=repr))
  dbg = getattr(jaxpr, "debug_info", None)
  parts = [getattr(dbg, "func_src_info", None), binders(jaxpr.constvars),
           binders(jaxpr.invars)]
  for eqn in jaxpr.eqns:
    parts.append((eqn.primitive, tuple(var(v) for v in eqn.invars), binders(eqn.outvars),
                  tuple((k, _key(p)) for k, p in sorted(eqn.params.items())),
                  effects(eqn.effects)))
  parts.append(tuple(var(v) for v in jaxpr.outvars))
  parts.append(effects(jaxpr.effects))
  return tuple(parts)
