"""The call sites of DMAs and semaphores in a compiled loop (``dma_start``,
``dma_wait``, ``semaphore_signal``, ``semaphore_wait``,
``semaphore_read``): each is a call back into its NumPy rule
(``dma_calls``; docs/native_dma.md).

The emitted code stores the site's scalar operands (indices, a signal's
increment, a wait's value) in the status array as int64 bits, calls the
callback with the site's number and raises when it reports an error (the
runner raises the rule's own error then). Refused: a remote DMA or signal
(a ``device_id`` or ``core_index`` operand: another device's or core's
memory and semaphores, with their locks), and operands that are arrays or
floats (never seen in a DMA or semaphore operand).
"""
from __future__ import annotations

import jax

from pallas_np import _compat as jc
from pallas_np.native import dma_calls, dma_queue
from pallas_np.native.codegen import Refused, dtype_of, np_name, register

HEADER = "\n".join([
    "from numba import types as _nt",
    "from numba.extending import intrinsic as _intrinsic",
    "import llvmlite.ir as _lir",
    "",
    "def _t_pycall(typingctx, fp, site, st):",
    "    def codegen(context, builder, sig, llargs):",
    "        i64 = _lir.IntType(64)",
    "        fnty = _lir.FunctionType(i64, [i64, i64])",
    "        fn = builder.inttoptr(llargs[0], fnty.as_pointer())",
    "        return builder.call(fn, [llargs[1], llargs[2]])",
    "    return _nt.int64(_nt.int64, _nt.int64, _nt.int64), codegen",
    "_pycall = _intrinsic(_t_pycall)",
    "", ""])


def _remote(eqn) -> bool:
  """Whether the eqn names another device or core (``device_id``,
  ``core_index``)."""
  marks = list(range(len(eqn.invars)))
  name = eqn.primitive.name
  if name in ("dma_start", "dma_wait"):
    tree = eqn.params["tree"]
    parts = tree.unflatten(marks) if hasattr(tree, "unflatten") else jax.tree_util.tree_unflatten(
        tree, marks)
    return parts[4] is not None
  if name == "semaphore_signal":
    parts = jax.tree_util.tree_unflatten(eqn.params["args_tree"], marks)
    return parts[3] is not None or parts[4] is not None
  return False


@register(*dma_calls.PRIMITIVES)
def _call_site(gen, eqn, ins):
  if _remote(eqn):
    raise Refused(f"a remote {eqn.primitive.name} (another device's or core's memory)")
  gen.headers.setdefault("pycall", HEADER)
  sites = getattr(gen, "pycalls", None)
  if sites is None:
    sites = gen.pycalls = []
    need = dma_queue.PENDING + dma_queue.PENDING_MAX
    gen.prologue.append(f"    if _st.shape[0] < {need}: "
                        "raise RuntimeError('pallas_np native loop: no callback slots')")
    dma_queue.setup(gen)
  operands, scalars, slot = [], [], dma_calls.OPERANDS
  for a, v in zip(eqn.invars, ins):
    if isinstance(a.aval, jc.AbstractRef):
      if v.kind != "r" or v.name not in gen.ref_positions:
        raise Refused(f"{eqn.primitive.name} of a ref that is not a loop operand")
      operands.append(("ref", gen.ref_positions[v.name]))
    elif isinstance(a, jc.Literal):
      operands.append(("literal", a.val))
    elif v.kind == "s" and v.dtype.kind in "biu":
      if slot >= dma_calls.OPERANDS + dma_calls.MAX_OPERANDS:
        raise Refused(f"{eqn.primitive.name} with more than {dma_calls.MAX_OPERANDS} "
                      "scalar operands")
      scalars.append((slot, v.name))
      operands.append(("scalar", slot, v.dtype))
      slot += 1
    else:
      raise Refused(f"{eqn.primitive.name} with an array or float operand")
  result = eqn.primitive.name == "semaphore_read"
  k = len(sites)
  sites.append(dma_calls.Site(eqn, operands, [e for e in gen.stack if e is not None], result))

  names = [name for _, name in scalars]
  starts = eqn.primitive.name == "dma_start"

  def callback(flush=dma_queue.ALL):  # (a signal or read leaves the queues alone)
    if eqn.primitive.name in dma_calls.QUEUE_FREE:
      flush = dma_queue.NONE
    dma_queue.emit_callback(gen, k, names, flush, starts)
  name, writes = eqn.primitive.name, None
  if name == "dma_start":
    writes = dma_queue.emit_start(gen, eqn, ins, k, names, callback)
  elif name == "dma_wait":
    writes = dma_queue.emit_wait(gen, eqn, ins, k, callback)
  elif name == "semaphore_signal":
    writes = dma_queue.emit_signal(gen, eqn, ins, callback)
  elif name == "semaphore_wait":
    writes = dma_queue.emit_semaphore_wait(gen, eqn, ins, callback)
  if writes is None:
    callback()
  else:  # (a read-only one turns the compiled queue off: the NumPy rule raises)
    sites[k].writes = tuple(gen.ref_positions[r] for r in writes)
  gen.fuse = None
  if not result:
    return []
  dt = dtype_of(eqn.outvars[0].aval)
  return [gen.scalar(f"{np_name(dt)}(_st[{dma_calls.OPERANDS}])", dt)]
