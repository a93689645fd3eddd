"""Reading and writing refs: get, swap, addupdate, run_scoped (masked
load/store live in ``masked.py``, atomics in ``atomics.py``).

Refs are NumPy arrays; a write goes through a view into the block, so it
lands in the operand/output buffer directly. A read returns a copy: the kernel
may overwrite the ref while the value read earlier is still alive.

Each primitive's batched rule (a vectorized grid, ``pallas_np.batching``)
sits right above its sequential rule: a lane-stacked ref indexed once for
every lane, or per-lane indices through ``state.lane_access``.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from pallas_np import _compat as jc
from pallas_np import batching, races, registry
from pallas_np.errors import NotBatchable, UnsupportedError
from pallas_np.memory import allocate
from pallas_np.shared_outputs import active as shared_outputs
from pallas_np.state import past_end
from pallas_np.state.indexing import RefAccess, static_atoms
from pallas_np.state.lane_access import (
    LaneIndexed, count_lane_bytes, dyn_flags, lane_index, lanes_of, trailing_slices, tracked)


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


def _read_lanes_last(x):
  """``_read`` keeping the memory order ('K'): a copy of a lanes-last
  block stays lanes-last (a 'C' copy would put the lanes first again)."""
  return x.copy(order="K") if x.flags.writeable else x



def _get_batched(bc, rule, info, in_batched):
  if info.compiler.params.oob_reads == "fill":  # (each lane may read past the ref)
    return batching.lane_loop(rule, info, in_batched)
  access = _access(info, info.in_avals[0], info.eqn.invars[1:], info.params["tree"])
  ref_b, leaf_b = in_batched[0], dyn_flags(access, in_batched[1:])
  resolve = access.resolve
  if ref_b and not any(leaf_b) and access.plain():
    read = _read_lanes_last if bc.lanes_last else _read

    def get(ref, *leaves):
      view, idx = resolve(ref, _dyn(access, leaves))
      return read(view[lane_index(idx)])
    return get, False, (True,)
  lane_acc = None if access.clamp else LaneIndexed.make(access, ref_b, leaf_b)
  if lane_acc is None:
    return batching.lane_loop(rule, info, in_batched)
  flags = tuple(in_batched)

  count_lane_bytes(bc, lane_acc, info.out_aval.dtype)

  def get_lanes(ref, *leaves):
    dyn, lanes = _dyn(access, leaves), lanes_of((ref, *leaves), flags)
    coords = lane_acc.coords(dyn)
    span = None if ref_b else lane_acc.span(ref, coords, lanes, None)
    if span is not None:
      shared = shared_outputs()
      if shared is not None:
        shared.access_span(ref, span, "read")
      return span.gather(ref, 0, ref.dtype)
    index, _, full = lane_acc.index(ref, coords, lanes, None)
    shared = None if ref_b else shared_outputs()
    if shared is not None:
      shared.access(ref, index, full, None, "read")
    return np.ascontiguousarray(np.broadcast_to(ref[trailing_slices(index, full)], full))
  return get_lanes, False, (True,)



@registry.register(jc.state_primitives.get_p, batch=_get_batched)
def _get(e):
  ref_aval = e.in_avals[0]
  access = _access(e, ref_aval, e.eqn.invars[1:], e.params["tree"], "read")
  get = _get_rule(e, access)
  if e.compiler.params.oob_reads == "fill":  # loads past the ref read the fill
    return past_end.filling_reads(get, access, lambda leaves: _dyn(access, leaves),
                                  e.compiler.params, e.out_avals[0].dtype)
  return get


def _static_index(e, access):
  """The basic index of an access with no dynamic operand and no transform
  but its indexer, built once (``ref[index]``: what ``resolve`` would give on
  every call), without access records; else None (also where building it
  raises: the access raises when run, at its grid point)."""
  if access.num_dynamic or e.compiler.params.records_accesses:
    return None
  if not access.steps:
    return (Ellipsis,)
  if access.index_only is None:
    return None
  try:
    idx = access.index_only(())
  except Exception:
    return None
  return idx if isinstance(idx, tuple) else None


def _get_rule(e, access):
  resolve = access.resolve
  if access.num_dynamic == 0:
    static = _static_index(e, access)
    if static is not None:  # x_ref[...]: the index and view, no resolve
      def get_static(ref, *_literal_indices):
        x = ref[static]
        return x.copy() if isinstance(x, np.ndarray) and x.flags.writeable else x
      return get_static

    def get(ref, *_literal_indices):  # literal index operands are still passed
      view, idx = resolve(ref, ())
      return _read(view[idx])
    return get
  index_of = _direct_index(e, access)
  one = _one_slice_access(e, index_of)
  if one is not None:  # (a loop body's x_ref[pl.ds(i, 1), :]: the slice built here)
    before, after, last, extent, stride = one
    if not before and not after and stride == 1:  # (x_ref[pl.ds(r, n), :]: no index tuple)
      def get_rows(ref, start):
        k = int(start)
        x = ref[k:k + extent] if 0 <= k <= last else ref[index_of((start,))]
        return x.copy() if x.flags.writeable else x
      return get_rows

    def get_one(ref, start):
      k = int(start)
      if 0 <= k <= last:
        x = ref[(*before, slice(k, k + extent, stride), *after)]
      else:  # (the checked index: raises, or clamps)
        x = ref[index_of((start,))]
      return x.copy() if x.flags.writeable else x
    return get_one
  if index_of is not None:  # (a loop body's x_ref[pl.ds(i, 1), :]: two calls fewer)
    def get_direct(ref, *leaves):
      x = ref[index_of(leaves)]
      return x.copy() if isinstance(x, np.ndarray) and x.flags.writeable else x
    return get_direct

  def get(ref, *leaves):
    view, idx = resolve(ref, _dyn(access, leaves))
    return _read(view[idx])
  return get


def _one_slice_access(e, index_of):
  """(static dims before, after, last in-bounds start, extent, stride) of a
  direct access (``_direct_index``) with one operand, a ``pl.ds`` start of
  static size: the access checks the start and builds the slice inline, one
  Python call instead of three (a loop body's running-sum read and store);
  else None."""
  one = getattr(index_of, "one_slice", None)
  n_leaves = len(e.in_avals) - (2 if e.primitive is jc.state_primitives.swap_p else 1)
  if one is None or n_leaves != 1 or one[2] != 0:
    return None
  before, after, _, last, extent, stride = one
  shape = getattr(e.in_avals[0], "shape", None)
  if shape is not None and len(shape) == len(before) + 1 + len(after):
    while after and isinstance(after[-1], slice) and \
        after[-1].indices(shape[len(before) + len(after)]) == (0, shape[len(before) + len(after)], 1):
      after = after[:-1]  # (a trailing whole-dim slice indexes as nothing)
  return before, after, last, extent, stride


def _direct_index(e, access):
  """The index builder of an access that is one indexer whose operands are
  all dynamic (so ``_dyn`` is the identity), without access records; else
  None."""
  n_leaves = len(e.in_avals) - (2 if e.primitive is jc.state_primitives.swap_p else 1)
  if (access.index_only is None or e.compiler.params.records_accesses
      or access.dynamic_positions != list(range(n_leaves))):
    return None
  return access.index_only


def _swap_batched(bc, rule, info, in_batched):
  access = _access(info, info.in_avals[0], info.eqn.invars[2:], info.params["tree"])
  ref_b = in_batched[0]
  leaf_b = dyn_flags(access, in_batched[2:])
  resolve = access.resolve
  want_old = info.outvars_used[0]
  kind = "readwrite" if want_old else "write"
  if ref_b and not any(leaf_b) and access.plain():
    order = "K" if bc.lanes_last else "C"

    def swap(ref, val, *leaves):
      view, idx = resolve(ref, _dyn(access, leaves))
      bidx = lane_index(idx)
      old = view[bidx].copy(order=order) if want_old else None
      view[bidx] = val
      return old
    if not want_old and access.num_dynamic == 0:
      swap.store_target = store_target(access, lane_index)
    return swap, False, (True,)
  lane_acc = None if access.clamp else LaneIndexed.make(access, ref_b, leaf_b)
  if lane_acc is None:
    if not ref_b:
      raise NotBatchable("write to a ref shared by all lanes")
    return batching.lane_loop(rule, info, in_batched)
  count_lane_bytes(bc, lane_acc, info.in_avals[1].dtype)
  flags = tuple(in_batched)

  def swap_lanes(ref, val, *leaves):
    dyn, lanes = _dyn(access, leaves), lanes_of((ref, val, *leaves), flags)
    coords = lane_acc.coords(dyn)
    span = None if ref_b else lane_acc.span(ref, coords, lanes, None)
    if span is not None:
      tracked(ref).access_span(ref, span, kind)
      old = span.gather(ref, 0, ref.dtype) if want_old else None
      span.scatter(ref, val)
      return old
    index, _, full = lane_acc.index(ref, coords, lanes, None)
    if not ref_b:  # a shared output: no two lanes may meet (checked first)
      tracked(ref).access(ref, index, full, None, kind)
      index = tuple(np.broadcast_to(c, full) for c in index)
    old = np.ascontiguousarray(ref[index]) if want_old else None
    ref[index] = val  # repeated indices: the last in C order wins, as per lane
    return old
  return swap_lanes, False, (True,)


@registry.register(jc.state_primitives.swap_p, batch=_swap_batched)
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
  index_of = _direct_index(e, access) if access.num_dynamic and not want_old else None
  one = _one_slice_access(e, index_of)
  if one is not None:
    before, after, last, extent, stride = one
    if not before and not after and stride == 1:  # (o_ref[pl.ds(r, n), :] = v: no index tuple)
      def swap_rows(ref, val, start):
        k = int(start)
        if 0 <= k <= last:
          ref[k:k + extent] = val
        else:  # (the checked index: raises, or clamps)
          ref[index_of((start,))] = val
      return swap_rows

    def swap_one(ref, val, start):
      k = int(start)
      if 0 <= k <= last:
        ref[(*before, slice(k, k + extent, stride), *after)] = val
      else:  # (the checked index: raises, or clamps)
        ref[index_of((start,))] = val
    return swap_one
  if index_of is not None:
    def swap_direct(ref, val, *leaves):
      ref[index_of(leaves)] = val
    return swap_direct
  if not want_old and access.num_dynamic == 0 and access.plain() \
      and not e.compiler.params.records_accesses:
    static = _static_index(e, access)
    if static is not None:  # o_ref[...] = v: the index and view, no resolve
      def swap_static(ref, val, *_literal_indices):
        ref[static] = val
      swap = swap_static
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


def _addupdate_batched(bc, rule, info, in_batched):
  access = _access(info, info.in_avals[0], info.eqn.invars[2:], info.params["tree"])
  if not in_batched[0]:
    raise NotBatchable("write to a ref shared by all lanes")
  if any(in_batched[2:]) or not access.plain():
    return batching.lane_loop(rule, info, in_batched)
  resolve = access.resolve

  def addupdate(ref, val, *leaves):
    view, idx = resolve(ref, _dyn(access, leaves))
    bidx = lane_index(idx)
    view[bidx] += val
    return []
  return addupdate, False, ()


@registry.register(jc.state_primitives.addupdate_p, batch=_addupdate_batched)
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


def _run_scoped_batched(bc, rule, info, in_batched):
  """Scoped buffers are lane-private: allocated with a lane axis."""
  jaxpr = info.params["jaxpr"]
  if info.params.get("collective_axes"):
    raise NotBatchable("run_scoped with collective_axes shares its buffers between programs")
  scoped = [v.aval.inner_aval if isinstance(v.aval, jc.AbstractRef) else v.aval
            for v in jaxpr.invars]
  compiled = bc.compile(jaxpr, constvars_as_args=True,
                        in_batched=(*in_batched, *([True] * len(scoped))))
  plan = compiled.fn
  params = bc.params

  def run_scoped(ctx, *consts):
    n = ctx.batch_size
    return plan(ctx, *consts, *[allocate((n, *a.shape), a.dtype, params) for a in scoped])
  return run_scoped, True, tuple(compiled.out_batched)


@registry.register(jc.pallas_primitives.run_scoped_p, needs_ctx=True, foldable=False,
                   batch=_run_scoped_batched, context_free=True)
def _run_scoped(e):
  """Allocate the scoped refs (uninitialized fill), run the body, drop them."""
  jaxpr = e.params["jaxpr"]
  plan = e.compiler.compile(jaxpr, constvars_as_args=True).fn
  params = e.compiler.params
  specs = scoped_specs(jaxpr, e.params)

  def fresh():
    return [np.zeros(s, d) if zeroed else allocate(s, d, params) for s, d, zeroed in specs]
  collective = e.params.get("collective_axes") or ()
  if collective:
    return _collective_run_scoped(e, plan, specs, collective, fresh)
  site = object()  # this run_scoped: its semaphores on every device of a shard_map
  semaphores = [i for i, (_, dtype, _) in enumerate(specs) if jc.is_semaphore_dtype(dtype)]
  eqn = e.eqn

  def run_scoped(ctx, *consts):
    thread = ctx.family  # a block of a Mosaic GPU cluster: its private scope
    private = thread.private_scope if thread is not None else None
    bufs = fresh() if private is None else private(ctx, eqn, fresh)
    device = ctx.device
    if semaphores and device is not None and device.session is not None:
      # Peers may signal them (the tutorial's double barrier): one per
      # device per invocation, like the stack slot it is on a TPU.
      for i in semaphores:
        bufs[i] = device.scoped_semaphore((site, i), bufs[i])
    return plan(ctx, *consts, *bufs)
  return run_scoped


_empty_ref_p = getattr(jc.jax_core, "empty_ref_p", None)
if _empty_ref_p is not None:
  @registry.register(_empty_ref_p, foldable=False,
                     batch=registry.unbatched("a fresh buffer per run, allocated once"))
  def _empty_ref(e):
    """``jax.empty_ref(ty, memory_space)`` in a kernel (an ``emit_pipeline``
    scratch, a nested kernel's buffer): a fresh buffer, uninitialised fill."""
    ty = e.params["ty"]
    if getattr(ty, "is_high", False):
      raise e.unsupported(f"jax.empty_ref of a high-level type {ty}")
    params = e.compiler.params
    shape, dtype = tuple(ty.shape), ty.dtype
    return lambda: allocate(shape, dtype, params)


def _collective_run_scoped(e, plan, specs, collective, fresh):
  """``pl.run_scoped(..., collective_axes=...)``: the instances that differ
  only along those axes get the same buffers. Only a kernel's executor knows
  its peers: a Mosaic GPU kernel's warpgroups (``ThreadContext.shared_scope``) or a mesh
  kernel's programs (pallas_np.meshes)."""
  key = id(e.eqn)
  eqn = e.eqn
  source = e.source
  params = e.compiler.params
  avals = [SimpleNamespace(shape=shape, dtype=dtype) for shape, dtype, _ in specs]

  def run_scoped(ctx, *consts):
    thread = ctx.family
    allocate_shared = thread.shared_scope if thread is not None else None
    if allocate_shared is not None:
      return plan(ctx, *consts, *allocate_shared(ctx, eqn, fresh))
    alloc = getattr(ctx.device, "collective_alloc", None)
    if alloc is None:
      raise UnsupportedError(
          f"pallas_np: pl.run_scoped(..., collective_axes={collective}) at {source} outside a "
          "mesh kernel (pl.kernel / pl.core_map): there are no programs to share the "
          "allocation with here")
    return plan(ctx, *consts, *alloc(key, collective, avals, params))
  return run_scoped


def scoped_specs(jaxpr, params) -> list[tuple]:
  """(shape, dtype, zeroed) of each scoped buffer: Mosaic GPU layout
  transforms (``ref_transforms``: tiling, swizzle) undone, so buffers are
  logical; WGMMA accumulators (registers) start at zero, as on a GPU."""
  avals = [v.aval for v in jaxpr.invars]
  transforms = params.get("ref_transforms") or ((),) * len(avals)
  specs = []
  for outer, ts in zip(avals, transforms):
    a = outer.inner_aval if isinstance(outer, jc.AbstractRef) else outer
    shape = jc.logical_shape(a.shape, a.dtype, ts) if ts else a.shape
    specs.append((shape, a.dtype, jc.is_wgmma_acc_aval(outer)))
  return specs
