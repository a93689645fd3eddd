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
library (refused by the code generator, its build failed) they are
*released*: each starts afresh as the loop tier's loop.

A body takes its loops where they hold DMA/semaphore call sites
(``dma_calls.PRIMITIVES``) or where every loop in it is unrolled by its
author (a ``scan`` whose ``unroll`` covers its ``length``:
``pl.loop(..., unroll=True)``, ``fori_loop(..., unroll=True)``):

* a loop with call sites runs, per grid step, the tier's general run and
  its call-site runner (no ``loop_step`` fast path);
* an unrolled loop is straight-line code on the hardware, not a hot loop:
  per grid step it is a few trips, and the plan's eqns, conds and casts
  around its ``loop_step`` entry cost the step as much Python as its trips
  cost machine code (JAX's TPU flash and splash attention: a one-trip
  ``pl.loop`` inside a ``pl.when`` beside two more);

the body's step function replaces both. Any other loop (a ``while``, a
rolled ``scan``) keeps the loop tier and its lite build: priced by the
caller's seconds in its kernel's runs, which a body's sampled steps do not
count (a Collatz body built that way came due after the first 1.5 s of
calls its loop's build lands in: PERF_LOG 162). A body holding loops is
kept without the probe (``bodies.BodyPlan._swapped``): the probe would
time it against its NumPy plan with the loops held on the NumPy path, not
against the loop tier's compiled loops, so it could only cost the caller
its NumPy steps.
"""
from __future__ import annotations

import types

from pallas_np import _compat as jc
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


def unrolled(jaxpr) -> bool:
  """Whether every loop of ``jaxpr`` (nested ones too) is a ``scan`` its
  author unrolled (``unroll`` at least its ``length``)."""
  for e in jaxpr.eqns:
    name = e.primitive.name
    if name == "while":
      return False
    if name == "scan":
      # (read as features, not assumed: a scan without either param counts as rolled,
      # and the loop tier keeps it; a bool ``unroll`` is JAX's ``True``: every trip)
      unroll, length = e.params.get("unroll"), e.params.get("length")
      if isinstance(unroll, bool) and length is not None:
        unroll = length if unroll else 1
      if not isinstance(unroll, int) or not isinstance(length, int) or unroll < length:
        return False
    if not all(unrolled(sub) for sub in jc.eqn_subjaxprs(e)):
      return False
  return True


def takes_loops(jaxpr) -> bool:
  """Whether a body holding loops is compiled with them (see the module
  doc): where it holds DMA/semaphore call sites, or its loops are all
  unrolled."""
  return holds_call_site(jaxpr) or unrolled(jaxpr)


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
