"""Primitives only the Pallas GPU (Triton) path has: compiler hints, the
debug barrier and ``approx_tanh``'s inline PTX.

Hints and barriers cannot change results of a sequential interpreter, so they
are identities/no-ops. Inline assembly is opaque; only the ``tanh.approx``
instructions ``pltriton.approx_tanh`` emits are understood. The GPU's
``tanh.approx`` (MUFU.TANH) is specified only to a relative error of about
2**-11 and its bits are not published, and JAX's interpret=True has no rule
for the asm at all: it is evaluated as XLA's float32 tanh (``lax.tanh`` in a
kernel; bf16/f16 rounded from it), so results are the same on every CPU and
agree with the GPU to that tolerance. Any other asm raises UnsupportedError.
"""
from __future__ import annotations

import math
import re

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import np_dtype
from pallas_np.primitives import xla_math
from pallas_np.primitives.shape import broadcast, lane_broadcast

tp = jc.triton_primitives

if tp is not None:
  registry.register(tp.max_contiguous_p, batch=registry.IDENTITY)(lambda e: (lambda x: x))
  registry.register(tp.debug_barrier_p, batch=registry.unbatched(
      "a barrier between threads of one program: nothing to batch"))(lambda e: (lambda: []))

  _TANH_ASM = re.compile(r"^\s*tanh\.approx\.(f16|bf16|f32|f64)\s+\$0\s*,\s*\$1\s*;?\s*$")

  @registry.register(tp.elementwise_inline_asm_p, batch=registry.unbatched(
      "inline assembly (approx tanh only): run lane by lane"))
  def _inline_asm(e):
    asm = e.params["asm"]
    if not _TANH_ASM.match(asm) or len(e.in_avals) != 1:
      raise e.unsupported(f"inline assembly {asm!r} (only pltriton.approx_tanh's "
                          "tanh.approx is understood)")
    out_dtype = np_dtype(e.out_avals[0].dtype)
    if out_dtype.itemsize > 4:  # f64: ROCm's __ocml_tanh_f64 (CUDA refuses it)
      return lambda x: [np.tanh(x)]

    def approx_tanh(x):  # XLA's float32 tanh: the same bits on every CPU
      return [xla_math.tanh_f32(np.asarray(x, dtype=np.float32)).astype(out_dtype)]
    return approx_tanh


# ``state.primitives.broadcast_to``: the equal-rank broadcast Triton kernels
# (and their vmap/autodiff rules) emit; NumPy's right-aligned broadcast.
_broadcast_to_p = getattr(jc.state_primitives, "broadcast_to_p", None)
def broadcast_to_geometry(e):
  """``(shape, expanded)`` of a ``broadcast_to`` eqn: the operand's shape
  padded with leading unit dims to the result's rank."""
  shape = tuple(e.params["shape"])
  in_shape = tuple(e.in_avals[0].shape)
  return shape, (1,) * (len(shape) - len(in_shape)) + in_shape


if _broadcast_to_p is not None:
  def _broadcast_to_batched(bc, rule, info, in_batched):
    """The state primitive Triton-style kernels emit: right-aligned."""
    return lane_broadcast(*broadcast_to_geometry(info))

  @registry.register(_broadcast_to_p, batch=_broadcast_to_batched)
  def _broadcast_to(e):
    shape, expanded = broadcast_to_geometry(e)
    size = math.prod(shape)
    return lambda x: broadcast(np.asarray(x), expanded, shape, size)
