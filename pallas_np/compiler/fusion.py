"""Peephole fusion planned on a jaxpr before it is emitted: ufunc results
written straight into a concatenate's buffer (through flips), and
``squeeze(slice(x))`` as one indexing op (see ``Fusion``).
"""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.compiler.emitter import Const, Line, per_dtype
from pallas_np.compiler.zeros import zero_select
from pallas_np.dtypes import is_low_precision_float
from pallas_np.memory import lanes_last_empty


class Fusion:
  """Peepholes planned on one jaxpr before it is emitted (sequential plans
  only; a batched value has a lane axis the indices below do not know):

  * ``squeeze(slice(x))`` (what ``y[:, 0]`` traces to) becomes one indexing
    op on ``x``.
  * A ``concatenate`` whose operands are results of elementwise ufuncs read
    nowhere else (possibly through a ``rev``, as in ``jnp.flip``) gets its
    buffer allocated first, and each ufunc writes its slot with ``out=``: no
    temporaries and no copy for the concatenate (a bitonic sort's
    compare-exchange is min + max + concatenate).

  Whether an operand really fuses is decided when its producer is emitted
  (its rule must be a plain NumPy ufunc on native dtypes); the rest is
  copied in by the concatenate's own line."""
  ROOTS = frozenset(("squeeze", "concatenate"))  # eqns a fusion starts from

  def __init__(self, jaxpr, keep, batched=False, lanes_last=False):
    eqns = jaxpr.eqns
    self.batched = batched  # a batch compiler's plan: values may carry a lane axis
    self.lanes_last = lanes_last  # lane-stacked buffers laid out lane-minor
    self.lane_buffer: dict[int, bool] = {}  # concat eqn -> its buffer has a lane axis
    uses: dict = {}
    for e in eqns:
      for v in e.invars:
        if isinstance(v, jc.Var):
          uses[v] = uses.get(v, 0) + 1
    for v in jaxpr.outvars:
      if isinstance(v, jc.Var):
        uses[v] = uses.get(v, 0) + 2  # never absorb an output
    producer = {o: i for i, e in enumerate(eqns) for o in e.outvars}
    self.squeeze_of: dict[int, tuple] = {}  # squeeze eqn -> (operand var, index)
    self.into: dict[int, tuple] = {}  # producer eqn -> (concat eqn, slot index)
    self.rev_of: dict[int, int] = {}  # absorbed rev eqn -> its producer eqn
    self.absorbed: set[int] = set()  # eqns emitted as part of another
    self.concat_buffer: dict[int, str | None] = {}  # concat eqn -> buffer name
    self.declined: set[int] = set()  # concat eqns left unfused (batched plans)
    self.fused: dict[int, set] = {}  # concat eqn -> operand positions written
    self.eqns = eqns

    def single_use_producer(v):
      if not isinstance(v, jc.Var) or uses.get(v) != 1:
        return None
      j = producer.get(v)
      return j if j is not None and keep[j] else None

    for i, e in enumerate(eqns):
      if not keep[i]:
        continue
      name = e.primitive.name
      if name == "squeeze":
        j = single_use_producer(e.invars[0])
        if j is not None and eqns[j].primitive.name == "slice":
          s = eqns[j].params
          strides = s["strides"] or (1,) * len(s["start_indices"])
          dims = set(e.params["dimensions"])
          index = tuple(int(st) if d in dims else slice(st, lim, step)
                        for d, (st, lim, step) in enumerate(
                            zip(s["start_indices"], s["limit_indices"], strides)))
          self.squeeze_of[i] = (eqns[j].invars[0], index)
          self.absorbed.add(j)
      elif name == "concatenate" and _native(e.outvars[0].aval):
        d = e.params["dimension"]
        rank = len(e.outvars[0].aval.shape)
        off = 0
        for pos, x in enumerate(e.invars):
          size = x.aval.shape[d]
          slot = (slice(None),) * d + (slice(off, off + size),)
          off += size
          j = single_use_producer(x)
          if j is None:
            continue
          rev = _rev_dims(eqns[j])
          if rev is not None:
            k = single_use_producer(eqns[j].invars[0])
            if k is None:
              continue
            view = tuple(slice(None, None, -1) if a in rev else slice(None)
                         for a in range(rank))
            self.rev_of[j] = k
            self.absorbed.add(j)
            j, slot = k, (slot, view)
          else:
            slot = (slot,)
          if len(eqns[j].outvars) == 1 and j not in self.absorbed:
            self.into[j] = (i, pos, slot)
            self.concat_buffer[i] = None

  def emit_into(self, j, em, env, fn, in_atoms, info, text) -> bool:
    """Emit producer ``j`` writing into its concatenate slot (False: not
    fusable after all; emit it normally)."""
    ufunc = getattr(fn, "if_no_zeros", fn)
    eqn = self.eqns[j]
    out_dtype = info.out_aval.dtype
    if (not isinstance(ufunc, np.ufunc) or all(isinstance(a, Const) for a in in_atoms)
        or not all(_native(a) and a.dtype == out_dtype for a in info.in_avals)
        or out_dtype != self.eqns[self.into[j][0]].outvars[0].aval.dtype):
      self.into.pop(j)
      return False
    ci, pos, slot = self.into[j]
    concat = self.eqns[ci]
    buf = self.concat_buffer.get(ci)
    lane_atom = next((a for a in in_atoms if not isinstance(a, Const) and a[1]), None)
    if buf is None:
      if self.batched and lane_atom is None:
        # An unbatched first operand: a later one may be batched and would
        # not fit an unbatched buffer. The concatenate runs unfused.
        self.declined.add(ci)
      if ci in self.declined:
        self.into.pop(j)
        return False
      buf = self.concat_buffer[ci] = em.fresh("v")
      aval = concat.outvars[0].aval
      em.zeros.note_size(buf, aval)
      alloc = em.fresh("f")
      shape, dtype = tuple(aval.shape), np.dtype(aval.dtype)
      if lane_atom is not None:  # lanes first; their count is known when run
        self.lane_buffer[ci] = True
        if self.lanes_last:
          em.env_globals[alloc] = lambda n: lanes_last_empty(n, shape, dtype)
        else:
          em.env_globals[alloc] = lambda n: np.empty((n, *shape), dtype)
        em.body.append(Line(alloc, ((lane_atom[0],),), (buf,)))
      else:
        em.env_globals[alloc] = lambda: np.empty(shape, dtype)
        em.body.append(Line(alloc, (), (buf,)))
      em.reads.append([] if lane_atom is None else [lane_atom[0]])
      em.line_eqns.append(concat)
    self.fused.setdefault(ci, set()).add(pos)
    if self.lane_buffer.get(ci):  # slots and views skip the lane axis
      slot = ((slice(None), *slot[0]),) + tuple((slice(None), *v) for v in slot[1:])
    if len(slot) == 1:
      (s,) = slot
      into = lambda out, *xs: ufunc(*xs, out=out[s])
      exact = lambda out, *xs: np.copyto(out[s], fn(*xs))
    else:
      s, view = slot
      into = lambda out, *xs: ufunc(*xs, out=out[s][view])
      exact = lambda out, *xs: np.copyto(out[s][view], fn(*xs))
    g = em.fresh("f")
    args = (buf, *[text(a) for a in in_atoms])
    flags = None
    if fn is not ufunc:  # zero-sensitive (float max/min)
      srcs = em.zeros.guard_sources(in_atoms, info.in_avals, info.out_aval)
      em.env_globals[g] = exact
      if srcs:
        flags = em.zeros.guard(em, srcs, eqn)
        g = zero_select(em, g, into, exact)
    else:
      em.env_globals[g] = into
    placeholder = em.fresh("_fused")
    env[eqn.outvars[0]] = (placeholder, bool(self.lane_buffer.get(ci)))
    if registry.properties(eqn.primitive).data_movement:
      em.zeros.moved(eqn, in_atoms, [placeholder])
    else:  # a source with no name of its own: checked as part of the buffer
      em.zeros.sources[placeholder] = frozenset((buf,))
    em.body.append(Line(g, args, flags=flags))
    em.reads.append([buf] + [a[0] for a in in_atoms if not isinstance(a, Const)])
    em.line_eqns.append(eqn)
    return True

  def absorb(self, i, em, env) -> bool:
    """An absorbed slice/rev: bind its output to a placeholder (its reader
    handles it). False when its fusion fell through: emit it normally."""
    if i in self.rev_of:
      j = self.rev_of[i]
      if j in self.into:
        eqn = self.eqns[i]
        producer_atom = env[self.eqns[j].outvars[0]]
        placeholder = em.fresh("_fused")
        env[eqn.outvars[0]] = (placeholder, False)
        em.zeros.sources[placeholder] = em.zeros.of_name(producer_atom[0])
        return True
      return False
    return True  # the slice of a squeeze(slice(x))

  def emit_concat(self, ci, em, env, in_atoms, text):
    """A concatenate with fused operands: copy in the others, if any."""
    eqn = self.eqns[ci]
    buf = self.concat_buffer[ci]
    rest = [p for p in range(len(in_atoms)) if p not in self.fused[ci]]
    if rest:
      d = eqn.params["dimension"]
      offsets = np.cumsum([0] + [v.aval.shape[d] for v in eqn.invars])
      d += 1 if self.lane_buffer.get(ci) else 0
      slots = [(slice(None),) * d + (slice(int(offsets[p]), int(offsets[p + 1])),)
               for p in rest]

      def fill(out, *xs):
        for s, x in zip(slots, xs):
          out[s] = x
      g = em.fresh("f")
      em.env_globals[g] = fill
      em.body.append(Line(g, (buf, *[text(in_atoms[p]) for p in rest])))
      em.reads.append([buf] + [in_atoms[p][0] for p in rest
                               if not isinstance(in_atoms[p], Const)])
      em.line_eqns.append(eqn)
    env[eqn.outvars[0]] = (buf, bool(self.lane_buffer.get(ci)))
    em.zeros.moved(eqn, in_atoms, [buf])


def _native_dtype(dt) -> bool:
  """A dtype NumPy ufuncs compute in natively (no bf16/fp8 round trip)."""
  try:
    return dt is not None and np.dtype(dt).kind in "fiub" and not is_low_precision_float(dt)
  except TypeError:
    return False


_native = per_dtype(_native_dtype)


def _rev_dims(eqn):
  """Dims reversed by a ``rev`` eqn or a ``jit`` wrapping one (jnp.flip)."""
  if eqn.primitive.name == "rev":
    return set(eqn.params["dimensions"])
  callee = eqn.params.get("jaxpr") if eqn.primitive.name in ("jit", "pjit") else None
  if callee is None:
    return None
  body = getattr(callee, "jaxpr", callee)
  if (len(body.eqns) == 1 and body.eqns[0].primitive.name == "rev"
      and body.eqns[0].invars[0] is body.invars[0]
      and body.outvars[0] is body.eqns[0].outvars[0]):
    return set(body.eqns[0].params["dimensions"])
  return None
