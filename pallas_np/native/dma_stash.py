"""The compiled DMA queue between calls of compiled loops (docs/native_dma.md).

Library kernels start the next block's copies in one call of their loop
and wait for them in the next call (the next grid point). The compiled
queue (``dma_queue``) therefore outlives a loop call: its rows stay in a
``Stash`` (an int64 array the compiled code reads by address, plus the
operands of each loop call that started a row, kept alive: a row's byte
addresses point into them, as a NumPy-path ``Dma`` holds views of them).
The next compiled loop call continues with the same rows.

While no loop runs, the stash hangs on the run's ``DmaState.native``, and
anything on the NumPy path that reads or changes the DMA queues (a start,
a wait, the kernel's end: ``state.dma.settle``) first *flushes* it: each
row is started on the NumPy path by its own site's rule with its recorded
operands, in start order, so the NumPy queue is then exactly what it
would have been had every DMA gone through it.
"""
from __future__ import annotations

import numpy as np

from pallas_np.native import dma_queue


class Stash:
  """The rows of DMAs compiled loops started and nobody waited for yet."""
  __slots__ = ("q", "qaddr", "owners", "order", "bind")

  def __init__(self, bind):
    self.bind = bind  # bind(site, params): the site's rule on its operands (dma_calls._bind)
    self.q = np.zeros((dma_queue.CAPACITY + 1, dma_queue.WIDTH), np.int64)
    self.qaddr = self.q.ctypes.data  # (read once: ``ndarray.ctypes`` costs ~3 us a call)
    # (sites, InterpretParams, operands) of each loop call that may own rows
    self.owners: list = []
    self.order: dict = {}  # id -> (Dma, start order) of the DMAs flushed to the NumPy path

  def own(self, sites, params, args, grid_point) -> int:
    """A loop call's number: its sites, parameters, operands and grid point."""
    self.owners.append((sites, params, args, grid_point))
    return len(self.owners) - 1

  def live(self) -> bool:
    return bool(self.q[0, 0] < self.q[0, 1])

  def settled(self) -> None:
    """After a loop call: forget the operands where no row is left."""
    if not self.live():
      self.owners.clear()
      self.order.clear()
      self.q[0, 0] = self.q[0, 1] = 0

  def started(self, ctx, order: int, before: int, grid_point) -> None:
    """The DMA a start site just queued on the NumPy path takes its place
    in start order (``DmaState.dmas``, which a kernel's end completes in
    order): a row flushed late is older than DMAs flushed before it; it
    was started at the grid point of its loop call (its error names it)."""
    dmas = ctx.rules.dma.dmas
    if len(dmas) <= before:
      return  # (nothing queued: a copy of size 0)
    new = dmas[-1]
    new.grid_point = grid_point
    self.order[id(new)] = (new, order)
    j = len(dmas) - 1
    while j > 0:
      prev = self.order.get(id(dmas[j - 1]))
      if prev is None or prev[0] is not dmas[j - 1] or prev[1] < order:
        break
      j -= 1
    if j < len(dmas) - 1:
      dmas.insert(j, dmas.pop())

  def flush(self, ctx) -> None:
    """Start every row on the NumPy path, in start order."""
    q = self.q
    st = np.zeros(dma_queue.OPERANDS + dma_queue.blas_calls.PYCALL_OPERANDS, np.int64)
    for r in range(int(q[0, 0]), int(q[0, 1])):
      row = q[r + 1]
      if row[dma_queue.SITE] < 0:
        continue
      sites, params, args, point = self.owners[int(row[dma_queue.OWN])]
      site = sites[int(row[dma_queue.SITE])]
      if site.call is None:
        site.call = self.bind(site, params)
      st[dma_queue.OPERANDS:] = row[dma_queue.SCALARS:]
      row[dma_queue.SITE] = -1
      before = len(ctx.rules.dma.dmas)
      site.call(ctx, st, args)
      self.started(ctx, int(row[dma_queue.SEQ]), before, point)
    q[0, 0] = q[0, 1]
    self.settled()
