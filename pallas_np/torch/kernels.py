"""Run a JAX function (with Pallas kernels inside) on torch tensors, in numpy
mode, with no XLA compilation.

The function is traced once per (argument shapes/dtypes, static arguments)
with every ``pallas_call`` routed to the NumPy interpreter; its jaxpr is
evaluated by pallas_np's evaluator on NumPy views of the tensors, and the
NumPy results are wrapped as tensors without copying.
"""
from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np
import torch

from pallas_np import api
from pallas_np.params import InterpretParams, resolve
from pallas_np.torch.convert import numpy_dtype_to_torch, to_numpy, to_torch


def _interp(interpret) -> InterpretParams:
  return interpret if isinstance(interpret, InterpretParams) else resolve("numpy")


def eager_under_compile(fn: Callable) -> Callable:
  """``torch.compiler.disable`` without importing torch._dynamo up front
  (seconds): nobody can be compiling until dynamo is imported. Under
  torch.compile the graph breaks around ``fn``, which runs eagerly."""
  disabled = []

  @functools.wraps(fn)
  def call(*args, **kwargs):
    if "torch._dynamo" not in sys.modules:
      return fn(*args, **kwargs)
    if not disabled:
      disabled.append(torch.compiler.disable(fn))
    return disabled[0](*args, **kwargs)
  return call


def _is_operand(a) -> bool:
  return isinstance(a, (torch.Tensor, np.ndarray))


class TorchNumpyRunner:
  """``runner(args, kwargs) -> pytree of tensors``: tensors (and NumPy
  arrays) in ``args`` are traced operands; every other positional/keyword argument is static (must be
  hashable), like ``static_argnums`` of torch_xla's kernels."""

  def __init__(self, fn: Callable, interpret: Any = None):
    self.fn = fn
    self.interpret = _interp(interpret)
    self._closures: dict = {}
    self._lock = threading.Lock()

  def _closure(self, args, kwargs):
    tensor_pos = tuple(i for i, a in enumerate(args) if _is_operand(a))
    statics = tuple((i, a) for i, a in enumerate(args) if not _is_operand(a))
    key = (len(args), tensor_pos, statics, tuple(sorted(kwargs.items())))
    try:
      hit = self._closures.get(key)
    except TypeError as e:
      raise TypeError(
          "pallas_np.torch: non-tensor arguments are static and must be hashable; "
          f"got {[type(a).__name__ for _, a in statics]} / {sorted(kwargs)}") from e
    if hit is not None:
      return tensor_pos, hit
    fn, n = self.fn, len(args)
    static_map = dict(statics)
    frozen_kwargs = dict(kwargs)

    def closure(*arrays):
      it = iter(arrays)
      full = [static_map[i] if i in static_map else next(it) for i in range(n)]
      return fn(*full, **frozen_kwargs)
    closure.__name__ = getattr(fn, "__name__", "kernel")
    with self._lock:
      hit = self._closures.setdefault(key, closure)
    return tensor_pos, hit

  def __call__(self, args: Sequence[Any], kwargs: dict | None = None):
    kwargs = kwargs or {}
    tensor_pos, closure = self._closure(args, kwargs)
    tensors = [args[i] for i in tensor_pos]
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
      raise ValueError(f"pallas_np.torch: tensors on several devices: {sorted(map(str, devices))}")
    device = next(iter(devices)) if devices else None
    arrays = [to_numpy(t) if isinstance(t, torch.Tensor) else t for t in tensors]
    with api.force_numpy_interpret(self.interpret):
      outs, tree = api.eager_numpy_call(closure, self.interpret, tuple(arrays),
                                        own_outputs=True)
    return jax.tree_util.tree_unflatten(tree, [to_torch(o, device) for o in outs])


def make_kernel_from_pallas(kernel: Callable, output_shape_dtype_fn: Callable, *,
                            interpret: Any = None):
  """torch_xla's ``make_kernel_from_pallas`` on CPU tensors, in numpy mode.

  ``kernel`` is a JAX function (usually jitted) that calls ``pl.pallas_call``;
  ``output_shape_dtype_fn(*args)`` returns ``[(shape, torch_dtype), ...]``.
  The returned callable takes torch tensors (non-tensor arguments are static)
  and returns one tensor, or a tuple for several outputs. The declared shapes
  and dtypes are checked against what the kernel produces.
  ``interpret`` may be an ``InterpretParams`` for interpreter options.
  """
  runner = TorchNumpyRunner(kernel, interpret)

  @eager_under_compile  # torch.compile: a graph break, then this runs eagerly
  def pallas_kernel(*args, static_argnums: Sequence[int] = (), **kwargs):
    # static_argnums is accepted for torch_xla compatibility: every
    # non-tensor argument is static here.
    for i in static_argnums:
      if isinstance(args[i], torch.Tensor):
        raise TypeError(f"pallas_np.torch: static argument {i} is a tensor")
    declared = output_shape_dtype_fn(*args)
    if not isinstance(declared, (list, tuple)):
      raise TypeError("output_shape_dtype_fn must return a list of (shape, dtype) tuples")
    outs = jax.tree_util.tree_leaves(runner(args, kwargs))
    if len(outs) != len(declared):
      raise ValueError(f"pallas_np.torch: kernel returned {len(outs)} outputs, "
                       f"output_shape_dtype_fn declared {len(declared)}")
    for i, (out, (shape, dtype)) in enumerate(zip(outs, declared)):
      if tuple(out.shape) != tuple(shape) or out.dtype != numpy_dtype_to_torch(dtype):
        raise ValueError(
            f"pallas_np.torch: output {i} of the kernel is {out.dtype}{list(out.shape)} "
            f"but output_shape_dtype_fn declared {dtype}{list(shape)}")
    return outs[0] if len(outs) == 1 else tuple(outs)

  pallas_kernel.__name__ = getattr(kernel, "__name__", "pallas_kernel")
  return pallas_kernel
