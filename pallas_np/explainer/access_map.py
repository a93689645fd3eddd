"""Access maps of one recorded kernel run: per operand, which grid steps
mapped (index maps) and touched (recorded ref accesses and DMAs) each
element, as NumPy arrays; plus the text summary built from them."""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np.explainer.record import RunRecorder, TrackedBuffer


class OperandAccess:
  """One operand (input or output) of a kernel run.

  Element arrays have the operand's shape (padding sliced off); the
  ``padded_*`` ones the padded shape the blocks are cut from.

  * ``visits`` / ``first_step``: grid steps whose *block* (index map) covers
    the element, and the first of them (-1: never mapped). This is what the
    pipeline copies.
  * ``block_visits``: the same per block index (one entry per block; for
    ``pl.Element`` dims, per element offset).
  * ``recorded_visits`` / ``recorded_first_step`` / ``read`` / ``written``:
    what the kernel body actually did (ref reads/writes, DMAs).
  """

  def __init__(self, plan, b: int, rec: RunRecorder, buf: TrackedBuffer, arg_name):
    geo = plan.blocks[b]
    self.index = b
    self.origin = str(geo.origin)
    self.arg_name = arg_name
    self.is_output = b >= plan.num_inputs
    out_pos = b - plan.num_inputs
    self.aliased_input = plan.out_for_in.get(out_pos) if self.is_output else None
    self.shape = tuple(geo.array_shape)
    self.dtype = np.dtype(_physical(geo.dtype))
    self.kinds = geo.kinds
    self.block_sizes = geo.sizes
    self.block_shape = tuple(None if k == "squeezed" else s for k, s in zip(geo.kinds, geo.sizes))
    self.pad_low = geo.pad_low
    self.padded_shape = geo.padded_shape
    self.memory_space = _memory_space(plan.grid_mapping.block_mappings[b])
    # Index maps mean nothing when the kernel gets the whole array each step.
    self.unblocked = self.memory_space in ("any", "hbm") or (
        geo.whole and geo.trivial_index_map and not geo.needs_padding)
    self.num_steps = rec.num_steps
    self.ran = rec.ran
    self.step_block = rec.block_indices[b]  # (steps, ndim), -1 where not run
    self._mapped(plan, geo)
    self._recorded(buf)
    pos = rec.buffers.index(buf)
    none = np.zeros(self.num_steps, np.int64)
    self.step_reads = rec.reads[:, pos] if rec.reads is not None else none
    self.step_writes = rec.writes[:, pos] if rec.writes is not None else none
    # Grid steps that mapped the operand but whose body never touched it.
    self.skipped_steps = self.ran & (self.step_reads == 0) & (self.step_writes == 0)

  # -- index-map view -----------------------------------------------------------
  def _mapped(self, plan, geo):
    space = tuple(p // s if k == "blocked" else p - s + 1 if k == "element" else p
                  for k, s, p in zip(self.kinds, self.block_sizes, self.padded_shape))
    self.block_grid = space
    self.block_visits = np.zeros(space, np.int64)
    visits = np.zeros(self.padded_shape, np.int64)
    first = np.full(self.padded_shape, -1, np.int64)
    steps = np.flatnonzero(self.ran)
    keys = self.step_block[steps]
    self.runs_per_block: dict[tuple, int] = {}
    if len(steps):
      uniq, first_pos, inverse, counts = np.unique(
          keys, axis=0, return_index=True, return_inverse=True, return_counts=True)
      inverse = inverse.ravel()
      # Runs of consecutive steps on the same block: the pipeline copies a
      # block once per run.
      change = np.ones(len(steps), bool)
      change[1:] = np.any(keys[1:] != keys[:-1], axis=1)
      runs = np.bincount(inverse[change], minlength=len(uniq))
      for key, pos, n, r in zip(uniq, first_pos, counts, runs):
        key = tuple(int(i) for i in key)
        self.block_visits[tuple(min(max(i, 0), s - 1) for i, s in zip(key, space))] += n
        self.runs_per_block[key] = int(r)
        region = geo.block_index(key, clamp=True)
        visits[region] += n
        sub = first[region]
        step = steps[pos]
        sub[(sub < 0) | (sub > step)] = step
    self.padded_visits = visits
    self.padded_first_step = first
    inside = self.unpadded_index()
    self.visits = visits[inside]
    self.first_step = first[inside]
    self.block_bytes = int(np.prod(self.block_sizes, dtype=np.int64)) * self.dtype.itemsize
    self.copies = sum(self.runs_per_block.values())  # block copies the pipeline makes

  def unpadded_index(self):
    return tuple(slice(lo, lo + n) for lo, n in zip(self.pad_low, self.shape))

  # -- recorded view -----------------------------------------------------------
  def _recorded(self, buf: TrackedBuffer):
    shape = self.padded_shape
    self.padded_recorded_visits = buf.visits.reshape(shape)
    self.padded_recorded_first_step = buf.first_step.reshape(shape)
    self.padded_read = buf.read.reshape(shape)
    self.padded_written = buf.written.reshape(shape)
    inside = self.unpadded_index()
    self.recorded_visits = self.padded_recorded_visits[inside]
    self.recorded_first_step = self.padded_recorded_first_step[inside]
    self.read = self.padded_read[inside]
    self.written = self.padded_written[inside]

  # -- derived facts -----------------------------------------------------------
  @property
  def label(self) -> str:
    return f"{self.arg_name} ({self.origin})" if self.arg_name else self.origin

  @property
  def padding(self) -> np.ndarray:
    """Bool mask over the padded shape: True where the array has no data."""
    mask = np.ones(self.padded_shape, bool)
    mask[self.unpadded_index()] = False
    return mask

  def partial_dims(self) -> list[str]:
    out = []
    for d, (k, n, b) in enumerate(zip(self.kinds, self.shape, self.block_sizes)):
      if k == "blocked" and n % b:
        out.append(f"dim {d}: {n} = {n // b}x{b} + {n % b}")
      elif k == "element" and (self.pad_low[d] or self.padded_shape[d] != n):
        out.append(f"dim {d}: Element padding {self.pad_low[d]} low, "
                   f"{self.padded_shape[d] - n - self.pad_low[d]} high")
    return out

  def revisits(self, grid) -> tuple[tuple[int, ...], int]:
    """(grid axes along which consecutive steps keep this operand's block,
    blocks visited again after the operand moved to another block)."""
    steps = np.flatnonzero(self.ran)
    keys = self.step_block[steps]
    axes = set()
    for s in range(1, len(steps)):
      if np.array_equal(keys[s], keys[s - 1]):
        a = np.unravel_index(steps[s], grid) if grid else ()
        p = np.unravel_index(steps[s - 1], grid) if grid else ()
        changed = [d for d in range(len(grid)) if a[d] != p[d]]
        if changed:
          axes.add(max(changed))  # the axis that stepped (faster ones wrapped)
    split = sum(1 for r in self.runs_per_block.values() if r > 1)
    return tuple(sorted(axes)), split

  def uses_recorded(self) -> bool:
    """Auto source of the picture: recorded accesses for whole-array
    operands, and for inputs the body skipped in some step it mapped them
    (``pl.when`` block skipping), where index maps would overstate."""
    return self.unblocked or (not self.is_output and bool(np.any(self.skipped_steps)))


def _physical(dtype):
  return jc.physical_dtype(dtype)


def _memory_space(bm) -> str:
  space = getattr(bm.transformed_block_aval, "memory_space", None)
  space = str(getattr(space, "value", space)).lower()
  for name in ("any", "hbm", "smem", "vmem", "semaphore"):
    if name in space:
      return name
  return "default"


def fmt_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n} B"
