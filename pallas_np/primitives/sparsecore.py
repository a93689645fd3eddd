"""SparseCore (``jax.experimental.pallas.tpu_sc``) primitives: indexed
gathers and scatters from VMEM refs, expanded loads / compressed stores,
atomic adds, ``parallel_loop`` and the subcore barrier.

The vector subcores themselves are programs of a mesh kernel
(``pallas_np.meshes``); what these rules need of them (the barrier) they ask
of the run context's program (``ctx.device``).
"""
from __future__ import annotations

import jax
import numpy as np

from pallas_np import _compat as jc
from pallas_np import devices, races, registry
from pallas_np.errors import UnsupportedError
from pallas_np.dtypes import np_dtype
from pallas_np.memory import allocate
from pallas_np.primitives.tpu_operands import operand_positions, ref_operand, scalar_operand

scp = jc.sc_primitives
_SEQUENTIAL = registry.unbatched("SparseCore state (refs, barriers) is per subcore: "
                                 "the grid runs sequentially")


def _check_indices(indices, shape, what):
  for d, (i, n) in enumerate(zip(indices, shape)):
    if i.size and (i.min() < 0 or i.max() >= n):
      bad = int(i[(i < 0) | (i >= n)][0])
      raise IndexError(f"{what}: index {bad} is out of bounds for dimension {d} of a ref "
                       f"of shape {tuple(shape)}")


def _indexed(e, tree):
  """(ref resolver, index getters, value getter or None, mask getter or None)."""
  parts = operand_positions(e, tree)
  if len(parts) == 4:
    ref, transforms, indices, mask = parts
    value = None
  else:
    ref, transforms, indices, value, mask = parts
  get_ref = ref_operand(e, ref, transforms)
  get_idx = [scalar_operand(e, i) for i in indices]
  get_val = scalar_operand(e, value) if value is not None else None
  get_mask = scalar_operand(e, mask) if mask is not None else None
  return get_ref, get_idx, get_val, get_mask


if scp is not None:
  @registry.register(scp.gather_p, foldable=False, batch=_SEQUENTIAL)
  def _gather(e):
    """``plsc.load_gather(ref, [i0, i1, ...], mask=)``: ``ref[i0[k], i1[k], ...]``;
    masked-off elements are undefined (the uninitialized fill here)."""
    get_ref, get_idx, _, get_mask = _indexed(e, e.params["tree"])
    out = e.out_avals[0]
    params = e.compiler.params
    what = f"load_gather at {e.source}"

    def gather(*args):
      view, idx = get_ref(args)
      sub = view[idx]
      ii = tuple(np.asarray(g(args)) for g in get_idx)
      if get_mask is not None:
        m = np.asarray(get_mask(args), bool)
        ii = tuple(i[m] for i in ii)
      _check_indices(ii, sub.shape, what)
      races.note(sub, ii, "read")
      if get_mask is None:
        return np.array(sub[ii], dtype=out.dtype)
      res = allocate(out.shape, out.dtype, params)
      res[m] = sub[ii]
      return res
    return gather

  @registry.register(scp.scatter_p, foldable=False, batch=_SEQUENTIAL)
  def _scatter(e):
    """``plsc.store_scatter`` / ``addupdate_scatter``: ``ref[i0[k], ...] = x[k]``
    (``+=`` with ``add``; repeated indices accumulate)."""
    get_ref, get_idx, get_val, get_mask = _indexed(e, e.params["tree"])
    add = bool(e.params["add"])
    what = f"{'addupdate' if add else 'store'}_scatter at {e.source}"

    def scatter(*args):
      view, idx = get_ref(args)
      sub = view[idx]
      ii = tuple(np.asarray(g(args)) for g in get_idx)
      x = np.asarray(get_val(args))
      if get_mask is not None:
        m = np.asarray(get_mask(args), bool)
        ii, x = tuple(i[m] for i in ii), x[m]
      _check_indices(ii, sub.shape, what)
      races.note(sub, ii, "readwrite" if add else "write")
      if add:
        np.add.at(sub, ii, x)
      else:
        sub[ii] = x
      return []
    return scatter

  def _ref_access(e):
    """The ref (invar 0) with the eqn's transforms, as ``fn(args) -> (view,
    index)``, and the mask's position (None without one)."""
    n_fixed = 2 if e.primitive is scp.swap_p else 1  # ref (, x)
    has_mask = bool(e.params["has_mask"])
    n_tr = len(e.eqn.invars) - n_fixed - (1 if has_mask else 0)
    n = len(e.eqn.invars)
    positions = operand_positions(e, jax.tree_util.tree_structure(list(range(n))))
    transforms = jc.tree_unflatten(e.params["tree"], positions[n_fixed:n_fixed + n_tr])
    get = ref_operand(e, positions[0], transforms)
    return get, (n_fixed + n_tr if has_mask else None)

  @registry.register(scp.load_p, foldable=False, batch=_SEQUENTIAL)
  def _load_expanded(e):
    """``plsc.load_expanded(ref, mask=)``: the i-th True of the mask gets the
    i-th element of the (flattened) ref; the others are undefined."""
    get, mask_pos = _ref_access(e)
    out = e.out_avals[0]
    params = e.compiler.params

    def load(*args):
      if mask_pos is None:
        view, idx = get(args)
        races.note(view, idx, "read")
        return np.array(view[idx])
      m = np.asarray(args[mask_pos], bool)
      view, idx, window = _first_elements(get, args, int(m.sum()), write=False)
      races.note(*(window or (view, idx)), "read")
      res = allocate(out.shape, out.dtype, params)
      res[m] = view[idx].reshape(-1)
      return res
    return load

  @registry.register(scp.swap_p, foldable=False, batch=_SEQUENTIAL)
  def _store_compressed(e):
    """``plsc.store_compressed`` / ``addupdate`` / ``addupdate_compressed``:
    the masked elements of ``x`` go, in order, to the first elements of the
    (flattened) ref (added with ``add``). Returns the ref's old contents."""
    get, mask_pos = _ref_access(e)
    add = bool(e.params["add"])
    params = e.compiler.params

    def store(*args):
      x = np.asarray(args[1])
      if mask_pos is None:
        view, idx = get(args)
        sub = view[idx]
        old = np.array(sub)
        races.note(view, idx, "readwrite" if add else "write")
        if add:
          sub += x
        else:
          sub[...] = x
        return old
      m = np.asarray(args[mask_pos], bool)
      vals = x[m]
      view, idx, window = _first_elements(get, args, vals.size, write=True)
      races.note(view, idx, "readwrite" if add else "write")
      if window is not None:
        old = np.array(window[0][window[1]])
      else:  # the window runs past the ref: what lies there is not read
        old = allocate(x.shape, view.dtype, params)
        old.reshape(-1)[:vals.size] = view[idx].reshape(-1)
      if add:
        view[idx] += vals.reshape(view[idx].shape)
      else:
        view[idx] = vals.reshape(view[idx].shape)
      return old
    return store

  def _first_elements(get, args, count, *, write):
    """``(view, index, window)``: ``view[index]`` are the first ``count``
    elements (in row-major order) of a compressed store's / expanded load's
    window, ``window`` the ref's ``(view, index)`` of the whole window, or
    None where it runs past the ref. Those elements are all such an access
    touches, so the window may run past the ref (tokamax top_k appends at
    ``pl.ds(count, lanes)``): only they are bounds-checked. ``write``: the
    elements must be a view of the ref (a store through a non-contiguous
    window is unsupported)."""
    try:
      view, idx = get(args)
    except IndexError:
      unchecked = get.unchecked(args)
      if unchecked is None:
        raise
      view, coords = unchecked
      shape = np.broadcast_shapes(*(np.shape(c) for c in coords))
      first = tuple(np.broadcast_to(c, shape).reshape(-1)[:count] for c in coords)
      for axis, (c, n) in enumerate(zip(first, view.shape)):
        if c.size and (c.min() < 0 or c.max() >= n):
          bad = int(c[(c < 0) | (c >= n)][0])
          raise IndexError(
              f"out-of-bounds ref access: a compressed store / expanded load of {count} "
              f"elements reaches index {bad} on axis {axis} of a ref of shape {view.shape}"
          ) from None
      return view, first, None
    sub = view[idx]
    flat = sub.reshape(-1)  # a view where the window is contiguous
    if write and sub.size and not np.shares_memory(flat, sub):
      raise UnsupportedError("pallas_np: a compressed store to a non-contiguous ref view")
    return flat, slice(0, count), (view, idx)

  @registry.register(scp.barrier_p, needs_ctx=True, foldable=False, batch=_SEQUENTIAL)
  def _subcore_barrier(e):
    what = f"plsc.subcore_barrier at {e.source}"

    def barrier(ctx):
      wait = getattr(ctx.device, "subcore_barrier", None)
      if wait is None:
        raise UnsupportedError(
            f"pallas_np: {what} outside a SparseCore VectorSubcoreMesh kernel (pl.kernel)")
      wait(ctx, what)
      return []
    return barrier

  @registry.register(scp.parallel_loop_p, needs_ctx=True, context_free=True, foldable=False,
                     batch=_SEQUENTIAL)
  def _parallel_loop(e):
    """``plsc.parallel_loop``: iterations are independent by contract, so
    running them in order is one of the schedules the hardware may pick."""
    jaxpr = e.params["jaxpr"]
    plan = e.compiler.compile(jaxpr, constvars_as_args=True).fn
    tree = e.params["tree"]
    idx_dtype = np.dtype(jaxpr.invars[0].aval.dtype)

    def parallel_loop(ctx, *args):
      lower, upper, step, consts, carry = jc.tree_unflatten(tree, list(args))
      carry = list(carry)
      for i in range(int(lower), int(upper), int(step)):
        carry = list(plan(ctx, *consts, idx_dtype.type(i), *carry))
      return carry
    return parallel_loop


_fetch_and_add_p = getattr(scp, "fetch_and_add_p", None) if scp is not None else None  # noqa: E501
if _fetch_and_add_p is not None:
  @registry.register(_fetch_and_add_p, needs_ctx=True, foldable=False, batch=_SEQUENTIAL)
  def _fetch_and_add(e):
    """``plsc.fetch_and_add(ref, v, subcore_id=s)``: atomically add ``v`` to
    the scalar SMEM ref on vector subcore ``s`` of this SparseCore and return
    its old value (under the programs' session lock)."""
    n_idx = len(e.eqn.invars) - 3
    what = f"plsc.fetch_and_add at {e.source}"
    dt = np_dtype(e.out_avals[0].dtype)

    def fetch_and_add(ctx, ref, value, *rest):
      idx, subcore = tuple(int(i) for i in rest[:n_idx]), int(rest[n_idx])
      me = ctx.device
      axes = getattr(me, "barrier_axes", None)
      if not axes:
        raise UnsupportedError(f"pallas_np: {what} outside a SparseCore VectorSubcoreMesh "
                               "kernel (pl.kernel)")
      with devices.lock(ctx):
        target = me.target_id({axes[0]: subcore}, jc.DeviceIdType.MESH)
        buf = ref if target == me.logical_id else me.peer_ref(
            me.session.members[target], ref, what)
        old = dt.type(buf[idx])
        buf[idx] = old + dt.type(value)
      return old
    return fetch_and_add


if scp is not None and getattr(scp, "all_reduce_population_count_p", None) is not None:
  @registry.register(scp.all_reduce_population_count_p, batch=_SEQUENTIAL)
  def _all_reduce_population_count(e):
    """Every element of the (n // reduce,) result holds the number of True in x."""
    n = e.out_avals[0].shape[0]
    return lambda x: np.full((n,), np.count_nonzero(x), np.int32)

  @registry.register(scp.all_reduce_ffs_p, batch=_SEQUENTIAL)
  def _all_reduce_ffs(e):
    """Every element holds the index of x's first True (x.size if none)."""
    n = e.out_avals[0].shape[0]

    def ffs(x):
      x = np.asarray(x, bool)
      first = int(np.argmax(x)) if x.any() else x.size
      return np.full((n,), first, np.int32)
    return ffs
