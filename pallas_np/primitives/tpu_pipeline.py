"""``pltpu.emit_pipeline`` as one primitive (``emit_pipeline_p``).

With ``jax_use_emit_pipeline_primitive`` (JAX 0.10+; JAX's pipeline tests run
every case with it on and off), ``pltpu.emit_pipeline`` traces its body once
into a jaxpr and binds ``emit_pipeline_p``; Mosaic's lowering expands it into
the double-buffered DMA loop. We run what that loop computes, directly:

* the pipeline grid in row-major order (each core's part: the grid offsets
  of a megacore split are added to the indices, as JAX's scheduler does);
* per operand, the block its index map names, in a buffer of the block's
  shape: an HBM/ANY operand's input block is *copied in* when its block index
  changes (the padding of an edge block is uninitialised), an output block is
  a fresh (uninitialised) buffer when its index changes and is *written back*,
  its in-bounds part only, when it changes again or the pipeline ends;
  a VMEM/SMEM operand is aliased (the body works on a window of it), as
  ``BufferedRef.bind_existing_ref`` does;
* the body sees ``pl.program_id``/``pl.num_programs`` of the pipeline grid
  for its leading axes (the enclosing kernel's beyond them), as Mosaic's
  lowering of ``pipeline_body`` sets them.

Reading an output block before writing it sees uninitialised memory here, as
on a TPU (a VMEM buffer that was not copied in). What is not supported raises
``UnsupportedError`` naming it: block dimensions other than blocked, squeezed
and element (``BlockGeometry``), nested refs in operands.
"""
from __future__ import annotations

import itertools

import jax
import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.grid.blocks import BlockGeometry
from pallas_np.memory import allocate
from pallas_np.state import lens
from pallas_np.primitives.tpu_operands import OperandPos, operand_positions, ref_operand

_emit_pipeline_p = jc.optional_primitive("pallas.mosaic.pipeline", "emit_pipeline_p")

_LOCAL_SPACES = ("vmem", "smem")


def _is_dynamic(d) -> bool:
  return d is None or isinstance(d, jc.DynamicGridDim)


def _space_name(aval) -> str:
  space = jc.memory_space_of(aval)
  space = getattr(space, "memory_space", space)  # `pltpu.VMEM @ mesh`
  if space is None:
    return "any"
  return str(getattr(space, "name", None) or getattr(space, "value", space)).lower()


def _windows(geo: BlockGeometry, padded_index):
  """(source index, block index, complete): the in-bounds part of a block
  (given by its index in padded coordinates) in the operand and in the
  block buffer; squeezed dims index the operand only."""
  src, dst, complete = [], [], True
  for d, ix in enumerate(padded_index[:-1]):  # (the trailing Ellipsis)
    lo, n = geo.pad_low[d], geo.array_shape[d]
    if isinstance(ix, slice):
      a, b = max(ix.start, lo), min(ix.stop, lo + n)
      b = max(a, b)
      complete = complete and (a, b) == (ix.start, ix.stop)
      src.append(slice(a - lo, b - lo))
      dst.append(slice(a - ix.start, b - ix.start))
    else:
      src.append(ix - lo)
  return (*src, Ellipsis), (*dst, Ellipsis), complete


class _Operand:
  """One pipelined operand: its geometry, index map and where it lives."""
  __slots__ = ("geo", "index_map", "n_consts", "get", "local", "is_output", "block_shape",
               "dtype")

  def __init__(self, geo, index_map, n_consts, get, local, is_output):
    self.geo, self.index_map, self.n_consts = geo, index_map, n_consts
    self.get, self.local, self.is_output = get, local, is_output
    self.block_shape = tuple(s for k, s in zip(geo.kinds, geo.sizes) if k != "squeezed")
    self.dtype = geo.dtype


if _emit_pipeline_p is not None:
  @registry.register(_emit_pipeline_p, needs_ctx=True, foldable=False,
                     batch=registry.unbatched(
                         "emit_pipeline runs its own grid: the outer grid runs sequentially"))
  def _emit_pipeline(e):
    p = e.params
    if "body_consts_len" not in p or "_static_grid_offsets" not in p:
      raise e.unsupported(  # JAX 0.12 packs its operands differently
          "pltpu.emit_pipeline as a primitive (jax_use_emit_pipeline_primitive) in this "
          "JAX version; with the flag off (its default) the pipeline runs")
    gm = p["grid_mapping"]
    params = e.compiler.params
    clamp = params.bounds_check == "clamp"
    bms = gm.block_mappings
    n_const = [len(bm.index_map_jaxpr.consts) for bm in bms]
    n_dyn = gm.num_dynamic_grid_bounds + p["_num_extra_dynamic"]
    first_arg = sum(n_const) + n_dyn + p["body_consts_len"]
    n = len(e.eqn.invars)
    marks = operand_positions(e, jax.tree_util.tree_structure(list(range(n))))
    nodes = jax.tree_util.tree_leaves(
        p["args_tree"].unflatten(marks[first_arg:]),
        is_leaf=lambda x: isinstance(x, (jc.TransformedRef, OperandPos)))
    if len(nodes) != len(bms):
      raise e.unsupported(f"emit_pipeline with {len(nodes)} operand refs for {len(bms)} "
                          "block specs (nested or non-ref operands)")
    operands = []
    for b, (bm, node) in enumerate(zip(bms, nodes)):
      base = node.ref if isinstance(node, jc.TransformedRef) else node
      geo = BlockGeometry(bm)
      index_map = e.compiler.compile(bm.index_map_jaxpr.jaxpr, constvars_as_args=True).fn
      local = _space_name(e.in_avals[base.k]) in _LOCAL_SPACES
      operands.append(_Operand(geo, index_map, n_const[b], ref_operand(e, node), local,
                               b >= gm.num_inputs))
    body = e.compiler.compile(p["body_jaxpr"], constvars_as_args=True).fn
    static_grid = tuple(gm.grid)
    static_offsets = tuple(p["_static_grid_offsets"])
    body_consts_at = sum(n_const) + n_dyn

    def emit_pipeline(ctx, *args):
      dyn = iter(args[sum(n_const):sum(n_const) + n_dyn])
      grid = tuple(int(next(dyn)) if _is_dynamic(d) else int(d)
                   for d in static_grid)
      offsets = tuple(int(next(dyn)) if _is_dynamic(d) else int(d)
                      for d in static_offsets)
      body_consts = args[body_consts_at:first_arg]
      consts, at = [], 0
      for op in operands:
        consts.append(args[at:at + op.n_consts])
        at += op.n_consts
      refs = [_operand_view(*op.get(args)) for op in operands]
      last = [None] * len(operands)
      bufs = [None] * len(operands)
      outer_ids, outer_num = ctx.program_ids, ctx.num_programs
      try:
        for local_point in itertools.product(*map(range, grid)):
          point = tuple(np.int32(i + o) for i, o in zip(local_point, offsets))
          for b, op in enumerate(operands):
            bidx = tuple(int(i) for i in op.index_map(ctx, *consts[b], *point))
            if bidx == last[b]:
              continue
            if op.is_output and bufs[b] is not None and last[b] is not None:
              _write_back(op, refs[b], bufs[b], last[b], clamp)
            last[b] = bidx
            bufs[b] = _block(op, refs[b], bidx, clamp, params)
          ctx.program_ids = (*point, *outer_ids[len(point):])
          ctx.num_programs = (*(np.int32(g) for g in grid), *outer_num[len(grid):])
          body(ctx, *body_consts, *bufs)
          ctx.program_ids, ctx.num_programs = outer_ids, outer_num
        for b, op in enumerate(operands):
          if op.is_output and bufs[b] is not None:
            _write_back(op, refs[b], bufs[b], last[b], clamp)
      finally:
        ctx.program_ids, ctx.num_programs = outer_ids, outer_num
      return []
    return emit_pipeline


def _operand_view(view, idx):
  """An operand as something blocks are read from and written to: a NumPy
  view, or a ``lens.LensView`` (a width-changing bitcast), whose blocks are
  always copied in and written back through it."""
  if isinstance(view, lens.LensView):
    return view if idx is Ellipsis else lens.indexed(view, idx)
  return view[idx]


def _block(op: _Operand, ref, bidx, clamp, params):
  """The buffer the body sees for block ``bidx``: a window of a local
  (VMEM/SMEM) operand, else a copy of an input block / a fresh output block."""
  src, dst, complete = _windows(op.geo, op.geo.block_index(bidx, clamp))
  if op.local and complete and isinstance(ref, np.ndarray):
    return ref[src]
  buf = allocate(op.block_shape, op.dtype, params)
  if not op.is_output or op.local:  # (a partial local output block: its data, copied)
    buf[dst] = ref[src]
  return buf


def _write_back(op: _Operand, ref, buf, bidx, clamp):
  src, dst, complete = _windows(op.geo, op.geo.block_index(bidx, clamp))
  if op.local and complete and isinstance(ref, np.ndarray):
    return  # the body wrote the operand itself
  ref[src] = buf[dst]
