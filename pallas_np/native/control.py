"""Control flow in a compiled loop: ``while`` and a carry-only ``scan``
(``fori_loop``) as Python loops over local carries, ``cond`` as an
``if``/``elif`` chain (``jit``/``closed_call`` bodies are inlined by
``codegen.Gen.run_jaxpr``)."""
from __future__ import annotations

from pallas_np import _compat as jc
from pallas_np.compiler import INLINE_CALLS
from pallas_np.native.codegen import Refused, Val, inline_callee, register


@register(*INLINE_CALLS)
def _call(gen, eqn, ins):
  """A call (``jit``, ``closed_call``, custom_jvp/vjp, remat...): its body
  emitted inline."""
  jaxpr, consts = inline_callee(eqn)
  gen.aliases.update(zip(jaxpr.invars, eqn.invars))
  return gen.run_jaxpr(jaxpr, consts, ins)


_call.lazy_ok = "reads"  # (lazy operands reach the body's eqns: shapes.ref_in_place)


def _carries(gen, inits) -> list:
  """Fresh loop variables holding ``inits`` (arrays copied: the loop
  writes its carries in place)."""
  out = []
  for v in inits:
    if v.kind == "r":
      raise Refused("a ref carried by a loop")
    c = Val(gen.fresh("x"), v.shape, v.dtype, v.kind)
    gen.emit(f"{c.name} = {v.name}.copy()" if v.kind == "a" else f"{c.name} = {v.name}")
    out.append(c)
  return out


def _assign(gen, targets, values) -> None:
  """The next iteration's carries. An eqn's buffer is copied into the
  carry's (its eqn rewrites it in the next iteration); any other value
  (a carry passed on, a cond output, a constant) is copied to a new array
  first, before any carry is overwritten."""
  later = []
  for t, v in zip(targets, values):
    if (v.shape, v.dtype) != (t.shape, t.dtype) or v.kind != t.kind:
      raise Refused("a carry changes shape, dtype or kind")
    if v.kind == "a" and not v.temp and v.name != t.name:
      n = gen.fresh("n")
      gen.emit(f"{n} = {v.name}.copy()")
      later.append((t.name, n))
    elif v.kind == "s":
      later.append((t.name, v.name))
  for t, v in zip(targets, values):
    if v.kind == "a" and v.temp:
      gen.copy_into(t.name, v.name, t.size)
  if later:  # (one tuple assignment: a scalar carry may pass on another)
    gen.emit(", ".join(t for t, _ in later) + ", = " + ", ".join(n for _, n in later) + ",")


@register("multiple_of", "max_contiguous", "stop_gradient", "sharding_constraint", "pvary",
          "optimization_barrier")
def _hint(gen, eqn, ins):
  """Compiler hints and barriers: their operands, unchanged (their NumPy
  rules are identities)."""
  return list(ins)


@register("while")
def _while(gen, eqn, ins, top=False):
  p = eqn.params
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cconsts, bconsts, init = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
  carry = _carries(gen, init)
  cond, body = p["cond_jaxpr"], p["body_jaxpr"]
  with gen.block("while True:"), gen.inside(None if top else eqn):
    (pred,) = gen.run_jaxpr(cond.jaxpr, cond.consts, cconsts + carry)
    gen.emit(f"if not {pred.name}: break")
    outs = gen.run_jaxpr(body.jaxpr, body.consts, bconsts + carry)
    _assign(gen, carry, outs)
  return carry


@register("scan")
def _scan(gen, eqn, ins, top=False):
  p = eqn.params
  num_consts, num_carry = jc.scan_counts(p)
  if len(ins) != num_consts + num_carry or len(eqn.outvars) != num_carry:
    raise Refused("a scan with xs or ys")
  consts, init = ins[:num_consts], ins[num_consts:]
  carry = _carries(gen, init)
  body = p["jaxpr"]
  with gen.block(f"for _ in range({int(p['length'])}):"), gen.inside(None if top else eqn):
    outs = gen.run_jaxpr(body.jaxpr, body.consts, consts + carry)
    _assign(gen, carry, outs)
  return carry


@register("cond")
def _cond(gen, eqn, ins):
  branches = eqn.params["branches"]
  index, ops = ins[0], ins[1:]
  last = len(branches) - 1
  # lax.cond clamps the index into range (as the NumPy rule does)
  k = gen.scalar(f"min(max(np.int64({index.name}), 0), {last})", index.dtype)
  results = [Val(gen.fresh("y"), v.aval.shape, None, None) for v in eqn.outvars]
  for b, branch in enumerate(branches):
    header = ("if True:" if last == 0 else f"if {k.name} == {b}:" if b == 0
              else f"elif {k.name} == {b}:" if b < last else "else:")
    with gen.block(header), gen.inside(eqn):
      outs = gen.run_jaxpr(branch.jaxpr, branch.consts, ops)
      for r, o in zip(results, outs):
        if o.kind == "r":
          raise Refused("a cond returning a ref")
        o = gen.owned(o)  # (a constant array is read-only: its type differs)
        r.dtype, r.kind = o.dtype, o.kind
        gen.emit(f"{r.name} = {o.name}")
  return results
