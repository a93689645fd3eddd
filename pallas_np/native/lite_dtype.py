"""lite's dtypes and constants without NumPy: the compile process
(``aot_worker``, ``lite_worker``) translates a loop with ``lite`` and
never imports NumPy, whose import (~0.1 s of the process's ~0.3 s start)
lay on the path of a fresh process's first build (docs/native.md, "lite").

A ``DType`` stands for one of NumPy's dtypes by what the translation reads
of it (``name``, ``kind``, ``itemsize``, ``str``); ``dtype`` gives the one
instance of each (so ``==`` is identity) from a name, an array-protocol
string (``"<f4"``), a NumPy dtype or scalar type (the caller's tests).
A loop's constants are a ``Scalar`` (its dtype and Python value) or a
``ConstArray`` (its dtype and size: the values are the caller's, passed at
each call); ``constants`` reads them from the job's ``.npz`` (NumPy's own
format: a zip of ``.npy`` files), ``constant`` from NumPy objects.
"""
from __future__ import annotations

import ast
import math
import struct
import zipfile


class DType:
  """One dtype, as lite reads it."""
  __slots__ = ("name", "kind", "itemsize", "str", "fmt")

  def __init__(self, name, kind, itemsize, string, fmt):
    self.name, self.kind, self.itemsize, self.str, self.fmt = name, kind, itemsize, string, fmt

  def __repr__(self) -> str:
    return f"dtype({self.name!r})"


_TABLE = [("bool", "b", 1, "|b1", "<?"), ("int8", "i", 1, "|i1", "<b"),
          ("int16", "i", 2, "<i2", "<h"), ("int32", "i", 4, "<i4", "<i"),
          ("int64", "i", 8, "<i8", "<q"), ("uint8", "u", 1, "|u1", "<B"),
          ("uint16", "u", 2, "<u2", "<H"), ("uint32", "u", 4, "<u4", "<I"),
          ("uint64", "u", 8, "<u8", "<Q"), ("float32", "f", 4, "<f4", "<f"),
          ("float64", "f", 8, "<f8", "<d")]
_BY = {}
for _row in _TABLE:
  _dt = DType(*_row)
  _BY[_dt.name] = _BY[_dt.str] = _dt
_BY["bool_"] = _BY["bool"]
# The dtypes the generated code computes in (``contract.SUPPORTED``, as NumPy dtypes).
SUPPORTED = frozenset(_BY[row[0]] for row in _TABLE)


def dtype(x) -> DType:
  """The ``DType`` of ``x``: a ``DType``, a name or array-protocol string,
  a NumPy dtype or scalar type; any other dtype is one lite refuses (not
  in ``SUPPORTED``)."""
  if isinstance(x, DType):
    return x
  if isinstance(x, type):
    x = x.__name__
  elif not isinstance(x, str):
    x = getattr(x, "str", None) or str(x)
  found = _BY.get(x)
  if found is None:  # (e.g. float16: translated to nothing, refused where it is used)
    kind = x[1] if len(x) > 1 and x[0] in "<>|=" else "V"
    found = _BY[x] = DType(x, kind, int(x[2:]) if x[2:].isdigit() else 0, x, None)
  return found


class Scalar:
  """A scalar constant of the loop's source: its dtype and value."""
  __slots__ = ("dtype", "value")

  def __init__(self, dt: DType, value):
    self.dtype, self.value = dt, value


class ConstArray:
  """An array constant of the loop's source: its dtype and element count
  (its values are passed at each call)."""
  __slots__ = ("dtype", "size")

  def __init__(self, dt: DType, size: int):
    self.dtype, self.size = dt, size


def constant(v):
  """A NumPy scalar or array as a ``Scalar``/``ConstArray``; anything else
  as it is (a name lite refuses)."""
  if isinstance(v, (Scalar, ConstArray)) or not (hasattr(v, "dtype") and hasattr(v, "shape")):
    return v
  if type(v).__name__ == "ndarray":
    return ConstArray(dtype(v.dtype), int(v.size))
  return Scalar(dtype(v.dtype), v.item())


def constants(path: str) -> dict:
  """The constants of a job's ``.npz`` (``numpy.savez``'s: one ``.npy``
  per name, read by its header: format 1.0-3.0), by name: a 0-d array is
  a ``Scalar``, any other a ``ConstArray``."""
  out = {}
  with zipfile.ZipFile(path) as z:
    for info in z.infolist():
      name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
      data = z.read(info)
      if data[:6] != b"\x93NUMPY":
        raise ValueError(f"{path}: {info.filename} is not a .npy file")
      if data[6] == 1:
        size, start = struct.unpack("<H", data[8:10])[0], 10
      else:
        size, start = struct.unpack("<I", data[8:12])[0], 12
      header = ast.literal_eval(data[start:start + size].decode("latin1"))
      descr, shape = header["descr"], tuple(header["shape"])
      dt = dtype(descr if isinstance(descr, str) else "|V0")
      body = data[start + size:]
      if shape:
        out[name] = ConstArray(dt, math.prod(shape))
      elif dt.fmt is not None:
        out[name] = Scalar(dt, struct.unpack(dt.fmt, body[:dt.itemsize])[0])
      else:
        out[name] = Scalar(dt, None)
  return out
