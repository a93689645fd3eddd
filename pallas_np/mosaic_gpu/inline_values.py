"""NumPy stand-ins for the Mosaic GPU Python API that ``plgpu.inline_mgpu``
bodies call, so that the common bodies *run* instead of building MLIR.

An ``inline_mgpu`` body is Python that emits MLIR through ``mgpu``
(``jax.experimental.mosaic.gpu``), ``ir`` and the ``gpu``/``arith``/``memref``
dialects. ``pallas_np.mosaic_gpu.inline`` runs the body once per warpgroup
(or warp) with those module names bound to the objects below, which compute
on NumPy values what the emitted code computes:

- special registers: ``gpu.block_id``/``grid_dim``/``cluster_block_id``/
  ``cluster_dim`` of the running block, in CUDA's launch grid (``Special``:
  Pallas's grid reversed, more than three axes squashed into ``z``, each axis
  scaled by the cluster, as JAX's lowering launches it);
- scalar ``arith`` integer ops (wrapping, in the operands' width), ``mgpu.c``,
  ``ir`` integer/float types;
- ``mgpu.FragmentedArray`` as a whole-warpgroup array: ``splat``, elementwise
  ``+ - * /`` and negation in its dtype, ``broadcast_in_dim``, the single
  register of a scalar (``registers.item()``);
- ``memref.load``/``store`` of a scalar on an untransformed ref argument;
- tiled refs (``plgpu.RefType`` with a tiling/swizzle): ``.type.shape`` (the
  tiled shape), ``mgpu.memref_slice`` of their leading (untiled) dims,
  ``FragmentedArray.load_tiled``/``store_tiled`` (SMEM is kept logical here:
  the tiling and swizzle change where bytes live, not the values), and the
  launch context's TMA store ``ctx.async_copy(src_ref=smem, dst_ref=gmem)``
  with its ``await_async_copy``, landing as ``copy_smem_to_gmem``'s copies
  do (at the wait, or the block's end); ``commit_shared`` (a fence),
  ``utils.single_thread_predicate``/``utils.when`` of a true condition (the
  body runs once per warpgroup).

Anything else (thread ids, per-thread registers, TMA loads, barriers through
the launch context, other dialect ops) raises ``UnsupportedError`` naming
the attribute, so a body is either computed exactly or refused."""
from __future__ import annotations

import math

import numpy as np

from pallas_np.errors import UnsupportedError


class Refused(UnsupportedError):
  """An ``inline_mgpu`` body used an MLIR construct the stand-ins lack."""


def refuse(what: str):
  raise Refused(what)


def _missing(owner: str, name: str):
  if name.startswith("__"):  # Python's protocol probes (copy, pickle, numpy)
    raise AttributeError(name)
  refuse(f"{owner}.{name}")


class Namespace:
  """A module stand-in: known names, and a refusal for any other."""

  def __init__(self, module_name: str, **names):
    self._module_name = module_name
    self.__dict__.update(names)

  def __getattr__(self, name):
    _missing(self.__dict__.get("_module_name", "?"), name)


class MlirType:
  """``ir`` types: a width and a kind (``i``: signless integer, ``index``,
  ``f``: float with its NumPy dtype)."""

  def __init__(self, kind: str, width: int, dtype=None):
    self.kind, self.width, self.float_dtype = kind, width, dtype

  def dtype(self, is_signed=True) -> np.dtype:
    if self.kind == "f":
      return np.dtype(self.float_dtype)
    if self.kind == "index":
      return np.dtype(np.int64)
    return np.dtype(f"{'int' if is_signed else 'uint'}{self.width}")

  def __eq__(self, other):
    return isinstance(other, MlirType) and (self.kind, self.width, str(self.float_dtype)) == (
        other.kind, other.width, str(other.float_dtype))

  __hash__ = None


def type_of(dtype) -> MlirType:
  dtype = np.dtype(dtype)
  if dtype.kind in "iub":
    return MlirType("i", 1 if dtype.kind == "b" else dtype.itemsize * 8)
  return MlirType("f", dtype.itemsize * 8, dtype)


def _float_type(dtype):
  return Namespace("ir.FloatType", get=lambda *a: MlirType("f", np.dtype(dtype).itemsize * 8,
                                                            np.dtype(dtype)))


def _ir_namespace():
  import ml_dtypes
  return Namespace(
      "ir",
      IntegerType=Namespace("ir.IntegerType",
                             get_signless=lambda w, *a: MlirType("i", int(w))),
      IndexType=Namespace("ir.IndexType", get=lambda *a: MlirType("index", 64)),
      F32Type=_float_type(np.float32), F16Type=_float_type(np.float16),
      F64Type=_float_type(np.float64), BF16Type=_float_type(ml_dtypes.bfloat16))


class Scalar:
  """A scalar SSA value: a NumPy scalar and its MLIR type (integers are
  signless: arithmetic wraps in ``width`` bits; comparisons/divisions name
  their signedness, as ``arith`` does)."""

  def __init__(self, value, type_: MlirType):
    self.type = type_
    self.value = np.asarray(value).astype(type_.dtype(), copy=False)[()]


def _as_scalar(x) -> Scalar:
  if isinstance(x, Scalar):
    return x
  refuse(f"an operand of type {type(x).__name__} in a scalar arith op")


def _int_op(fn, signed=True):
  def op(a, b, *rest):
    a, b = _as_scalar(a), _as_scalar(b)
    if a.type.kind == "f" or a.type != b.type:
      refuse(f"arith op {fn.__name__} on {a.type.kind}{a.type.width}/{b.type.kind}{b.type.width}")
    dt = a.type.dtype(signed)
    x, y = np.asarray(a.value).astype(dt), np.asarray(b.value).astype(dt)
    with np.errstate(over="ignore"):
      return Scalar(fn(x, y), a.type)
  op.__name__ = fn.__name__
  return op


def _div(x, y):
  if y == 0:
    refuse("an integer division by zero (undefined on the GPU)")
  q = np.abs(x.astype(np.int64)) // np.abs(y.astype(np.int64))  # arith rounds toward zero
  return (q * np.sign(x.astype(np.int64)) * np.sign(y.astype(np.int64))).astype(x.dtype)


def _rem(x, y):
  if y == 0:
    refuse("an integer remainder by zero (undefined on the GPU)")
  return np.fmod(x, y)


def _index_cast(type_, value):
  value = _as_scalar(value)
  if type_.kind == "f" or value.type.kind == "f":
    refuse("arith.index_cast of a float")
  return Scalar(value.value, type_)  # sign-extends (index_cast is signed)


def _constant(type_, value):
  return Scalar(value, type_)


def _arith_namespace():
  return Namespace(
      "arith",
      addi=_int_op(np.add), subi=_int_op(np.subtract), muli=_int_op(np.multiply),
      divui=_int_op(_div, signed=False), remui=_int_op(_rem, signed=False),
      divsi=_int_op(_div), remsi=_int_op(_rem), index_cast=_index_cast,
      index_castui=_index_cast, constant=_constant,
      andi=_int_op(np.bitwise_and), ori=_int_op(np.bitwise_or), xori=_int_op(np.bitwise_xor))


class Special:
  """The running block's CUDA special registers (x, y, z order), as JAX's
  lowering launches a ``plgpu`` mesh: grid reversed (row-major Pallas grid,
  column-major CUDA grid), axes beyond the minor two squashed into one,
  each axis scaled by the cluster size (clusters tile the CUDA grid)."""

  def __init__(self, grid, grid_index, cluster, cluster_index):
    if len(cluster) > 3:
      refuse("a cluster of more than 3 axes")
    pad = (3 - len(cluster))
    cluster3 = (1,) * pad + tuple(cluster)
    cidx3 = (0,) * pad + tuple(cluster_index)
    if len(grid) <= 3:
      pad = 3 - len(grid)
      grid3, gidx3 = (1,) * pad + tuple(grid), (0,) * pad + tuple(grid_index)
    else:
      major = int(np.ravel_multi_index(tuple(grid_index[:-2]), tuple(grid[:-2])))
      grid3 = (math.prod(grid[:-2]), *grid[-2:])
      gidx3 = (major, *grid_index[-2:])
    self.grid_dim = tuple(g * c for g, c in zip(grid3, cluster3))[::-1]
    self.block_id = tuple(g * c + i for g, c, i in zip(gidx3, cluster3, cidx3))[::-1]
    self.cluster_dim = cluster3[::-1]
    self.cluster_block_id = cidx3[::-1]


def _gpu_namespace(special: Special | None, dimension_enum):
  def reader(name):
    def read(dim):
      if special is None:
        refuse(f"gpu.{name} outside a plgpu mesh kernel (plgpu.kernel / pl.core_map)")
      return Scalar(getattr(special, name)[int(getattr(dim, "value", dim))], MlirType("index", 64))
    return read
  return Namespace("gpu", Dimension=dimension_enum, block_id=reader("block_id"),
                    grid_dim=reader("grid_dim"), cluster_block_id=reader("cluster_block_id"),
                    cluster_dim=reader("cluster_dim"))


def _memref_namespace():
  def store(value, ref, indices):
    buf = _as_ref(ref).buffer
    buf[_indices(indices)] = _as_scalar(value).value
  def load(ref, indices):
    buf = _as_ref(ref).buffer
    return Scalar(buf[_indices(indices)], type_of(buf.dtype))
  return Namespace("memref", store=store, load=load)


def _indices(indices):
  return tuple(int(_as_scalar(i).value) for i in indices)


class MemRefType:
  """A ref's ``.type``: its (tiled) shape and element type."""

  def __init__(self, shape, dtype):
    self.shape = list(shape)
    self.element_type = type_of(dtype)

  def __getattr__(self, name):
    _missing("MemRefType", name)


class MemRef:
  """A ref argument (``plgpu.RefType``). ``view``: its logical elements
  (the pallas-side indexers applied). ``tiling``/``swizzle``: its declared
  layout; ``memref.load/store`` need an untransformed ref (``plain``)."""

  def __init__(self, view, plain: bool, what: str, tiling=(), swizzle=None):
    self._buffer, self._plain, self._what = view, plain, what
    self.tiling, self.swizzle = tuple(tiling), swizzle

  @property
  def buffer(self):
    if not self._plain:
      refuse(f"memref.load/store on {self._what} (a ref argument with transforms or indexers)")
    return self._buffer

  @property
  def view(self) -> np.ndarray:
    return self._buffer

  @property
  def type(self) -> MemRefType:
    shape = tuple(self._buffer.shape)
    k = len(self.tiling)
    if k:
      lead, tiled = shape[:-k], shape[-k:]
      if any(n % t for n, t in zip(tiled, self.tiling)):
        refuse(f"{self._what}: shape {list(shape)} not divisible by its tiling {self.tiling}")
      shape = (*lead, *(n // t for n, t in zip(tiled, self.tiling)), *self.tiling)
    return MemRefType(shape, self._buffer.dtype)

  def sliced(self, indices) -> "MemRef":
    """``mgpu.memref_slice``: ints/slices of the leading (untiled) dims."""
    idx = tuple(int(_as_scalar(i).value) if isinstance(i, Scalar) else i for i in indices)
    untiled = self._buffer.ndim - len(self.tiling)
    if len(idx) > untiled or not all(isinstance(i, (int, slice)) for i in idx):
      refuse(f"mgpu.memref_slice of {self._what} along its tiled dims")
    return MemRef(self._buffer[idx], self._plain and not idx, self._what, self.tiling,
                  self.swizzle)

  def __getattr__(self, name):
    _missing(self.__dict__.get("_what", "a ref argument"), name)


def _as_ref(ref) -> MemRef:
  if isinstance(ref, MemRef):
    return ref
  refuse(f"a memref op on {type(ref).__name__}")


class _Registers:
  def __init__(self, value):
    self._value = value

  def item(self):
    return self._value


class Fragmented:
  """``mgpu.FragmentedArray`` as the warpgroup's whole array (its layout
  is where the elements live, which changes no value)."""

  def __init__(self, array, layout=None):
    self.array = np.asarray(array)
    self.layout = layout

  shape = property(lambda self: tuple(self.array.shape))
  mlir_dtype = property(lambda self: type_of(self.array.dtype))
  is_signed = property(lambda self: self.array.dtype.kind == "i" if self.array.dtype.kind in "iu"
                       else None)

  @property
  def registers(self):
    if self.array.shape:
      refuse("FragmentedArray.registers of a non-scalar array (per-thread registers)")
    return _Registers(Scalar(self.array[()], self.mlir_dtype))

  @staticmethod
  def splat(value, shape, layout=None, *, is_signed=None):
    value = _as_scalar(value)
    dt = value.type.dtype(is_signed is not False)
    return Fragmented(np.full(tuple(shape), np.asarray(value.value).astype(dt), dt), layout)

  @staticmethod
  def load_tiled(ref, swizzle=None, *, is_signed=None, layout=None, **kwargs):
    if kwargs or not isinstance(ref, MemRef):
      refuse(f"FragmentedArray.load_tiled with {sorted(kwargs) or type(ref).__name__}")
    return Fragmented(ref.view.copy(), layout)

  def store_tiled(self, ref, swizzle=None, **kwargs):
    if kwargs or not isinstance(ref, MemRef) or tuple(ref.view.shape) != self.shape:
      refuse("FragmentedArray.store_tiled to a ref of another shape" if isinstance(ref, MemRef)
             else f"FragmentedArray.store_tiled with {sorted(kwargs) or type(ref).__name__}")
    ref.view[...] = self.array.astype(ref.view.dtype, copy=False)

  def broadcast_in_dim(self, shape, source_dimensions, layout=None):
    shape = tuple(shape)
    src = list(source_dimensions)
    if len(src) != self.array.ndim or sorted(src) != src:
      refuse("FragmentedArray.broadcast_in_dim with permuted dimensions")
    expanded = self.array.reshape([shape[d] if d in src else 1 for d in range(len(shape))])
    return Fragmented(np.broadcast_to(expanded, shape).copy(), layout)

  def _binary(self, other, fn, name):
    if isinstance(other, Fragmented):
      if other.shape != self.shape or other.array.dtype.itemsize != self.array.dtype.itemsize \
          or (other.array.dtype.kind == "f") != (self.array.dtype.kind == "f"):
        refuse(f"FragmentedArray {name} of {self.array.dtype}{list(self.shape)} and "
               f"{other.array.dtype}{list(other.shape)}")
      y = other.array.astype(self.array.dtype, copy=False)
    elif isinstance(other, (int, float, np.number)):
      y = np.asarray(other).astype(self.array.dtype)
    else:
      refuse(f"FragmentedArray {name} with {type(other).__name__}")
    with np.errstate(all="ignore"):
      return Fragmented(np.asarray(fn(self.array, y)).astype(self.array.dtype, copy=False),
                        self.layout)

  def __add__(self, o):
    return self._binary(o, np.add, "+")

  def __sub__(self, o):
    return self._binary(o, np.subtract, "-")

  def __mul__(self, o):
    return self._binary(o, np.multiply, "*")

  def __truediv__(self, o):
    if self.array.dtype.kind != "f":
      refuse("FragmentedArray / on integers")
    return self._binary(o, np.divide, "/")

  __radd__, __rmul__ = __add__, __mul__

  def __rsub__(self, o):
    return self._binary(o, lambda a, b: b - a, "-")

  def __neg__(self):
    return Fragmented(-self.array, self.layout)

  def __getattr__(self, name):
    _missing("FragmentedArray", name)


def _c(value, type_):
  if not isinstance(type_, MlirType):
    refuse(f"mgpu.c of type {type(type_).__name__}")
  return Scalar(value, type_)


class _When:
  """``mgpu.utils.when(cond)``: the ``with`` body runs (Python cannot skip
  it), so only a true condition is modelled."""

  def __init__(self, cond):
    if not bool(_as_scalar(cond).value):
      refuse("mgpu.utils.when of a false condition")

  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


def _memref_slice(ref, indices):
  if not isinstance(ref, MemRef):
    refuse(f"mgpu.memref_slice of {type(ref).__name__}")
  return ref.sliced(indices if isinstance(indices, tuple) else (indices,))


def _mgpu_namespace(real_mgpu):
  fragmented = Namespace("mgpu.FragmentedArray", splat=Fragmented.splat,
                         load_tiled=Fragmented.load_tiled)
  # The body runs once per warpgroup: "a single thread" of it is that run.
  utils = Namespace("mgpu.utils", is_signed=getattr(real_mgpu.utils, "is_signed", None),
                    single_thread_predicate=lambda *a, **k: Scalar(True, MlirType("i", 1)),
                    when=_When)
  return Namespace("mgpu", FragmentedArray=fragmented, c=_c, utils=utils,
                    memref_slice=_memref_slice, commit_shared=lambda: None,
                    TileTransform=getattr(real_mgpu, "TileTransform", None),
                    WGSplatFragLayout=getattr(real_mgpu, "WGSplatFragLayout", None))


class LaunchContext:
  """The ``ctx`` argument: its TMA stores (SMEM -> GMEM ``async_copy`` and
  ``await_async_copy``) on the running block (``threads.BlockState``:
  they land at the wait or the block's end, as ``copy_smem_to_gmem``'s);
  nothing else of it (TMA loads, barriers, profiling) is modelled."""

  def __init__(self, block=None, thread: int = 0):
    self._block, self._thread = block, thread

  def async_copy(self, *, src_ref, dst_ref, swizzle=None, gmem_transform=(), **kwargs):
    if kwargs or self._block is None:
      refuse(f"the launch context's async_copy with {sorted(kwargs) or 'no block'}")
    if not isinstance(src_ref, MemRef) or not isinstance(dst_ref, MemRef) or \
        not dst_ref._plain or not src_ref.tiling and gmem_transform:
      refuse("the launch context's async_copy other than a TMA store of an SMEM ref "
             "argument to an untransformed GMEM ref argument")
    if tuple(src_ref.view.shape) != tuple(dst_ref.view.shape):
      refuse(f"async_copy of {list(src_ref.view.shape)} into {list(dst_ref.view.shape)}")
    data = src_ref.view.copy()  # read when issued, as the TMA unit does
    dst = dst_ref.view

    def land():
      dst[...] = data
    self._block.store_to_gmem(self._thread, land)

  def await_async_copy(self, allow_groups, await_read_only=False, **kwargs):
    if kwargs or self._block is None:
      refuse(f"the launch context's await_async_copy with {sorted(kwargs)}")
    self._block.flush_to_gmem(self._thread, keep=int(allow_groups))

  def __getattr__(self, name):
    _missing("the launch context", name)


def namespaces(modules: dict, special: Special | None) -> dict:
  """Stand-ins for the real modules ``modules`` (kind -> module object):
  kind is one of mgpu, ir, gpu, arith, memref."""
  out = {}
  for kind, module in modules.items():
    if kind == "mgpu":
      out[kind] = _mgpu_namespace(module)
    elif kind == "ir":
      out[kind] = _ir_namespace()
    elif kind == "gpu":
      out[kind] = _gpu_namespace(special, module.Dimension)
    elif kind == "arith":
      out[kind] = _arith_namespace()
    elif kind == "memref":
      out[kind] = _memref_namespace()
  return out
