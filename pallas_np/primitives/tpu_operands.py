"""TPU kernel operands inside pytrees: refs with transforms (indexers,
bitcasts, ``select_ref``, index refs sliced with a traced size), scalars
and device ids, as DMA, semaphore, pipeline and SparseCore rules receive
them. Apart from ``tpu.py``'s rules because every TPU family resolves its
operands the same way (``sparsecore.py``, ``mxu.py``, ``tpu_pipeline.py``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from pallas_np import _compat as jc
from pallas_np.dtypes import np_dtype
from pallas_np.errors import UnsupportedError
from pallas_np.state import lens, past_end
from pallas_np.state.indexing import RefAccess


class OperandPos:
  """Marks the k-th eqn invar inside an unflattened operand tree (DMA trees
  keep static Python ints as statics, so plain ints would be ambiguous)."""
  __slots__ = ("k",)

  def __init__(self, k):
    self.k = k


def operand_positions(e, tree):
  marks = [OperandPos(i) for i in range(len(e.eqn.invars))]
  if hasattr(tree, "unflatten"):
    return tree.unflatten(marks)
  return jax.tree_util.tree_unflatten(tree, marks)


def operand_atom(e, leaf):
  if isinstance(leaf, OperandPos):
    return e.eqn.invars[leaf.k]
  return jc.Literal(leaf, None)  # a static index baked into the tree


def ref_operand(e, node, transforms=(), dma=False):
  """``node`` is a ``OperandPos`` or a TransformedRef of ``OperandPos``/statics (from
  ``operand_positions``), or a ``OperandPos`` plus ``transforms``: compile it into
  ``fn(args) -> (view, idx)``, with the operand's static shape as
  ``fn.shape``."""
  if node is None:
    return None
  if isinstance(node, jc.TransformedRef) and isinstance(node.ref, (tuple, list)):
    return _selected_operand(e, node, transforms)
  if isinstance(node, jc.TransformedRef):
    node, transforms = node.ref, node.transforms
  if not isinstance(node, OperandPos):
    raise NotImplementedError("nested transformed refs in a DMA/semaphore operand")
  ref_pos = node.k
  aval = e.in_avals[ref_pos]
  if not transforms:
    fn = lambda args: (args[ref_pos], Ellipsis)
    fn.shape = tuple(aval.shape)
    return fn
  transforms, index_refs = index_ref_slices(e, transforms)
  leaves, tree = jax.tree_util.tree_flatten(transforms)
  atoms = [index_refs[l.k].atom if isinstance(l, OperandPos) and l.k in index_refs else operand_atom(e, l)
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
  options = [ref_operand(e, r) for r in node.ref]
  idx = sel.idx
  if isinstance(idx, OperandPos):
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


def index_ref_slices(e, transforms):
  """Indexers whose index is itself a transformed ref (an indexed DMA
  through a slice of the index ref, ``out.at[idx_ref.at[pl.ds(0, n)]]``,
  as SparseCore kernels write, ``n`` static or traced): each such index is
  replaced by a fresh ``OperandPos`` numbered past the eqn's invars, mapped to
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
          get = ref_operand(e, ix)
          k = len(e.eqn.invars) + len(index_refs)
          atom = _IndexAtom(get.bound_shape, operand_dtype(e, ix))

          def read(args, get=get):
            view, idx = get(args)
            return np.asarray(view[idx] if idx is not Ellipsis else lens.value(view))
          index_refs[k] = _IndexRef(atom, read, get.shape is None, n == len(transforms) - 1)
          ix = OperandPos(k)
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
  if isinstance(ix, OperandPos):
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


def scalar_operand(e, leaf):
  """Compile a scalar operand (``OperandPos`` or static) into ``fn(args)``."""
  if isinstance(leaf, OperandPos):
    atom = e.eqn.invars[leaf.k]
    if isinstance(atom, jc.Literal):
      val = atom.val
      return lambda args: val
    k = leaf.k
    return lambda args: args[k]
  return lambda args: leaf


def device_target(e, device_id_node):
  """Compile a DMA/signal's ``device_id`` into ``fn(ctx, args)``: None when
  the target is this device, else the peer's logical id (``pallas_np.devices``).
  Outside a multi-device run only device 0 (this device) exists."""
  if device_id_node is None:
    return None
  id_type = e.params.get("device_id_type", jc.DeviceIdType.MESH)
  if isinstance(device_id_node, dict):
    getters = {k: scalar_operand(e, v) for k, v in device_id_node.items()}
    read = lambda args: {k: int(g(args)) for k, g in getters.items()}
  elif isinstance(device_id_node, (tuple, list)):
    getters = [scalar_operand(e, v) for v in device_id_node]
    read = lambda args: tuple(int(g(args)) for g in getters)
  else:
    get = scalar_operand(e, device_id_node)
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


def split_indices(node, what):
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
            if ignored is not None or n or axis or not isinstance(ix.values, OperandPos):
              raise UnsupportedError(
                  f"pallas_np: {what}: plsc.Indices(..., ignored_value=) other than as the "
                  "first indexer of the first transform")
            ignored = (ix.values.k, ix.ignored_value)
          ix = ix.values
        indices.append(ix)
      t = dataclasses.replace(t, indices=tuple(indices))
    transforms.append(t)
  return jc.TransformedRef(node.ref, tuple(transforms)), ignored


def operand_dtype(e, node) -> np.dtype:
  """The element type of a DMA operand, after its bitcasts."""
  if not isinstance(node, jc.TransformedRef):
    return np_dtype(e.in_avals[node.k].dtype)
  dtype = e.in_avals[node.ref.k].dtype
  for t in node.transforms:
    if jc.BitcastTransform is not None and isinstance(t, jc.BitcastTransform):
      dtype = t.dtype
  return np_dtype(dtype)


def skip_ignored(args, ignored, get_indexed, get_other, what):
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
