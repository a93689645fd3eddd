"""jnp functions whose jaxpr is many XLA ops but one NumPy ufunc.

``x // 2`` and ``x % 2`` on integers trace to ``jit[name=floor_divide]`` and
``jit[name=remainder]``: XLA's truncating ``div``/``rem`` plus sign fix-ups
(8-10 eqns, each a NumPy pass of ~1 µs on a small block). For a divisor
without zeros (and, for signed types, positive: no INT_MIN // -1) their result
is exactly Python's floor division and modulo, NumPy's ``floor_divide`` and
``remainder``. A call is recognised only when its body is *structurally
identical* to what jnp itself traces for the same operand types (compared
eqn by eqn: primitives, params, dataflow, literals), never by name alone,
so a user function that happens to be called ``remainder`` is inlined as
usual. Kernels traced with jit calls inlined (``tracing``) have no call eqn:
there ``find`` looks for jnp's flat body (traced under ``disable_jit`` for the
same operand type and constant divisor) as a contiguous run of eqns whose
intermediate values nobody else reads."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_np import _compat as jc
from pallas_np import lru

# jit name -> (the jnp function that traces it, the NumPy ufunc it equals)
_IDIOMS = {"floor_divide": (jnp.floor_divide, np.floor_divide),
           "remainder": (jnp.remainder, np.remainder)}
_MISSING = object()
# Every flat template contains one of these (jnp's ``//`` is XLA's truncating
# ``div`` plus fix-ups, ``%`` its ``rem``; tests/test_idioms.py checks the
# installed JAX's templates): a jaxpr without one has no run to find, and
# ``find`` returns without tracing the templates (a few ms of a first call).
# Were a template ever to contain neither, the idiom would only be missed.
_DIVISION_PRIMITIVES = frozenset({"div", "rem"})
# (name, operand types[, divisor]) -> jnp's traced body (canonical or flat), or None
_templates = lru.LRU(512)


def _canonical(jaxpr) -> tuple:
  """A jaxpr as nested tuples without variable identities: each operand is
  an input position, an earlier eqn's output, a const position or a literal."""
  if isinstance(jaxpr, jc.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  where = {v: ("in", k) for k, v in enumerate(jaxpr.invars)}
  where.update({v: ("const", k) for k, v in enumerate(jaxpr.constvars)})

  def ref(v):
    if isinstance(v, jc.Literal):
      return ("lit", str(v.aval), repr(np.asarray(v.val).tolist()))
    return where[v]
  eqns = []
  for i, eqn in enumerate(jaxpr.eqns):
    params = tuple(sorted(
        (k, _canonical(p) if isinstance(p, (jc.ClosedJaxpr, jc.Jaxpr)) else repr(p))
        for k, p in eqn.params.items()))
    eqns.append((eqn.primitive.name, params, tuple(ref(v) for v in eqn.invars),
                 tuple(str(o.aval) for o in eqn.outvars)))
    for j, o in enumerate(eqn.outvars):
      where[o] = ("eqn", i, j)
  return (tuple(str(v.aval) for v in jaxpr.invars), tuple(eqns),
          tuple(ref(v) for v in jaxpr.outvars))


def _template(name, in_avals):
  """jnp's own traced body of ``name`` for these operand types (cached)."""
  key = (name, tuple((a.shape, str(a.dtype), bool(getattr(a, "weak_type", False)))
                     for a in in_avals))
  canon = _templates.get(key, _MISSING)
  if canon is _MISSING:
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=bool(getattr(a, "weak_type", False)))
               for a in in_avals]
    canon = None
    try:
      outer = jax.make_jaxpr(_IDIOMS[name][0])(*structs).jaxpr
      if len(outer.eqns) == 1 and outer.eqns[0].params.get("name") == name:
        canon = _canonical(outer.eqns[0].params["jaxpr"])
    except Exception:  # noqa: BLE001 - no template: the call is inlined as usual
      canon = None
    _templates.put(key, canon)
  return canon


def integer_division(eqn, divisor):
  """(ufunc, divisor as the result's type) equal to a jnp
  ``floor_divide``/``remainder`` call eqn whose divisor is the constant
  ``divisor`` (None where not constant), or None."""
  if eqn.primitive.name not in ("jit", "pjit"):
    return None
  name = eqn.params.get("name")
  if name not in _IDIOMS or divisor is None or len(eqn.invars) != 2 or len(eqn.outvars) != 1:
    return None
  x_aval, y_aval = (v.aval for v in eqn.invars)
  out = eqn.outvars[0].aval
  dt = np.dtype(out.dtype) if isinstance(out.dtype, np.dtype) else None
  if dt is None or dt.kind not in "iu" or not getattr(x_aval, "shape", ()) or np.ndim(divisor):
    return None
  d = np.asarray(divisor)
  if d.dtype.kind not in "iu" or d <= 0 or int(d.astype(dt)) != int(d):
    return None  # (a weak Python int divisor is converted to x's type by jnp)
  body = eqn.params.get("jaxpr")
  template = _template(name, (x_aval, y_aval))
  if template is None or body is None or _canonical(body) != template:
    return None
  return _IDIOMS[name][1], dt.type(int(d))


def by_power_of_two(ufunc, divisor):
  """(ufunc, operand) computing ``ufunc(x, divisor)`` (floor division or
  modulo by a positive constant): a modulo by 2**k is ``x & (2**k - 1)``
  in two's complement (signed too: Python's modulo takes the divisor's
  sign), one cheaper ufunc (~0.8 against ~1.3 us on a small block). A
  floor division by 2**k is ``x >> k``: NumPy shifts signed integers
  arithmetically, which rounds toward minus infinity as ``//`` does (INT_MIN
  included); unsigned ones logically. Same cost on a small block, half from
  ~64k elements (24 against 13 us)."""
  d = int(divisor)
  if d > 0 and d & (d - 1) == 0:
    if ufunc is np.remainder:
      return np.bitwise_and, np.asarray(divisor).dtype.type(d - 1)
    if ufunc is np.floor_divide:
      return np.right_shift, np.asarray(divisor).dtype.type(d.bit_length() - 1)
  return ufunc, divisor


def _flat_template(name, x_aval, divisor):
  """jnp's body of ``name(x, divisor)`` traced with jit calls inlined, as
  its eqns (cached; None if it does not trace to one output)."""
  key = ("flat", name, x_aval.shape, str(x_aval.dtype), type(divisor), repr(divisor))
  found = _templates.get(key, _MISSING)
  if found is _MISSING:
    fn = _IDIOMS[name][0]
    struct = jax.ShapeDtypeStruct(x_aval.shape, x_aval.dtype)
    found = None
    try:
      with jax.disable_jit():
        closed = jax.make_jaxpr(lambda x: fn(x, divisor))(struct)
      j = closed.jaxpr
      if not j.constvars and len(j.outvars) == 1 and j.eqns and isinstance(j.outvars[0], jc.Var):
        found = j
    except Exception:  # noqa: BLE001 - no template: nothing is replaced
      found = None
    _templates.put(key, found)
  return found


def _same_literal(a, b):
  return (str(a.aval) == str(b.aval)
          and np.array_equal(np.asarray(a.val), np.asarray(b.val)))


def _match_at(eqns, i, template):
  """The kernel var bound to the template's input if ``eqns[i:]`` starts
  with the template's eqns (same primitives, params, literals, dataflow),
  with the kernel's names for the template's values; else None."""
  tx = template.invars[0]
  names = {}  # template var -> kernel var
  if i + len(template.eqns) > len(eqns):
    return None
  for t, k in zip(template.eqns, eqns[i:]):
    if (t.primitive is not k.primitive or len(t.invars) != len(k.invars)
        or len(t.outvars) != len(k.outvars)
        or repr(sorted(t.params.items())) != repr(sorted(k.params.items()))):
      return None
    for tv, kv in zip(t.invars, k.invars):
      if isinstance(tv, jc.Literal):
        if not isinstance(kv, jc.Literal) or not _same_literal(tv, kv):
          return None
      elif isinstance(kv, jc.Literal):
        return None
      elif tv is tx and tv not in names:
        names[tv] = kv
      elif names.get(tv) is not kv:
        return None
    for to, ko in zip(t.outvars, k.outvars):
      if str(to.aval) != str(ko.aval) or isinstance(ko, jc.DropVar):
        return None
      names[to] = ko
  return names


def find(jaxpr):
  """{first eqn index: (index after the run, ufunc, x var, divisor, out var)}
  for each run of eqns that is jnp's ``x // c`` or ``x % c`` on an integer
  array ``x`` and a constant ``c`` without zeros (positive if signed)."""
  eqns = jaxpr.eqns
  found = {}
  for eqn in eqns:
    if eqn.primitive.name in _DIVISION_PRIMITIVES:
      break
  else:  # no division: nothing to find, no template traced
    return found
  i = 0
  while i < len(eqns):
    hit = _find_at(eqns, i)
    if hit is not None:
      found[i] = hit
      i = hit[0]
    else:
      i += 1
  if not found:
    return found
  # Values inside a run must die there: nobody else may read them.
  reads = {}
  for k, eqn in enumerate(eqns):
    for v in eqn.invars:
      if isinstance(v, jc.Var):
        reads.setdefault(v, []).append(k)
  outs = set(v for v in jaxpr.outvars if isinstance(v, jc.Var))
  for start, (end, _, _, _, out) in list(found.items()):
    for eqn in eqns[start:end]:
      for o in eqn.outvars:
        if o is out:
          continue
        if o in outs or any(not start <= k < end for k in reads.get(o, ())):
          del found[start]
          break
      else:
        continue
      break
  return found


def _signature(eqn):
  return eqn.primitive, tuple(isinstance(v, jc.Literal) for v in eqn.invars)


def _first_primitives():
  """The primitive (and which operands are literals) each flat template
  starts with, traced once on a tiny operand: other eqns trace no template
  (first calls stay cheap)."""
  firsts = _templates.get("first", _MISSING)
  if firsts is _MISSING:
    firsts = set()
    for name in _IDIOMS:
      t = _flat_template(name, jax.ShapeDtypeStruct((2,), np.int32), 3)
      if t is not None:
        firsts.add(_signature(t.eqns[0]))
    _templates.put("first", frozenset(firsts))
  return firsts


def _find_at(eqns, i):
  first = eqns[i]
  if _signature(first) not in _first_primitives():
    return None
  divisors = [v for v in first.invars if isinstance(v, jc.Literal)]
  for lit in divisors[:1]:
    val = np.asarray(lit.val)
    if val.ndim or val.dtype.kind not in "iu" or val <= 0:
      continue
    divisor = int(val)  # jnp's templates with a Python int: a weak constant
    for k in range(i, min(i + 4, len(eqns))):
      xs = [v for v in eqns[k].invars if isinstance(v, jc.Var) and getattr(v.aval, "shape", ())]
      if xs:
        break
    else:
      continue
    x = xs[0]
    dt = np.dtype(x.aval.dtype) if isinstance(x.aval.dtype, np.dtype) else None
    if dt is None or dt.kind not in "iu" or np.dtype(lit.aval.dtype) != dt:
      continue
    for name in _IDIOMS:
      template = _flat_template(name, x.aval, divisor)
      if template is None:
        continue
      names = _match_at(eqns, i, template)
      if names is None or names.get(template.invars[0]) is not x:
        continue
      out = names.get(template.outvars[0])
      if out is None:
        continue
      return (i + len(template.eqns), _IDIOMS[name][1], x, np.asarray(divisor, dt)[()], out)
  return None


# -- jnp.roll by a traced shift --------------------------------------------------------
def _roll_template(x_aval, shift_aval, axis):
  """jnp's own call eqn body of ``jnp.roll(x, shift, axis)`` for these
  operand types (canonical, cached; None if it does not trace to one call)."""
  key = ("roll", x_aval.shape, str(x_aval.dtype), str(shift_aval), axis)
  canon = _templates.get(key, _MISSING)
  if canon is _MISSING:
    canon = None
    try:
      outer = jax.make_jaxpr(lambda x, s: jnp.roll(x, s, axis=axis))(
          jax.ShapeDtypeStruct(x_aval.shape, x_aval.dtype),
          jax.ShapeDtypeStruct(shift_aval.shape, shift_aval.dtype,
                               weak_type=bool(getattr(shift_aval, "weak_type", False)))).jaxpr
      if len(outer.eqns) == 1 and outer.eqns[0].primitive.name in ("jit", "pjit"):
        canon = (outer.eqns[0].params.get("name"), _canonical(outer.eqns[0].params["jaxpr"]))
    except Exception:  # noqa: BLE001 - no template: the call is inlined as usual
      canon = None
    _templates.put(key, canon)
  return canon


def roll_axis(eqn):
  """The axis of a call eqn that is jnp's ``roll(x, shift, axis)`` by a
  0-d integer ``shift`` (a concatenate of ``x`` with itself and a dynamic
  slice, with the shift's modulo: ~20 NumPy lines), else None. Recognised
  when its body equals, eqn by eqn, the body jnp itself traces for the same
  operand types and axis (``_canonical``); the axis is read off the body's
  concatenate only to pick the reference to compare with."""
  if eqn.primitive.name not in ("jit", "pjit") or len(eqn.invars) != 2 \
      or len(eqn.outvars) != 1:
    return None
  x_aval, s_aval = (v.aval for v in eqn.invars)
  if not getattr(x_aval, "shape", ()) or getattr(s_aval, "shape", None) != () \
      or np.dtype(s_aval.dtype).kind not in "iu":
    return None
  body = eqn.params.get("jaxpr")
  inner = getattr(body, "jaxpr", body)
  if inner is None or not hasattr(inner, "eqns"):
    return None
  concats = [e for e in inner.eqns if e.primitive.name == "concatenate"]
  if len(concats) != 1 or any(v is not inner.invars[0] for v in concats[0].invars):
    return None
  axis = int(concats[0].params["dimension"])
  template = _roll_template(x_aval, s_aval, axis)
  if template is None or template != (eqn.params.get("name"), _canonical(body)):
    return None
  return axis


def roll_fn(shape, axis, lanes: bool):
  """``np.roll(x, shift, axis)`` as jnp computes it (the shift taken
  modulo the axis' size): two slices and one concatenate (``np.roll``'s
  Python costs ~8 us). Always a new array (a copy for a shift of 0), so
  later lines may write into it (``passes.in_place``)."""
  n = max(int(shape[axis]), 1)
  ax = axis + 1 if lanes else axis
  pre = (slice(None),) * ax
  concatenate = np.concatenate

  def roll(x, shift):
    k = n - int(shift) % n
    if k == n:
      return x.copy()
    return concatenate((x[pre + (slice(k, None),)], x[pre + (slice(None, k),)]), ax)
  return roll
