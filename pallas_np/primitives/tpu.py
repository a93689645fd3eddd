"""TPU (Mosaic) primitives: roll, bitcast, PRNG, delay, trace values,
semaphores and DMAs (data movement lives in ``pallas_np.state.dma``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import np_dtype
from pallas_np.errors import UnsupportedError
from pallas_np.kernel_context import rule_state
from pallas_np.state import dma as dma_mod
from pallas_np.state import lens, past_end
from pallas_np.state.indexing import RefAccess

mp = jc.mosaic_primitives
pp = jc.pallas_primitives


# Properties shared by this module's registrations.
_SEQUENTIAL = registry.unbatched(
    "TPU state (DMAs, semaphores, the PRNG) is per core and in grid order: "
    "the grid runs sequentially")
_NO_OP = registry.unbatched("a no-op here that takes the run context: the grid runs sequentially")


# -- value primitives ----------------------------------------------------------
@registry.register(mp.roll_p, batch=registry.unbatched("rare: run lane by lane"))
def _roll(e):
  axis = int(e.params["axis"])
  stride, stride_axis = e.params["stride"], e.params["stride_axis"]
  if stride is None:
    return lambda x, shift: np.roll(x, int(shift), axis)

  def roll_strided(x, shift):
    # Slice k along stride_axis is rolled by shift + k * stride.
    shift = int(shift)
    parts = [np.roll(xs, shift + k * stride, axis)
             for k, xs in enumerate(np.split(x, x.shape[stride_axis], stride_axis))]
    return np.concatenate(parts, stride_axis)
  return roll_strided


@registry.register(mp.bitcast_p, batch=registry.unbatched("rare: run lane by lane"))
def _bitcast(e):
  """TPU bitcast packs/unpacks consecutive elements along one dim: the second
  minor (JAX 0.10, and 0.12's default) or ``dim`` (JAX 0.12's ``dim=``;
  ``plsc.bitcast`` is ``dim=-1``). With that dim moved minormost it is
  ``ndarray.view`` (see JAX 0.12's lowering of ``bitcast_p``)."""
  dst = np_dtype(e.params["ty"])
  ndim = len(e.in_avals[0].shape)
  dim = jc.tpu_bitcast_dim(e.params)
  return minor_viewer(ndim, ndim - 2 if dim is None else int(dim), dst)


def minor_viewer(ndim: int, dim: int, dst):
  """``fn(x)``: ``x`` (of rank ``ndim``) viewed as ``dst``, the ratio of the
  widths scaling dim ``dim``: consecutive elements along it are packed into
  (or unpacked from) one. The permutations are fixed here: ``np.moveaxis``
  per call cost ~50 us (its axis normalisation), most of a bitcast of a
  small block (tokamax MLA bitcasts ~10^5 blocks per test)."""
  dst = np.dtype(dst)
  if ndim == 0:
    return lambda x: np.asarray(x).view(dst)
  dim %= ndim
  if dim == ndim - 1:
    return lambda x: np.ascontiguousarray(x).view(dst)
  perm = tuple(i for i in range(ndim) if i != dim) + (dim,)
  inverse = tuple(int(i) for i in np.argsort(perm))

  def view(x):
    return np.ascontiguousarray(np.asarray(x).transpose(perm)).view(dst).transpose(inverse)
  return view


# -- PRNG -----------------------------------------------------------------------


@registry.register(mp.prng_seed_p, needs_ctx=True, batch=_SEQUENTIAL)
def _prng_seed(e):
  """The TPU's hardware PRNG cannot be reproduced on CPU (TPU interpret mode
  returns zeros); we seed NumPy's Philox with the seed words so sampling is
  deterministic per seed and statistically sound."""
  def seed(ctx, *seeds):
    flat = []
    for s in seeds:
      flat.extend(int(w) for w in np.asarray(s).astype(np.uint32).ravel())
    rule_state(ctx).prng = np.random.Generator(np.random.Philox(np.random.SeedSequence(flat)))
    return []
  return seed


@registry.register(mp.prng_random_bits_p, needs_ctx=True, batch=_SEQUENTIAL)
def _prng_random_bits(e):
  return _prng_random_bits_fn(tuple(e.params["shape"]))


def _prng_random_bits_fn(shape):
  def bits(ctx):
    gen = ctx.rules.prng if ctx.rules is not None else None
    if gen is None:
      raise RuntimeError("pltpu.prng_random_bits called before pltpu.prng_seed")
    return gen.integers(0, 1 << 32, size=shape, dtype=np.uint64).astype(
        np.uint32).view(np.int32)
  return bits


# Stateful sampling (pltpu.stateful_uniform/normal/...) is jax.random on pltpu's
# stateful key impl, whose random_bits binds prng_random_bits: the jax.random
# rules (primitives/random.py) trace it and hand this rule the run context.


# -- no-ops for a CPU ------------------------------------------------------------
registry.register(pp.delay_p, needs_ctx=True, context_free=True, batch=_NO_OP)(lambda e: (lambda ctx, nanos: []))
registry.register(mp.trace_value_p, needs_ctx=True, context_free=True, batch=_NO_OP)(lambda e: (lambda ctx, v: []))
registry.register(mp.touch_p, needs_ctx=True, context_free=True, batch=_NO_OP)(lambda e: (lambda ctx, *refs: []))


# -- refs with transforms inside pytrees (DMA and semaphore operands) -----------
class _Pos:
  """Marks the k-th eqn invar inside an unflattened operand tree (DMA trees
  keep static Python ints as statics, so plain ints would be ambiguous)."""
  __slots__ = ("k",)

  def __init__(self, k):
    self.k = k


def _positions(e, tree):
  marks = [_Pos(i) for i in range(len(e.eqn.invars))]
  if hasattr(tree, "unflatten"):
    return tree.unflatten(marks)
  return jax.tree_util.tree_unflatten(tree, marks)


def _atom(e, leaf):
  if isinstance(leaf, _Pos):
    return e.eqn.invars[leaf.k]
  return jc.Literal(leaf, None)  # a static index baked into the tree


def _ref_operand(e, node, transforms=(), dma=False):
  """``node`` is a ``_Pos`` or a TransformedRef of ``_Pos``/statics (from
  ``_positions``), or a ``_Pos`` plus ``transforms``: compile it into
  ``fn(args) -> (view, idx)``, with the operand's static shape as
  ``fn.shape``."""
  if node is None:
    return None
  if isinstance(node, jc.TransformedRef) and isinstance(node.ref, (tuple, list)):
    return _selected_operand(e, node, transforms)
  if isinstance(node, jc.TransformedRef):
    node, transforms = node.ref, node.transforms
  if not isinstance(node, _Pos):
    raise NotImplementedError("nested transformed refs in a DMA/semaphore operand")
  ref_pos = node.k
  aval = e.in_avals[ref_pos]
  if not transforms:
    fn = lambda args: (args[ref_pos], Ellipsis)
    fn.shape = tuple(aval.shape)
    return fn
  transforms, index_refs = _index_ref_slices(e, transforms)
  leaves, tree = jax.tree_util.tree_flatten(transforms)
  atoms = [index_refs[l.k].atom if isinstance(l, _Pos) and l.k in index_refs else _atom(e, l)
           for l in leaves]
  access = RefAccess.shared(tree, atoms, aval.shape, ref_dtype=aval.dtype,
                            clamp=e.compiler.params.bounds_check == "clamp")
  dyn = [leaves[k].k for k in access.dynamic_positions]
  resolve = access.resolve
  if dma:  # a DMA window may run into the buffer's tile padding
    resolve = past_end.padded_dma_operand(resolve, access, aval.dtype, e.compiler.params)
  # static: the operand's shape; None for a traced pl.ds size, here or in
  # an index ref's slice (known at run time)
  dynamic = access.dynamic_size or any(r.dynamic for r in index_refs.values())
  if index_refs:  # the index arrays read from their index refs' slices first
    reads = {k: r.read for k, r in index_refs.items()}
    values = lambda args: [reads[p](args) if p in reads else args[p] for p in dyn]
    fn = lambda args: resolve(args[ref_pos], values(args))
  else:
    values = lambda args: [args[p] for p in dyn]
    fn = lambda args: resolve(args[ref_pos], [args[p] for p in dyn])
  fn.shape = None if dynamic else tuple(access.result_shape)
  fn.bound_shape = tuple(access.result_shape)  # a traced size's axis bound
  # ``(view, coords)`` with no bounds check (RefAccess.unchecked_coords), or
  # None: for accesses that touch only part of their window
  fn.unchecked = lambda args: access.unchecked_coords(args[ref_pos], values(args))
  return fn


def _selected_operand(e, node, transforms):
  """``pl.select_ref(i, *refs)`` (a DMA operand picked at run time): the
  operand of each ref, the one ``i`` names used when the DMA runs."""
  sel, *rest = node.transforms
  if jc.SelectTransform is None or not isinstance(sel, jc.SelectTransform) or rest or transforms:
    raise UnsupportedError(
        f"pallas_np: transforms {node.transforms} over several refs (only pl.select_ref at the "
        f"top of a DMA operand is supported), at {e.source}")
  options = [_ref_operand(e, r) for r in node.ref]
  idx = sel.idx
  if isinstance(idx, _Pos):
    pick = lambda args, k=idx.k: int(np.asarray(args[k]))
  else:
    pick = lambda args, v=int(idx): v

  def fn(args):
    i = pick(args)
    if not 0 <= i < len(options):
      raise IndexError(f"pl.select_ref index {i} is out of range for {len(options)} refs")
    return options[i](args)
  shapes = {o.shape for o in options}
  fn.shape = shapes.pop() if len(shapes) == 1 else None
  return fn


def _index_ref_slices(e, transforms):
  """Indexers whose index is itself a transformed ref (an indexed DMA
  through a slice of the index ref, ``out.at[idx_ref.at[pl.ds(0, n)]]``,
  as SparseCore kernels write, ``n`` static or traced): each such index is
  replaced by a fresh ``_Pos`` numbered past the eqn's invars, mapped to
  an ``_IndexRef``: an atom with the slice's aval (its bound for a traced
  size) and ``read(args)``, its current values."""
  index_refs = {}
  out = []
  for n, t in enumerate(transforms):
    if isinstance(t, jc.NDIndexer) and any(
        isinstance(ix, jc.TransformedRef) for ix in t.indices):
      indices = []
      for ix in t.indices:
        if isinstance(ix, jc.TransformedRef):
          get = _ref_operand(e, ix)
          k = len(e.eqn.invars) + len(index_refs)
          atom = _IndexAtom(get.bound_shape, _operand_dtype(e, ix))

          def read(args, get=get):
            view, idx = get(args)
            return np.asarray(view[idx] if idx is not Ellipsis else lens.value(view))
          index_refs[k] = _IndexRef(atom, read, get.shape is None, n == len(transforms) - 1)
          ix = _Pos(k)
        indices.append(ix)
      t = dataclasses.replace(t, indices=tuple(indices))
      if any(not isinstance(ix, jc.Slice) and index_refs.get(getattr(ix, "k", None)) and
             index_refs[ix.k].dynamic for ix in indices):
        # the traced length in JAX's int_indexer_shape: its bound instead
        t = dataclasses.replace(t, int_indexer_shape=np.broadcast_shapes(
            *(_index_shape(e, ix, index_refs) for ix in indices if not isinstance(ix, jc.Slice))))
    out.append(t)
  return tuple(out), index_refs


def _index_shape(e, ix, index_refs) -> tuple:
  """The static shape of an integer indexer (its bound for an index slice
  of traced length)."""
  if isinstance(ix, _Pos):
    if ix.k in index_refs:
      return index_refs[ix.k].atom.aval.shape
    return tuple(getattr(e.eqn.invars[ix.k].aval, "shape", ()))
  return np.shape(ix)


class _IndexRef(NamedTuple):
  """An index array read from a sliced index ref: ``atom`` stands for it
  in ``RefAccess`` (which needs only its rank), ``read(args)`` reads it
  when the DMA starts; ``dynamic``: its length is a traced ``pl.ds``
  size; ``last``: its indexer is the operand's last transform."""
  atom: Any
  read: Callable
  dynamic: bool
  last: bool


class _IndexAtom:
  """Stands for an index array read from a sliced index ref: RefAccess
  needs only its aval (the rank of the index)."""
  __slots__ = ("aval",)

  def __init__(self, shape, dtype):
    self.aval = jax.core.ShapedArray(tuple(shape), dtype)


def _arg(e, leaf):
  """Compile a scalar operand (``_Pos`` or static) into ``fn(args)``."""
  if isinstance(leaf, _Pos):
    atom = e.eqn.invars[leaf.k]
    if isinstance(atom, jc.Literal):
      val = atom.val
      return lambda args: val
    k = leaf.k
    return lambda args: args[k]
  return lambda args: leaf


def _device_target(e, device_id_node):
  """Compile a DMA/signal's ``device_id`` into ``fn(ctx, args)``: None when
  the target is this device, else the peer's logical id (``pallas_np.devices``).
  Outside a multi-device run only device 0 (this device) exists."""
  if device_id_node is None:
    return None
  id_type = e.params.get("device_id_type", jc.DeviceIdType.MESH)
  if isinstance(device_id_node, dict):
    getters = {k: _arg(e, v) for k, v in device_id_node.items()}
    read = lambda args: {k: int(g(args)) for k, g in getters.items()}
  elif isinstance(device_id_node, (tuple, list)):
    getters = [_arg(e, v) for v in device_id_node]
    read = lambda args: tuple(int(g(args)) for g in getters)
  else:
    get = _arg(e, device_id_node)
    read = lambda args: int(get(args))

  def target(ctx, args):
    device_id = read(args)
    me = ctx.device
    if me is None:
      ids = device_id.values() if isinstance(device_id, dict) else (
          device_id if isinstance(device_id, tuple) else (device_id,))
      for i in ids:
        if i != 0:
          raise NotImplementedError(
              f"remote DMA/semaphore to device {device_id}: outside a multi-device run "
              "(jax.jit of a jax.shard_map) the NumPy interpreter has one device "
              "(only device id 0 = itself)")
      return None
    t = me.target_id(device_id, id_type)
    return None if t == me.logical_id else t
  return target


def _split_indices(node, what):
  """``node`` with every ``plsc.Indices(values, ignored_value=)`` indexer
  replaced by its values, and the (values position, ignored value) of the
  one with an ignored value (None if none). Its indexed axis must be the
  first of the operand (the index ref first, as indexed DMAs take it)."""
  if jc.SCIndices is None or not isinstance(node, jc.TransformedRef):
    return node, None
  ignored, transforms = None, []
  for n, t in enumerate(node.transforms):
    if isinstance(t, jc.NDIndexer) and any(isinstance(i, jc.SCIndices) for i in t.indices):
      indices = []
      for axis, ix in enumerate(t.indices):
        if isinstance(ix, jc.SCIndices):
          if ix.ignored_value is not None:
            if ignored is not None or n or axis or not isinstance(ix.values, _Pos):
              raise UnsupportedError(
                  f"pallas_np: {what}: plsc.Indices(..., ignored_value=) other than as the "
                  "first indexer of the first transform")
            ignored = (ix.values.k, ix.ignored_value)
          ix = ix.values
        indices.append(ix)
      t = dataclasses.replace(t, indices=tuple(indices))
    transforms.append(t)
  return jc.TransformedRef(node.ref, tuple(transforms)), ignored


def _operand_dtype(e, node) -> np.dtype:
  """The element type of a DMA operand, after its bitcasts."""
  if not isinstance(node, jc.TransformedRef):
    return np_dtype(e.in_avals[node.k].dtype)
  dtype = e.in_avals[node.ref.k].dtype
  for t in node.transforms:
    if jc.BitcastTransform is not None and isinstance(t, jc.BitcastTransform):
      dtype = t.dtype
  return np_dtype(dtype)


def _skip_ignored(args, ignored, get_indexed, get_other, what):
  """(indexed side, other side) of a DMA whose indices may hold the
  ignored value: those rows are neither read nor written (the other side's
  rows at those positions are left alone)."""
  k, value = ignored
  indices = np.asarray(args[k])
  keep = indices != value
  if keep.all():
    return get_indexed(args), get_other(args)
  filtered = list(args)
  filtered[k] = indices[keep]
  o_view, o_idx = get_other(args)
  rows = o_view[o_idx]
  if rows.size and not np.shares_memory(rows, o_view):
    raise UnsupportedError(f"pallas_np: {what}: ignored indices with an indexed other side")
  return get_indexed(filtered), (rows, (np.flatnonzero(keep),))


@registry.register(mp.dma_start_p, needs_ctx=True, foldable=False, batch=_SEQUENTIAL)
def _dma_start(e):
  src, dst, dst_sem, src_sem, device_id = _positions(e, e.params["tree"])
  what = f"DMA at {e.source}"
  src, src_ignored = _split_indices(src, what)
  dst, dst_ignored = _split_indices(dst, what)
  if src_ignored and dst_ignored:
    raise UnsupportedError(f"pallas_np: {what}: ignored indices on both sides")
  get_src, get_dst = _ref_operand(e, src, dma=True), _ref_operand(e, dst, dma=True)
  get_dst_sem, get_src_sem = _ref_operand(e, dst_sem), _ref_operand(e, src_sem)
  target = _device_target(e, device_id)
  add = bool(e.params.get("add", False))
  source = e.source
  # The shapes are static: a mismatch raises when the DMA runs (with its
  # grid point), checked once here.
  src_shape, dst_shape = get_src.shape, get_dst.shape
  mismatch = (f"DMA shape mismatch: source {src_shape}, destination {dst_shape}"
              if src_shape != dst_shape else None)
  dynamic = src_shape is None or dst_shape is None
  if dynamic:
    mismatch = None
  # Skipped rows still count: the semaphore gets the whole copy's bytes,
  # which is what the matching wait (sized by the source) waits for.
  full_nbytes = None
  if (src_ignored or dst_ignored) and src_shape is not None:
    full_nbytes = int(np.prod(src_shape, dtype=np.int64)) * _operand_dtype(e, src).itemsize

  def dma_start(ctx, *args):
    peer = target(ctx, args) if target is not None else None
    if mismatch is not None:
      raise ValueError(mismatch)
    if peer is not None:
      if src_ignored or dst_ignored:
        raise UnsupportedError(f"pallas_np: {what}: a remote DMA with ignored indices")
      dma_mod.remote_start(ctx, peer, get_src(args), get_dst(args), get_dst_sem(args),
                           get_src_sem(args) if get_src_sem is not None else None,
                           add=add, source=source)
      return []
    nbytes = None
    if src_ignored:
      (s_view, s_idx), (d_view, d_idx) = _skip_ignored(args, src_ignored, get_src, get_dst, what)
      nbytes = full_nbytes
    elif dst_ignored:
      (d_view, d_idx), (s_view, s_idx) = _skip_ignored(args, dst_ignored, get_dst, get_src, what)
      nbytes = full_nbytes
    else:
      s_view, s_idx = get_src(args)
      d_view, d_idx = get_dst(args)
    if dynamic:
      dma_mod.check_shapes(s_view[s_idx], d_view[d_idx])
    dsem = dma_mod.sem_cell(*get_dst_sem(args))
    ssem = dma_mod.sem_cell(*get_src_sem(args)) if get_src_sem is not None else None
    dma_mod.start(ctx, (s_view, s_idx), (d_view, d_idx), dsem, ssem, add=add,
                  source=source, nbytes=nbytes)
    return []
  return dma_start


def _element_bytes(dtype) -> int:
  """Bytes per element a DMA moves: a typed PRNG key (``key<pl>``,
  ``key<fry>``) is its key data (e.g. 2 x uint32), as the DMA's start moves
  it."""
  phys = jc.physical_aval(jc.ShapedArray((), dtype))
  return int(np.prod(phys.shape, dtype=np.int64)) * np_dtype(phys.dtype).itemsize


@registry.register(mp.dma_wait_p, needs_ctx=True, foldable=False, batch=_SEQUENTIAL)
def _dma_wait(e):
  src, dst, sem, _, device_id = _positions(e, e.params["tree"])
  get_sem = _ref_operand(e, sem)
  if isinstance(src, jc.TransformedRef) and isinstance(src.ref, (tuple, list)):
    src = src.ref[0]  # pl.select_ref: the refs it picks from have one shape (Mosaic)
  # TPU interpret mode waits for the byte size of the (transformed) source.
  if isinstance(src, _Pos):
    aval = e.in_avals[src.k]
    shape, dtype = aval.shape, aval.dtype
  else:
    src, _ = _split_indices(src, f"DMA wait at {e.source}")
    transforms, index_refs = _index_ref_slices(e, src.transforms)
    leaves, tree = jax.tree_util.tree_flatten(transforms)
    aval = e.in_avals[src.ref.k]
    atoms = [index_refs[l.k].atom if isinstance(l, _Pos) and l.k in index_refs else _atom(e, l)
             for l in leaves]
    # an index slice of traced length: the rows its current values name
    index_lengths = any(r.dynamic for r in index_refs.values())
    if any(r.dynamic and not r.last for r in index_refs.values()):
      raise UnsupportedError(
          f"pallas_np: a DMA wait whose index ref, sliced with a traced size, is not in "
          f"its last indexer, at {e.source}")
    acc = RefAccess.shared(tree, atoms, aval.shape, ref_dtype=aval.dtype, clamp=True)
    shape = acc.result_shape
    dtype = aval.dtype
    for t in src.transforms:
      if jc.BitcastTransform is not None and isinstance(t, jc.BitcastTransform):
        dtype = t.dtype
  itemsize = _element_bytes(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
  what = f"DMA wait at {e.source}"
  if not isinstance(src, _Pos) and (acc.dynamic_size or index_lengths):  # a traced pl.ds size
    # Only the descriptor's byte count matters: a wait never dereferences
    # its addresses, so one wait for several DMAs may name a region larger
    # than the ref (``buf.at[0, pl.ds(0, total)]``), as TPU interpret mode
    # (product of the transformed shape times the item size) allows.
    runtime_shape = acc.runtime_shape
    dyn = [leaves[k].k for k in acc.dynamic_positions]
    reads = {k: r.read for k, r in index_refs.items()}

    def dma_wait(ctx, *args):
      values = [reads[p](args) if p in reads else args[p] for p in dyn]
      shape = runtime_shape(values, index_lengths=index_lengths)
      n = int(np.prod(shape, dtype=np.int64)) * itemsize
      dma_mod.wait(ctx, dma_mod.sem_cell(*get_sem(args)), n, what=what)
      return []
    return dma_wait

  def dma_wait(ctx, *args):
    dma_mod.wait(ctx, dma_mod.sem_cell(*get_sem(args)), nbytes, what=what)
    return []
  return dma_wait


@registry.register(pp.semaphore_signal_p, needs_ctx=True, foldable=False, batch=_SEQUENTIAL)
def _semaphore_signal(e):
  ref, transforms, inc, device_id, core_index = _positions(e, e.params["args_tree"])
  get_sem = _ref_operand(e, ref, transforms)
  target = _device_target(e, device_id)
  get_inc = _arg(e, inc)
  get_core = _arg(e, core_index) if core_index is not None else None
  source = e.source

  def signal(ctx, *args):
    peer = target(ctx, args) if target is not None else None
    if get_core is not None:
      core = int(get_core(args))
      to_core = getattr(ctx.device, "core_target", None)
      if to_core is not None:  # a program of a mesh kernel (pallas_np.meshes)
        peer = to_core(core)
      elif core != 0:
        raise NotImplementedError(
            "signalling another core (core_index=...) outside a pl.kernel/pl.core_map "
            "mesh kernel: a pallas_call grid runs one core at a time here")
    if peer is not None:
      dma_mod.remote_signal(ctx, peer, get_sem(args), int(get_inc(args)), source=source)
      return []
    dma_mod.signal(ctx, dma_mod.sem_cell(*get_sem(args)), int(get_inc(args)))
    return []
  return signal


@registry.register(pp.semaphore_wait_p, needs_ctx=True, foldable=False, batch=_SEQUENTIAL)
def _semaphore_wait(e):
  ref, transforms, value, decrement = _positions(e, e.params["args_tree"])
  get_sem = _ref_operand(e, ref, transforms)
  what = f"semaphore_wait at {e.source}"
  get_value, get_dec = _arg(e, value), _arg(e, decrement)

  def sem_wait(ctx, *args):
    cell = dma_mod.sem_cell(*get_sem(args))
    dma_mod.wait(ctx, cell, int(get_value(args)), what=what,
                 decrement=bool(get_dec(args)))
    return []
  return sem_wait


@registry.register(pp.semaphore_read_p, needs_ctx=True, foldable=False, batch=_SEQUENTIAL)
def _semaphore_read(e):
  ref, transforms = _positions(e, e.params["args_tree"])
  get_sem = _ref_operand(e, ref, transforms)

  def read(ctx, *args):
    return np.int32(dma_mod.sem_cell(*get_sem(args))[()])
  return read


@registry.register(mp.get_barrier_semaphore_p, needs_ctx=True, foldable=False,
                   batch=_SEQUENTIAL)
def _get_barrier_semaphore(e):
  return lambda ctx: dma_mod.barrier_semaphore(ctx)


# -- devices: jax.lax.axis_index inside a kernel ----------------------------------
@registry.register(jc.axis_index_p, needs_ctx=True, foldable=False, batch=registry.unbatched(
    "axis_index reads the device the kernel instance runs on: the grid runs sequentially"))
def _axis_index(e):
  name = e.params["axis_name"]
  source = e.source

  def axis_index(ctx):
    thread = ctx.family  # a Mosaic GPU mesh kernel's block/warpgroup
    if thread is not None and name in thread.mesh_axes:
      return thread.mesh_axes[name]
    if ctx.device is None:
      raise UnsupportedError(
          f"pallas_np: jax.lax.axis_index({name!r}) at {source} needs the device the kernel "
          "runs on: it is supported inside jax.jit(jax.shard_map(...)) (or pmap), where "
          "XLA runs each device's kernel instance; not on this path (an eager "
          "evaluation of the kernel outside JAX's multi-device runtime)")
    return ctx.device.axis_index(name)
  return axis_index


def assume_tpu_chip(version: str = "v5e", num_cores: int = 1):
  """Make JAX's TPU-only tracing helpers (``pltpu.emit_pipeline`` infers DMA
  tilings from the device's TpuInfo) trace on a CPU by assuming this chip.
  Affects tracing only; kernels still run in the NumPy interpreter."""
  chip = pltpu.ChipVersion(version)
  kind = jax.devices()[0].device_kind
  jc.register_tpu_device_kind(kind, lambda: pltpu.get_tpu_info_for_chip(chip, num_cores))


# -- pltpu.has_memory_space (JAX >= 0.12) ----------------------------------------
_has_memory_space_p = getattr(mp, "has_memory_space_p", None)
if _has_memory_space_p is not None:
  @registry.register(_has_memory_space_p, foldable=False, batch=registry.ELEMENTWISE)
  def _has_memory_space(e):
    """A ``pl.ANY`` ref is placed in HBM here (as TPU interpret mode places
    it), so the check is true exactly for HBM."""
    space = e.params["memory_space"]
    answer = np.bool_(str(getattr(space, "name", space)).upper() == "HBM")
    return lambda ref: answer


# -- pltpu.conv (JAX >= 0.12) ----------------------------------------------------
_conv_p = getattr(mp, "conv_p", None)
if _conv_p is not None:
  @registry.register(_conv_p, gemm=True, batch=registry.unbatched("rare: run lane by lane"))
  def _tpu_conv(e):
    """``acc + conv(lhs, rhs)`` (acc zero when absent), through JAX's NumPy
    reference convolution (opt_einsum); float inputs accumulate in float32
    as the MXU does, integers in int64 (wrapping to the output type)."""
    p = e.params
    if p.get("feature_group_count", 1) != 1 or p.get("batch_group_count", 1) != 1:
      raise e.unsupported("pltpu.conv with feature/batch groups")
    if p.get("window_reversal") is not None and any(p["window_reversal"]):
      raise e.unsupported("pltpu.conv with window_reversal")
    if any(lo < 0 or hi < 0 for lo, hi in (p.get("padding") or ())):
      raise e.unsupported("pltpu.conv with negative padding")
    dn = p["dimension_numbers"]
    nsp = len(dn.lhs_spec) - 2
    strides = tuple(p.get("window_strides") or (1,) * nsp)
    pads = tuple(tuple(x) for x in (p.get("padding") or ((0, 0),) * nsp))
    lhs_dil = tuple(p.get("lhs_dilation") or (1,) * nsp)
    rhs_dil = tuple(p.get("rhs_dilation") or (1,) * nsp)
    out_dt = np_dtype(e.out_avals[0].dtype)
    acc_dt = np.dtype(np.int64) if np.issubdtype(out_dt, np.integer) else np.dtype(np.float32)
    out_perm = np.argsort(dn.out_spec)
    ref = jc.lax_reference

    def conv(lhs, rhs, *acc):
      l = np.transpose(np.asarray(lhs, acc_dt), dn.lhs_spec)
      r = np.transpose(np.asarray(rhs, acc_dt), dn.rhs_spec)
      y = np.transpose(ref.conv_with_general_padding(l, r, strides, pads, lhs_dil, rhs_dil),
                       out_perm)
      if acc:
        y = y + np.asarray(acc[0], acc_dt)
      return y.astype(out_dt)
    return conv


# Operand helpers other TPU families (SparseCore: primitives/sparsecore.py) share.
operand_positions = _positions
OperandPos = _Pos
ref_operand = _ref_operand
scalar_operand = _arg
