"""``pallas_np.explain``: see how a kernel's grid and BlockSpecs carve its
operands.

``explain(fn, *args)`` runs ``fn`` with every ``pallas_call`` in the NumPy
interpreter and a recorder in place of the race detector (same hooks: the
grid loop reports each step's block indices, ref rules and DMAs report the
elements they touch), then returns one ``KernelExplanation`` per kernel run:
a text summary, NumPy access maps, and pictures (``pallas_np.explainer.render``,
matplotlib imported only there).
"""
from __future__ import annotations

import os
import re

import jax
import numpy as np

from pallas_np.api import force_numpy_interpret
from pallas_np.explainer.access_map import OperandAccess, fmt_bytes
from pallas_np.explainer.record import ExplainSession, RunRecorder
from pallas_np.params import default_params

__all__ = ["explain", "Explanation", "KernelExplanation", "OperandAccess", "explain_params"]


def explain_params(session: ExplainSession):
  """InterpretParams that record into ``session``: point by point, one
  thread (the recorder needs grid order), everything else default."""
  return default_params(explain=session, vectorize=False, num_threads=1)


def explain(fn, *args, **kwargs) -> "Explanation":
  """Run ``fn(*args, **kwargs)`` with every pallas_call in numpy mode
  (whatever its ``interpret=``) and explain each kernel run.

  Returns an ``Explanation`` (a list of ``KernelExplanation``, in run order;
  ``.result`` holds what ``fn`` returned). Print one for the summary, call
  ``.save("k.png")`` / ``.save("k.svg")`` for the picture (needs the
  ``pallas-np[viz]`` extra), or read its access maps (``.operands[i].visits``,
  ``.first_step``, ``.written``...)."""
  session = ExplainSession()
  try:
    with force_numpy_interpret(explain_params(session)):
      result = fn(*args, **kwargs)
      jax.block_until_ready(result)
  finally:
    runs = session.close()
  out = Explanation(KernelExplanation(r) for r in runs)
  out.result = result
  return out


class Explanation(list):
  """The ``KernelExplanation`` of every kernel run, in run order."""
  result = None

  def __str__(self):
    if not self:
      return "pallas_np.explain: no pallas_call ran"
    return "\n\n".join(str(k) for k in self)

  __repr__ = __str__

  def save_all(self, outdir: str, fmt: str = "png", **options) -> list[str]:
    """One picture per kernel run in ``outdir``: ``NN_kernel.fmt``."""
    os.makedirs(outdir, exist_ok=True)
    paths = []
    for i, k in enumerate(self):
      safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", k.name)[:80] or "kernel"
      path = os.path.join(outdir, f"{i:02d}_{safe}.{fmt}")
      k.save(path, **options)
      paths.append(path)
    return paths


class KernelExplanation:
  """One kernel run: grid, operands' access maps, scratch, summary, picture.

  ``operands``: an ``OperandAccess`` per input and output (scalar-prefetch
  operands are listed in ``scalar_prefetch`` only); ``step_points``: the grid
  point of each step (row-major, last axis fastest); ``ran``: which steps
  ran; ``step_accesses``: elements the body read or wrote per step (all
  operands and scratch)."""

  def __init__(self, rec: RunRecorder):
    plan = rec.plan
    self.name = plan.name
    self.grid = rec.grid
    self.num_steps = rec.num_steps
    self.ran = rec.ran
    self.dimension_semantics = _semantics(plan.compiler_params)
    names = tuple(getattr(plan.kernel_jaxpr.debug_info, "arg_names", None) or ())
    names = [n if n and n.isidentifier() else None for n in names]
    names += [None] * (plan.num_index + len(plan.blocks) + len(plan.scratch_avals))
    self.scalar_prefetch = [names[i] or f"prefetch[{i}]" for i in range(plan.num_index)]
    self.operands = [OperandAccess(plan, b, rec, rec.buffers[b], names[plan.num_index + b])
                     for b in range(len(plan.blocks))]
    self.inputs = [o for o in self.operands if not o.is_output]
    self.outputs = [o for o in self.operands if o.is_output]
    first_scratch = plan.num_index + len(plan.blocks)
    self.scratch = [(names[first_scratch + i], tuple(a.shape), str(a.dtype))
                    for i, a in enumerate(plan.scratch_avals)]
    steps = np.arange(self.num_steps)
    self.step_points = (np.stack(np.unravel_index(steps, self.grid), axis=1)
                        if self.grid else np.zeros((1, 0), np.int64))
    total = np.zeros(self.num_steps, np.int64)
    if rec.reads is not None:
      total = rec.reads.sum(axis=1) + rec.writes.sum(axis=1)
    self.step_accesses = total

  # -- summary ------------------------------------------------------------------
  def accumulators(self) -> list[tuple[OperandAccess, tuple[int, ...]]]:
    """Outputs whose block stays put across consecutive steps, with the
    grid axes along which it does."""
    found = []
    for o in self.outputs:
      if o.unblocked:
        continue
      axes, _ = o.revisits(self.grid)
      if axes:
        found.append((o, axes))
    return found

  def skipped_steps(self) -> int:
    """Steps whose body touched no operand or scratch (``pl.when`` skips)."""
    return int(np.sum(self.ran & (self.step_accesses == 0)))

  def summary(self) -> str:
    sem = (f"dimension_semantics {self.dimension_semantics}" if self.dimension_semantics
           else "no dimension_semantics (all arbitrary)")
    steps = f"{self.num_steps} grid step{'s' * (self.num_steps != 1)}"
    lines = [f"kernel '{self.name}': grid {self.grid} = {steps} (last axis fastest), {sem}"]
    if self.scalar_prefetch:
      lines.append(f"  scalar prefetch: {', '.join(self.scalar_prefetch)}")
    width = max(len(o.label) for o in self.operands) if self.operands else 0
    for o in self.operands:
      lines.append(f"  {'out' if o.is_output else 'in ':3s} {o.label:<{width}s}  "
                   f"{o.dtype.name}{list(o.shape)}  {_describe_blocks(o)}")
    for o in self.operands:
      parts = o.partial_dims()
      if parts:
        pad = int(o.padding.sum())
        lines.append(f"  partial edge blocks: {o.label} {'; '.join(parts)} "
                     f"({pad} padding element{'s' * (pad != 1)})")
    if self.scratch:
      lines.append("  scratch: " + ", ".join(
          f"{n or f'scratch[{i}]'} {dt}{list(sh)}" for i, (n, sh, dt) in enumerate(self.scratch)))
    blocked = [o for o in self.operands if not o.unblocked]
    if blocked:
      per_in = sum(o.block_bytes for o in blocked if not o.is_output)
      per_out = sum(o.block_bytes for o in blocked if o.is_output)
      ran = max(int(self.ran.sum()), 1)
      moved = sum(o.copies * o.block_bytes for o in blocked) / ran
      lines.append(f"  bytes per grid step: blocks {fmt_bytes(per_in + per_out)} "
                   f"(in {fmt_bytes(per_in)}, out {fmt_bytes(per_out)}); "
                   f"{fmt_bytes(moved)} copied per step on average (a block kept by "
                   "consecutive steps is copied once)")
    for o in self.operands:
      if o.unblocked:
        r, w = int(o.read.sum()), int(o.written.sum())
        lines.append(f"  manual accesses: {o.label} (whole array, memory_space="
                     f"{o.memory_space}): {r} of {o.read.size} elements read, {w} written, "
                     f"in {int((o.step_reads + o.step_writes > 0).sum())} steps")
    accs = self.accumulators()
    if accs:
      for o, axes in accs:
        lines.append(f"  accumulator: {o.label} keeps its block across consecutive steps "
                     f"along grid axis {axes[0] if len(axes) == 1 else list(axes)}")
    else:
      lines.append("  accumulators: none (no output block is revisited)")
    for o in self.outputs:
      _, split = o.revisits(self.grid)
      if split and not o.unblocked:
        lines.append(f"  WARNING: {o.label}: {split} block(s) revisited after the grid "
                     "moved to another block (on TPU the later visit starts from an "
                     "uninitialised VMEM block and overwrites the earlier result)")
      missing = int((~o.written).sum())
      if missing:
        lines.append(f"  WARNING: {o.label}: {missing} of {o.written.size} elements never "
                     f"written{_bbox(~o.written)}"
                     + (f" (keep the aliased input's values)" if o.aliased_input is not None
                        else ""))
    skipped = self.skipped_steps()
    if skipped:
      lines.append(f"  skipped steps: {skipped} of {int(self.ran.sum())} steps touched no "
                   "ref (e.g. pl.when)")
    return "\n".join(lines)

  __str__ = summary

  def __repr__(self):
    return self.summary()

  # -- pictures -------------------------------------------------------------
  def figure(self, **options):
    """A matplotlib ``Figure`` (see ``pallas_np.explainer.render.figure``)."""
    from pallas_np.explainer import render  # imports matplotlib, an optional dependency
    return render.figure(self, **options)

  def save(self, path: str, **options) -> str:
    """Write the picture; the format follows the suffix (.png, .svg, .pdf)."""
    from pallas_np.explainer import render  # imports matplotlib, an optional dependency
    return render.save(self, path, **options)

  def _repr_png_(self):
    from pallas_np.explainer import render  # imports matplotlib, an optional dependency
    return render.to_bytes(self, "png")

  def _repr_svg_(self):
    from pallas_np.explainer import render  # imports matplotlib, an optional dependency
    return render.to_bytes(self, "svg").decode("utf-8")


def _describe_blocks(o: OperandAccess) -> str:
  if o.unblocked:
    return f"whole array every step (memory_space={o.memory_space})"
  shape = tuple("None" if b is None else b for b in o.block_shape)
  grid = "x".join(str(n) for n in o.block_grid)
  visited = o.block_visits
  return (f"block ({', '.join(map(str, shape))}){'' if len(shape) != 1 else ''}  "
          f"{grid} blocks  visits/block {int(visited.min())}..{int(visited.max())}"
          + (f"  aliased to input {o.aliased_input}" if o.aliased_input is not None else ""))


def _bbox(mask: np.ndarray) -> str:
  where = np.argwhere(mask)
  if not len(where):
    return ""
  lo, hi = where.min(axis=0), where.max(axis=0) + 1
  return " in [" + ", ".join(f"{a}:{b}" for a, b in zip(lo, hi)) + "]"


def _semantics(compiler_params) -> tuple[str, ...] | None:
  if isinstance(compiler_params, dict):  # older JAX: {"mosaic_tpu": params}
    compiler_params = compiler_params.get("mosaic_tpu") or compiler_params.get("mosaic")
  sem = getattr(compiler_params, "dimension_semantics", None)
  if not sem:
    return None
  return tuple(str(getattr(s, "value", getattr(s, "name", s))).lower() for s in sem)
