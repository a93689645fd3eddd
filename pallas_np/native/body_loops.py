"""Kernel bodies that hold loops (docs/native_bodies.md, "Bodies holding
loops").

A kernel body holding a ``while``/``scan`` is compiled whole by the body
tier (``bodies.py``), loop included: one native call per grid step rather
than the NumPy plan's eqns around a compiled loop's entry (JAX's TPU paged
attention: a grid step is a few scalar reads and stores, three block fills
and the loop over the sequence's pages). The kernel's NumPy plan still
holds the loop tier's ``NativeLoop`` of each such loop
(``control_flow/loops.py`` wraps it at plan compile time); left alone, it
would time itself while the body is timed and be built too: two builds of
the same loop. So while the body is in play its plan's loops are *held*:
they run their NumPy path untimed (the tier's ``waiting`` state, as while
a build is under way), and never build. Where the body ends without a
library (refused by the code generator, its build failed, dropped by the
probe) they are *released*: each starts afresh as the loop tier's loop.

Only bodies holding DMA/semaphore call sites (``dma_calls.PRIMITIVES``)
take their loops so far: a loop with call sites runs, per grid step, the
tier's general run and its call-site runner (no ``loop_step`` fast path),
which the body's step function replaces; a loop without them is entered
through ``loop_step`` (~2 us a run), where compiling the body around it
is not measured to pay yet, and the loop tier keeps it (and its lite
builds).
"""
from __future__ import annotations

import types

from pallas_np.compiler.plan import Plan
from pallas_np.native import dma_calls, tier

# Primitives of a loop (control_flow/loops.py wraps them in NativeLoop).
LOOPS = frozenset(("while", "scan"))
# How deep ``inner_loops`` looks through a plan's globals and closures (a
# loop inside a cond branch inside a call: a few levels).
_DEPTH = 8


def holds_loop(jaxpr) -> bool:
  """Whether ``jaxpr`` or a nested jaxpr holds a ``while`` or ``scan``."""
  return tier.holds(jaxpr, LOOPS)


def holds_call_site(jaxpr) -> bool:
  """Whether ``jaxpr`` (or a nested jaxpr) holds a DMA or semaphore call
  site (``dma_calls.PRIMITIVES``)."""
  return tier.holds(jaxpr, dma_calls.PRIMITIVES)


def takes_loops(jaxpr) -> bool:
  """Whether a body holding loops is compiled with them (see the module
  doc): where it holds DMA/semaphore call sites."""
  return holds_call_site(jaxpr)


def inner_loops(plan) -> list:
  """The loop tier's ``NativeLoop`` objects a kernel's NumPy plan calls:
  the loop entries (``NativeLoop.entry``: a function with ``native_tier``)
  found in the plan's globals, and, through them, in its sub-plans (cond
  branches, calls) and the closures of its rules."""
  found, seen = [], set()

  def visit(obj, depth):
    if depth > _DEPTH or id(obj) in seen:
      return
    seen.add(id(obj))
    loop = getattr(obj, "native_tier", None) if isinstance(obj, types.FunctionType) else None
    if isinstance(loop, tier.NativeLoop):
      found.append(loop)
      return
    if isinstance(obj, Plan):
      visit(obj.fn, depth + 1)
      for v in obj._text[4].values():  # noqa: SLF001 - the generated function's globals
        visit(v, depth + 1)
    elif isinstance(obj, types.FunctionType):
      for cell in obj.__closure__ or ():
        try:
          visit(cell.cell_contents, depth + 1)
        except ValueError:  # (an empty cell)
          pass
    elif isinstance(obj, (list, tuple)):
      for v in obj:
        visit(v, depth + 1)
  visit(plan, 0)
  return found


def hold(loops) -> None:
  """The loops run their NumPy path, untimed, and never build (the tier's
  ``waiting`` state) while the body that holds them is in play."""
  for loop in loops:
    loop.timing = False
    loop.waiting = True


def release(loops) -> None:
  """The loops back in the loop tier's hands (their state recomputed from
  their phase, as the tier sets it: a held loop never ran its tier)."""
  for loop in loops:
    loop.phase = loop.phase  # (the setter sets ``timing`` and ``waiting``)
