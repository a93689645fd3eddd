"""TPU (Mosaic) primitives: roll, bitcast, PRNG, delay, trace values,
semaphores and DMAs (data movement lives in ``pallas_np.state.dma``)."""
from __future__ import annotations

import jax
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import np_dtype
from pallas_np.errors import UnsupportedError
from pallas_np.kernel_context import rule_state
from pallas_np.state import dma as dma_mod
from pallas_np.state.indexing import RefAccess
from pallas_np.primitives.tpu_operands import (
    OperandPos, device_target, index_ref_slices, operand_atom, operand_dtype, operand_positions,
    ref_operand, scalar_operand, skip_ignored, split_indices)

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


@registry.register(mp.dma_start_p, needs_ctx=True, foldable=False, batch=_SEQUENTIAL)
def _dma_start(e):
  src, dst, dst_sem, src_sem, device_id = operand_positions(e, e.params["tree"])
  what = f"DMA at {e.source}"
  src, src_ignored = split_indices(src, what)
  dst, dst_ignored = split_indices(dst, what)
  if src_ignored and dst_ignored:
    raise UnsupportedError(f"pallas_np: {what}: ignored indices on both sides")
  get_src, get_dst = ref_operand(e, src, dma=True), ref_operand(e, dst, dma=True)
  get_dst_sem, get_src_sem = ref_operand(e, dst_sem), ref_operand(e, src_sem)
  target = device_target(e, device_id)
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
    full_nbytes = int(np.prod(src_shape, dtype=np.int64)) * operand_dtype(e, src).itemsize

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
      (s_view, s_idx), (d_view, d_idx) = skip_ignored(args, src_ignored, get_src, get_dst, what)
      nbytes = full_nbytes
    elif dst_ignored:
      (d_view, d_idx), (s_view, s_idx) = skip_ignored(args, dst_ignored, get_dst, get_src, what)
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
  src, dst, sem, _, device_id = operand_positions(e, e.params["tree"])
  get_sem = ref_operand(e, sem)
  if isinstance(src, jc.TransformedRef) and isinstance(src.ref, (tuple, list)):
    src = src.ref[0]  # pl.select_ref: the refs it picks from have one shape (Mosaic)
  # TPU interpret mode waits for the byte size of the (transformed) source.
  if isinstance(src, OperandPos):
    aval = e.in_avals[src.k]
    shape, dtype = aval.shape, aval.dtype
  else:
    src, _ = split_indices(src, f"DMA wait at {e.source}")
    transforms, index_refs = index_ref_slices(e, src.transforms)
    leaves, tree = jax.tree_util.tree_flatten(transforms)
    aval = e.in_avals[src.ref.k]
    atoms = [index_refs[l.k].atom if isinstance(l, OperandPos) and l.k in index_refs else operand_atom(e, l)
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
  if not isinstance(src, OperandPos) and (acc.dynamic_size or index_lengths):  # a traced pl.ds size
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
  ref, transforms, inc, device_id, core_index = operand_positions(e, e.params["args_tree"])
  get_sem = ref_operand(e, ref, transforms)
  target = device_target(e, device_id)
  get_inc = scalar_operand(e, inc)
  get_core = scalar_operand(e, core_index) if core_index is not None else None
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
  ref, transforms, value, decrement = operand_positions(e, e.params["args_tree"])
  get_sem = ref_operand(e, ref, transforms)
  what = f"semaphore_wait at {e.source}"
  get_value, get_dec = scalar_operand(e, value), scalar_operand(e, decrement)

  def sem_wait(ctx, *args):
    cell = dma_mod.sem_cell(*get_sem(args))
    dma_mod.wait(ctx, cell, int(get_value(args)), what=what,
                 decrement=bool(get_dec(args)))
    return []
  return sem_wait


@registry.register(pp.semaphore_read_p, needs_ctx=True, foldable=False, batch=_SEQUENTIAL)
def _semaphore_read(e):
  ref, transforms = operand_positions(e, e.params["args_tree"])
  get_sem = ref_operand(e, ref, transforms)

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


