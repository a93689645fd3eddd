"""Other devices' memory in a Mosaic GPU kernel: ``plgpu.remote_ref`` (a
``PeerMemRef`` transform) and the device a warpgroup thread runs on.

GMEM refs are symmetric across the devices of a ``shard_map``: the same
kernel operand or output (or semaphore) exists on every device, so a
remote ref names the peer's copy of the ref it transforms
(``devices.DeviceContext.peer_ref``). Accessors (``operands.ref_accessor``)
have no run context, so the device of the running warpgroup is kept per
thread (``activate``/``current``): each warpgroup is its own Python thread.
"""
from __future__ import annotations

import threading

import jax

from pallas_np import _compat as jc
from pallas_np.errors import UnsupportedError
from pallas_np.state import peer_refs

_local = threading.local()


def activate(device) -> None:
  """The device (``devices.DeviceContext``) this thread's warpgroup runs on."""
  _local.device = device


def current():
  return getattr(_local, "device", None)


def _peer_type():
  return getattr(jc.mgpu_core, "PeerMemRef", None) if jc.mgpu_core is not None else None


def _is_peer(t) -> bool:
  cls = _peer_type()
  return cls is not None and isinstance(t, cls)


class _Leaf:
  """A transform leaf's position among an eqn's operands."""
  __slots__ = ("k",)

  def __init__(self, k: int):
    self.k = k


def split(tree, n: int):
  """``(tree, positions, peer)``: the transforms without their ``PeerMemRef``
  (``positions``: which of the ``n`` leaves they keep) and the
  ``PeerMemRef`` (its device id's leaves are positions), or ``peer`` None."""
  if tree is None or _peer_type() is None:
    return tree, list(range(n)), None
  # Placeholders, not ints: an int leaf of a pl.ds would be flattened back
  # as a static start.
  transforms = jc.tree_unflatten(tree, [_Leaf(k) for k in range(n)])
  seq = transforms if isinstance(transforms, (list, tuple)) else [transforms]
  peers = [t for t in seq if _is_peer(t)]
  if not peers:
    return tree, list(range(n)), None
  if len(peers) > 1:
    raise UnsupportedError("pallas_np: a remote_ref of a remote_ref")
  rest = [t for t in seq if not _is_peer(t)]
  rest = type(transforms)(rest) if isinstance(transforms, (list, tuple)) else rest
  leaves, new_tree = jax.tree_util.tree_flatten(rest)
  return new_tree, [leaf.k for leaf in leaves], peers[0]


def has_peer(tree, n: int) -> bool:
  return split(tree, n)[2] is not None


def resolver(peer, start: int, what: str):
  """``fn(args, view)``: the peer's copy of ``view`` (a kernel-level ref)
  that ``peer`` (a ``PeerMemRef`` whose leaves are positions after
  ``start``) names; ``view`` itself when the peer is this device."""
  device_id, id_type = peer.device_id, peer.device_id_type
  if isinstance(device_id, dict):
    read = lambda args: {k: int(args[start + p.k]) for k, p in device_id.items()}  # noqa: E731
  elif isinstance(device_id, (tuple, list)):
    read = lambda args: tuple(int(args[start + p.k]) for p in device_id)  # noqa: E731
  else:
    read = lambda args: int(args[start + device_id.k])  # noqa: E731

  def on_peer(args, view):
    return peer_copy(view, read(args), id_type, what)
  return on_peer


def peer_copy(view, target, id_type, what: str = "a kernel line"):
  """The copy of ``view`` (a kernel-level GMEM ref) on device ``target`` (a
  ``device_id``) as seen from the device this thread runs on."""
  me = current()
  if me is None or me.session is None or not me.placement.names:
    ids = target.values() if isinstance(target, dict) else (
        target if isinstance(target, tuple) else (target,))
    if all(int(i) == 0 for i in ids):
      return view  # one device: itself
    raise UnsupportedError(
        f"pallas_np: plgpu.remote_ref to device {target} at {what}: outside a multi-device "
        "run (jax.jit of a jax.shard_map) there is one device here")
  t = me.target_id(target, id_type)
  if t == me.logical_id:
    return view
  return me.peer_ref(me.session.members[t], view, f"plgpu.remote_ref at {what}")


peer_refs.install_peer_resolver(peer_copy)
