"""NumPy arrays to jax.Arrays and back, on the per-call floor: one
``batched_device_put`` out, a buffer view in."""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax._src.lib import xla_client as _xc

from pallas_np._compat.core import ArrayImpl, ShapedArray


def np_to_jax(x, weak_type: bool = False):
  """A jax.Array of a NumPy result (fresh: it may be aliased) by one
  ``batched_device_put`` on the default CPU device; ``weak_type``: the
  traced program's output is weakly typed (what XLA's run would return)."""
  x = np.asarray(x)
  try:
    dev, sharding = _default_placement()
    key = (x.shape, x.dtype, weak_type)
    aval = _avals.get(key)
    if aval is None:
      aval = _avals[key] = ShapedArray(x.shape, x.dtype, weak_type=weak_type)
      if len(_avals) > 4096:
        _avals.clear()
    return _xc.batched_device_put(aval, sharding, [x], [dev], False)
  except Exception:  # pragma: no cover - exotic dtypes/devices: JAX's own route
    return jax.device_put(x)


_avals: dict = {}  # (shape, dtype, weak) -> ShapedArray: building one costs ~3 µs


def jax_array_maker(shape, dtype, weak_type: bool = False):
  """``np_to_jax`` for arrays of exactly this shape and (plain) dtype, the
  aval and placement looked up once (a kernel's outputs: the per-call floor)."""
  dev, sharding = _default_placement()
  shape, dtype = tuple(shape), np.dtype(dtype)
  aval = ShapedArray(shape, dtype, weak_type=weak_type)

  def to_jax(x):  # (batched_device_put trusts the aval: a mismatch would be garbage)
    if type(x) is np.ndarray and x.dtype == dtype and x.shape == shape:
      try:
        return _xc.batched_device_put(aval, sharding, [x], [dev], False)
      except Exception:  # pragma: no cover - exotic dtypes/devices: as np_to_jax
        pass
    return np_to_jax(x, weak_type)
  return to_jax


def exact_array_putter(shape, dtype, weak_type: bool = False):
  """``put([x]) -> jax.Array`` for NumPy arrays ``x`` that are *always*
  fresh ``np.ndarray``s of exactly this shape and (plain) dtype (a kernel
  run's own output buffers): ``batched_device_put`` with its aval and
  placement bound, a C call with no Python frame and no guard (the caller
  vouches for the array: a mismatch would be garbage, see
  ``jax_array_maker``). The result is what ``np_to_jax`` returns (the same
  aval, weak type, default-device sharding, uncommitted). None where the
  dtype is not a NumPy or ml_dtypes one, or this jaxlib lacks the keywords."""
  dtype = np.dtype(dtype)
  if not dtype.isbuiltin or dtype.hasobject or _PUT_KEYWORDS is None:
    return None  # (0: structured or other user dtypes; 2, ml_dtypes' bfloat16 etc.: fine)
  dev, sharding = _default_placement()
  aval = ShapedArray(tuple(shape), dtype, weak_type=weak_type)
  return functools.partial(_xc.batched_device_put, aval, sharding,
                           **{_PUT_KEYWORDS[0]: [dev], _PUT_KEYWORDS[1]: False})


def _put_keywords():
  """The names of ``batched_device_put``'s ``devices`` and ``committed``
  parameters, read from its signature (None if it has no such names)."""
  doc = getattr(_xc.batched_device_put, "__doc__", None) or ""
  if "devices:" in doc and "committed:" in doc:
    return ("devices", "committed")
  return None


_PUT_KEYWORDS = _put_keywords()


_host_view = getattr(ArrayImpl, "_single_device_array_to_np_array_did_copy", None)
_one_cpu: dict = {}  # sharding -> on one CPU device? (arrays share a few)


def host_array(x) -> np.ndarray:
  """``np.asarray`` of a jax.Array: ml_dtypes (bfloat16, ...) ones, which
  NumPy reads through ``__array__`` (~6 µs), straight from the buffer (~2 µs)."""
  if x.dtype.isbuiltin != 2 or _host_view is None or x.is_deleted():  # 2: ml_dtypes
    return np.asarray(x)
  sharding = x.sharding
  one = _one_cpu.get(sharding)
  if one is None:
    if len(_one_cpu) > 1024:
      _one_cpu.clear()
    devs = sharding.device_set
    one = _one_cpu[sharding] = len(devs) == 1 and next(iter(devs)).platform == "cpu"
  return _host_view(x)[0] if one else np.asarray(x)


_placement = None


def _default_placement():
  global _placement
  if _placement is None:
    dev = jax.devices()[0]
    _placement = (dev, jax.sharding.SingleDeviceSharding(dev))
  return _placement
