"""Threads, vector clocks, happens-before and shadow memory: the library
every race detector uses (mesh kernels' programs, ``pallas_np.meshes.programs``; Mosaic
GPU warpgroups and their asynchronous agents,
``pallas_np.mosaic_gpu.race_clocks``; devices of a multi-device run,
``pallas_np.device_races``).

A *thread* is anything that runs in order: a program, a warpgroup, a TMA
unit, a device. Each has a vector clock: entry ``u`` is how far thread ``u``
had got when this thread last learnt of it; a thread's own entry is its
step, and grows at every release. Happens-before edges:

* ``release(t, key)``: thread ``t`` signals the sync object ``key`` (a
  semaphore, a barrier phase, a copy's completion token): its clock joins the
  object's, then ``t`` steps on;
* ``acquire(t, key)``: a wait on ``key`` returned: ``t``'s clock joins the
  object's;
* ``join(t, u)``: ``t`` continues after everything ``u`` did so far (a
  warpgroup issuing an asynchronous copy: the TMA unit starts after it).

An access recorded as ``(writer, step)`` (``writer``'s step at the access)
happens before thread ``t``'s current point iff ``step <= knows(t, writer)``
(``ordered``). A clock space covers threads ``base .. base + n - 1``: a
detector may keep one space per unit that never synchronises with the
others (a Mosaic GPU cluster of a kernel without semaphores), and threads
outside the space are never ordered with it (``knows`` is 0 for them; steps
start at 1).

Shadow memory (``Shadow``): per element of a buffer, the last writer and its
step; ``accessed_elements`` maps an access (any view, index and mask) to the
element numbers of its buffer.

This is the model of JAX's own TPU and GPU interpreters
(``jax/_src/pallas/mosaic/interpret/vector_clock.py``), one array row per
thread so the checks of many elements are NumPy operations.
"""
from __future__ import annotations

import threading

import numpy as np


class VectorClocks:
  """The vector clocks of ``n`` threads (ids ``base ...``) and the clocks
  released onto sync objects. ``lock`` guards them when threads run at once."""

  def __init__(self, n: int, base: int = 0):
    self.lock = threading.Lock()
    self.base = base
    self.program = np.zeros((n, n), np.int64)  # row t: thread base+t's clock
    np.fill_diagonal(self.program, 1)
    self.semaphore: dict = {}  # sync object key -> the clock released onto it
    self.detectors: list = []  # detectors sharing this space (for their caches)

  def __len__(self) -> int:
    return self.program.shape[0]

  def row(self, thread: int) -> int:
    """``thread``'s row (a global thread id in this space)."""
    return thread - self.base

  def step(self, row: int) -> int:
    """The own entry of the thread at ``row``: its current step."""
    return int(self.program[row, row])

  def release(self, row: int, key) -> int:
    """The thread at ``row`` signals ``key``; returns its next step."""
    with self.lock:
      mine = self.program[row]
      old = self.semaphore.get(key)
      self.semaphore[key] = mine.copy() if old is None else np.maximum(old, mine)
      mine[row] += 1
      return int(mine[row])

  def acquire(self, row: int, key):
    """The thread at ``row`` observed ``key`` (its wait returned)."""
    with self.lock:
      sem = self.semaphore.get(key)
      if sem is not None:
        np.maximum(self.program[row], sem, out=self.program[row])

  def join(self, row: int, other: int):
    """The thread at ``row`` continues after the one at ``other``."""
    with self.lock:
      np.maximum(self.program[row], self.program[other], out=self.program[row])

  def tick(self, row: int) -> int:
    self.program[row, row] += 1
    return int(self.program[row, row])

  def knows(self, row: int, threads: np.ndarray) -> np.ndarray:
    """What the thread at ``row`` knows of each global thread id in
    ``threads``: its clock entries, 0 for ids outside this space."""
    mine = self.program[row]
    local = np.asarray(threads) - self.base
    inside = (local >= 0) & (local < mine.size)
    return np.where(inside, mine[np.clip(local, 0, mine.size - 1)], 0)


  def unordered_in_units(self, row: int, unit, local, per_unit: int, steps) -> np.ndarray:
    """Per access of thread ``unit * per_unit + local`` at ``steps``: is it
    *not* ordered before the thread at ``row``? (Threads grouped in units of
    ``per_unit``: a cluster's agents; ``local`` may broadcast against
    ``unit``.) The ids are never built, so the check of many elements stays
    a few NumPy passes."""
    mine = self.program[row]
    first, count = self.base // per_unit, mine.size // per_unit
    if count == 1:  # a space of one unit: other units are never ordered
      return (unit != first) | (steps > mine[local])
    u = unit - first
    inside = (u >= 0) & (u < count)
    known = np.where(inside, mine[np.clip(u, 0, count - 1) * per_unit + local], 0)
    return ~ordered(steps, known)


def ordered(steps: np.ndarray, known: np.ndarray) -> np.ndarray:
  """Per access: does an access at ``steps`` happen before a thread that
  knows ``known`` of its thread?"""
  return steps <= known


# -- shadow memory ---------------------------------------------------------------------
class Shadow:
  """The shadow of one buffer: per element, the thread that last wrote it
  (``group``: a parallel group of a grid, a program, a Mosaic GPU agent) and
  that thread's step then (``step``); both -1 until written, allocated at the
  first write (``ensure``). ``scratch``: private to a core on hardware."""
  __slots__ = ("name", "start", "end", "itemsize", "shape", "size", "step",
               "group", "scratch", "written")

  def __init__(self, name, arr: np.ndarray, scratch: bool):
    self.name = name
    self.start = arr.__array_interface__["data"][0]
    self.end = self.start + arr.nbytes
    self.itemsize = arr.itemsize
    self.shape = arr.shape
    self.size = arr.size
    self.step = self.group = None  # allocated at the first write
    self.scratch = scratch
    self.written = False

  def ensure(self):
    if not self.written:
      self.written = True
      self.step = np.full(self.size, -1, np.int32)   # last writer's grid step
      self.group = np.full(self.size, -1, np.int32)  # last writer's parallel group


def byte_offsets(view: np.ndarray) -> np.ndarray:
  """Byte offset of each element of ``view`` from its first element."""
  off = np.zeros((), np.int64)
  for d, (n, s) in enumerate(zip(view.shape, view.strides)):
    shape = [1] * view.ndim
    shape[d] = n
    off = off + (np.arange(n, dtype=np.int64) * s).reshape(shape)
  return np.broadcast_to(off, view.shape)


def accessed_elements(view, index, mask, ptr: int, start: int, itemsize: int) -> np.ndarray:
  """Element numbers (``itemsize`` units from ``start``) of the elements an
  access ``view[index]`` (where ``mask``) touches; ``ptr`` is ``view``'s
  address. Works for any view: strided, bitcast, broadcast."""
  offsets = byte_offsets(view)
  if index is not Ellipsis:
    offsets = offsets[index]
  offsets = np.asarray(offsets)
  if mask is not None:
    offsets = offsets[np.broadcast_to(np.asarray(mask, bool), offsets.shape)]
  return ((ptr - start) + offsets.ravel()) // itemsize
