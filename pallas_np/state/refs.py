"""Reading and writing refs: get, swap, addupdate, run_scoped (masked
load/store live in ``masked.py``, atomics in ``atomics.py``).

Refs are NumPy arrays; a write goes through a view into the block, so it
lands in the operand/output buffer directly. A read returns a copy: the kernel
may overwrite the ref while the value read earlier is still alive.
"""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import races, registry
from pallas_np.state.indexing import RefAccess, static_atoms


def _access(e: registry.EqnInfo, ref_aval, idx_atoms, tree, kind=None):
  """``kind`` ("read"/"write"/"readwrite") reports the access to the race
  detector when ``detect_races`` is on; masked accesses pass None and report
  themselves with their mask."""
  clamp = e.compiler.params.bounds_check == "clamp"
  idx_atoms = static_atoms(e.folded, idx_atoms)
  if kind is not None and e.compiler.params.records_accesses:  # its own, wrapped resolve
    access = RefAccess(tree, idx_atoms, ref_aval.shape, ref_dtype=ref_aval.dtype, clamp=clamp)
    access.resolve = races.wrap_resolve(access.resolve, kind)
    return access
  return RefAccess.shared(tree, idx_atoms, ref_aval.shape, ref_dtype=ref_aval.dtype, clamp=clamp)


def _dyn(access: RefAccess, leaves):
  """Select the dynamic (non-literal) leaves: literals were folded in."""
  pos = access.dynamic_positions
  if len(pos) == len(leaves):
    return leaves
  return [leaves[p] for p in pos]


def _copy(x):
  return x.copy() if isinstance(x, np.ndarray) else x


def _read(x):
  """A value read from a ref: a copy, since the kernel may overwrite the ref
  while the value is alive -- except from read-only memory (input blocks the
  kernel never writes: the grid marks them read-only), which nothing can
  change during the run, so the view itself is the value."""
  return x.copy() if isinstance(x, np.ndarray) and x.flags.writeable else x


@registry.register(jc.state_primitives.get_p)
def _get(e):
  ref_aval = e.in_avals[0]
  access = _access(e, ref_aval, e.eqn.invars[1:], e.params["tree"], "read")
  resolve = access.resolve
  if access.num_dynamic == 0:
    view_idx = None

    def get(ref, *_literal_indices):  # literal index operands are still passed
      view, idx = resolve(ref, ())
      return _read(view[idx])
    return get
  def get(ref, *leaves):
    view, idx = resolve(ref, _dyn(access, leaves))
    return _read(view[idx])
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
  if not want_old and access.num_dynamic == 0 and access.plain() \
      and not e.compiler.params.records_accesses:
    swap.store_target = store_target(access, lambda idx: idx)
  return swap


def store_target(access: RefAccess, lane_index):
  """The block a static, transform-free store writes (a view of the ref):
  the evaluator may compute the stored value right there (``into_refs``).
  None where the write would not go through (out of bounds, read-only):
  the store itself then raises."""
  resolve = access.resolve

  def target(ref):
    try:
      view, idx = resolve(ref, ())
      out = view[lane_index(idx)]
    except Exception:  # the store reports it, at its own line
      return None
    return out if isinstance(out, np.ndarray) and out.flags.writeable else None
  return target


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
