"""Races between devices: ``detect_races=True`` on a multi-device kernel.

Two devices that write the same element of one device's buffer with remote
DMAs race unless a chain of semaphore signals and waits orders the two
writes (on a TPU the DMAs land in any order). We keep happens-before with
vector clocks, as TPU interpret mode does (``mosaic/interpret/``):

* every device is a thread of the clock library (``pallas_np.clocks``) with
  a vector clock; a remote write ticks the sender's own entry;
* a signal (a remote ``semaphore_signal``, a remote DMA counting the peer's
  receive semaphore and its own send semaphore) releases the sender's clock
  onto the semaphore;
* a satisfied wait acquires the semaphore's clock;
* each element written remotely remembers its writer and the writer's clock
  entry at that time; a later remote write to it by another device, or a
  read or write by its owner, whose clock has not seen that entry is a race
  (e.g. reading a receive buffer before waiting on its semaphore);
* each element of a remotely addressable buffer remembers its owner's clock
  at the owner's last access (ref loads/stores, local DMAs, the source of
  its remote DMAs; a tick each); a remote write by a device whose clock has
  not seen it is a race (e.g. a ring that overwrites a neighbour's buffer
  without waiting for its "ready to receive" signal).

State lives in the session (``Session.races``), under the session lock; all
of it is dropped with the session. Masked accesses (``pl.load/store`` with
``mask=``) are not checked against remote writes.
"""
from __future__ import annotations

import numpy as np

from pallas_np.clocks import VectorClocks, byte_offsets, ordered
from pallas_np.errors import RaceError


class _Write:
  __slots__ = ("device", "clock", "source", "grid_point")

  def __init__(self, device, clock, source, grid_point):
    self.device, self.clock, self.source, self.grid_point = device, clock, source, grid_point


class _Shadow:
  __slots__ = ("buffer", "record", "owner_clock", "numbers")

  def __init__(self, buffer: np.ndarray):
    self.buffer = buffer
    self.record = np.full(buffer.size, -1, np.int32)  # last remote write (index in writes)
    self.owner_clock = np.zeros(buffer.size, np.int64)  # owner's clock at its last access
    self.numbers = np.arange(buffer.size).reshape(buffer.shape)


def elements_of_view(buffer: np.ndarray, view: np.ndarray, index) -> np.ndarray | None:
  """Flat element numbers of ``buffer`` that ``view[index]`` touches (``view``
  a view into ``buffer``); None when ``view`` is not inside ``buffer``."""
  base = buffer.__array_interface__["data"][0]
  start = view.__array_interface__["data"][0] - base
  if not 0 <= start < max(buffer.nbytes, 1):
    return None
  offsets = byte_offsets(view)
  if index is not Ellipsis:
    offsets = offsets[index]
  return ((start + np.ravel(offsets)) // buffer.itemsize).astype(np.int64)


class DeviceRaces:
  """Vector clocks and per-element last remote writers of one session."""

  def __init__(self, n: int, kernel: str):
    self.kernel = kernel
    self.clocks = VectorClocks(n)  # the devices' clocks; semaphores are sync objects
    # id(buffer) -> _Shadow
    self.shadows: dict[int, _Shadow] = {}
    self.writes: list[_Write] = []

  def tick(self, dev: int) -> int:
    return self.clocks.tick(dev)

  def signal(self, dev: int, sem_address: int):
    """``dev`` signals the semaphore at ``sem_address``."""
    self.clocks.release(dev, sem_address)

  def waited(self, dev: int, sem_address: int):
    """``dev``'s wait on the semaphore at ``sem_address`` was satisfied."""
    self.clocks.acquire(dev, sem_address)

  def _knows(self, dev: int, writer: int, step: int) -> bool:
    """Has ``dev`` learnt of ``writer``'s access at ``step``?"""
    return bool(ordered(step, self.clocks.program[dev, writer]))

  def _shadow(self, buffer: np.ndarray) -> _Shadow:
    entry = self.shadows.get(id(buffer))
    if entry is None or entry.buffer is not buffer:
      entry = self.shadows[id(buffer)] = _Shadow(buffer)
    return entry

  def remote_write(self, dev: int, owner_dev: int, buffer: np.ndarray, index, *, owner: str,
                   name: str, source: str, grid_point):
    """``dev`` writes ``buffer[index]`` (``buffer``: device ``owner_dev``'s
    array) with a remote DMA; raises ``RaceError`` if an earlier remote write
    by another device or the owner's last access to one of its elements is
    not ordered before it."""
    shadow = self._shadow(buffer)
    elems = np.ravel(shadow.numbers[index])
    if elems.size == 0:
      return
    clock = self.tick(dev)
    point = tuple(int(p) for p in grid_point)
    seen = shadow.record[elems]
    for k in np.unique(seen[seen >= 0]):
      w = self.writes[int(k)]
      if w.device != dev and not self._knows(dev, w.device, w.clock):
        where = self._where(buffer, elems[int(np.argmax(seen == k))])
        raise RaceError(
            f"data race across devices in kernel '{self.kernel}': device {dev} writes "
            f"element {where} of {name} on {owner} with a remote DMA at {source} (grid point "
            f"{point}), which device {w.device} wrote with a remote DMA at {w.source} (grid "
            f"point {w.grid_point}); no semaphore wait orders the two writes, so on a TPU "
            "either may land last",
            buffer=name, grid_points=(w.grid_point, point), element=where)
    if owner_dev != dev:
      unseen = ~ordered(shadow.owner_clock[elems], self.clocks.program[dev, owner_dev])
      if unseen.any():
        where = self._where(buffer, elems[int(np.argmax(unseen))])
        raise RaceError(
            f"data race across devices in kernel '{self.kernel}': device {dev} writes "
            f"element {where} of {name} on {owner} with a remote DMA at {source} (grid point "
            f"{point}), but {owner} used that element (read or wrote it) after the last "
            f"semaphore signal device {dev} waited for: the write may land while {owner} "
            "still uses the old value (a missing \"ready to receive\" handshake?)",
            buffer=name, grid_points=(None, point), element=where)
    self.writes.append(_Write(dev, clock, source, point))
    shadow.record[elems] = len(self.writes) - 1

  def local_access(self, dev: int, buffer: np.ndarray, elems: np.ndarray, kind: str, *,
                   name: str, grid_point):
    """``dev`` reads/writes elements ``elems`` of its own ``buffer``."""
    if elems.size == 0:
      return
    shadow = self._shadow(buffer)
    seen = shadow.record[elems]
    if (seen >= 0).any():
      for k in np.unique(seen[seen >= 0]):
        w = self.writes[int(k)]
        if w.device != dev and not self._knows(dev, w.device, w.clock):
          where = self._where(buffer, elems[int(np.argmax(seen == k))])
          verb = "reads" if kind == "read" else "writes"
          raise RaceError(
              f"data race across devices in kernel '{self.kernel}': device {dev} {verb} "
              f"element {where} of its {name} at grid point "
              f"{tuple(int(p) for p in grid_point)}, which device {w.device} wrote with a "
              f"remote DMA at {w.source} (grid point {w.grid_point}); no semaphore wait "
              "orders the two (wait on the DMA's receive semaphore first)",
              buffer=name, grid_points=(w.grid_point, tuple(int(p) for p in grid_point)),
              element=where)
    shadow.owner_clock[elems] = self.tick(dev)

  @staticmethod
  def _where(buffer, elem) -> tuple:
    return tuple(int(i) for i in np.unravel_index(int(elem), buffer.shape))
