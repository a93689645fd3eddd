"""Every lane of a vectorized pass through a compiled loop in one call
(docs/native.md, "Vectorized grids").

A loop in a vectorized grid's batched plan (``grid/vectorize.py``: many
grid points in one NumPy pass) is a ``tier.NativeLoop`` with ``in_batched``
flags: each lane-stacked operand holds one lane per grid point (lanes
first). Called once per lane, the compiled loop cost a Python call, a
status array, the checks and the results' reshapes per lane: for
``bitonic_fori`` ~0.5 ms of a warm call around four ~57 us lanes. Here the
loop's eqn becomes a ``LanesEqn``, whose generated function takes the
lane-stacked operands whole and loops over the lanes inside:

    def native_loop(_st, a0, a1, ...):
        <the loop's buffers, allocated once for all lanes>
        o0 = np.empty(_lanes * size0, dtype0)     # each carry, lane by lane
        for _lane in range(_lanes):
            _st[LANE] = _lane
            l0 = a0[_lane]                         # the lane's view
            <the loop, on the lane's operands>
            <its carries copied into o0[_lane * size0 : ...], ...>
        return (0, o0, ...)

Bits are the per-lane run's: each lane runs the very loop the sequential
grid would, on its own views, in lane order. A bounds check that fails
leaves the failing lane in the status array's ``LANE`` slot: ``run``
raises the NumPy rule's error with that lane's operands, as the per-lane
run did. A loop with DMA or semaphore call sites (``native/dma.py``) is
refused here (their callback has the status array's last operand slots).
"""
from __future__ import annotations

import math

import numpy as np

from pallas_np import _compat as jc
from pallas_np.native import blas_calls, codegen, scheduler
from pallas_np.native.codegen import Refused

# The status-array slot holding the lane being run (the last operand slot
# of a DMA call site: a loop with call sites is refused).
LANE = blas_calls.PYCALL + blas_calls.PYCALL_OPERANDS


class _Stacked:
  """The aval of a lane-stacked operand as the tier's signature and the
  pre-key read it: the lane's aval with a leading lane axis (of unknown
  length, written 0)."""

  def __init__(self, aval):
    inner = getattr(aval, "inner_aval", None)
    if inner is not None:
      self.inner_aval = _Stacked(inner)
      self.memory_space = getattr(aval, "memory_space", None)
    else:
      self.shape = (0, *aval.shape)
      self.dtype = aval.dtype
      self.weak_type = getattr(aval, "weak_type", False)


class _StackedVar:
  """An operand of a ``LanesEqn``: a lane-stacked ``aval``."""

  def __init__(self, var):
    self.aval = _Stacked(var.aval)


class _LanesPrimitive:
  name = "pallas_np_lanes"


class LanesEqn:
  """A loop eqn run for every lane of a vectorized pass in one call (see
  the module doc): ``invars`` are the loop's, lane-stacked where batched;
  ``outvars`` the loop's (one lane's avals); ``params`` the loop's, with
  the batching flags and the loop's primitive (for the price and the
  pre-key)."""

  primitive = _LanesPrimitive()

  def __init__(self, eqn, in_batched, out_batched):
    self.eqn = eqn
    self.in_batched = tuple(bool(b) for b in in_batched)
    self.out_batched = tuple(bool(b) for b in out_batched)
    self.invars = [_StackedVar(v) if b else v for v, b in zip(eqn.invars, self.in_batched)]
    self.outvars = list(eqn.outvars)
    self.params = dict(eqn.params, lanes_loop=eqn.primitive.name, lanes_in=self.in_batched,
                       lanes_out=self.out_batched)

  def loop_source(self, clamp: bool, uninitialized: str) -> codegen.Source:
    """The generated function (module doc); raises ``Refused``."""
    eqn = self.eqn
    gen = codegen.Gen(clamp, uninitialized)
    batched = [k for k, b in enumerate(self.in_batched) if b]
    if not batched:
      raise Refused("a vectorized loop with no lane-stacked operand")
    outs = [(tuple(v.aval.shape), codegen.dtype_of(v.aval)) for v in eqn.outvars]
    args, kinds = [f"a{k}" for k in range(len(eqn.invars))], []
    gen.emit(f"_lanes = a{batched[0]}.shape[0]")
    for j, (shape, dt) in enumerate(outs):
      gen.emit(f"o{j} = np.empty(_lanes * {max(math.prod(shape), 1)}, {codegen.np_name(dt)})")
    gen.emit("for _lane in range(_lanes):")
    gen.depth += 1
    gen.emit(f"_st[{LANE}] = _lane")
    ins = []
    for k, (v, b) in enumerate(zip(eqn.invars, self.in_batched)):
      aval = v.aval
      scalar = not isinstance(aval, jc.AbstractRef) and aval.shape == ()
      kinds.append("r" if isinstance(aval, jc.AbstractRef) else "s" if scalar and not b else "a")
      name = f"a{k}"
      if b:
        gen.emit(f"l{k} = a{k}[_lane]")
        name = f"l{k}"
      ins.append(codegen.operand(gen, name, k, aval))
    results = codegen.emitter(eqn.primitive)(gen, eqn, ins, top=True)
    for j, (r, (shape, _)) in enumerate(zip(results, outs)):
      if r.kind == "s":
        gen.emit(f"o{j}[_lane] = {r.name}")
      else:
        size = math.prod(shape)
        gen.emit(f"for _c in range({size}):")
        gen.emit(f"    o{j}[_lane * {size} + _c] = {r.name}[_c]")
    gen.depth -= 1
    if getattr(gen, "pycalls", ()):
      raise Refused("DMA or semaphore call sites in a vectorized loop")
    gen.emit(f"return (0{''.join(f', o{j}' for j in range(len(outs)))},)")
    return codegen.finish(gen, args, kinds, [("a", dt) for _, dt in outs])


def run(loop, fn, ctx, args):
  """``loop`` (a ``tier.NativeLoop`` of a ``LanesEqn``) on a vectorized
  pass's operands: its carries, lane-stacked where ``out_batched``; None
  where the operands are not the types compiled for."""
  if not loop._fits(args):  # noqa: SLF001 - the tier's guard
    return None
  eqn = loop.eqn
  if loop.scalars:
    args = list(args)
    for pos, t in loop.scalars:  # (an operand shared by the lanes: its exact type)
      a = args[pos]
      if a.__class__ is not t:
        args[pos] = t(a)
  # (the loop's own status array, as ``NativeLoop._run``'s: a call holds the GIL throughout,
  # a loop with DMA call sites is refused here)
  st = loop.status
  try:
    res = fn(st, *args, *loop.scratch)
  except IndexError:
    loop.status = loop.new_status()  # (the next call's: this one holds the error)
    if not st[0]:  # (no bounds-check site's)
      raise
    lane = int(st[LANE])
    loop._raise_oob(st, [a[lane] if b else a for a, b in zip(args, eqn.in_batched)])  # noqa: SLF001
  n = ctx.batch_size
  scheduler.state["native_calls"] += n
  out = []
  for v, (shape, dt), b in zip(res[1:], loop.outs, eqn.out_batched):
    if b:
      out.append(v.reshape((n, *shape)))
    elif shape:
      out.append(v[:math.prod(shape)].reshape(shape))
    else:
      out.append(dt.type(v[0]))
  return tuple(out)

