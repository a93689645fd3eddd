"""Which grid points may run together: the lane/ownership analysis shared
by the vectorized grid (``pallas_np.grid.vectorize``) and the threaded one
(``pallas_np.grid.threads``).

A *lane* is one grid point of the batched axes. Grid points may run out of
grid order when nothing observes the order (``order_free_reason``) and every
output block is owned by one lane (``lane_axes``, on the index maps
evaluated over the whole grid). The jaxpr walks here are heuristics for the
choice of axes and layout only (``loop_axes``, ``partly_read_operands``,
``prefers_lanes_last``): correctness never depends on them.
"""
from __future__ import annotations

import math

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.batching import JAXPR_TYPES, has_subjaxprs
from pallas_np.compiler import INLINE_CALLS

MAX_GRID = 1 << 20           # points evaluated up front for the analysis


# Scalar-prefetch operands up to this many bytes key the per-grid caches by
# value (a page table, a row index): the analysis depends on nothing else.
_PREFETCH_KEY_BYTES = 1 << 12


def per_grid(cache: dict, kp, grid, index_ops, compute):
  """``compute(grid, index_ops)``, cached per grid when the index maps
  depend on nothing else (no scalar prefetch), or per grid and the values of
  small scalar-prefetch operands; bounded for dynamic grids."""
  key = grid
  if kp.num_index:
    if sum(np.asarray(o).nbytes for o in index_ops) > _PREFETCH_KEY_BYTES:
      return compute(grid, index_ops)
    key = (grid, *[(o.shape, o.dtype.str, o.tobytes()) for o in map(np.asarray, index_ops)])
  hit = cache.get(key)
  if hit is None and key not in cache:
    if len(cache) >= 16:
      cache.clear()
    hit = cache[key] = compute(grid, index_ops)
  return hit


def order_free_reason(kp) -> str | None:
  """Why grid points of ``kp`` may not run out of grid order (batched or on
  threads), before looking at the index maps; None if they may."""
  params = kp.params
  if params.trace is not None or params.pdb or params.records_accesses:
    return "an option that observes grid order (trace/pdb/detect_races/explain) is on"
  if kp.written_inputs:
    return "the kernel writes an input ref"
  if kp.shared_aliases:
    return "an aliased input and its output are one buffer (reads see earlier writes)"
  for geo in kp.blocks[kp.num_inputs:]:
    if "element" in geo.kinds:
      return "an output has Element block dims"
  return None


_LOOP_FREE_MIN_LANES = 8  # fewer lanes than this: batching a loop axis too may still pay


def lane_axes(grid, coords, out_block_idx, scratch: bool, avoid=frozenset()):
  """The grid axes whose coordinates make a *lane* such that every output
  block is touched by one lane only, or None. ``coords``: (ndim, points)
  grid coordinates in grid order; ``out_block_idx``: per output, the block
  index columns over those points. Tried in order: all axes, grid prefixes,
  single axes (longest first); sets of at least 8 lanes without an
  ``avoid`` axis (see ``loop_axes``) before the others. With scratch, lanes
  must be consecutive in grid order (batched axes before sequential ones)
  for the vectorizer's scratch hand-over check to be exact: prefixes only."""
  ndim = len(grid)
  cands = [d for d in range(ndim) if grid[d] > 1]
  options = [] if scratch else [tuple(cands)]
  for m in range(ndim, 0, -1):
    options.append(tuple(d for d in cands if d < m))
  if not scratch:
    options += sorted(((d,) for d in cands), key=lambda t: -grid[t[0]])
  if avoid:  # loop-free sets of at least _LOOP_FREE_MIN_LANES lanes first (stable)
    options.sort(key=lambda axes: any(d in avoid for d in axes) or math.prod(
        grid[d] for d in axes) < _LOOP_FREE_MIN_LANES)
  seen = set()
  for axes in options:
    if not axes or axes in seen:
      continue
    seen.add(axes)
    if owned(grid, coords, axes, out_block_idx):
      return axes
  return None


def owned(grid, coords, axes, out_block_idx):
  """Every output block is touched by grid points of one lane only."""
  lane = np.ravel_multi_index(tuple(coords[d] for d in axes), tuple(grid[d] for d in axes))
  for cols in out_block_idx:
    if not cols:
      return False  # a 0-d output: one block shared by everyone
    # Sort grid points by (block, lane); a block seen with two lanes fails.
    order = np.lexsort((lane, *reversed(cols)))
    same_block = np.ones(len(order) - 1, bool)
    for c in cols:
      cs = c[order]
      same_block &= cs[1:] == cs[:-1]
    ls = lane[order]
    if np.any(same_block & (ls[1:] != ls[:-1])):
      return False
  return True


def all_eqns(jaxpr) -> list:
  """The eqns of ``jaxpr`` and of every sub-jaxpr (each sub-jaxpr's right
  after the eqn that holds it)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  out = []
  for eqn in jaxpr.eqns:
    out.append(eqn)
    if eqn.params and has_subjaxprs(eqn):
      for v in eqn.params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
          if isinstance(x, JAXPR_TYPES):
            out += all_eqns(x)
  return out


def _sub_bindings(eqn):
  """[(sub-jaxpr, the eqn atoms its invars take)] for the call-like and
  control-flow eqns whose operands map onto sub-jaxpr inputs; None for any
  other eqn with sub-jaxprs (the callers then assume the worst)."""
  name, params, ins = eqn.primitive.name, eqn.params, list(eqn.invars)
  unwrap = lambda j: getattr(j, "jaxpr", j)
  if name == "cond":
    return [(unwrap(b), ins[1:]) for b in params["branches"]]
  if name == "while":
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    carry = ins[nc + nb:]
    return [(unwrap(params["cond_jaxpr"]), ins[:nc] + carry),
            (unwrap(params["body_jaxpr"]), ins[nc:nc + nb] + carry)]
  if name == "scan":
    return [(unwrap(params["jaxpr"]), ins)]
  if name == "run_scoped":
    body = unwrap(params["jaxpr"])
    return [(body.replace(invars=[*body.constvars, *body.invars], constvars=[]), ins)]
  callee = params.get(INLINE_CALLS.get(name, ""))
  if callee is not None:
    return [(unwrap(callee), ins)]
  return None if has_subjaxprs(eqn) else []


def loop_axes(kp) -> frozenset:
  """Grid dims whose program_id reaches a ``while`` loop's operands (a
  ``fori_loop`` with a program_id-dependent trip count, as in causal
  attention): batching such an axis makes the lanes' trip counts differ,
  and the pass iterates every lane until the longest is done. A heuristic
  for the choice of axes only: correctness never depends on it."""
  local = kp.local_dims
  found: set = set()
  none = frozenset()
  var = jc.Var

  def walk(jaxpr, taint) -> frozenset:
    """Taints ``jaxpr``'s values; returns every axis seen in it (the taint
    of a call or loop's outputs: a coarse but safe over-approximation)."""
    seen = none.union(*taint.values())
    for eqn in jaxpr.eqns:
      # Most eqns read nothing tainted and call nothing: one cheap test each
      # (this walk is on every vectorized kernel's first call).
      axes = none
      if taint:
        hits = [taint[v] for v in eqn.invars if isinstance(v, var) and v in taint]
        if hits:
          axes = none.union(*hits)
      name = eqn.primitive.name
      if name == "program_id":
        axes = axes | {local[eqn.params["axis"]]}
      elif name == "while":
        found.update(axes)
      if eqn.params and has_subjaxprs(eqn):
        for sub, atoms in _sub_bindings(eqn) or ():
          axes = axes | walk(sub, {v: taint[a] for v, a in zip(sub.invars, atoms)
                                   if isinstance(a, var) and a in taint})
      if axes:
        seen = seen | axes
        for o in eqn.outvars:
          taint[o] = axes
    return seen
  walk(kp.kernel_jaxpr, {})
  return frozenset(found)


def partly_read_operands(kp) -> frozenset:
  """Operands (block positions) the kernel only ever reads or writes in
  windows smaller than their block (``k_ref[pl.ds(start, 64), :]`` of a
  whole K block): a lane's real traffic is then those windows, not its
  block. Any other use of the ref (whole-block access, a primitive this
  walk does not know) counts as whole."""
  whole: set = set()
  partial: set = set()
  getters = ("get", "swap", "masked_load", "masked_swap", "addupdate")

  def walk(jaxpr, refs):
    for eqn in jaxpr.eqns:
      used = [(k, refs[v]) for k, v in enumerate(eqn.invars)
              if isinstance(v, jc.Var) and v in refs]
      if not used:
        continue
      name = eqn.primitive.name
      if name in getters and used == [(0, used[0][1])]:
        ref_aval = eqn.invars[0].aval
        moved = (eqn.outvars or eqn.invars[1:])[0].aval  # what a read/swap moves
        size = math.prod(getattr(moved, "shape", ()) or (1,))
        block = math.prod(getattr(ref_aval, "shape", ()) or (1,))
        (partial if 2 * size <= block else whole).add(used[0][1])
        continue
      subs = _sub_bindings(eqn)
      if not subs or name in getters:  # an unknown use (a DMA, an atomic, ...)
        whole.update(op for _, op in used)
        continue
      for sub, atoms in subs:
        walk(sub, {v: refs[a] for v, a in zip(sub.invars, atoms)
                   if isinstance(a, jc.Var) and a in refs})

  jaxpr = kp.kernel_jaxpr
  ops = jaxpr.invars[kp.num_index:kp.num_index + len(kp.blocks)]
  walk(jaxpr, {v: b for b, v in enumerate(ops)})
  return frozenset(partial - whole)


# -- the lanes-last layout: which kernels want it --------------------------------------
# A batched value is (lanes, *per-lane shape). Stored lanes-first (C order),
# every NumPy op's contiguous inner run is the per-lane value's last axis (or
# less: a bitonic sort's compare-exchange on a (256, 1) column reads runs of
# 1, 2, 4, ... elements), and ufuncs over short strided runs cost several
# times more per element. Stored lanes-last (the lane axis contiguous, the logical shape
# unchanged) every elementwise op, slice, reshape and reduction runs over
# all lanes contiguously, and NumPy keeps that layout ('K' order) through
# ufunc results, slices, transposes and fused concatenate buffers. The slab
# runner copies the lanes' blocks and scratch into that layout and the
# output blocks back; results are the same values in either layout.
# Chosen per kernel: lanes-last when the typical (size-weighted median) eqn
# result has a short last axis, and never with GEMMs (BLAS wants contiguous
# rows; the lanes fold into them).
_LANES_LAST_MAX_INNER = 64


def has_gemm(kp) -> bool:
  """Whether ``kp``'s kernel computes a matrix product (anywhere)."""
  return any(registry.properties(eqn.primitive).gemm for eqn in all_eqns(kp.kernel_jaxpr))


def prefers_lanes_last(kp) -> bool:
  """Whether ``kp``'s batched passes should store lanes last (see above)."""
  inner = []  # (last-axis length, elements) per eqn result
  for eqn in all_eqns(kp.kernel_jaxpr):
    if registry.properties(eqn.primitive).gemm:
      return False
    for v in eqn.outvars:
      shape = getattr(v.aval, "shape", None)
      if shape and not isinstance(v.aval, jc.AbstractRef):
        size = math.prod(shape)
        if size > 1:
          inner.append((shape[-1], size))
  if not inner:
    return False
  inner.sort()
  half, seen = sum(w for _, w in inner) / 2, 0
  for last, w in inner:
    seen += w
    if seen >= half:
      return last <= _LANES_LAST_MAX_INNER
  return False
