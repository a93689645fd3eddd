"""A bounded cache, least recently used entry evicted first.

Every cache of compiled things (kernel plans, eager plans, eager-jit routes,
``pallas_np.jit`` closures, code objects) is one of these, so memory stays
bounded however many distinct kernels a program compiles, and
``clear_all()`` (``pallas_np.clear_caches()``) empties them all.
"""
from __future__ import annotations

import collections
import threading
import weakref

_all: weakref.WeakSet = weakref.WeakSet()  # every LRU and Slot made, for clear_all
_MISSING = object()


class LRU:
  """``get``/``put``/``setdefault``/``clear``/``len`` over at most
  ``maxsize`` entries; thread-safe."""
  __slots__ = ("maxsize", "_data", "_lock", "__weakref__")

  def __init__(self, maxsize: int):
    self.maxsize = maxsize
    self._data: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()
    _all.add(self)

  def get(self, key, default=None):
    """The value of ``key`` (now the most recently used), else ``default``."""
    with self._lock:
      value = self._data.get(key, _MISSING)
      if value is _MISSING:
        return default
      self._data.move_to_end(key)
      return value

  def peek(self, key, default=None):
    """The value of ``key`` without marking it used: no lock, for the
    per-call fast paths (a dict read is atomic; eviction then follows
    insertion order for entries only ever peeked)."""
    return self._data.get(key, default)

  def put(self, key, value) -> None:
    """Set ``key`` (most recently used), evicting the least recently used
    entries beyond ``maxsize``."""
    with self._lock:
      self._data[key] = value
      self._data.move_to_end(key)
      self._evict()

  def setdefault(self, key, value):
    """The value of ``key`` if there is one, else ``value``, now stored."""
    with self._lock:
      found = self._data.get(key, _MISSING)
      if found is not _MISSING:
        self._data.move_to_end(key)
        return found
      self._data[key] = value
      self._evict()
      return value

  def _evict(self):
    data = self._data
    while len(data) > self.maxsize:
      data.popitem(last=False)

  def values(self) -> list:
    """The values, least recently used first (a snapshot)."""
    with self._lock:
      return list(self._data.values())

  def clear(self) -> None:
    with self._lock:
      self._data.clear()

  def __len__(self) -> int:
    return len(self._data)

  def __contains__(self, key) -> bool:
    return key in self._data


class Slot:
  """One remembered value (``value``, None when empty) that ``clear_all``
  empties with the caches: a per-call fast path's last hit, read as a
  plain attribute (no call)."""
  __slots__ = ("value", "__weakref__")

  def __init__(self):
    self.value = None
    _all.add(self)

  def clear(self) -> None:
    self.value = None


def clear_all() -> None:
  """Empty every LRU (and every ``Slot``)."""
  for cache in list(_all):
    cache.clear()
