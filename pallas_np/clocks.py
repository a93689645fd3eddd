"""Threads, vector clocks and happens-before: the clock library every race
detector uses (mesh kernels' programs, ``pallas_np.meshes.programs``; Mosaic
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


def ordered(steps: np.ndarray, known: np.ndarray) -> np.ndarray:
  """Per access: does an access at ``steps`` happen before a thread that
  knows ``known`` of its thread?"""
  return steps <= known
