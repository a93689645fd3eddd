"""while_loop and scan (``fori_loop``, ``pl.loop`` lower to these); in a
vectorized pass a while whose trip count differs per lane iterates the lanes
still active (lane groups)."""
from __future__ import annotations

import functools
import time

import numpy as np

from jax import lax

from pallas_np import _compat as jc
from pallas_np import batching, native, registry
from pallas_np.compiler import loop_codegen
from pallas_np.control_flow import lane_groups
from pallas_np.errors import NotBatchable, PallasNumpyError
from pallas_np.dtypes import np_dtype


def _hot(compiler, jaxpr, **kwargs):
  """Compile a loop body or condition: hot code (see ``Compiler.loop_body``).
  Its plan compiles only if called: its lines are usually inlined into
  the loop's own function (``loop_codegen``)."""
  with compiler.loop_body():
    return compiler.compile(jaxpr, lazy=True, **kwargs)


def _inlined(compiler) -> bool:
  """Whether loops are generated as one function with their body inlined
  (not under pdb, where each body runs as its own plan, as written)."""
  return not compiler.params.pdb


class LoopWatchdogError(PallasNumpyError, TimeoutError):
  """A kernel's ``while_loop`` ran past ``InterpretParams.loop_watchdog_s``
  (its condition likely never becomes false in the interpreter)."""


def _watchdog(compiler):
  """The loop watchdog's seconds, or None (off: loops compile as before)."""
  return getattr(compiler.params, "loop_watchdog_s", None)


def _timed_out(seconds, source, ctx, iterations):
  """The error a watched loop raises (the grid executor adds the kernel,
  the grid point and the primitive's line around it)."""
  return LoopWatchdogError(
      f"pallas_np loop watchdog: the while_loop at {source} ran for more than "
      f"{seconds:g} s ({iterations} iterations) at program ids "
      f"{tuple(np.asarray(p).tolist() for p in ctx.program_ids)} and was stopped: its "
      "condition never became false here (on the hardware such a kernel hangs, or fails "
      "to compile where a lowering error was expected); raise "
      "InterpretParams(loop_watchdog_s=...) for a legitimately long loop, or None to "
      "turn the watchdog off")


def _watched_while(seconds, source, nc, nb, cond_fn, body_fn, lift=None):
  """A while loop over plans that checks the wall clock every iteration
  (a ``time.monotonic`` call: noise next to a plan call). ``lift`` maps a
  body's carries back to the loop's batching (a vectorized pass)."""
  def while_loop(ctx, *args):
    cconsts, bconsts, carry = args[:nc], args[nc:nc + nb], args[nc + nb:]
    deadline = time.monotonic() + seconds
    iterations = 0
    while cond_fn(ctx, *cconsts, *carry)[0]:
      carry = body_fn(ctx, *bconsts, *carry)
      if lift is not None:
        carry = lift(ctx, carry)
      iterations += 1
      if time.monotonic() > deadline:
        raise _timed_out(seconds, source, ctx, iterations)
    return tuple(carry)
  return while_loop


def _native(e, fn, in_batched=None, out_batched=None):
  """``fn`` (a loop's NumPy path) with its native tier (``pallas_np.native``)
  where the loop may be compiled: an outermost loop (a nested one is
  compiled with it), options allowing it, a vectorized pass only with
  lanes first and every ref operand lane-stacked (each lane then runs the
  compiled loop on its own operands, as the sequential grid would)."""
  compiler = e.compiler
  if compiler.loop_depth or not native.enabled(compiler.params) or _watchdog(compiler):
    # (the watchdog runs in the NumPy path's loops: a compiled loop, or a
    # compiled scan around a while, would not stop)
    return fn
  if in_batched is not None:
    if compiler.lanes_last or any(isinstance(a, jc.AbstractRef) and not b
                                  for a, b in zip(e.in_avals, in_batched)):
      return fn
  return native.NativeLoop(e.eqn, compiler.params, fn, in_batched, out_batched).entry()


def _while_batched(bc, rule, info, in_batched):
  fn, needs_ctx, out_b = _while_batched_numpy(bc, rule, info, in_batched)
  return _native(info, fn, in_batched, out_b), needs_ctx, out_b


def _while_batched_numpy(bc, rule, info, in_batched):
  p = info.params
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cc_b = tuple(in_batched[:nc])
  bc_b = tuple(in_batched[nc:nc + nb])
  carry0 = tuple(in_batched[nc + nb:])
  n_carry = len(carry0)
  guess = lane_groups.carry_guess(p["body_jaxpr"].jaxpr, bc_b, carry0)
  if lane_groups.computed_from_batched(p["cond_jaxpr"].jaxpr, cc_b + guess)[0]:
    # A lane-dependent trip count (causal attention's kv loop): every carry
    # ends up batched; no fixpoint to compile the body for.
    pred_b, body = True, None
  else:
    carry_b, body = lane_groups.fixpoint_carry(
        lambda cb: _hot(bc, p["body_jaxpr"], in_batched=bc_b + cb), n_carry, guess)
    cond = _hot(bc, p["cond_jaxpr"], in_batched=cc_b + carry_b)
    pred_b = cond.out_batched[0]
  carry_avals = info.in_avals[nc + nb:]
  carry_is_ref = [isinstance(a, jc.AbstractRef) for a in carry_avals]
  body_written = jc.written_invar_positions(p["body_jaxpr"].jaxpr)
  bconst_is_ref = [i in body_written for i in range(nb)]  # refs to copy back
  if any(carry_is_ref):
    raise NotBatchable("refs in a while carry")

  seconds = _watchdog(bc)
  if not pred_b:
    body_fn, cond_fn = body.fn, cond.fn
    body_lift = tuple(body.out_batched)
    if seconds is not None:
      def lift_carry(ctx, carry):
        return batching.lift(carry, body_lift, carry_b, ctx.batch_size)
      watched = _watched_while(seconds, info.source, nc, nb, cond_fn, body_fn,
                               None if body_lift == carry_b else lift_carry)

      def while_watched(ctx, *args):
        carry = batching.lift(args[nc + nb:], carry0, carry_b, ctx.batch_size)
        return watched(ctx, *args[:nc + nb], *carry)
      return while_watched, True, carry_b
    if body_lift == carry_b and _inlined(bc):
      loop = loop_codegen.loop_function(
          "while_loop", bc.name, cond=cond, n_cond_consts=nc, body=body, n_body_consts=nb,
          n_carry=n_carry)
      if carry0 == carry_b:
        return loop, True, carry_b
      lift, n_consts = batching.lift, nc + nb

      def while_lifted(ctx, *args):
        carry = lift(args[n_consts:], carry0, carry_b, ctx.batch_size)
        return loop(ctx, *args[:n_consts], *carry)
      return while_lifted, True, carry_b

    def while_loop(ctx, *args):
      cconsts = args[:nc]
      bconsts = args[nc:nc + nb]
      carry = batching.lift(args[nc + nb:], carry0, carry_b, ctx.batch_size)
      while cond_fn(ctx, *cconsts, *carry)[0]:
        carry = body_fn(ctx, *bconsts, *carry)
        if body_lift != carry_b:
          carry = batching.lift(carry, body_lift, carry_b, ctx.batch_size)
      return carry
    return while_loop, True, carry_b

  carry_b = (True,) * n_carry
  if body is None or tuple(body.out_batched) != carry_b:  # once every carry is batched
    body = _hot(bc, p["body_jaxpr"], in_batched=bc_b + carry_b)
  body_fn, body_lift = body.fn, tuple(body.out_batched)
  cond = _hot(bc, p["cond_jaxpr"], in_batched=cc_b + carry_b)
  cond_fn = cond.fn

  def while_lanes(ctx, *args):
    cconsts = args[:nc]
    bconsts = args[nc:nc + nb]
    n = ctx.batch_size
    carry = [np.array(batching.to_lanes(v, n)) if not b else np.array(v)
             for v, b in zip(args[nc + nb:], carry0)]
    pid_b = lane_groups.pid_batched(bc, ctx)
    deadline = None if seconds is None else time.monotonic() + seconds
    iterations = 0
    while True:
      pred = np.asarray(cond_fn(ctx, *cconsts, *carry)[0])
      if not pred.any():
        return carry
      if deadline is not None:
        iterations += 1
        if time.monotonic() > deadline:
          raise _timed_out(seconds, info.source, ctx, iterations)
      if pred.all():
        new = body_fn(ctx, *bconsts, *carry)
        carry = [np.array(v) for v in batching.lift(new, body_lift, carry_b, n)]
        continue
      group = lane_groups.LaneGroup(pred)
      sub_ctx = group.ctx(ctx, pid_b)
      sub_b = group.take(bconsts, bc_b)
      new = group.run(body_fn, sub_ctx, *sub_b, *[c[group.sel] for c in carry])
      group.put_back_refs(bconsts, sub_b, bc_b, bconst_is_ref)
      for c, v in zip(carry, batching.lift(new, body_lift, carry_b, group.count)):
        c[group.sel] = v
  return while_lanes, True, carry_b


@registry.register(lax.while_p, needs_ctx=True, context_free=True, batch=_while_batched)
def _while(e):
  p = e.params
  cond = _hot(e.compiler, p["cond_jaxpr"])
  body = _hot(e.compiler, p["body_jaxpr"])
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  n_carry = len(e.in_avals) - nc - nb
  seconds = _watchdog(e.compiler)
  if seconds is not None:
    return _watched_while(seconds, e.source, nc, nb, cond.fn, body.fn)
  if _inlined(e.compiler):
    return _native(e, loop_codegen.loop_function(
        "while_loop", e.compiler.name, cond=cond, n_cond_consts=nc, body=body,
        n_body_consts=nb, n_carry=n_carry))
  return _while_loop(nc, nb, n_carry)(cond.fn, body.fn)


def _names(prefix, n):
  return "".join(f"{prefix}{k}, " for k in range(n))


def _maker(source: str, filename: str):
  """The ``make`` function a loop template defines (our own source text)."""
  scope = {}
  exec(compile(source, filename, "exec"), scope)  # noqa: S102 - our own template
  return scope["make"]


@functools.lru_cache(maxsize=256)
def _while_loop(nc, nb, n_carry):
  """A while loop over plans ``cond``/``body`` written out for its arity:
  named carries, no argument tuples sliced or splatted per iteration."""
  cc, bc, carry = _names("c", nc), _names("b", nb), _names("x", n_carry)
  source = (f"def make(cond, body):\n"
            f"  def while_loop(ctx, {cc}{bc}{carry}):\n"
            f"    while cond(ctx, {cc}{carry})[0]:\n"
            f"      {carry + '= ' if carry else ''}body(ctx, {bc}{carry})\n"
            f"    return ({carry})\n"
            f"  return while_loop\n")
  return _maker(source, "<pallas_np while_loop>")


@functools.lru_cache(maxsize=256)
def _carry_loop(n_consts, n_carry):
  """A scan without xs and ys (``fori_loop``), written out for its arity."""
  consts, carry = _names("c", n_consts), _names("x", n_carry)
  source = (f"def make(body, order):\n"
            f"  def scan_carry_only(ctx, {consts}{carry}):\n"
            f"    for _ in order:\n"
            f"      {carry + '= ' if carry else ''}body(ctx, {consts}{carry})\n"
            f"    return ({carry})\n"
            f"  return scan_carry_only\n")
  return _maker(source, "<pallas_np scan_carry_only>")


def _scan_batched(bc, rule, info, in_batched):
  fn, needs_ctx, out_b = _scan_batched_numpy(bc, rule, info, in_batched)
  if len(info.out_avals) != jc.scan_counts(info.params)[1] or len(in_batched) != sum(
      jc.scan_counts(info.params)):
    return fn, needs_ctx, out_b  # (xs or ys: not compiled)
  return _native(info, fn, in_batched, out_b), needs_ctx, out_b


def _scan_batched_numpy(bc, rule, info, in_batched):
  p = info.params
  num_consts, num_carry = jc.scan_counts(p)
  length = int(p["length"])
  reverse = bool(p["reverse"])
  consts_b = tuple(in_batched[:num_consts])
  carry0 = tuple(in_batched[num_consts:num_consts + num_carry])
  xs_b = tuple(in_batched[num_consts + num_carry:])
  if any(isinstance(a, jc.AbstractRef) for a in info.in_avals[num_consts:]):
    raise NotBatchable("refs in a scan carry")
  carry_b, body = lane_groups.fixpoint_carry(
      lambda cb: _hot(bc, p["jaxpr"], in_batched=consts_b + cb + xs_b), num_carry,
      lane_groups.carry_guess(p["jaxpr"].jaxpr, consts_b, carry0, xs_b))
  body_fn = body.fn
  body_lift = tuple(body.out_batched[:num_carry])
  ys_b = tuple(body.out_batched[num_carry:])
  y_avals = info.out_avals[num_carry:]
  order = range(length - 1, -1, -1) if reverse else range(length)
  if not xs_b and not ys_b and body_lift == carry_b and _inlined(bc):
    loop = loop_codegen.loop_function("fori_loop", bc.name, body=body,
                                      n_body_consts=num_consts, n_carry=num_carry, order=order)
    if carry0 == carry_b:
      return loop, True, carry_b
    lift = batching.lift

    def scan_lifted(ctx, *args):
      carry = lift(args[num_consts:], carry0, carry_b, ctx.batch_size)
      return loop(ctx, *args[:num_consts], *carry)
    return scan_lifted, True, carry_b

  def scan(ctx, *args):
    n = ctx.batch_size
    consts = args[:num_consts]
    carry = batching.lift(args[num_consts:num_consts + num_carry], carry0, carry_b, n)
    xs = args[num_consts + num_carry:]
    ys = [np.empty((n, *a.shape) if b else tuple(a.shape),
                   np.dtype(jc.physical_dtype(a.dtype))) for a, b in zip(y_avals, ys_b)]
    for i in order:
      out = body_fn(ctx, *consts, *carry, *[x[:, i] if b else x[i] for x, b in zip(xs, xs_b)])
      carry = out[:num_carry]
      if body_lift != carry_b:
        carry = batching.lift(carry, body_lift, carry_b, n)
      for y, v, b in zip(ys, out[num_carry:], ys_b):
        if b:
          y[:, i] = v
        else:
          y[i] = v
    return (*carry, *ys)
  return scan, True, carry_b + ys_b


@registry.register(lax.scan_p, needs_ctx=True, context_free=True, batch=_scan_batched)
def _scan(e):
  p = e.params
  body_plan = _hot(e.compiler, p["jaxpr"])
  body = body_plan.fn
  num_consts, num_carry = jc.scan_counts(p)
  length = int(p["length"])
  reverse = bool(p["reverse"])
  y_avals = e.out_avals[num_carry:]
  y_specs = [(tuple(a.shape), np_dtype(a.dtype)) for a in y_avals]  # (length, ...)
  order = range(length - 1, -1, -1) if reverse else range(length)
  n_xs = len(e.in_avals) - num_consts - num_carry

  if not y_specs and n_xs == 0:
    if _inlined(e.compiler):
      return _native(e, loop_codegen.loop_function(
          "fori_loop", e.compiler.name, body=body_plan, n_body_consts=num_consts,
          n_carry=num_carry, order=order))
    return _carry_loop(num_consts, num_carry)(body, order)

  def scan(ctx, *args):
    consts = args[:num_consts]
    carry = args[num_consts:num_consts + num_carry]
    xs = args[num_consts + num_carry:]
    ys = [np.empty(shape, dt) for shape, dt in y_specs]
    for i in order:
      out = body(ctx, *consts, *carry, *[x[i] for x in xs])
      carry = out[:num_carry]
      for y, v in zip(ys, out[num_carry:]):
        y[i] = v
    return (*carry, *ys)
  return scan
