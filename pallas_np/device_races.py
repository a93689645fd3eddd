"""Races between devices: ``detect_races=True`` on a multi-device kernel.

Two devices that write the same element of one device's buffer with remote
DMAs race unless a chain of semaphore signals and waits orders the two
writes (on a TPU the DMAs land in any order). We keep happens-before with
vector clocks, as TPU interpret mode does (``mosaic/interpret/``):

* every device has a vector clock; a remote write or a remote signal ticks
  the sender's own entry;
* a signal (a remote ``semaphore_signal``, a remote DMA counting the peer's
  receive semaphore and its own send semaphore) joins the sender's clock
  into the semaphore's clock;
* a satisfied wait joins the semaphore's clock into the waiter's clock;
* each element written remotely remembers its writer and the writer's clock
  entry at that time; a later remote write to it by another device whose
  clock has not seen that entry is a race.

State lives in the session (``Session.races``), under the session lock; all
of it is dropped with the session. Checked: remote writes against remote
writes. Not checked: a device's own (local) reads and writes against remote
writes into its buffers (docs/tpu.md, limits).
"""
from __future__ import annotations

import numpy as np

from pallas_np.errors import RaceError


class _Write:
  __slots__ = ("device", "clock", "source", "grid_point")

  def __init__(self, device, clock, source, grid_point):
    self.device, self.clock, self.source, self.grid_point = device, clock, source, grid_point


class DeviceRaces:
  """Vector clocks and per-element last remote writers of one session."""

  def __init__(self, n: int, kernel: str):
    self.kernel = kernel
    self.clocks = np.zeros((n, n), np.int64)
    self.sem_clocks: dict[int, np.ndarray] = {}
    # id(buffer) -> (last remote write per element, element numbers, buffer)
    self.shadows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    self.writes: list[_Write] = []

  def tick(self, dev: int) -> int:
    self.clocks[dev, dev] += 1
    return int(self.clocks[dev, dev])

  def signal(self, dev: int, sem_address: int):
    """``dev`` signals the semaphore at ``sem_address``."""
    self.tick(dev)
    clock = self.sem_clocks.get(sem_address)
    if clock is None:
      self.sem_clocks[sem_address] = self.clocks[dev].copy()
    else:
      np.maximum(clock, self.clocks[dev], out=clock)

  def waited(self, dev: int, sem_address: int):
    """``dev``'s wait on the semaphore at ``sem_address`` was satisfied."""
    clock = self.sem_clocks.get(sem_address)
    if clock is not None:
      np.maximum(self.clocks[dev], clock, out=self.clocks[dev])

  def remote_write(self, dev: int, buffer: np.ndarray, index, *, owner: str, name: str,
                   source: str, grid_point):
    """``dev`` writes ``buffer[index]`` (``buffer``: another device's array)
    with a remote DMA; raises ``RaceError`` on an unordered earlier remote
    write by another device to one of its elements."""
    entry = self.shadows.get(id(buffer))
    if entry is None or entry[2] is not buffer:
      entry = self.shadows[id(buffer)] = (np.full(buffer.size, -1, np.int32),
                                          np.arange(buffer.size).reshape(buffer.shape), buffer)
    record, numbers, _ = entry
    elems = np.ravel(numbers[index])
    if elems.size == 0:
      return
    clock = self.tick(dev)
    seen = record[elems]
    mine = self.clocks[dev]
    for k in np.unique(seen[seen >= 0]):
      w = self.writes[int(k)]
      if w.device != dev and mine[w.device] < w.clock:
        at = int(elems[int(np.argmax(seen == k))])
        where = tuple(int(i) for i in np.unravel_index(at, buffer.shape))
        raise RaceError(
            f"data race across devices in kernel '{self.kernel}': device {dev} writes "
            f"element {where} of {name} on {owner} with a remote DMA at {source} (grid point "
            f"{tuple(int(p) for p in grid_point)}), which device {w.device} wrote with a "
            f"remote DMA at {w.source} (grid point {w.grid_point}); no semaphore wait "
            "orders the two writes, so on a TPU either may land last",
            buffer=name, grid_points=(w.grid_point, tuple(int(p) for p in grid_point)),
            element=where)
    self.writes.append(_Write(dev, clock, source, tuple(int(p) for p in grid_point)))
    record[elems] = len(self.writes) - 1
