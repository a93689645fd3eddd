"""Shape and data-movement primitives and integer/bool reductions in a
compiled loop. Arrays are flat, their shapes static, so each primitive is
one loop nest whose source index is a linear expression of the loop
variables; a reshape (squeeze, expand_dims) is the same flat array.

Float reductions are ``native/reductions.py``'s (NumPy's pairwise order);
float dots ``native/dots.py``'s.

An iota and a broadcast are lazy values (``loop_fusion``): no buffer, each
elementwise loop reading one computes its element from the element's
indices; so is a ref block read in place by elementwise eqns only
(``ref_in_place``).
"""
from __future__ import annotations

import math

import numpy as np

from pallas_np import _compat as jc
from pallas_np.native.codegen import Refused, Val, dtype_of, emitter, np_name, register

NO_REFS = frozenset()  # (a lazy value's ref accesses: none)


def row_strides(shape) -> list[int]:
  out, acc = [], 1
  for n in reversed(shape):
    out.append(acc)
    acc *= n
  return out[::-1]


def linear(terms) -> str:
  """``a*b + c*d + k`` from (var or None, coefficient) pairs."""
  parts, const = [], 0
  for var, coef in terms:
    if var is None:
      const += coef
    elif coef == 1:
      parts.append(var)
    elif coef:
      parts.append(f"{var} * {coef}")
  if const or not parts:
    parts.append(str(const))
  return " + ".join(parts)


def gather(gen, shape, dt, source):
  """A fresh array of ``shape`` whose element at loop variables ``js`` is
  ``source(js)``."""
  out = gen.array(shape, dt)
  js = gen.nest(shape)
  gen.emit(f"{out.name}[{linear(zip(js, row_strides(shape)))}] = {source(js)}")
  gen.close(shape)
  return out


def retarget(gen, v: Val, shape) -> Val:
  """``v``'s elements (row-major) as a value of ``shape``."""
  shape = tuple(shape)
  if math.prod(shape) != v.size:
    raise Refused("reshape size")
  if v.kind == "r":
    raise Refused("reshape of a ref")
  if not shape:
    return v if v.kind == "s" else gen.scalar(f"{v.name}[0]", v.dtype)
  if v.kind == "s":
    out = gen.array(shape, v.dtype)
    gen.elementwise(out, lambda: v.name)
    return out
  return Val(v.name, shape, v.dtype, "a", glob=v.glob, temp=v.temp)


def lazy_broadcast(gen, x: Val, shape, dims) -> Val:
  """``x`` (a scalar, an array or a lazy value) broadcast to ``shape``, its
  axis k the result's ``dims[k]`` (stretched where x's is 1): a lazy value
  reading x's element (a row broadcast: one load per row of a nested
  loop)."""
  shape = tuple(shape)
  if x.kind == "s":
    return gen.lazy(shape, x.dtype, lambda ds: (x.name, NO_REFS))
  if x.lazy is not None:
    inner = x.lazy.expr
    return gen.lazy(shape, x.dtype, lambda ds: inner(
        [ds[d] if n != 1 else "0" for d, n in zip(dims, x.shape)]))
  strides = row_strides(x.shape)
  return gen.lazy(shape, x.dtype, lambda ds: (f"{x.name}[" + linear(
      (ds[d], s if n != 1 else 0) for d, n, s in zip(dims, x.shape, strides)) + "]", NO_REFS))


def broadcast_to(gen, v: Val, shape) -> Val:
  """``v`` (same rank, dims 1 or equal) broadcast to ``shape``: an
  elementwise operand that NumPy-style broadcasting would stretch."""
  if len(v.shape) != len(shape) or any(a not in (1, b) for a, b in zip(v.shape, shape)):
    raise Refused("operand shapes")
  return lazy_broadcast(gen, v, shape, range(len(shape)))


@register("reshape", "squeeze", "expand_dims")
def _reshape(gen, eqn, ins):
  return [retarget(gen, ins[0], eqn.outvars[0].aval.shape)]


def passes_lazy(fn):
  """Mark an emitter that takes lazy operands and passes them on (its
  result lazy too: ``codegen.Gen.run_jaxpr`` materialises them for any
  other emitter)."""
  fn.lazy_ok = "passes"
  return fn


@register("broadcast_in_dim")
@passes_lazy
def _broadcast_in_dim(gen, eqn, ins):
  x = ins[0]
  shape = tuple(eqn.params["shape"])
  dims = tuple(eqn.params["broadcast_dimensions"])
  if len(ins) != 1:
    raise Refused("dynamic broadcast shape")
  if x.lazy is None and x.kind == "a" and x.size == math.prod(shape):
    return [retarget(gen, x, shape)]
  if x.kind not in "as":
    raise Refused(f"broadcast_in_dim of kind {x.kind}")
  return [lazy_broadcast(gen, x, shape, dims)]


@register("slice")
def _slice(gen, eqn, ins):
  x = ins[0]
  p = eqn.params
  starts = p["start_indices"]
  strides = p["strides"] or (1,) * len(starts)
  shape = tuple(eqn.outvars[0].aval.shape)
  in_strides = row_strides(x.shape)
  if not shape:
    return [x]
  return [gather(gen, shape, x.dtype, lambda js: f"{x.name}[" + linear(
      [(j, st * s) for j, st, s in zip(js, strides, in_strides)]
      + [(None, b * s) for b, s in zip(starts, in_strides)]) + "]")]


@register("transpose")
def _transpose(gen, eqn, ins):
  x = ins[0]
  perm = tuple(eqn.params["permutation"])
  if x.kind == "v":  # a ref block only a dot reads (native/dots.py's RefView)
    return [x.transposed(gen, perm)]
  shape = tuple(eqn.outvars[0].aval.shape)
  in_strides = row_strides(x.shape)
  return [gather(gen, shape, x.dtype, lambda js: f"{x.name}[" + linear(
      (j, in_strides[p]) for j, p in zip(js, perm)) + "]")]


@register("rev")
def _rev(gen, eqn, ins):
  x = ins[0]
  dims = set(eqn.params["dimensions"])
  in_strides = row_strides(x.shape)
  terms = lambda js: [(j, -s if d in dims else s) for d, (j, s) in enumerate(zip(js, in_strides))] \
      + [(None, (n - 1) * s) for d, (n, s) in enumerate(zip(x.shape, in_strides)) if d in dims]
  return [gather(gen, x.shape, x.dtype, lambda js: f"{x.name}[{linear(terms(js))}]")]


@register("iota")
def _iota(gen, eqn, ins):
  p = eqn.params
  dt = dtype_of(eqn.outvars[0].aval)
  dim = int(p["dimension"])
  shape = tuple(p["shape"])
  if dt == np.bool_:
    raise Refused("bool iota")
  c = np_name(dt)
  return [gen.lazy(shape, dt, lambda ds: (f"{c}({ds[dim]})", NO_REFS))]


LAZY_ROLL = True


@register("concatenate")
def _concatenate(gen, eqn, ins):
  dim = int(eqn.params["dimension"])
  users = gen.consumers.get(eqn.outvars[0], ())
  if (LAZY_ROLL and len(ins) == 2 and ins[0] is ins[1] and ins[0].kind == "a" and len(users) == 1
      and users[0][0] is not None and users[0][0].primitive.name == "dynamic_slice"
      and users[0][1] == 0):
    # jnp.roll's concatenate([x, x]) read by one dynamic_slice: that slice
    # reads x with the index wrapped instead (one pass, not three)
    lazy = Val(gen.fresh("roll"), eqn.outvars[0].aval.shape, ins[0].dtype, "a")
    lazy.roll = (ins[0], dim)
    return [lazy]
  shape = tuple(eqn.outvars[0].aval.shape)
  dt = dtype_of(eqn.outvars[0].aval)
  out = gen.array(shape, dt)
  out_strides = row_strides(shape)
  offset = 0
  for x in ins:
    if x.kind != "a":
      raise Refused("concatenate of scalars")
    js = gen.nest(x.shape)
    dst = linear([(j, s) for j, s in zip(js, out_strides)] + [(None, offset * out_strides[dim])])
    gen.emit(f"{out.name}[{dst}] = {x.name}[{linear(zip(js, row_strides(x.shape)))}]")
    gen.close(x.shape)
    offset += x.shape[dim]
  return [out]


def _clamped_starts(gen, starts, operand_shape, sizes):
  """XLA clamps dynamic slice starts into [0, dim - size]."""
  out = []
  for s, n, z in zip(starts, operand_shape, sizes):
    if s.kind != "s":
      raise Refused("array start index")
    out.append(gen.scalar(f"min(max(np.int64({s.name}), 0), {n - z})", np.dtype(np.int64)).name)
  return out


@register("dynamic_slice")
def _dynamic_slice(gen, eqn, ins):
  x, starts = ins[0], ins[1:]
  sizes = tuple(eqn.params["slice_sizes"])
  if x.kind != "a":
    raise Refused("dynamic_slice of a scalar")
  st = _clamped_starts(gen, starts, x.shape, sizes)
  if x.roll is not None:
    return [_roll_gather(gen, x.roll, sizes, st)]
  in_strides = row_strides(x.shape)
  return [gather(gen, sizes, x.dtype, lambda js: f"{x.name}[" + " + ".join(
      f"({j} + {s}) * {k}" for j, s, k in zip(js, st, in_strides)) + "]")]


def _roll_gather(gen, roll, sizes, starts):
  """``dynamic_slice(concatenate([w, w], dim), starts, sizes)`` read from
  ``w``: along ``dim`` the loop is split where the index wraps, so each
  half is a plain contiguous copy."""
  w, dim = roll
  n = w.shape[dim]
  out = gen.array(sizes, w.dtype)
  w_strides, o_strides = row_strides(w.shape), row_strides(sizes)
  s = starts[dim]
  for half in (0, 1):
    js = []
    for d, size in enumerate(sizes):
      j = gen.fresh("j")
      js.append(j)
      if d != dim:
        gen.emit(f"for {j} in range({size}):")
      elif half == 0:
        gen.emit(f"for {j} in range(min({size}, {n} - {s})):")
      else:
        gen.emit(f"for {j} in range(max(0, {n} - {s}), {size}):")
      gen.depth += 1
    src = " + ".join(f"({j} + {st}{' - ' + str(n) if (d == dim and half) else ''}) * {k}"
                     for d, (j, st, k) in enumerate(zip(js, starts, w_strides)))
    gen.emit(f"{out.name}[{linear(zip(js, o_strides))}] = {w.name}[{src}]")
    gen.depth -= len(sizes)
  return out


@register("dynamic_update_slice")
def _dynamic_update_slice(gen, eqn, ins):
  x, upd, starts = ins[0], ins[1], ins[2:]
  if x.kind != "a" or upd.kind not in "as":
    raise Refused("dynamic_update_slice of a scalar")
  st = _clamped_starts(gen, starts, x.shape, upd.shape)
  out = gen.array(x.shape, x.dtype)
  gen.copy_into(out.name, x.name, x.size)
  js = gen.nest(upd.shape)
  dst = " + ".join(f"({j} + {s}) * {k}" for j, s, k in zip(js, st, row_strides(x.shape)))
  src = upd.at(linear(zip(js, row_strides(upd.shape))))
  gen.emit(f"{out.name}[{dst}] = {src}")
  gen.close(upd.shape)
  return [out]


def int_reduction(kind):
  """The emitter of an integer or bool ``reduce_<kind>`` (float ones:
  ``native/reductions.py``)."""
  def emit(gen, eqn, ins):
    x = ins[0]
    axes = tuple(sorted(eqn.params["axes"]))
    dt = x.dtype
    if dt.kind == "f":
      raise Refused(f"float {kind} reduction")  # (native/reductions.py)
    if kind in ("sum",) and dt == np.bool_:
      raise Refused("bool sum")
    c = np_name(dt)
    if dt == np.bool_:
      init = "True" if kind in ("and", "min") else "False"
      # (bitwise, not ``or``/``and``: a short-circuit is a branch per
      # element, which keeps LLVM from vectorizing the reduction)
      step = {"or": "({a} | {x})", "max": "({a} | {x})",
              "and": "({a} & {x})", "min": "({a} & {x})"}[kind]
    else:
      info = np.iinfo(dt)
      init = {"sum": f"{c}(0)", "max": f"{c}({int(info.min)})", "min": f"{c}({int(info.max)})",
              "or": f"{c}(0)", "and": f"{c}(-1)" if dt.kind == "i" else f"{c}({int(info.max)})"}[kind]
      step = {"sum": c + "({a} + {x})", "max": c + "({a} if {a} > {x} else {x})",
              "min": c + "({a} if {a} < {x} else {x})", "or": c + "({a} | {x})",
              "and": c + "({a} & {x})"}[kind]
    if x.kind == "s":
      return [x]
    kept = [d for d in range(len(x.shape)) if d not in axes]
    out_shape = tuple(x.shape[d] for d in kept)
    in_strides = row_strides(x.shape)
    out = None if not out_shape else gen.array(out_shape, dt)
    ko = gen.nest(out_shape)
    acc = gen.fresh("acc")
    gen.emit(f"{acc} = {init}")
    kr = gen.nest([x.shape[d] for d in axes])
    idx = linear([(j, in_strides[d]) for j, d in zip(ko, kept)]
                  + [(j, in_strides[d]) for j, d in zip(kr, axes)])
    gen.emit(f"{acc} = " + step.format(a=acc, x=f"{x.name}[{idx}]"))
    gen.close(axes)
    if out is not None:
      gen.emit(f"{out.name}[{linear(zip(ko, row_strides(out_shape)))}] = {acc}")
    gen.close(out_shape)
    return [out if out is not None else Val(acc, (), dt, "s")]
  return emit


for _k in ("or", "and"):
  register(f"reduce_{_k}")(int_reduction(_k))


@register("unstack")
def _unstack(gen, eqn, ins):
  """(newer JAX's ``jnp.roll`` unstacks its shift): one value per index
  along ``axis``, that axis removed."""
  x = ins[0]
  axis = int(eqn.params["axis"])
  if x.kind != "a":
    raise Refused("unstack of a scalar")
  strides = row_strides(x.shape)
  shape = x.shape[:axis] + x.shape[axis + 1:]
  kept = [d for d in range(len(x.shape)) if d != axis]
  outs = []
  for k in range(x.shape[axis]):
    if not shape:
      outs.append(gen.scalar(f"{x.name}[{k * strides[axis]}]", x.dtype))
      continue
    outs.append(gather(gen, shape, x.dtype, lambda js, k=k: f"{x.name}[" + linear(
        [(j, strides[d]) for j, d in zip(js, kept)] + [(None, k * strides[axis])]) + "]"))
  return outs


@register("tile")
@passes_lazy
def _tile(gen, eqn, ins):
  x = ins[0]
  shape = tuple(eqn.outvars[0].aval.shape)
  if x.kind != "a" or len(x.shape) != len(shape):
    raise Refused("tile")
  if tuple(x.shape) == shape:  # (every rep 1, as flash attention's ``pltpu.repeat``s: x itself)
    return [x]
  x = gen.materialize(x)
  strides = row_strides(x.shape)
  return [gather(gen, shape, x.dtype, lambda js: f"{x.name}[" + linear(
      (f"({j} % {n})", k) for j, n, k in zip(js, x.shape, strides)) + "]")]


@register("broadcast_to")
@passes_lazy
def _broadcast_to_state(gen, eqn, ins):
  """``state.primitives.broadcast_to`` (Triton-style kernels): NumPy's
  right-aligned broadcast, the operand's shape padded with leading unit
  dims (the NumPy rule's ``broadcast_to_geometry``)."""
  x = ins[0]
  shape = tuple(eqn.params["shape"])
  if x.kind not in "as":
    raise Refused(f"broadcast_to of kind {x.kind}")
  if x.kind == "s":
    return [x if not shape else lazy_broadcast(gen, x, shape, ())]
  if len(x.shape) > len(shape):
    raise Refused("broadcast_to a lower rank")
  lead = len(shape) - len(x.shape)
  if any(n not in (1, shape[lead + k]) for k, n in enumerate(x.shape)):
    raise Refused("operand shapes")
  if x.shape == shape:
    return [x]
  if x.lazy is None and x.size == math.prod(shape):
    return [retarget(gen, x, shape)]
  return [lazy_broadcast(gen, x, shape, range(lead, len(shape)))]


def _writes_refs(eqn) -> bool:
  """Whether ``eqn`` may write a ref (conservatively: a ref operand of an
  eqn other than ``get``, an effect other than a read, such an eqn in a
  nested jaxpr)."""
  if eqn.primitive.name != "get" and any(
      isinstance(getattr(a, "aval", None), jc.AbstractRef) for a in eqn.invars):
    return True
  if any(not isinstance(e, jc.ReadEffect) for e in eqn.effects):
    return True
  return any(_writes_refs(e) for sub in jc.eqn_subjaxprs(eqn) for e in sub.eqns)


def _lazy_ok(prim):
  try:
    return getattr(emitter(prim), "lazy_ok", None)
  except Refused:
    return None


def ref_in_place(gen, eqn, ref: str, at, shape, dt) -> Val | None:
  """A ``get`` of ref block ``at`` (of ``shape``) as a lazy value read in
  place, where every reader of its value is an elementwise eqn or an
  inlined call of the same jaxpr (``lazy_ok == "reads"``: it reads the
  value into buffers of its own) and no eqn from the ``get`` to the last of
  them may write a ref (the block is then the value at each of those
  reads); else None (the block is copied, ``refs._read``)."""
  if not shape or not hasattr(at, "parts"):
    return None
  pos = gen.position.get(id(eqn))
  users = gen.consumers.get(eqn.outvars[0], ())
  if pos is None or not users:
    return None
  jaxpr, k = pos
  last = k
  for user, _ in users:
    if user is None or _lazy_ok(user.primitive) != "reads" or _writes_refs(user):
      return None
    where = gen.position.get(id(user))
    if where is None or where[0] is not jaxpr or where[1] <= k:
      return None
    last = max(last, where[1])
  if any(_writes_refs(e) for e in jaxpr.eqns[k + 1:last]):
    return None
  return gen.lazy(shape, dt, lambda ds: (at(ds), frozenset({(ref, at(ds))})))
