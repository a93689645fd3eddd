"""Mosaic GPU kernels across devices: ``plgpu.multimem_store``,
``plgpu.multimem_load_reduce``, ``plgpu.semaphore_signal_multicast`` and
``pl.get_global`` semaphores; which kernels need the device scheduler
(``device_features``). ``pl.semaphore_signal/wait`` (with ``device_id``)
are the shared rules of ``pallas_np.primitives.tpu``, on the device model
of ``pallas_np.devices``; ``plgpu.remote_ref`` is resolved by
``peers``/``operands``.

A multimem store writes every device's copy of the ref at once (the NVLink
switch broadcasts it); a load-reduce reads every device's copy and reduces
them in device order (0, 1, ...) in the ref's dtype, each partial result
rounded to it: ``multimem.ld_reduce`` without ``.acc::f32``, as JAX emits
it. Both happen under the session lock, so a peer sees all or nothing."""
from __future__ import annotations

import jax
import numpy as np

from pallas_np import _compat as jc
from pallas_np import devices, registry
from pallas_np.errors import UnsupportedError
from pallas_np.mosaic_gpu import operands, peers
from pallas_np.state import dma as dma_mod

_UNBATCHED = registry.unbatched("talks to other devices: runs once per warpgroup")

_REDUCE = {"add": np.add, "min": np.minimum, "max": np.maximum,
           "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}


def _prim(name):
  return jc.mgpu_primitive(name)


# -- which kernels need the device scheduler -------------------------------------
def _has_device_id(eqn) -> bool:
  marks = list(range(len(eqn.invars)))
  parts = jc.tree_unflatten(eqn.params["args_tree"], marks)
  return parts[3] is not None


def _has_remote_ref(eqn) -> bool:
  for v in eqn.params.values():
    if isinstance(v, jax.tree_util.PyTreeDef) and peers.has_peer(v, v.num_leaves):
      return True
  return False


def device_features(jaxpr, mesh_axes) -> tuple[frozenset, bool, bool]:
  """(axis names ``axis_index`` reads that are not the kernel's own mesh
  axes, whether it talks to other devices, whether its blocks wait on
  semaphores): the last two run on the device scheduler (``device_blocks``)."""
  remote_prims = {_prim(n) for n in ("multimem_store_p", "multimem_load_reduce_p",
                                     "semaphore_signal_multicast_p")} - {None}
  names, remote, waits = set(), False, False
  stack = [jaxpr]
  while stack:
    jx = stack.pop()
    jx = getattr(jx, "jaxpr", jx) if not isinstance(jx, jc.Jaxpr) else jx
    for eqn in jx.eqns:
      prim = eqn.primitive
      if prim is jc.axis_index_p:
        name = eqn.params["axis_name"]
        names.update(n for n in (name if isinstance(name, tuple) else (name,))
                     if n not in mesh_axes)
      elif prim in remote_prims:
        remote = True
      elif prim in (jc.pallas_primitives.semaphore_signal_p, _prim("semaphore_signal_p")):
        remote = remote or _has_device_id(eqn)
      elif prim is _prim("semaphore_signal_parallel_p"):
        remote = remote or any(d is not None for d in jc.tree_unflatten(
            eqn.params["args_tree"], list(range(len(eqn.invars))))[3])
      elif prim in (jc.pallas_primitives.semaphore_wait_p, _GET_GLOBAL,
                    _prim("semaphore_wait_p")):
        waits = True
      if not remote and _has_remote_ref(eqn):
        remote = True
    stack.extend(jc.subjaxprs(jx))
  return frozenset(names), remote, waits


# -- all devices of the collective axes ------------------------------------------
def _all_devices(ctx, axes, what: str):
  """(me, [(logical id, DeviceContext)] in device order); ``axes`` must be
  every mesh axis (JAX's lowering allows no other)."""
  me = ctx.device
  axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
  if me is None or me.session is None or not me.placement.names:
    raise UnsupportedError(  # JAX's lowering needs a device mesh too
        f"pallas_np: {what} over {axes}: outside a multi-device run (jax.jit of a "
        "jax.shard_map) there are no devices to reach")
  if set(axes) != set(me.placement.names):
    raise UnsupportedError(
        f"pallas_np: {what} over {axes}: only all the mesh's axes "
        f"{me.placement.names} are supported (as in JAX's lowering)")
  members = me.session.members
  if len(members) == 1:
    return me, [(me.logical_id, me)]
  return me, sorted(members.items())


def _copy_on(me, dev, view, what):
  if dev.logical_id == me.logical_id:
    return view
  return me.peer_ref(dev, view, what)


if _prim("multimem_store_p") is not None:
  @registry.register(_prim("multimem_store_p"), needs_ctx=True, foldable=False,
                     batch=_UNBATCHED)
  def _multimem_store(e):
    get, _ = operands.ref_accessor(e, 1, e.params.get("transforms_tree"), 2)
    axes = e.params["collective_axes"]
    what = f"multimem_store at {e.source}"

    def store(ctx, *args):
      data = np.asarray(args[0])
      with devices.lock(ctx):
        me, devs = _all_devices(ctx, axes, what)
        for _, dev in devs:
          view, idx = get.on(_copy_on(me, dev, get.base(args), what), args)
          view[idx] = data
      return []
    return store


def _reduce_fn(op, dtype, what):
  dtype = np.dtype(dtype)
  op = str(getattr(op, "value", op))
  fn = _REDUCE.get(op)
  if fn is None:
    raise UnsupportedError(f"pallas_np: {what} with reduction_op={op!r}")
  floating = not (np.issubdtype(dtype, np.integer) or dtype == np.bool_)
  if floating and op in ("and", "or", "xor"):
    raise ValueError(f"{what}: only add, min and max are supported for floats")
  if dtype == np.float32 and op != "add":
    raise ValueError(f"{what}: only add is supported for f32 (as multimem.ld_reduce)")
  return fn


if _prim("multimem_load_reduce_p") is not None:
  @registry.register(_prim("multimem_load_reduce_p"), needs_ctx=True, foldable=False,
                     batch=_UNBATCHED)
  def _multimem_load_reduce(e):
    p = e.params
    get, _ = operands.ref_accessor(e, 0, p.get("tree"), 1)
    what = f"multimem_load_reduce at {e.source}"
    dtype = e.in_avals[0].inner_aval.dtype
    reduce = _reduce_fn(p["reduction_op"], dtype, what)
    axes = p["collective_axes"]

    def load_reduce(ctx, *args):
      with devices.lock(ctx):
        me, devs = _all_devices(ctx, axes, what)
        acc = None
        for _, dev in devs:  # device order, in the ref's dtype
          part = operands.read(*get.on(_copy_on(me, dev, get.base(args), what), args))
          acc = part if acc is None else reduce(acc, part).astype(part.dtype, copy=False)
      return acc
    return load_reduce


if _prim("semaphore_signal_multicast_p") is not None:
  @registry.register(_prim("semaphore_signal_multicast_p"), needs_ctx=True, foldable=False,
                     batch=_UNBATCHED)
  def _semaphore_signal_multicast(e):
    n = len(e.eqn.invars)
    sem_pos, transforms, inc_pos = jc.tree_unflatten(e.params["args_tree"], list(range(n)))
    leaves, tree = jax.tree_util.tree_flatten(transforms)
    if leaves and leaves != list(range(1, 1 + len(leaves))):
      raise e.unsupported("semaphore_signal_multicast with this operand layout")
    get, _ = operands.ref_accessor(e, sem_pos, tree, 1)
    axes = e.params["collective_axes"]
    what = f"semaphore_signal_multicast at {e.source}"
    source = e.source

    def signal(ctx, *args):
      inc = int(args[inc_pos])
      me, devs = _all_devices(ctx, axes, what)
      sem = get(args)
      for logical, _ in devs:
        if logical == me.logical_id:
          dma_mod.signal(ctx, dma_mod.sem_cell(*sem), inc)
        else:
          dma_mod.remote_signal(ctx, logical, sem, inc, source=source)
      return []
    return signal


_GET_GLOBAL = getattr(jc.pallas_primitives, "get_global_p", None)

if _GET_GLOBAL is not None:
  @registry.register(_GET_GLOBAL, needs_ctx=True, foldable=False, batch=_UNBATCHED)
  def _get_global(e):
    what = e.params["what"]
    shape = tuple(getattr(what, "shape", ()))
    dtype = getattr(getattr(what, "inner_aval", what), "dtype", None)
    if dtype is None or not jc.is_semaphore_dtype(dtype):
      raise e.unsupported(f"pl.get_global of {what} (only semaphores, as in JAX's lowering)")
    site = object()  # this call site: the same semaphore in every block
    source = e.source

    def get_global(ctx):
      dev = ctx.device
      alloc = getattr(dev, "global_semaphore", None)
      if alloc is None:
        raise UnsupportedError(
            f"pallas_np: pl.get_global at {source} outside a Mosaic GPU mesh kernel "
            "(plgpu.kernel)")
      return alloc(site, np.zeros(shape, np.int64))
    return get_global


# -- plgpu.semaphore_signal / semaphore_wait (JAX 0.12: with a memory scope) --------
def _like_pallas(pallas_prim):
  def compile_rule(e):
    return registry.lookup(pallas_prim).compile(e)
  return compile_rule


for _name, _pallas_prim in (("semaphore_signal_p", jc.pallas_primitives.semaphore_signal_p),
                            ("semaphore_wait_p", jc.pallas_primitives.semaphore_wait_p)):
  # The memory scope ("sys"/"gpu") orders memory for the hardware; here every
  # access is visible at once, so they are pl.semaphore_signal/wait.
  if _prim(_name) is not None and _prim(_name) is not _pallas_prim:
    registry.register(_prim(_name), needs_ctx=True, foldable=False,
                      batch=_UNBATCHED)(_like_pallas(_pallas_prim))


class _Leaf:
  """An operand position (placeholder leaf: a pl.ds start stays dynamic)."""
  __slots__ = ("k",)

  def __init__(self, k: int):
    self.k = k


def _device_reader(node):
  if node is None:
    return None
  if isinstance(node, dict):
    return lambda args: {a: int(args[p.k]) for a, p in node.items()}
  if isinstance(node, (tuple, list)):
    return lambda args: tuple(int(args[p.k]) for p in node)
  return lambda args: int(args[node.k])


if _prim("semaphore_signal_parallel_p") is not None:
  @registry.register(_prim("semaphore_signal_parallel_p"), needs_ctx=True, foldable=False,
                     batch=_UNBATCHED)
  def _semaphore_signal_parallel(e):
    """Every signal, in order (one of the orders the hardware may show)."""
    marks = [_Leaf(k) for k in range(len(e.eqn.invars))]
    refs, transforms, incs, device_ids = jc.tree_unflatten(e.params["args_tree"], marks)
    signals = []
    for ref, ts, inc, dev in zip(refs, transforms, incs, device_ids):
      leaves, tree = jax.tree_util.tree_flatten(ts)
      start = leaves[0].k if leaves else 0
      if [leaf.k for leaf in leaves] != list(range(start, start + len(leaves))):
        raise e.unsupported("semaphore_signal_parallel with this operand layout")
      get, _ = operands.ref_accessor(e, ref.k, tree if leaves else None, start)
      signals.append((get, inc.k, _device_reader(dev)))
    source = e.source

    def signal(ctx, *args):
      for get, inc_pos, read_dev in signals:
        sem, inc = get(args), int(args[inc_pos])
        me = ctx.device
        target = None
        if read_dev is not None and me is not None and me.placement.names:
          target = me.target_id(read_dev(args), jc.DeviceIdType.MESH)
        elif read_dev is not None:
          dev = read_dev(args)
          ids = dev.values() if isinstance(dev, dict) else (
              dev if isinstance(dev, tuple) else (dev,))
          if any(int(i) != 0 for i in ids):
            raise UnsupportedError(
                f"pallas_np: semaphore_signal_parallel to device {dev} at {source}: outside "
                "a multi-device run (jax.jit of a jax.shard_map) there is one device here")
        if target is None or target == me.logical_id:
          dma_mod.signal(ctx, dma_mod.sem_cell(*sem), inc)
        else:
          dma_mod.remote_signal(ctx, target, sem, inc, source=source)
      return []
    return signal
