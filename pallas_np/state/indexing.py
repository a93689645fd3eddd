"""Ref transforms compiled to NumPy indexing.

A ref access (``get``/``swap``/``addupdate``, masked load/store, atomics, DMA)
carries a pytree of transforms: NDIndexers (ints, ``pl.ds`` slices with
stride, integer arrays), bitcasts, reshapes, transposes. ``RefAccess`` looks
at that tree once, at compile time, and returns a resolver that maps the ref
(a NumPy array) and the dynamic index values to ``(base_view, index)``, where
``base_view[index]`` is the accessed region: reading copies it, writing
assigns through it. Every dynamic index is bounds-checked (``IndexError``) or
clamped like XLA's dynamic_slice, per ``InterpretParams.bounds_check``.

Negative indices: a *static* negative int (``x_ref[:, -1]``, kept as a literal
-1 in the jaxpr) means what it means in NumPy, as in interpret=True. A
*dynamic* negative index or ``pl.ds`` start is not wrapped (on TPU/GPU it
addresses memory before the ref): it raises, and the message says what
interpret=True does with it (adds the axis size, then clamps, as
``lax.dynamic_slice`` and ``jnp`` gathers do), which is what
``bounds_check="clamp"`` does.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Sequence

import numpy as np

from pallas_np import _compat as jc
from pallas_np.errors import UnsupportedError
from pallas_np.state import aliased_refs, lens, peer_refs, ref_views
from pallas_np.state.bounds import check_array, check_int, check_slice


class _Dyn:
  """Placeholder for the k-th dynamic leaf while analysing the tree (``ndim``
  of its value: an integer-array index is dynamic too)."""
  __slots__ = ("k", "ndim")

  def __init__(self, k, ndim=0):
    self.k = k
    self.ndim = ndim

  def __repr__(self):
    return f"_Dyn({self.k})"


def is_static(v):
  return not isinstance(v, _Dyn)


class Folded:
  """An index operand the compiler folded to a constant: static, like a
  literal (``x_ref[idx, -1]`` broadcasts the -1 with an eqn of its own)."""
  __slots__ = ("val",)

  def __init__(self, val):
    self.val = val


def static_atoms(folded: dict, atoms) -> list:
  """``atoms`` (eqn invars) with the folded ones replaced by ``Folded``."""
  if not folded:
    return list(atoms)
  return [Folded(folded[a]) if isinstance(a, jc.Var) and a in folded else a for a in atoms]


def _is_static_atom(a) -> bool:
  return isinstance(a, (jc.Literal, Folded))


class _DimInt:
  __slots__ = ("value", "dim")

  def __init__(self, value, dim):
    self.value, self.dim = value, dim


class DimSlice:
  __slots__ = ("start", "size", "stride", "dim")

  def __init__(self, start, size, stride, dim):
    self.start, self.size, self.stride, self.dim = start, size, stride, dim


class DimArray:
  __slots__ = ("value", "dim")

  def __init__(self, value, dim):
    self.value, self.dim = value, dim


def wrap_static(v, dim):
  """A static (literal) index counts from the end when negative, as in NumPy
  and interpret=True; below -dim it stays out of bounds."""
  if isinstance(v, _Dyn):
    return v
  a = np.asarray(v)
  if not (a < 0).any():
    return v
  a = np.where((a < 0) & (a >= -dim), a + dim, a).astype(a.dtype)
  return int(a) if a.ndim == 0 else a


_SHARED: dict = {}  # see RefAccess.shared


class RefAccess:
  """Compiled transforms of one ref access.

  ``resolve(ref, leaves)`` -> ``(view, index)``; ``leaves`` are the runtime
  values of the non-literal index operands, in eqn order.
  """

  def plain(self) -> bool:
    """At most one NDIndexer of ints and slices: ``view[index]`` is basic
    NumPy indexing (a view)."""
    steps = self.steps
    if not steps:
      return True
    if len(steps) != 1 or steps[0][0] != "index":
      return False
    return not any(isinstance(d, DimArray) for d in steps[0][1])

  def __init__(self, tree, idx_atoms: Sequence[Any], ref_shape, *, clamp: bool,
               ref_dtype=None):
    leaves = []
    self.num_dynamic = 0
    self.dynamic_positions = []
    for pos, a in enumerate(idx_atoms):
      if _is_static_atom(a):
        leaves.append(a.val)
      else:
        leaves.append(_Dyn(self.num_dynamic, len(getattr(a.aval, "shape", ()))))
        self.dynamic_positions.append(pos)
        self.num_dynamic += 1
    transforms = jc.tree_unflatten(tree, leaves) if tree is not None else ()
    if transforms is None:
      transforms = ()
    self.clamp = clamp
    self.dynamic_size = False
    # Walk the transforms, tracking the ref's shape/dtype.
    shape = tuple(ref_shape)
    steps = []
    for i, t in enumerate(transforms):
      if jc.is_peer_transform(t):
        # It commutes with every other transform (JAX's commute_ndindexer):
        # the peer's copy of the whole ref, then the rest.
        steps.insert(0, ("peer", t, tuple(ref_shape)))
      elif isinstance(t, jc.NDIndexer):
        dims = []
        broadcast = []  # (dim position, size) of the stride-0 slices
        for axis, (ix, n) in enumerate(zip(t.indices, shape)):
          if isinstance(ix, jc.Slice) and int(ix.stride) == 0:
            # ``pl.ds(start, size, 0)``: a zero-stride (sublane broadcast)
            # load, ``size`` copies of element ``start`` (Mosaic's
            # strided load with stride 0). Indexed as the one row, then
            # broadcast by a step of its own: a read-only view.
            if not is_static(ix.size):
              raise UnsupportedError(
                  "pallas_np: a zero-stride pl.ds with a traced size is not supported")
            broadcast.append((axis, int(ix.size)))
            dims.append(DimSlice(ix.start, 1, 1, n))
          elif isinstance(ix, jc.Slice):
            dims.append(DimSlice(ix.start, ix.size, int(ix.stride), n))
          elif ix.ndim == 0 if isinstance(ix, _Dyn) else np.ndim(ix) == 0:
            dims.append(_DimInt(wrap_static(ix, n), n))
          else:
            dims.append(DimArray(wrap_static(ix, n), n))
        if self.dynamic_size:
          raise UnsupportedError(
              "pallas_np: indexing a dynamically sized ref slice again is not supported")
        steps.append(("index", dims, shape))
        self._final_layout = _int_block_layout(dims, tuple(t.int_indexer_shape))
        # A traced pl.ds size (JAX allows it in refs handed to DMAs): the
        # size is known when the access runs; result_shape holds the axis
        # size there, an upper bound (see runtime_shape).
        self.dynamic_size = any(isinstance(d, DimSlice) and not is_static(d.size)
                                for d in dims)
        shape = _indexed_shape(dims, self._final_layout)
        if broadcast:
          slice_axes = self._final_layout[2]
          wide = list(shape)
          for pos, size in broadcast:
            wide[slice_axes[pos]] = size
          steps.append(("broadcast", tuple(wide), shape))
          shape = tuple(wide)
      elif self.dynamic_size:
        raise UnsupportedError(  # JAX refuses these at trace time too
            f"pallas_np: ref transform {t!r} after a dynamically sized slice is not supported")
      elif jc.BitcastTransform is not None and isinstance(t, jc.BitcastTransform):
        steps.append(("bitcast", np.dtype(t.dtype), shape))
        shape = ref_views.bitcast_shape(shape, ref_dtype, t.dtype)
        ref_dtype = t.dtype
      elif jc.ReshapeTransform is not None and isinstance(t, jc.ReshapeTransform):
        steps.append(("reshape", tuple(t.shape), shape))
        shape = tuple(t.shape)
      elif jc.TransposeTransform is not None and isinstance(t, jc.TransposeTransform):
        steps.append(("transpose", tuple(t.permutation), shape))
        shape = tuple(shape[p] for p in t.permutation)
      elif (jc.SharedMemRefSliceTransform is not None
            and isinstance(t, jc.SharedMemRefSliceTransform)):
        width = t.transform_type(jc.ShapedArray(shape, ref_dtype)).shape[-1]
        steps.append(("subcore_slice", width, shape))
        shape = (*shape[:-1], width)
      elif peer_refs.is_cluster_transform(t):  # plgpu.cluster_ref
        steps.append(("cluster", t, shape))
      elif aliased_refs.is_alias(t):  # a plgpu.RefUnion member
        steps.append(("alias", aliased_refs.alias_step(t, transforms[i + 1:], shape, ref_dtype),
                      shape))
        shape, ref_dtype = tuple(t.shape), t.dtype
      elif jc.is_layout_only_transform(t):
        # Mosaic GPU tiling/swizzling: layout only, the buffer is kept in
        # its logical shape (pallas_np.mosaic_gpu), so no view changes.
        shape = jc.logical_shape(shape, ref_dtype, (t,))
      else:
        raise UnsupportedError(f"pallas_np: ref transform {t!r} is not supported")
    self.result_shape = shape
    self.steps = steps
    self._prefix_fns = None
    self.index_only = None
    self.resolve = self._build()

  @classmethod
  def shared(cls, tree, idx_atoms: Sequence[Any], ref_shape, *, clamp: bool, ref_dtype=None):
    """A RefAccess shared by equal accesses (same transforms, literal indices,
    dynamic-index ranks, ref shape and dtype): DMA-heavy kernels repeat a few
    accesses hundreds of times (paged attention: ~200 accesses, ~20
    distinct). The result must not be modified."""
    parts = []
    for a in idx_atoms:
      if _is_static_atom(a):
        v = np.asarray(a.val)
        if v.ndim:
          return cls(tree, idx_atoms, ref_shape, clamp=clamp, ref_dtype=ref_dtype)
        parts.append((v.dtype.str, v.item()))
      else:
        parts.append(len(getattr(a.aval, "shape", ())))
    key = (tree, tuple(parts), tuple(ref_shape), clamp, str(ref_dtype))
    try:
      hit = _SHARED.get(key)
    except TypeError:  # an unhashable pytree node
      return cls(tree, idx_atoms, ref_shape, clamp=clamp, ref_dtype=ref_dtype)
    if hit is None:
      hit = cls(tree, idx_atoms, ref_shape, clamp=clamp, ref_dtype=ref_dtype)
      if len(_SHARED) >= 4096:
        _SHARED.clear()
      _SHARED[key] = hit
    return hit

  def _build(self):
    steps = self.steps
    clamp = self.clamp
    if not steps:
      return lambda ref, leaves: (ref, ...)
    # Compile each step into fn(view, leaves) -> view (all but last) and the
    # last NDIndexer into an index builder.
    fns = []
    for i, (kind, arg, shape) in enumerate(steps):
      last = i == len(steps) - 1
      if kind == "index":
        builder = self._index_builder(arg, shape)
        if last:
          final = builder
          break
        fns.append(_apply_index(builder))
      elif kind == "bitcast":
        fns.append(ref_views.bitcast_view(arg))
      elif kind == "reshape":
        fns.append(ref_views.reshape_view(arg))
      elif kind == "transpose":
        fns.append(ref_views.transpose_view(arg))
      elif kind == "subcore_slice":
        fns.append(_subcore_slice_view(arg))
      elif kind == "broadcast":
        fns.append(ref_views.broadcast_view(arg))
      elif kind == "peer":
        fns.append(peer_refs.peer_view(arg, _Dyn))
      elif kind == "cluster":
        fns.append(peer_refs.cluster_view(arg, _Dyn))
      elif kind == "alias":
        fns.append(aliased_refs.alias_view(arg))
    else:
      final = None
    self._prefix_fns = fns if final is not None else None
    # One NDIndexer and nothing before it: ``ref[index_only(leaves)]``
    # (the plain get/swap rules call it without ``resolve``).
    self.index_only = final if final is not None and not fns else None
    if final is None:
      if len(fns) == 1:
        f0 = fns[0]
        return lambda ref, leaves: (f0(ref, leaves), ...)

      def resolve(ref, leaves):
        for f in fns:
          ref = f(ref, leaves)
        return ref, ...
      return resolve
    if not fns:
      return lambda ref, leaves: (ref, final(leaves))

    def resolve(ref, leaves):
      for f in fns:
        ref = f(ref, leaves)
      return ref, final(leaves)
    return resolve

  def _index_builder(self, dims, shape):
    clamp = self.clamp
    # Fully static: validate once; an invalid static index raises when run
    # (with the grid point), not when compiled.
    if all(self._dim_static(d) for d in dims):
      try:
        idx = tuple(self._build_dim(d, axis, shape, ()) for axis, d in enumerate(dims))
      except IndexError as err:
        msg = str(err)

        def fail(leaves):
          raise IndexError(msg)
        return fail
      return lambda leaves: idx
    build = self._build_dim
    enumerated = tuple(enumerate(dims))
    try:  # static dims are checked and built once
      parts = [None if not self._dim_static(d) else build(d, axis, shape, ())
               for axis, d in enumerated]
    except IndexError:  # raises when run, with the grid point
      return lambda leaves: tuple(build(d, axis, shape, leaves) for axis, d in enumerated)
    dynamic = [(axis, self._dim_builder(d, axis, shape))
               for axis, d in enumerated if parts[axis] is None]
    if len(dynamic) == 1:
      # Common case: one dynamic pl.ds / int per access, the rest static.
      ((k, dim_of),) = dynamic
      before, after = tuple(parts[:k]), tuple(parts[k + 1:])
      index = lambda leaves: (*before, dim_of(leaves), *after)
      in_bounds = getattr(dim_of, "in_bounds", None)
      if in_bounds is not None:  # see refs._one_slice_access
        index.one_slice = (before, after, *in_bounds)
      return index

    def index(leaves):
      idx = list(parts)
      for axis, dim_of in dynamic:
        idx[axis] = dim_of(leaves)
      return tuple(idx)
    return index

  def _dim_builder(self, d, axis, shape):
    """``fn(leaves)``: the checked index of one dynamic dim, specialised."""
    clamp = self.clamp
    if isinstance(d, _DimInt):
      k, n = d.value.k, d.dim
      return lambda leaves: check_int(leaves[k], n, axis, shape, clamp)
    if isinstance(d, DimSlice) and isinstance(d.start, _Dyn) and is_static(d.size):
      k, size, stride, n = d.start.k, d.size, d.stride, d.dim
      size = int(size)
      extent = (size - 1) * stride + 1 if size > 0 else 0
      if size > 0 and extent <= n:  # in bounds exactly when 0 <= start <= last
        last = n - extent

        def dim_slice(leaves):
          start = int(leaves[k])
          if 0 <= start <= last:
            return slice(start, start + extent, stride)
          return check_slice(start, size, stride, n, axis, shape, clamp)
        # (leaf, last in-bounds start, extent, stride): accesses with this one
        # dynamic dim may build the slice themselves (refs._one_slice_access)
        dim_slice.in_bounds = (k, last, extent, stride)
        return dim_slice
      return lambda leaves: check_slice(leaves[k], size, stride, n, axis, shape, clamp)
    build = self._build_dim
    return lambda leaves: build(d, axis, shape, leaves)

  def runtime_shape(self, leaves, index_lengths: bool = False) -> tuple:
    """The accessed shape for these index values, with no bounds check and
    no memory touched: a traced ``pl.ds`` size replaces its axis' bound in
    ``result_shape``; with ``index_lengths`` the integer-array indices of
    the last indexer give their block its shape (an index array read from
    an index ref sliced with a traced size is shorter than its aval). A
    DMA wait needs only this (its descriptor's byte count; Mosaic never
    dereferences a wait's addresses)."""
    if not (self.dynamic_size or index_lengths):
      return self.result_shape
    dims = self.steps[-1][1]
    int_shape, int_at, slice_axes = self._final_layout
    shape = list(self.result_shape)
    for d, axis in zip(dims, slice_axes):
      if isinstance(d, DimSlice) and not is_static(d.size):
        size = int(leaves[d.size.k])
        if size < 0:
          raise ValueError(f"negative pl.ds size {size} in a DMA descriptor")
        shape[axis] = size
    arrays = [np.shape(leaves[d.value.k] if isinstance(d.value, _Dyn) else d.value)
              for d, axis in zip(dims, slice_axes) if axis is None]
    if index_lengths and arrays:
      shape[int_at:int_at + len(int_shape)] = np.broadcast_shapes(*arrays)
    return tuple(shape)

  def unchecked_coords(self, ref, leaves):
    """``(view, coords)`` of the last indexer without bounds checks.

    For masked (Triton-style) accesses whose masked-off lanes may point out of
    bounds: ``coords[a]`` holds, for every element of the access, its index
    along axis ``a`` of ``view``; the arrays are broadcastable to
    ``result_shape`` (not broadcast: a slice stays 1-D along its axis).
    ``None`` when the access does not end in an indexer (nothing there can go
    out of bounds).

    Indexers of ints and slices right before the last one (``ref.at[pl.ds(
    228, 64)]`` then loaded at ``pl.ds(0, 64)``) are composed into the
    coordinates too, and ``view`` is the ref before them: such a view may
    run past the end of the ref for masked-off lanes, as on a GPU, where
    the view is pointer arithmetic. Earlier transforms are applied (and
    checked) as usual."""
    if self._prefix_fns is None:
      return None
    first = len(self._prefix_fns)
    while first > 0 and _composable(self.steps[first - 1]):
      first -= 1
    view = ref
    for f in self._prefix_fns[:first]:
      view = f(view, leaves)
    coords = self._last_coords(leaves)
    for step in reversed(self.steps[first:-1]):
      coords = _unindex(step[1], leaves, coords, len(self.result_shape))
    return view, coords

  def _last_coords(self, leaves):
    dims = self.steps[-1][1]
    n_out = len(self.result_shape)
    int_shape, int_at, slice_axes = self._final_layout
    coords = []
    for d, slice_axis in zip(dims, slice_axes):
      if isinstance(d, DimSlice):
        start = leaves[d.start.k] if isinstance(d.start, _Dyn) else d.start
        size = int(leaves[d.size.k] if isinstance(d.size, _Dyn) else d.size)
        c = int(start) + d.stride * np.arange(size, dtype=np.int64)
        shape = [1] * n_out
        shape[slice_axis] = size
        c = c.reshape(shape)
      else:
        v = leaves[d.value.k] if isinstance(d.value, _Dyn) else d.value
        c = np.asarray(v, dtype=np.int64)
        c = c.reshape((1,) * (len(int_shape) - c.ndim) + c.shape)  # right-aligned
        c = c.reshape((1,) * int_at + c.shape + (1,) * (n_out - int_at - len(int_shape)))
      coords.append(c)
    return coords

  def lane_coords(self, leaves, batched):
    """``unchecked_coords`` for many lanes at once, for a lone indexer whose
    dynamic leaves may carry a leading lane axis (``batched[k]``): coordinate
    arrays broadcastable to ``(lanes, *result_shape)``. None when the access
    has other transforms or a dynamic slice size."""
    if len(self.steps) != 1 or self.steps[0][0] != "index":
      return None
    dims = self.steps[0][1]
    n_out = len(self.result_shape)
    int_shape, int_at, slice_axes = self._final_layout
    coords = []
    for d, slice_axis in zip(dims, slice_axes):
      if isinstance(d, DimSlice):
        if not is_static(d.size):
          return None
        shape = [1] * (n_out + 1)
        shape[slice_axis + 1] = int(d.size)
        c = (d.stride * np.arange(int(d.size), dtype=np.int64)).reshape(shape)
        if isinstance(d.start, _Dyn):
          s = np.asarray(leaves[d.start.k], dtype=np.int64)
          c = c + (s.reshape((-1,) + (1,) * n_out) if batched[d.start.k] else s)
        else:
          c = c + int(d.start)
      else:
        lane_axis = isinstance(d.value, _Dyn) and batched[d.value.k]
        v = leaves[d.value.k] if isinstance(d.value, _Dyn) else d.value
        v = np.asarray(v, dtype=np.int64)
        lead, core = (v.shape[:1], v.shape[1:]) if lane_axis else ((1,), v.shape)
        core = (1,) * (len(int_shape) - len(core)) + core  # right-aligned
        c = v.reshape(lead + (1,) * int_at + core + (1,) * (n_out - int_at - len(int_shape)))
      coords.append(c)
    return coords

  @staticmethod
  def _dim_static(d):
    if isinstance(d, DimSlice):
      return is_static(d.start) and is_static(d.size)
    return is_static(d.value)

  def _build_dim(self, d, axis, shape, leaves):
    clamp = self.clamp
    if isinstance(d, DimSlice):
      start = leaves[d.start.k] if isinstance(d.start, _Dyn) else d.start
      size = leaves[d.size.k] if isinstance(d.size, _Dyn) else d.size
      return check_slice(start, size, d.stride, d.dim, axis, shape, clamp)
    if isinstance(d, _DimInt):
      v = leaves[d.value.k] if isinstance(d.value, _Dyn) else d.value
      return check_int(v, d.dim, axis, shape, clamp)
    v = leaves[d.value.k] if isinstance(d.value, _Dyn) else d.value
    return check_array(v, d.dim, axis, shape, clamp)


_running = threading.local()  # .vector_subcore: the SparseCore subcore this thread runs


@contextlib.contextmanager
def vector_subcore(index: int):
  """Within: this thread runs SparseCore vector subcore ``index`` (what
  ``plsc.slice_subcore_vmem_from_shared`` slices by; set by
  ``pallas_np.meshes`` around each vector subcore program)."""
  prev = getattr(_running, "vector_subcore", None)
  _running.vector_subcore = index
  try:
    yield
  finally:
    _running.vector_subcore = prev


def _subcore_slice_view(width: int):
  """``plsc.slice_subcore_vmem_from_shared``: subcore s's stripe of the
  shared VMEM, minor-dim elements ``[s*width, (s+1)*width)``
  (``tpu.shared_memref_slice``: the minor dim divided across the physical
  subcores, one stripe each)."""
  def view_of(view, leaves):
    s = getattr(_running, "vector_subcore", None)
    if s is None:
      raise UnsupportedError("pallas_np: plsc.slice_subcore_vmem_from_shared outside a "
                             "SparseCore VectorSubcoreMesh kernel")
    return view[..., s * width:(s + 1) * width]
  return view_of


def _composable(step) -> bool:
  """An indexer of ints and static-size slices: its view's axes are its
  slice dims, in order, so coordinates map back through it one to one."""
  return step[0] == "index" and not any(
      isinstance(d, DimArray) or (isinstance(d, DimSlice) and not is_static(d.size))
      for d in step[1])


def _unindex(dims, leaves, coords, n_out):
  """Coordinates in the view an indexer made -> in the ref it indexed."""
  out = []
  it = iter(coords)
  for d in dims:
    if isinstance(d, DimSlice):
      start = leaves[d.start.k] if isinstance(d.start, _Dyn) else d.start
      out.append(int(start) + d.stride * next(it))
    else:
      v = leaves[d.value.k] if isinstance(d.value, _Dyn) else d.value
      out.append(np.full((1,) * n_out, int(v), dtype=np.int64))
  return out


def _indexed_shape(dims, layout) -> tuple:
  """The shape an NDIndexer gives (NumPy's rule, as
  ``NDIndexer.get_indexer_shape``), from the layout already computed:
  JAX's own method costs ~20 us per access at plan-compile time."""
  int_shape, int_at, slice_axes = layout
  has_int = any(a is None for a in slice_axes)
  out = [0] * (sum(a is not None for a in slice_axes) + (len(int_shape) if has_int else 0))
  for d, axis in zip(dims, slice_axes):
    if axis is not None:
      out[axis] = int(d.size) if is_static(d.size) else d.dim  # the bound
  if has_int:
    out[int_at:int_at + len(int_shape)] = int_shape
  return tuple(out)


def _int_block_layout(dims, int_shape):
  """Where an NDIndexer puts its axes in the result (NumPy's rule, which
  ``NDIndexer.get_indexer_shape`` follows): ``(int_shape, first axis of the
  integer-indexed block, result axis of each slice dim or None)``."""
  is_int = [not isinstance(d, DimSlice) for d in dims]
  int_dims = [i for i, x in enumerate(is_int) if x]
  contiguous = all(b - a == 1 for a, b in zip(int_dims, int_dims[1:]))
  int_shape = tuple(int(s) for s in int_shape)
  if int_dims and contiguous:
    int_at = sum(1 for i in range(int_dims[0]) if not is_int[i])
  else:
    int_at = 0
  slice_axes = []
  n_slices_seen = 0
  for i, d in enumerate(dims):
    if is_int[i]:
      slice_axes.append(None)
      continue
    axis = n_slices_seen
    if int_dims and (not contiguous or i > int_dims[0]):
      axis += len(int_shape)
    slice_axes.append(axis)
    n_slices_seen += 1
  return int_shape, int_at, slice_axes


def _apply_index(builder):
  def f(view, leaves):
    idx = builder(leaves)
    if isinstance(view, lens.LensView):
      return lens.indexed(view, idx)
    out = view[idx]
    if not isinstance(out, np.ndarray) or (out.base is None and out.size and view.size):
      if any(isinstance(i, np.ndarray) for i in idx):
        raise UnsupportedError(
            "pallas_np: integer-array indexing is only supported as the last ref transform "
            "(Mosaic's DMA lowering says the same: an indexed ref cannot have any "
            "transforms following the indexer)")
    return out
  return f
