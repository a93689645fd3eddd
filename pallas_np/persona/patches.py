"""Attribute patches that are undone exactly: the persona changes nothing
it does not put back when it is left."""
from __future__ import annotations

_MISSING = object()


class PatchSet:
  """Attributes set on modules and classes, restored in reverse order.

  The previous value is read from the object's own ``__dict__`` (not
  inherited lookups), so an attribute a class only inherited is deleted
  again rather than copied down onto it."""

  def __init__(self):
    self._undo: list[tuple[object, str, object]] = []

  def set(self, obj, name: str, value) -> None:
    old = vars(obj).get(name, _MISSING)
    setattr(obj, name, value)
    self._undo.append((obj, name, old))

  def wrap(self, obj, name: str, make) -> None:
    """Replace ``obj.name`` by ``make(original)`` (where it exists)."""
    original = getattr(obj, name, None)
    if original is not None:
      self.set(obj, name, make(original))

  def undo(self) -> None:
    while self._undo:
      obj, name, old = self._undo.pop()
      if old is _MISSING:
        try:
          delattr(obj, name)
        except AttributeError:
          pass
      else:
        setattr(obj, name, old)

  def __len__(self) -> int:
    return len(self._undo)
