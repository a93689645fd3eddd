"""Exceptions that point at the kernel, not at the interpreter."""
from __future__ import annotations

from pallas_np.env_switches import env_switch


class PallasNumpyError(Exception):
  """Base class of errors raised while interpreting a kernel."""


class KernelError(PallasNumpyError):
  """An exception raised inside a kernel, re-raised with where it happened.

  ``kernel``, ``program_ids``, ``primitive`` and ``source`` (file:line) say
  where; the original exception is chained as ``__cause__``. Raised as a
  subclass of the original exception type too, so ``except IndexError`` still
  catches an out-of-bounds access.
  """

  def __init__(self, message, *, kernel=None, program_ids=None,
               primitive=None, source=None, original=None):
    super().__init__(message)
    self.kernel = kernel
    self.program_ids = program_ids
    self.primitive = primitive
    self.source = source
    self.original = original


class UnsupportedError(PallasNumpyError, NotImplementedError):
  """A primitive or feature the NumPy interpreter does not implement."""


class FallbackError(PallasNumpyError, AssertionError):
  """A fast path (vectorized or threaded grid) failed where the sequential
  grid loop then succeeded: an interpreter bug the fallback would hide as a
  slowdown. Raised only with ``PALLAS_NP_STRICT_FALLBACKS=1`` (the test-suite
  sets it); otherwise the failure is kept for ``grid_report()``."""


def check_fallback(failure: BaseException | None, path: str, kernel: str) -> None:
  if failure is not None and env_switch("PALLAS_NP_STRICT_FALLBACKS", False):
    raise FallbackError(
        f"pallas_np: the {path} run of kernel '{kernel}' failed with "
        f"{type(failure).__name__}: {failure}; the sequential grid loop then "
        "succeeded (PALLAS_NP_STRICT_FALLBACKS=1 makes this an error)") from failure


_error_classes: dict[type, type] = {}


def kernel_error_class(original_type: type) -> type:
  """A KernelError that also is-a ``original_type``."""
  if issubclass(original_type, KernelError):
    return original_type
  cls = _error_classes.get(original_type)
  if cls is None:
    try:
      cls = type(f"Kernel{original_type.__name__}", (KernelError, original_type), {
          "__init__": KernelError.__init__, "__str__": lambda self: self.args[0],
          "__module__": __name__})
    except TypeError:  # layout conflict with exotic exception types
      cls = KernelError
    _error_classes[original_type] = cls
  return cls


class RaceError(PallasNumpyError):
  """Two grid points that may run concurrently touch the same element
  (``InterpretParams(detect_races=True)``); names both and the buffer."""

  def __init__(self, message, *, buffer=None, grid_points=None, element=None):
    super().__init__(message)
    self.buffer = buffer
    self.grid_points = grid_points
    self.element = element


class NotBatchable(Exception):
  """The kernel (or an index map) cannot be evaluated lane-batched."""


class LaneOutOfBounds(NotBatchable, IndexError):
  """A lane accessed outside its ref: the sequential rerun raises it at its
  grid point and line (or clamps, with ``bounds_check="clamp"``)."""
