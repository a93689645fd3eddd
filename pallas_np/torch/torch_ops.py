"""Torch ops on JAX values: what lets a Pallas kernel body be written with
torch ops (``torch_pallas_call``).

Why not torchax: torchax 0.0.10-0.0.13 do not import with torch 2.13 (they
reference removed ``Dimname`` overloads), and a kernel needs only a small,
well-defined slice of torch. So, while the kernel is traced:

* each ref is a ``TorchRef``: indexing it loads a ``JaxTensor``, assigning to
  it stores (casting to the ref's dtype and broadcasting, like
  ``Tensor.copy_``);
* a ``JaxTensor`` wraps a JAX tracer and implements ``__torch_function__``,
  so ``torch.add(x, y)``, ``x.sum(-1)``, ``x @ y``, ``F.relu(x)`` ... reach
  the op table, which maps each torch op onto ``jax.numpy``/``lax``;
* a ``TorchFunctionMode`` active only during tracing maps factory functions
  (``torch.zeros``, ``torch.arange``, ``torch.full`` ...) the same way.

An op outside the table raises ``UnsupportedTorchOpError`` (an
``UnsupportedError``) naming the op and the kernel line. Semantics follow
torch except that dtype promotion is JAX's (identical for same-kind
operands) and, as in JAX without x64, int64/float64 become int32/float32.
In-place methods (``x.add_(y)``) rebind the wrapper; views do not alias.

Where things are: this module holds ``torch_kernel`` and the tracing mode;
``values.py`` the wrappers and dispatch; ``ops_table.py`` the table;
``ops_elementwise.py``, ``ops_reductions.py``, ``ops_linalg.py``,
``ops_shape.py``, ``ops_dtype.py`` and ``ops_factories.py`` the ops.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
from torch.overrides import TorchFunctionMode

from pallas_np import _compat as jc
# The ops_* modules register their ops in the table when imported.
from pallas_np.torch import (ops_dtype, ops_elementwise, ops_linalg,  # noqa: F401
                             ops_reductions, ops_shape)
from pallas_np.torch.ops_factories import FACTORIES
from pallas_np.torch.values import (JaxTensor, TorchRef, call_torch_op, dispatch, func_name,
                                    unwrap, wrap)


class KernelTorchMode(TorchFunctionMode):
  """Active while a torch-op kernel is traced: factory functions produce
  JaxTensors; ops on JaxTensors go to the table; everything else is torch."""

  def __torch_function__(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if any(t is JaxTensor for t in types) or _has_jax(args) or _has_jax(kwargs):
      return call_torch_op(func, args, kwargs)
    name, qualified = func_name(func)
    if name in FACTORIES:
      return dispatch(name, qualified, args, kwargs)
    return func(*args, **kwargs)


def _has_jax(x) -> bool:
  if isinstance(x, JaxTensor):
    return True
  if isinstance(x, (list, tuple)):
    return any(_has_jax(v) for v in x)
  if isinstance(x, dict):
    return any(_has_jax(v) for v in x.values())
  return False


def torch_kernel(kernel: Callable) -> Callable:
  """A Pallas kernel (refs in) from a kernel written with torch ops."""
  @functools.wraps(kernel)
  def jax_kernel(*refs, **kwargs):
    wrapped = jax.tree_util.tree_map(_wrap_ref, refs)
    with KernelTorchMode():
      out = kernel(*wrapped, **kwargs)
    return jax.tree_util.tree_map(unwrap, out, is_leaf=lambda v: isinstance(v, (JaxTensor, TorchRef)))
  return jax_kernel


def _wrap_ref(x):
  if isinstance(getattr(x, "aval", None), jc.AbstractRef) or hasattr(x, "transforms"):
    return TorchRef(x)
  return wrap(x)
