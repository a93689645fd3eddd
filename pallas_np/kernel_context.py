"""The typed parts of a run context (``compiler.RunContext``), replacing
string-keyed state: what a kernel family hands the rules of each of its
threads (``ThreadContext``, ``RunContext.family``) and what stateful rules
keep for one run (``RuleState``, ``RunContext.rules``).

A leaf module: rules read these fields by name without importing the family
that set them (``state/refs.py`` reads a Mosaic GPU thread's scopes,
``primitives/tpu.py`` its mesh coordinates), so the import graph stays one
way (families above rules).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(slots=True)
class ThreadContext:
  """One thread of a kernel family's instance (today: a warpgroup, or a warp
  of a ``plgpu.warp_map``, of a Mosaic GPU block), as its rules see it.
  Set by the family's launcher (``mosaic_gpu.device_blocks.Launch.context``);
  None on ``RunContext.family`` for grid kernels (``pallas_call``) and TPU
  mesh programs, whose place is ``program_ids`` and ``RunContext.device``."""
  # ``lax.axis_index`` of the kernel's mesh axes (blocks, clusters,
  # warpgroups, warps): axis name -> np.int32 coordinate; and their sizes.
  mesh_axes: dict = dataclasses.field(default_factory=dict)
  mesh_sizes: dict = dataclasses.field(default_factory=dict)
  mesh: Any = None  # the plgpu.Mesh (special registers of inline_mgpu bodies)
  block: Any = None  # the block's mosaic_gpu.threads.BlockState
  thread: int = 0  # the warpgroup id within its block
  slot: int | None = None  # the thread's slot in its cluster (warpgroups, then their warps)
  task: Any = None  # the thread's mosaic_gpu.threads.Task on the scheduler
  # err, warp=None -> the error wrapped with the thread's place (KernelError)
  wrap_error: Callable | None = None
  # slot -> the thread's race detector; None without detect_races
  make_detector: Callable | None = None
  # ctx, eqn, fresh -> buffers of a collective run_scoped (shared by the
  # block's warpgroups); of a private one in a cluster (peers reach it)
  shared_scope: Callable | None = None
  private_scope: Callable | None = None

  def for_warp(self, axis, warp: int, slot: int, task) -> ThreadContext:
    """The context of warp ``warp`` of this warpgroup's ``warp_map``."""
    return dataclasses.replace(self, mesh_axes={**self.mesh_axes, axis: warp}, slot=slot,
                               task=task)


@dataclasses.dataclass(slots=True)
class RuleState:
  """What stateful rules keep for one run of a kernel body (one grid loop,
  one mesh program, one thread): created on first use (``rule_state``),
  shared by the sub-contexts of lane groups."""
  dma: Any = None  # state.dma.DmaState: DMAs in flight, queued DMA tasks
  mxu: Any = None  # primitives.mxu.MxuState: the MXUs' staging and result buffers
  prng: Any = None  # the np.random.Generator pltpu.prng_seed seeded
  gpu_block: Any = None  # the BlockState of a pallas_call with Mosaic GPU params


def rule_state(ctx) -> RuleState:
  """``ctx.rules``, created on first use."""
  st = ctx.rules
  if st is None:
    st = ctx.rules = RuleState()
  return st
