"""Torch-looking JAX values inside a kernel traced from torch ops, and the
dispatch of torch calls on them to the op table.

* dtype mapping (``jax_dtype``, ``torch_dtype``, ``astype``);
* ``unwrap``/``wrap`` between torch-side and JAX values;
* ``JaxTensor`` (a JAX value whose ``__torch_function__``, methods and
  operators reach the table) and ``TorchRef`` (a Pallas ref seen from torch);
* ``call_torch_op``/``dispatch``: from a torch function or method name to the
  implementation in ``ops_table.OPS`` (in-place variants rebind the wrapper).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch

from pallas_np import _compat as jc
from pallas_np.torch.convert import numpy_dtype_to_torch, to_numpy, torch_dtype_to_numpy
from pallas_np.torch.ops_table import INPLACE_OK, OPS, unsupported


# -- dtypes ------------------------------------------------------------------
def jax_dtype(dtype):
  """torch dtype (or anything NumPy understands) -> canonical JAX dtype."""
  if dtype is None:
    return None
  if isinstance(dtype, torch.dtype):
    dtype = torch_dtype_to_numpy(dtype)
  return jax.dtypes.canonicalize_dtype(np.dtype(dtype))


def torch_dtype(dtype) -> torch.dtype:
  return numpy_dtype_to_torch(np.dtype(dtype))


def astype(x, dtype):
  dt = jax_dtype(dtype)
  return x if dt is None else x.astype(dt)


# -- values ------------------------------------------------------------------
def unwrap(x):
  """JaxTensor/TorchRef/torch.Tensor -> JAX value/ref/array; containers recursed."""
  if isinstance(x, JaxTensor):
    return x._value
  if isinstance(x, TorchRef):
    return x._ref
  if isinstance(x, torch.Tensor):
    return jnp.asarray(to_numpy(x))
  if isinstance(x, torch.dtype):
    return jax_dtype(x)
  if isinstance(x, torch.Size):
    return tuple(x)
  if isinstance(x, jc.Slice):  # pl.ds(start, size) with torch-side values
    return jc.Slice(unwrap(x.start), unwrap(x.size), x.stride)
  if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
    return type(x)(unwrap(v) for v in x)
  if isinstance(x, dict):
    return {k: unwrap(v) for k, v in x.items()}
  return x


def wrap(x):
  """JAX values -> JaxTensor (containers recursed)."""
  if isinstance(x, (jax.Array, jc.Tracer, np.ndarray, np.generic)):
    return JaxTensor(x)
  if isinstance(x, tuple) and hasattr(x, "_fields"):
    return type(x)(*(wrap(v) for v in x))
  if isinstance(x, (list, tuple)):
    return type(x)(wrap(v) for v in x)
  return x


class JaxTensor:
  """A torch-looking JAX value inside a kernel traced from torch ops."""
  __slots__ = ("_value",)

  def __init__(self, value):
    self._value = jnp.asarray(value)

  @classmethod
  def __torch_function__(cls, func, types, args=(), kwargs=None):
    return call_torch_op(func, args, kwargs or {})

  def __jax_array__(self):
    return self._value

  # -- metadata --
  @property
  def shape(self) -> torch.Size:
    return torch.Size(self._value.shape)

  @property
  def dtype(self) -> torch.dtype:
    return torch_dtype(self._value.dtype)

  @property
  def ndim(self) -> int:
    return self._value.ndim

  @property
  def device(self) -> torch.device:
    return torch.device("cpu")

  @property
  def requires_grad(self) -> bool:
    return False

  @property
  def T(self):
    return JaxTensor(jnp.transpose(self._value))

  @property
  def mT(self):
    return JaxTensor(jnp.swapaxes(self._value, -1, -2))

  def size(self, dim=None):
    return self.shape if dim is None else self._value.shape[dim]

  def dim(self) -> int:
    return self._value.ndim

  def numel(self) -> int:
    return int(np.prod(self._value.shape, dtype=np.int64))

  def element_size(self) -> int:
    return np.dtype(self._value.dtype).itemsize

  def is_floating_point(self) -> bool:
    return jnp.issubdtype(self._value.dtype, jnp.floating)

  def is_complex(self) -> bool:
    return jnp.issubdtype(self._value.dtype, jnp.complexfloating)

  def __len__(self):
    return self._value.shape[0]

  def __iter__(self):
    return (JaxTensor(self._value[i]) for i in range(len(self)))

  def __repr__(self):
    return f"JaxTensor({self._value!r})"

  def __bool__(self):
    return bool(self._value)  # JAX explains why a traced value has no truth value

  def __getitem__(self, idx):
    return JaxTensor(self._value[unwrap(idx)])

  def __setitem__(self, idx, val):
    self._value = self._value.at[unwrap(idx)].set(
        jnp.asarray(unwrap(val)).astype(self._value.dtype))

  def __getattr__(self, name):
    if name.startswith("__"):
      raise AttributeError(name)
    return functools.partial(_call_method, name, self)


# A pytree node, so JaxTensors flow through lax.fori_loop/cond carries.
def _unflatten_jax_tensor(_, children):
  t = object.__new__(JaxTensor)  # JAX may unflatten placeholders: no conversion
  t._value = children[0]
  return t


jax.tree_util.register_pytree_node(JaxTensor, lambda t: ((t._value,), None),
                                   _unflatten_jax_tensor)


def _call_method(name, self, *args, **kwargs):
  return dispatch(name, f"torch.Tensor.{name}", (self, *args), kwargs)


def _binary_dunder(name, swap=False):
  def method(self, other):
    args = (other, self) if swap else (self, other)
    return dispatch(name, f"torch.Tensor.__{'r' if swap else ''}{name}__", args, {})
  return method


for _name, _op in [("add", "add"), ("sub", "sub"), ("mul", "mul"), ("truediv", "div"),
                   ("floordiv", "floor_divide"), ("mod", "remainder"), ("pow", "pow"),
                   ("matmul", "matmul"), ("and", "bitwise_and"), ("or", "bitwise_or"),
                   ("xor", "bitwise_xor"), ("lshift", "bitwise_left_shift"),
                   ("rshift", "bitwise_right_shift")]:
  setattr(JaxTensor, f"__{_name}__", _binary_dunder(_op))
  setattr(JaxTensor, f"__r{_name}__", _binary_dunder(_op, swap=True))
  setattr(JaxTensor, f"__i{_name}__", _binary_dunder(_op))
for _name, _op in [("eq", "eq"), ("ne", "ne"), ("lt", "lt"), ("le", "le"), ("gt", "gt"),
                   ("ge", "ge")]:
  setattr(JaxTensor, f"__{_name}__", _binary_dunder(_op))
JaxTensor.__neg__ = lambda self: dispatch("neg", "torch.Tensor.__neg__", (self,), {})
JaxTensor.__pos__ = lambda self: self
JaxTensor.__abs__ = lambda self: dispatch("abs", "torch.Tensor.__abs__", (self,), {})
JaxTensor.__invert__ = lambda self: dispatch("bitwise_not", "torch.Tensor.__invert__", (self,), {})
JaxTensor.__hash__ = object.__hash__


class TorchRef:
  """A Pallas ref seen from torch: ``ref[idx]`` loads a JaxTensor,
  ``ref[idx] = value`` stores (cast to the ref dtype, broadcast)."""
  __slots__ = ("_ref",)

  def __init__(self, ref):
    self._ref = ref

  @property
  def shape(self) -> torch.Size:
    return torch.Size(self._ref.shape)

  @property
  def dtype(self) -> torch.dtype:
    return torch_dtype(jc.physical_dtype(self._ref.dtype))

  @property
  def ndim(self) -> int:
    return len(self._ref.shape)

  def size(self, dim=None):
    return self.shape if dim is None else self._ref.shape[dim]

  def dim(self) -> int:
    return self.ndim

  @property
  def at(self):
    return _RefAt(self._ref)

  @property
  def jax(self):
    """The underlying JAX ref (for pl./pltpu. functions that take refs)."""
    return self._ref

  def __getitem__(self, idx):
    return JaxTensor(self._ref[unwrap(idx)])

  def __setitem__(self, idx, val):
    idx = unwrap(idx)
    val = jnp.asarray(unwrap(val))
    shape = _indexed_shape(self._ref, idx)
    if val.dtype != self._ref.dtype:
      val = val.astype(self._ref.dtype)
    if tuple(val.shape) != shape:
      val = jnp.broadcast_to(val, shape)
    self._ref[idx] = val

  def __repr__(self):
    return f"TorchRef({self._ref!r})"


class _RefAt:
  __slots__ = ("_ref",)

  def __init__(self, ref):
    self._ref = ref

  def __getitem__(self, idx):
    return TorchRef(self._ref.at[unwrap(idx)])


def _indexed_shape(ref, idx) -> tuple:
  if not isinstance(idx, tuple):
    idx = (idx,)
  indexer = jc.NDIndexer.from_indices_shape(idx, tuple(ref.shape))
  return tuple(indexer.get_indexer_shape())


# -- dispatch -------------------------------------------------------------------
def func_name(func) -> tuple[str, str]:
  name = getattr(func, "__name__", None) or str(func)
  module = getattr(func, "__module__", None) or ""
  qual = getattr(func, "__qualname__", name)
  if name.startswith("__r") and name.endswith("__") and name[3:-2] in (
      "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
      "xor", "lshift", "rshift"):
    return "__r" + name[3:-2], f"torch.Tensor.{name}"
  if name.startswith("__") and name.endswith("__"):
    base = name[2:-2]
    base = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder",
            "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor",
            "lshift": "bitwise_left_shift", "rshift": "bitwise_right_shift",
            "invert": "bitwise_not", "iadd": "add", "isub": "sub", "imul": "mul",
            "itruediv": "div"}.get(base, base)
    return base, f"torch.Tensor.{name}"
  if "Tensor" in qual or module in ("torch._tensor",):
    return name, f"torch.Tensor.{name}"
  if module.startswith("torch.nn.functional") or module == "torch._C._nn":
    return name, f"torch.nn.functional.{name}"
  if module.startswith("torch._C._"):  # torch._C._fft.fft_fft -> torch.fft.fft
    sub = module[len("torch._C._"):]
    short = name[len(sub) + 1:] if name.startswith(sub + "_") else name
    return (short if sub == "special" else name), f"torch.{sub}.{short}"
  return name, f"{module}.{name}" if module and module != "torch" else f"torch.{name}"


def call_torch_op(func, args, kwargs):
  name, qualified = func_name(func)
  if name.startswith("__r"):  # reflected operator: swap operands
    base = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder",
            "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor",
            "lshift": "bitwise_left_shift", "rshift": "bitwise_right_shift"}.get(
                name[3:], name[3:])
    return dispatch(base, qualified, (args[1], args[0]), kwargs)
  return dispatch(name, qualified, args, kwargs)


def dispatch(name, qualified, args, kwargs):
  impl = OPS.get(name)
  inplace = False
  if impl is None and name.endswith("_") and name[:-1] in INPLACE_OK:
    impl, inplace = OPS[name[:-1]], True
  if impl is None:
    raise unsupported(qualified)
  if kwargs.get("inplace") and name in INPLACE_OK:
    inplace = True
  result = impl(*unwrap(args), **unwrap(kwargs))
  if inplace:
    target = args[0]
    if not isinstance(target, JaxTensor):
      raise unsupported(f"{qualified} in place on a non-kernel tensor")
    target._value = jnp.asarray(result).astype(target._value.dtype)
    return target
  return wrap(result)
