"""Reading and writing refs: get, swap, addupdate, masked load/store,
run_scoped.

Refs are NumPy arrays; a write goes through a view into the block, so it
lands in the operand/output buffer directly. A read returns a copy: the kernel
may overwrite the ref while the value read earlier is still alive.
"""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import races, registry
from pallas_np.state.indexing import RefAccess


def _access(e: registry.EqnInfo, ref_aval, idx_atoms, tree, kind=None):
  """``kind`` ("read"/"write"/"readwrite") reports the access to the race
  detector when ``detect_races`` is on; masked accesses pass None and report
  themselves with their mask."""
  access = RefAccess(tree, idx_atoms, ref_aval.shape, ref_dtype=ref_aval.dtype,
                     clamp=e.compiler.params.bounds_check == "clamp")
  if kind is not None and e.compiler.params.detect_races:
    access.resolve = races.wrap_resolve(access.resolve, kind)
  return access


def _race_note(e):
  """``races.note`` when detection is on, else None (nothing on the hot path)."""
  return races.note if e.compiler.params.detect_races else None


def _dyn(access: RefAccess, leaves):
  """Select the dynamic (non-literal) leaves: literals were folded in."""
  pos = access.dynamic_positions
  if len(pos) == len(leaves):
    return leaves
  return [leaves[p] for p in pos]


def _copy(x):
  return x.copy() if isinstance(x, np.ndarray) else x


@registry.register(jc.state_primitives.get_p)
def _get(e):
  ref_aval = e.in_avals[0]
  access = _access(e, ref_aval, e.eqn.invars[1:], e.params["tree"], "read")
  resolve = access.resolve
  if access.num_dynamic == 0:
    view_idx = None

    def get(ref, *_literal_indices):  # literal index operands are still passed
      view, idx = resolve(ref, ())
      return _copy(view[idx])
    return get
  def get(ref, *leaves):
    view, idx = resolve(ref, _dyn(access, leaves))
    return _copy(view[idx])
  return get


@registry.register(jc.state_primitives.swap_p)
def _swap(e):
  ref_aval = e.in_avals[0]
  want_old = e.outvars_used[0]
  access = _access(e, ref_aval, e.eqn.invars[2:], e.params["tree"],
                   "readwrite" if want_old else "write")
  resolve = access.resolve

  def swap(ref, val, *leaves):
    view, idx = resolve(ref, _dyn(access, leaves))
    if want_old:
      old = _copy(view[idx])
      view[idx] = val
      return old
    view[idx] = val
    return None
  return swap


@registry.register(jc.state_primitives.addupdate_p)
def _addupdate(e):
  ref_aval = e.in_avals[0]
  access = _access(e, ref_aval, e.eqn.invars[2:], e.params["tree"], "readwrite")
  resolve = access.resolve

  def addupdate(ref, val, *leaves):
    view, idx = resolve(ref, _dyn(access, leaves))
    if isinstance(idx, tuple) and any(isinstance(i, np.ndarray) for i in idx):
      np.add.at(view, idx, val)  # repeated indices accumulate
    else:
      view[idx] += val
    return []
  return addupdate


def _split_masked_args(e, n_lead):
  """Unflatten a masked load/swap args_tree into positions of the eqn invars."""
  tree = e.params["args_tree"]
  positions = list(range(len(e.eqn.invars)))
  return jc.tree_unflatten(tree, positions)


@registry.register(jc.pallas_primitives.load_p)
def _masked_load(e):
  ref_pos, transforms_pos, mask_pos, other_pos = _split_masked_args(e, 1)
  invars = e.eqn.invars
  idx_positions = jc.jax.tree_util.tree_leaves(transforms_pos)
  idx_tree = jc.jax.tree_util.tree_structure(transforms_pos)
  ref_aval = e.in_avals[ref_pos]
  access = _access(e, ref_aval, [invars[p] for p in idx_positions], idx_tree)
  resolve = access.resolve
  dyn_positions = [idx_positions[p] for p in access.dynamic_positions]
  out_aval = e.out_aval
  fill = _masked_fill(out_aval.dtype)
  note = _race_note(e)

  def load(*args):
    ref = args[ref_pos]
    view, idx = resolve(ref, [args[p] for p in dyn_positions])
    if mask_pos is None:
      if note is not None:
        note(view, idx, "read")
      return _copy(view[idx])
    mask = np.broadcast_to(args[mask_pos], out_aval.shape)
    if note is not None:
      note(view, idx, "read", mask)
    # Masked-off lanes may point out of bounds (Triton style): read clamped.
    val = _masked_read(view, idx, mask, access)
    other = args[other_pos] if other_pos is not None else fill
    return np.where(mask, val, other).astype(val.dtype, copy=False)
  return load


@registry.register(jc.pallas_primitives.swap_p)
def _masked_swap(e):
  ref_pos, transforms_pos, val_pos, mask_pos = _split_masked_args(e, 1)
  invars = e.eqn.invars
  idx_positions = jc.jax.tree_util.tree_leaves(transforms_pos)
  idx_tree = jc.jax.tree_util.tree_structure(transforms_pos)
  ref_aval = e.in_avals[ref_pos]
  access = _access(e, ref_aval, [invars[p] for p in idx_positions], idx_tree)
  resolve = access.resolve
  dyn_positions = [idx_positions[p] for p in access.dynamic_positions]
  want_old = e.outvars_used[0]
  note = _race_note(e)

  def swap(*args):
    ref = args[ref_pos]
    val = args[val_pos]
    view, idx = resolve(ref, [args[p] for p in dyn_positions])
    if note is not None:
      note(view, idx, "readwrite" if want_old else "write",
           None if mask_pos is None else args[mask_pos])
    if mask_pos is None:
      old = _copy(view[idx]) if want_old else None
      view[idx] = val
      return old
    mask = np.asarray(args[mask_pos])
    region = view[idx]
    old = _copy(region)
    if isinstance(region, np.ndarray) and np.shares_memory(region, view):
      np.copyto(region, np.broadcast_to(val, region.shape), where=np.broadcast_to(mask, region.shape))
    else:
      view[idx] = np.where(mask, val, old)
    return old
  return swap


def _masked_fill(dtype):
  return jc.uninitialized_value_np(jc.physical_dtype(dtype))


def _masked_read(view, idx, mask, access):
  return view[idx]


@registry.register(jc.pallas_primitives.run_scoped_p, needs_ctx=True, foldable=False)
def _run_scoped(e):
  """Allocate the scoped refs (uninitialized fill), run the body, drop them."""
  from pallas_np.grid import allocate
  jaxpr = e.params["jaxpr"]
  plan = e.compiler.compile(jaxpr, constvars_as_args=True).fn
  params = e.compiler.params
  scoped = [v.aval.inner_aval if isinstance(v.aval, jc.AbstractRef) else v.aval
            for v in jaxpr.invars]

  def run_scoped(ctx, *consts):
    return plan(ctx, *consts, *[allocate(a.shape, a.dtype, params) for a in scoped])
  return run_scoped
