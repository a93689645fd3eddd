"""The table of torch ops that kernels written with torch ops may use.

``@op("name", ...)`` registers an implementation (on JAX values) under torch
op names; the ``ops_*`` modules fill the table, ``values.dispatch`` reads it.
An op outside the table raises ``UnsupportedTorchOpError``, naming the op and
the kernel line.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

import torch

from pallas_np.errors import UnsupportedError


class UnsupportedTorchOpError(UnsupportedError):
  """A torch op used in a kernel that pallas_np does not map onto JAX."""


_TORCH_DIR = os.path.dirname(torch.__file__)
_OUR_DIR = os.path.dirname(__file__)


def _user_site() -> str:
  """'file:line' of the innermost frame outside torch and this package."""
  f = sys._getframe(1)
  while f is not None:
    fn = f.f_code.co_filename
    if not (fn.startswith(_TORCH_DIR) or fn.startswith(_OUR_DIR)):
      return f"{fn}:{f.f_lineno}"
    f = f.f_back
  return "<unknown>"


def unsupported(what: str) -> UnsupportedTorchOpError:
  return UnsupportedTorchOpError(
      f"pallas_np.torch: torch op '{what}' is not mapped onto JAX for kernels "
      f"written with torch ops (at {_user_site()}); "
      "see pallas_np.torch.covered_torch_ops() for the ops that are")


# -- the op table --------------------------------------------------------------
OPS: dict[str, Callable] = {}
INPLACE_OK = set()


def op(*names):
  def deco(fn):
    for n in names:
      OPS[n] = fn
    return fn
  return deco


def covered_torch_ops() -> list[str]:
  """Names of the torch ops (functions, Tensor methods, ``F.*``) that kernels
  written with torch ops may use; ``name_`` in-place variants of the
  element-wise ones work too."""
  return sorted(OPS)


def no_out(out):
  if out is not None:
    raise unsupported("out= argument")
