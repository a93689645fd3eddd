"""Reading a Mosaic GPU eqn's operands: refs followed by their flattened
transforms (``*_transforms_tree`` / ``*_treedef`` params), compiled once per
eqn into accessors that return ``(view, index)`` of the NumPy buffer."""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import races, registry
from pallas_np.kernel_context import rule_state
from pallas_np.state.indexing import RefAccess, static_atoms
from pallas_np.mosaic_gpu import peers, threads


def num_leaves(tree) -> int:
  return 0 if tree is None else tree.num_leaves


def ref_accessor(e: registry.EqnInfo, ref_pos: int, tree, start: int):
  """``(get, next_start)``: ``get(args)`` -> ``(view, index)`` of operand
  ``ref_pos`` with the transforms whose leaves are operands ``start...``."""
  n = num_leaves(tree)
  # plgpu.remote_ref: the transforms name another device's copy of the ref.
  tree, positions, peer = peers.split(tree, n)
  atoms = [e.eqn.invars[start + p] for p in positions]
  aval = e.in_avals[ref_pos]
  inner = aval.inner_aval if isinstance(aval, jc.AbstractRef) else aval
  # Never clamped: TMA windows past a GMEM ref's end are clipped (tma_read,
  # tma_writer), anything else out of bounds is an error, as on a GPU.
  access = RefAccess.shared(tree, static_atoms(e.folded, atoms), inner.shape,
                            ref_dtype=inner.dtype, clamp=False)
  dyn = [start + positions[p] for p in access.dynamic_positions]
  resolve = access.resolve
  if peer is None:
    base = lambda args: args[ref_pos]  # noqa: E731
  else:
    on_peer = peers.resolver(peer, start, e.source)
    base = lambda args: on_peer(args, args[ref_pos])  # noqa: E731

  def get(args):
    return resolve(base(args), [args[i] for i in dyn])
  get.access = access
  get.leaves = lambda args: [args[i] for i in dyn]
  get.base = base
  # The same window of another buffer (a multimem op's copy on each device).
  get.on = lambda buf, args: resolve(buf, [args[i] for i in dyn])
  get.ref_pos = ref_pos
  return get, start + n


def _tma_window(get, args):
  """(view, coords, in_bounds) of a GMEM window that runs past the ref's
  end: the TMA unit clips such boxes (zero-filled reads, dropped writes)."""
  res = get.access.unchecked_coords(get.base(args), get.leaves(args))
  if res is None:
    raise IndexError("out-of-bounds TMA window")
  view, coords = res
  coords = np.broadcast_arrays(*coords)
  ok = np.ones(coords[0].shape, bool)
  for c, n in zip(coords, view.shape):
    ok &= (c >= 0) & (c < n)
  return view, coords, ok


def window(get, args):
  """(view, index) of the in-bounds part of a TMA window (race detection)."""
  try:
    return get(args)
  except IndexError:
    view, coords, ok = _tma_window(get, args)
    return view, tuple(c[ok] for c in coords)


def tma_read(get, args) -> np.ndarray:
  """Read a GMEM window; elements out of bounds read 0 (TMA semantics)."""
  try:
    return read(*get(args))
  except IndexError:
    res = get.access.unchecked_coords(get.base(args), get.leaves(args))
    if res is None:
      raise
    view, coords = res  # per-axis coordinates, broadcastable (not broadcast)
    ok = True
    for c, n in zip(coords, view.shape):
      ok = ok & (c >= 0) & (c < n)
    clipped = tuple(np.clip(c, 0, max(n - 1, 0)) for c, n in zip(coords, view.shape))
    out = view[clipped]
    return np.where(ok, out, np.zeros((), out.dtype))


def tma_writer(get, args, data, reduce=None, poison=None):
  """A callable writing ``data`` into a GMEM window; elements out of bounds
  are dropped (TMA semantics). ``poison``: a value the window holds until
  then (the uninitialised fill)."""
  try:
    view, idx = get(args)
    if poison is not None:
      view[idx] = poison
  except IndexError:
    view, coords, ok = _tma_window(get, args)
    idx = tuple(c[ok] for c in coords)
    data = np.broadcast_to(data, ok.shape)[ok]
  if reduce is None:
    def land():
      view[idx] = data
  else:
    def land():
      view[idx] = reduce(view[idx], data)
  land.window = (view, idx)
  return land


def store_rule(e: registry.EqnInfo):
  """A ref write at ``operands[0][transforms]`` of ``operands[-1]``'s value
  (``plgpu.store``, ``async_store_tmem``: explicit-layout stores)."""
  get, _ = ref_accessor(e, 0, e.params["tree"], 2)

  def store(*args):
    view, idx = get(args)
    races.note(view, idx, "write")
    view[idx] = args[1]
    return []
  return store


def read(view, idx) -> np.ndarray:
  return np.array(view[idx])


def one_barrier(view, idx) -> threads.Barrier:
  """The single barrier a (transformed) barrier ref names."""
  cell = view[idx]
  if isinstance(cell, np.ndarray):
    if cell.size != 1:
      unindexed = ("Attempting to operate on barrier without indexing, but "
                   f"`num_barriers = {cell.size}`: " if cell.shape == view.shape else "")
      raise ValueError(f"{unindexed}expected a single barrier, got an array of {cell.size} "
                       "barriers")
    cell = cell.reshape(-1)[0]
  return cell


def block_of(ctx) -> threads.BlockState:
  thread = ctx.family
  st = thread.block if thread is not None else None
  if st is None:  # a pl.pallas_call with plgpu.CompilerParams: one thread per program
    rules = rule_state(ctx)
    st = rules.gpu_block
    if st is None:
      st = rules.gpu_block = threads.BlockState("", 1, ctx.kernel_name)
      st.defer_stores = False
  if not st.defer_stores:  # the grid point this pallas_call program runs
    st.block = str(tuple(int(i) for i in ctx.program_ids))
  return st


def thread_of(ctx) -> int:
  """The thread's slot in its cluster (a warpgroup of a block, or a warp)."""
  thread = ctx.family
  if thread is None:
    return 0
  return thread.thread if thread.slot is None else thread.slot


def thread_name(ctx) -> str:
  task = ctx.family.task if ctx.family is not None else None
  return task.name if task is not None else f"warpgroup {thread_of(ctx)}"


def in_warp(ctx) -> bool:
  """Is this thread a warp of a ``plgpu.warp_map`` (not a warpgroup)?"""
  thread = ctx.family
  slot = thread.slot if thread is not None else None
  per_wg = getattr(thread.block, "slots_per_wg", 1) if thread is not None else 1
  return slot is not None and per_wg > 1 and slot % per_wg != 0
