"""The compiler's passes, besides emitting: constant folding (while
emitting, ``fold``), then over a finished emitter, in this order: free each
value after its last use (``free_dead_values``), let ufunc lines write into
dying operands (``in_place``), and compute values stored whole into a ref
in the ref's block itself (``into_refs``). None runs under pdb, where every
value stays inspectable.
"""
from __future__ import annotations

import math

from pallas_np import _compat as jc
from pallas_np.compiler.emitter import Const


def fold(rule, eqn, fn, needs_ctx, in_atoms):
  """Constant folding: the outputs of a pure eqn whose operands are all
  constants, computed now; None when it is not folded (emit it)."""
  if not (rule.foldable and not needs_ctx
          and all(a.__class__ is Const for a in in_atoms)
          and not _has_effects(eqn) and _foldable_size(eqn)):
    return None
  try:
    out = fn(*[a.value for a in in_atoms])
  except Exception:
    return None
  return list(out) if eqn.primitive.multiple_results else [out]


def _has_effects(eqn) -> bool:
  return bool(eqn.effects)


_FOLD_LIMIT = 1 << 16


def _foldable_size(eqn) -> bool:
  """Fold only modestly sized results: a folded constant lives in the plan."""
  for o in eqn.outvars:
    shape = getattr(o.aval, "shape", None)
    if shape is None:
      return False
    if math.prod(shape) > _FOLD_LIMIT:
      return False
    if isinstance(o.aval, jc.AbstractRef):
      return False
  return True


def free_dead_values(em, returned):
  """Free each intermediate after its last use (``; del v3`` on the same
  line, keeping one line per eqn): otherwise every value of the kernel
  stays alive until the plan returns, and each op writes to fresh,
  cache-cold memory. By name, after inlining, so a value shared by an
  inlined body and its caller lives until the caller is done with it."""
  last: dict[str, int] = {}
  for i, names in enumerate(em.reads):
    for n in names:
      last[n] = i
  dead: dict[int, list[str]] = {}
  for n, i in last.items():
    if n.startswith("v") and n not in returned:
      dead.setdefault(i, []).append(n)
  for i, names in dead.items():
    em.body[i].dels = tuple(sorted(set(names)))


def in_place(em, returned):
  """Let a ufunc line write its result into an operand that dies there
  (``ufunc(x, y, out=x)``) instead of a fresh array: a chain such as
  softmax's ``exp(x - m) / s`` then reuses one buffer, so a first call
  page-faults less fresh memory and warm calls stay in cache. The operand
  must be an array a ufunc line allocated (no other owner), of the
  result's shape, dtype and lane axis (checked when the line was emitted),
  and nothing derived from it by the lines that read it before may
  outlive this line (a view of it would see the overwrite): outputs of
  ufunc lines are fresh arrays; any other reader's outputs must die here
  or earlier, as must theirs. Readers with effects (callbacks may keep
  their arguments) rule it out."""
  fresh, body = em.fresh_values, em.body
  last, outlives = _lifetimes(em, returned)
  for i, line in enumerate(body):
    if line.into is None:
      continue
    ufunc, positions, checked = line.into
    for k in positions:
      name = line.args[k]
      into = _ufunc_into(ufunc, k)
      if into is None:
        continue
      if name in fresh and last[name] == i and name in line.dels \
          and not outlives(name, i):
        g = em.fresh("f")
        em.env_globals[g] = into if checked is None else checked(into)
        line.wrote = (k, line.callee)
        line.callee = g
        em.wrote_into[i] = k
        break

def _lifetimes(em, returned):
  """(the last line reading each value, ``outlives(name, i)``: whether
  something derived from ``name`` by its readers other than line ``i``
  stays alive after line ``i``)."""
  last: dict[str, int] = {}
  readers: dict[str, list[int]] = {}
  for i, names in enumerate(em.reads):
    for n in names:
      last[n] = i
      readers.setdefault(n, []).append(i)
  fresh, body, eqns = em.fresh_values, em.body, em.line_eqns

  def outlives(name, i) -> bool:
    for j in readers[name]:
      if j == i:
        continue
      eqn = eqns[j + 1]
      if eqn is not None and (eqn.effects or "callback" in eqn.primitive.name):
        return True
      for o in body[j].outs:
        if not o.startswith("v") or o in fresh:
          continue
        if o in returned or last.get(o, len(body)) > i or outlives(o, i):
          return True
    return False
  return last, outlives

def into_refs(em, returned):
  """Compute a value stored whole into a ref (``o_ref[...] = exp(x - m)
  / s``) in the ref's block itself: the ufunc line that allocated its
  buffer (before ``in_place`` chained the later lines into it) writes
  into the block instead, and the store finds the value already there.
  Saves the temporary and the copy; on a first call the temporary is
  fresh memory (page faults).
  Legal when the stored value dies at the store with nothing derived
  from it alive (as in ``in_place``), and no line from the allocation
  up to the store reads or passes the ref, or takes the run context
  (a DMA could land in it): the block's earlier contents are then
  never observed between the two lines."""
  body = em.body
  stores = [s for s, line in enumerate(body) if line.store is not None]
  if not stores:
    return
  fresh, reads = em.fresh_values, em.reads
  last, outlives = _lifetimes(em, returned)
  producer = {o: i for i, line in enumerate(body) for o in line.outs}
  for s in stores:
    line = body[s]
    target, store, checked = line.store
    ref, val = line.args[0], line.args[1]
    if (val not in fresh or val in returned or last.get(val) != s
        or val not in line.dels or outlives(val, s)):
      continue
    i = producer.get(val)
    while i in em.wrote_into:  # back along the in-place chain to its allocation
      i = producer.get(body[i].args[em.wrote_into[i]])
    if i is None or body[i].into is None or producer.get(ref, -1) >= i:
      continue
    if any(ref in reads[j] or "ctx" in body[j].args for j in range(i, s)):
      continue
    alloc = body[i]
    ufunc, _, alloc_checked = alloc.into
    g = em.fresh("f")
    into = _into_ref(ufunc, target)
    em.env_globals[g] = into if alloc_checked is None else alloc_checked(into)
    alloc.callee = g
    alloc.args = (*alloc.args, ref)
    reads[i].append(ref)
    g = em.fresh("f")
    unless = _store_unless_there(target, store)
    em.env_globals[g] = unless if checked is None else checked(unless)
    line.callee = g


def _ufunc_into(ufunc, k):
  """``ufunc`` writing its result into its operand ``k`` (None: a rule's
  ``into_operand`` cannot write into that operand)."""
  into_operand = getattr(ufunc, "into_operand", None)
  if into_operand is not None:
    return into_operand(k)
  if ufunc.nin == 1:
    return lambda x: ufunc(x, out=x)
  if k == 0:
    return lambda x, y: ufunc(x, y, out=x)
  if k == 1 and ufunc.nin == 2:
    return lambda x, y: ufunc(x, y, out=y)
  return lambda *xs: ufunc(*xs, out=xs[k])


def _into_ref(ufunc, target):
  """``ufunc`` (or a rule's ``with_out``) writing its result into
  ``target(ref)``, the ref being its last argument (a fresh result where
  the target is unavailable: the store then copies, and raises where it
  should)."""
  def into_ref(*args):
    out = target(args[-1])
    if out is None:
      return ufunc(*args[:-1])
    return ufunc(*args[:-1], out=out)
  return into_ref


def _store_unless_there(target, store):
  """The store of a value ``_into_ref`` computed in place: nothing to
  do when the value is the target block itself."""
  def store_unless_there(ref, val, *leaves):
    out = target(ref)
    if out is not None and val.base is out.base and val.strides == out.strides \
        and val.shape == out.shape:  # (the same view: into_ref returned ``out``)
      return None
    return store(ref, val, *leaves)
  return store_unless_there
