"""``pltpu.pack_elementwise`` / ``unpack_elementwise`` (JAX 0.12): several
narrow values per word, element by element.

No JAX oracle (interpret=True cannot lower them on CPU, TPU interpret mode
has no rule): the semantics are the docs of ``tpu.pack_elementwise`` /
``tpu.unpack_elementwise`` (jaxlib's Mosaic dialect) and of the pltpu
functions, written out in the docstrings below and in docs/tpu.md.
"""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import bit_width, np_dtype

mp = jc.mosaic_primitives
_PURE = registry.unbatched("rare: run lane by lane")


def _is_float(dt) -> bool:
  return dt.kind == "f" or (dt.kind == "V" and "float" in dt.name)


def _container(dt) -> str:
  """The unsigned type of ``dt``'s storage (a byte for sub-byte types)."""
  return f"uint{dt.itemsize * 8}"


def _narrow_bits(x, packed, bits: int) -> np.ndarray:
  """The ``bits``-bit pattern of each element of ``x`` as ``packed``
  (int64): integers keep their low bits (truncation, as the op's doc says),
  floats are converted (round to nearest even, as ``astype``: pallas_np's
  reading of the f32 -> bf16 case, which the doc leaves open)."""
  x = np.asarray(x)
  if _is_float(packed):
    raw = np.ascontiguousarray(x.astype(packed)).view(_container(packed)).astype(np.int64)
  else:
    raw = x.astype(np.int64)
  return raw & ((1 << bits) - 1)


def pack_elementwise(xs, packed, word) -> np.ndarray:
  """xs[k] goes to bits [k*b, (k+1)*b) of each output word (b: the packed
  width; xs[0] lowest)."""
  bits = bit_width(packed)
  out = np.zeros(np.shape(xs[0]), np.int64)
  for k, x in enumerate(xs):
    out |= _narrow_bits(x, packed, bits) << (k * bits)
  return out.astype(np.uint64).astype(word)


def unpack_elementwise(x, index: int, packed, unpacked) -> np.ndarray:
  """Bits [index*b, (index+1)*b) of each word, read as ``packed`` (signed
  integers sign-extend) and converted to ``unpacked``."""
  x = np.asarray(x)
  bits = bit_width(packed)
  raw = (np.ascontiguousarray(x).view(f"uint{x.dtype.itemsize * 8}").astype(np.int64)
         >> (index * bits)) & ((1 << bits) - 1)
  if _is_float(packed):
    return raw.astype(_container(packed)).view(packed).astype(unpacked)
  if packed.kind == "i" or (packed.kind == "V" and packed.name.startswith("int")):
    raw = np.where(raw >= 1 << (bits - 1), raw - (1 << bits), raw)
  return raw.astype(unpacked)


if getattr(mp, "pack_elementwise_p", None) is not None:
  @registry.register(mp.pack_elementwise_p, batch=_PURE)
  def _pack_elementwise(e):
    """``pltpu.pack_elementwise(xs, packed_dtype=)``: one word of packed
    values per element (a ``uint`` as wide as the sources)."""
    packed = np_dtype(e.params["packed_dtype"])
    word = np_dtype(e.out_avals[0].dtype)
    return lambda *xs: pack_elementwise(xs, packed, word)

  @registry.register(mp.unpack_elementwise_p, batch=_PURE)
  def _unpack_elementwise(e):
    """``pltpu.unpack_elementwise(x, index=, packed_dtype=, unpacked_dtype=)``."""
    packed = np_dtype(e.params["packed_dtype"])
    unpacked = np_dtype(e.params["unpacked_dtype"])
    index = int(e.params["index"])
    return lambda x: unpack_elementwise(x, index, packed, unpacked)
