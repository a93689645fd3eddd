"""torch <-> NumPy without copies.

NumPy has no bfloat16/float8, so those tensors travel as their raw bits
(``int16``/``uint8`` views) reinterpreted with the ml_dtypes type JAX uses:
same memory, same values, no rounding.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

# torch dtypes NumPy cannot hold natively: (ml_dtypes type, same-width torch int).
_BIT_VIEWS = {torch.bfloat16: (ml_dtypes.bfloat16, torch.int16)}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "float8_e8m0fnu"):
  if hasattr(torch, _name) and hasattr(ml_dtypes, _name):
    _BIT_VIEWS[getattr(torch, _name)] = (getattr(ml_dtypes, _name), torch.uint8)

_TORCH_TO_NP = {
    torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
    torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
    torch.int64: np.int64, torch.uint8: np.uint8, torch.uint16: np.uint16,
    torch.uint32: np.uint32, torch.uint64: np.uint64, torch.bool: np.bool_,
    torch.complex64: np.complex64, torch.complex128: np.complex128,
}
_TORCH_TO_NP.update({t: ml for t, (ml, _) in _BIT_VIEWS.items()})
_NP_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_NP.items()}
_NP_BIT_VIEWS = {np.dtype(ml): (t, bits) for t, (ml, bits) in _BIT_VIEWS.items()}


def torch_dtype_to_numpy(dtype: torch.dtype) -> np.dtype:
  try:
    return np.dtype(_TORCH_TO_NP[dtype])
  except KeyError:
    raise TypeError(f"pallas_np.torch: torch dtype {dtype} has no NumPy/JAX "
                    "equivalent") from None


def numpy_dtype_to_torch(dtype) -> torch.dtype:
  """Also accepts JAX dtypes (jnp.bfloat16 is ml_dtypes.bfloat16)."""
  if isinstance(dtype, torch.dtype):
    return dtype
  try:
    return _NP_TO_TORCH[np.dtype(dtype)]
  except (KeyError, TypeError):
    raise TypeError(f"pallas_np.torch: dtype {dtype} has no torch equivalent") from None


def to_numpy(t: torch.Tensor) -> np.ndarray:
  """A NumPy view of a CPU tensor's memory (a copy only for non-CPU tensors
  or conjugate/negative-bit views, which NumPy cannot represent)."""
  t = t.detach()
  if t.device.type != "cpu":
    t = t.cpu()
  t = t.resolve_conj().resolve_neg()
  bit_view = _BIT_VIEWS.get(t.dtype)
  if bit_view is not None:
    ml, bits = bit_view
    return t.view(bits).numpy().view(ml)
  if t.dtype not in _TORCH_TO_NP:
    torch_dtype_to_numpy(t.dtype)  # raises the clear error
  return t.numpy()


def to_torch(a, device=None) -> torch.Tensor:
  """A tensor sharing ``a``'s memory when NumPy allows it; read-only arrays
  and negative strides (which torch cannot wrap) are copied first."""
  a = np.asarray(a)
  if not a.flags.writeable or any(s < 0 for s in a.strides):
    a = np.array(a)
  bit_view = _NP_BIT_VIEWS.get(a.dtype)
  if bit_view is not None:
    tdtype, bits = bit_view
    npbits = np.int16 if bits is torch.int16 else np.uint8
    out = torch.from_numpy(a.view(npbits)).view(tdtype)
  else:
    numpy_dtype_to_torch(a.dtype)  # clear error for unsupported dtypes
    out = torch.from_numpy(a)
  if device is not None and torch.device(device).type != "cpu":
    out = out.to(device)
  return out
