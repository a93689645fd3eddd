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
  the table below, which maps each torch op onto ``jax.numpy``/``lax``;
* a ``TorchFunctionMode`` active only during tracing maps factory functions
  (``torch.zeros``, ``torch.arange``, ``torch.full`` ...) the same way.

An op outside the table raises ``UnsupportedTorchOpError`` (an
``UnsupportedError``) naming the op and the kernel line. Semantics follow
torch except that dtype promotion is JAX's (identical for same-kind
operands) and, as in JAX without x64, int64/float64 become int32/float32.
In-place methods (``x.add_(y)``) rebind the wrapper; views do not alias.
"""
from __future__ import annotations

import collections
import functools
import os
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from torch.overrides import TorchFunctionMode

from pallas_np import _compat as jc
from pallas_np.errors import UnsupportedError
from pallas_np.torch.convert import numpy_dtype_to_torch, to_numpy, torch_dtype_to_numpy


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


def _unsupported(what: str) -> UnsupportedTorchOpError:
  return UnsupportedTorchOpError(
      f"pallas_np.torch: torch op '{what}' is not mapped onto JAX for kernels "
      f"written with torch ops (at {_user_site()}); "
      "see pallas_np.torch.covered_torch_ops() for the ops that are")


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
  return _dispatch(name, f"torch.Tensor.{name}", (self, *args), kwargs)


def _binary_dunder(name, swap=False):
  def method(self, other):
    args = (other, self) if swap else (self, other)
    return _dispatch(name, f"torch.Tensor.__{'r' if swap else ''}{name}__", args, {})
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
JaxTensor.__neg__ = lambda self: _dispatch("neg", "torch.Tensor.__neg__", (self,), {})
JaxTensor.__pos__ = lambda self: self
JaxTensor.__abs__ = lambda self: _dispatch("abs", "torch.Tensor.__abs__", (self,), {})
JaxTensor.__invert__ = lambda self: _dispatch("bitwise_not", "torch.Tensor.__invert__", (self,), {})
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


# -- the op table --------------------------------------------------------------
_OPS: dict[str, Callable] = {}
_INPLACE_OK = set()


def _op(*names):
  def deco(fn):
    for n in names:
      _OPS[n] = fn
    return fn
  return deco


def covered_torch_ops() -> list[str]:
  """Names of the torch ops (functions, Tensor methods, ``F.*``) that kernels
  written with torch ops may use; ``name_`` in-place variants of the
  element-wise ones work too."""
  return sorted(_OPS)


def _axis(dim):
  if isinstance(dim, (list, tuple)):
    return tuple(dim)
  return dim


def _astype(x, dtype):
  dt = jax_dtype(dtype)
  return x if dt is None else x.astype(dt)


# element-wise binary
@_op("add")
def _add(input, other, *, alpha=1, out=None):
  _no_out(out)
  return input + other * alpha if alpha != 1 else jnp.add(input, other)


@_op("sub", "subtract")
def _sub(input, other, *, alpha=1, out=None):
  _no_out(out)
  return input - other * alpha if alpha != 1 else jnp.subtract(input, other)


@_op("rsub")
def _rsub(input, other, *, alpha=1):
  return other - input * alpha


@_op("mul", "multiply")
def _mul(input, other, *, out=None):
  _no_out(out)
  return jnp.multiply(input, other)


@_op("div", "divide", "true_divide")
def _div(input, other, *, rounding_mode=None, out=None):
  _no_out(out)
  if rounding_mode is None:
    return jnp.true_divide(input, other)
  if rounding_mode == "floor":
    return jnp.floor_divide(input, other)
  if rounding_mode == "trunc":
    if jnp.issubdtype(jnp.result_type(input, other), jnp.integer):
      return lax.div(*jnp.broadcast_arrays(*_promote(input, other)))  # rounds to zero
    return jnp.trunc(jnp.true_divide(input, other))
  raise ValueError(f"div: unknown rounding_mode {rounding_mode!r}")


def _promote(*xs):
  dt = jnp.result_type(*xs)
  return [jnp.asarray(x, dt) for x in xs]


def _no_out(out):
  if out is not None:
    raise _unsupported("out= argument")


_SIMPLE_BINARY = {
    "floor_divide": jnp.floor_divide, "remainder": jnp.remainder, "fmod": jnp.fmod,
    "pow": jnp.power, "float_power": jnp.float_power, "maximum": jnp.maximum,
    "minimum": jnp.minimum, "fmax": jnp.fmax, "fmin": jnp.fmin, "atan2": jnp.arctan2,
    "arctan2": jnp.arctan2, "hypot": jnp.hypot, "copysign": jnp.copysign,
    "eq": jnp.equal, "ne": jnp.not_equal, "not_equal": jnp.not_equal, "lt": jnp.less,
    "less": jnp.less, "le": jnp.less_equal, "less_equal": jnp.less_equal,
    "gt": jnp.greater, "greater": jnp.greater, "ge": jnp.greater_equal,
    "greater_equal": jnp.greater_equal, "logical_and": jnp.logical_and,
    "logical_or": jnp.logical_or, "logical_xor": jnp.logical_xor,
    "bitwise_and": jnp.bitwise_and, "bitwise_or": jnp.bitwise_or,
    "bitwise_xor": jnp.bitwise_xor, "bitwise_left_shift": jnp.left_shift,
    "bitwise_right_shift": jnp.right_shift, "xlogy": jax.scipy.special.xlogy,
}
for _n, _f in _SIMPLE_BINARY.items():
  _op(_n)(lambda input, other, *, out=None, _f=_f: (_no_out(out), _f(input, other))[1])

_SIMPLE_UNARY = {
    "neg": jnp.negative, "negative": jnp.negative, "abs": jnp.abs, "absolute": jnp.abs,
    "exp": jnp.exp, "exp2": jnp.exp2, "expm1": jnp.expm1, "log": jnp.log, "log2": jnp.log2,
    "log10": jnp.log10, "log1p": jnp.log1p, "sqrt": jnp.sqrt, "rsqrt": lax.rsqrt,
    "square": jnp.square, "reciprocal": jnp.reciprocal, "sin": jnp.sin, "cos": jnp.cos,
    "tan": jnp.tan, "asin": jnp.arcsin, "arcsin": jnp.arcsin, "acos": jnp.arccos,
    "arccos": jnp.arccos, "atan": jnp.arctan, "arctan": jnp.arctan, "sinh": jnp.sinh,
    "cosh": jnp.cosh, "tanh": jnp.tanh, "asinh": jnp.arcsinh, "acosh": jnp.arccosh,
    "atanh": jnp.arctanh, "sigmoid": jax.nn.sigmoid, "expit": jax.nn.sigmoid,
    "erf": jax.scipy.special.erf, "erfc": jax.scipy.special.erfc,
    "erfinv": jax.scipy.special.erfinv, "floor": jnp.floor, "ceil": jnp.ceil,
    "trunc": jnp.trunc, "fix": jnp.trunc, "frac": lambda x: x - jnp.trunc(x),
    "sign": jnp.sign, "sgn": jnp.sign, "signbit": jnp.signbit,
    "logical_not": jnp.logical_not, "bitwise_not": jnp.invert, "isnan": jnp.isnan,
    "isinf": jnp.isinf, "isfinite": jnp.isfinite, "relu": jax.nn.relu,
    "relu6": jax.nn.relu6, "silu": jax.nn.silu, "mish": jax.nn.mish,
    "logsigmoid": jax.nn.log_sigmoid, "tanhshrink": lambda x: x - jnp.tanh(x),
    "conj": jnp.conj, "real": jnp.real, "imag": jnp.imag, "angle": jnp.angle,
    "lgamma": jax.scipy.special.gammaln, "digamma": jax.scipy.special.digamma,
    "i0": jax.scipy.special.i0,
}
for _n, _f in _SIMPLE_UNARY.items():
  _op(_n)(lambda input, *, inplace=False, out=None, _f=_f: (_no_out(out), _f(input))[1])
  _INPLACE_OK.add(_n)
_INPLACE_OK.update(_SIMPLE_BINARY)
_INPLACE_OK.update(("add", "sub", "subtract", "mul", "multiply", "div", "divide",
                    "true_divide", "clamp", "clip", "clamp_min", "clamp_max", "lerp",
                    "round", "nan_to_num", "fill", "zero", "copy", "masked_fill",
                    "leaky_relu", "elu", "hardtanh", "gelu", "softplus", "celu", "selu"))


@_op("round")
def _round(input, *, decimals=0):
  return jnp.round(input, decimals)


@_op("clamp", "clip")
def _clamp(input, min=None, max=None):
  if min is not None:
    input = jnp.maximum(input, jnp.asarray(min, input.dtype) if np.ndim(min) == 0 else min)
  if max is not None:
    input = jnp.minimum(input, jnp.asarray(max, input.dtype) if np.ndim(max) == 0 else max)
  return input


@_op("clamp_min")
def _clamp_min(input, min):
  return _clamp(input, min=min)


@_op("clamp_max")
def _clamp_max(input, max):
  return _clamp(input, max=max)


@_op("lerp")
def _lerp(input, end, weight):
  return input + weight * (end - input)


@_op("nan_to_num")
def _nan_to_num(input, nan=0.0, posinf=None, neginf=None):
  return jnp.nan_to_num(input, nan=nan, posinf=posinf, neginf=neginf)


@_op("where")
def _where(condition, input=None, other=None):
  if input is None or other is None:
    raise _unsupported("torch.where(condition) (data-dependent shape)")
  return jnp.where(condition, input, other)


@_op("masked_fill")
def _masked_fill(input, mask, value):
  return jnp.where(mask, jnp.asarray(value, input.dtype), input)


@_op("fill")
def _fill(input, value):
  return jnp.full_like(input, value)


@_op("zero")
def _zero(input):
  return jnp.zeros_like(input)


@_op("copy")
def _copy(input, src, non_blocking=False):
  return jnp.broadcast_to(jnp.asarray(src), input.shape).astype(input.dtype)


# activations (F.*)
@_op("gelu")
def _gelu(input, approximate="none"):
  return jax.nn.gelu(input, approximate=approximate == "tanh")


@_op("leaky_relu")
def _leaky_relu(input, negative_slope=0.01, inplace=False):
  return jax.nn.leaky_relu(input, negative_slope)


@_op("elu")
def _elu(input, alpha=1.0, inplace=False):
  return jax.nn.elu(input, alpha)


@_op("celu")
def _celu(input, alpha=1.0, inplace=False):
  return jax.nn.celu(input, alpha)


@_op("selu")
def _selu(input, inplace=False):
  return jax.nn.selu(input)


@_op("hardtanh")
def _hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False):
  return jnp.clip(input, min_val, max_val)


@_op("softplus")
def _softplus(input, beta=1.0, threshold=20.0):
  scaled = input * beta
  return jnp.where(scaled > threshold, input, jnp.log1p(jnp.exp(scaled)) / beta)


@_op("softmax")
def _softmax(input, dim=None, _stacklevel=3, dtype=None):
  return jax.nn.softmax(_astype(input, dtype), axis=-1 if dim is None else dim)


@_op("log_softmax")
def _log_softmax(input, dim=None, _stacklevel=3, dtype=None):
  return jax.nn.log_softmax(_astype(input, dtype), axis=-1 if dim is None else dim)


# reductions
def _reduction(jfn):
  def fn(input, dim=None, keepdim=False, *, dtype=None, out=None):
    _no_out(out)
    return jfn(_astype(input, dtype), axis=_axis(dim), keepdims=keepdim)
  return fn


for _n, _f in [("sum", jnp.sum), ("mean", jnp.mean), ("nansum", jnp.nansum),
               ("nanmean", jnp.nanmean), ("prod", jnp.prod)]:
  _op(_n)(_reduction(_f))


@_op("amax")
def _amax(input, dim=(), keepdim=False):
  return jnp.max(input, axis=_axis(dim) if dim != () else None, keepdims=keepdim)


@_op("amin")
def _amin(input, dim=(), keepdim=False):
  return jnp.min(input, axis=_axis(dim) if dim != () else None, keepdims=keepdim)


@_op("all")
def _all(input, dim=None, keepdim=False):
  return jnp.all(input, axis=_axis(dim), keepdims=keepdim)


@_op("any")
def _any(input, dim=None, keepdim=False):
  return jnp.any(input, axis=_axis(dim), keepdims=keepdim)


MinMax = collections.namedtuple("MinMax", ["values", "indices"])


def _minmax(reduce, arg, elementwise):
  def fn(input, dim=None, keepdim=False, *, out=None):
    _no_out(out)
    if dim is None:
      return reduce(input)
    if not isinstance(dim, (int, np.integer)):  # torch.max(x, other)
      return elementwise(input, dim)
    values = reduce(input, axis=dim, keepdims=keepdim)
    indices = arg(input, axis=dim, keepdims=keepdim).astype(jax_dtype(torch.int64))
    return MinMax(values, indices)
  return fn


_op("max")(_minmax(jnp.max, jnp.argmax, jnp.maximum))
_op("min")(_minmax(jnp.min, jnp.argmin, jnp.minimum))


@_op("argmax")
def _argmax(input, dim=None, keepdim=False):
  return jnp.argmax(input, axis=dim, keepdims=keepdim).astype(jax_dtype(torch.int64))


@_op("argmin")
def _argmin(input, dim=None, keepdim=False):
  return jnp.argmin(input, axis=dim, keepdims=keepdim).astype(jax_dtype(torch.int64))


@_op("logsumexp")
def _logsumexp(input, dim, keepdim=False):
  return jax.nn.logsumexp(input, axis=_axis(dim), keepdims=keepdim)


@_op("cumsum")
def _cumsum(input, dim, *, dtype=None):
  return jnp.cumsum(_astype(input, dtype), axis=dim)


@_op("cumprod")
def _cumprod(input, dim, *, dtype=None):
  return jnp.cumprod(_astype(input, dtype), axis=dim)


def _correction(unbiased, correction):
  if correction is not None:
    return correction
  return 1 if unbiased in (None, True) else 0


@_op("var")
def _var(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
  if isinstance(dim, bool):  # var(x, unbiased)
    dim, unbiased = None, dim
  return jnp.var(input, axis=_axis(dim), ddof=_correction(unbiased, correction),
                 keepdims=keepdim)


@_op("std")
def _std(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
  if isinstance(dim, bool):
    dim, unbiased = None, dim
  return jnp.std(input, axis=_axis(dim), ddof=_correction(unbiased, correction),
                 keepdims=keepdim)


@_op("norm")
def _norm(input, p="fro", dim=None, keepdim=False, dtype=None):
  x = _astype(input, dtype)
  if p in ("fro", 2, 2.0):
    return jnp.sqrt(jnp.sum(jnp.abs(x) ** 2, axis=_axis(dim), keepdims=keepdim))
  if p in (float("inf"), "inf"):
    return jnp.max(jnp.abs(x), axis=_axis(dim), keepdims=keepdim)
  return jnp.sum(jnp.abs(x) ** p, axis=_axis(dim), keepdims=keepdim) ** (1.0 / p)


# linear algebra
@_op("matmul", "mm", "bmm")
def _matmul(input, other, *, out=None):
  _no_out(out)
  return jnp.matmul(input, other)


@_op("dot", "inner", "vdot")
def _dot(input, other):
  return jnp.dot(input, other)


@_op("outer", "ger")
def _outer(input, vec2):
  return jnp.outer(input, vec2)


@_op("einsum")
def _einsum(equation, *operands):
  if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
    operands = operands[0]
  return jnp.einsum(equation, *operands)


@_op("addmm", "baddbmm")
def _addmm(input, mat1, mat2, *, beta=1, alpha=1):
  return beta * input + alpha * jnp.matmul(mat1, mat2)


@_op("linear")
def _linear(input, weight, bias=None):
  y = jnp.matmul(input, jnp.swapaxes(weight, -1, -2))
  return y if bias is None else y + bias


# shapes
def _shape_args(shape):
  if len(shape) == 1 and isinstance(shape[0], (list, tuple, torch.Size)):
    return tuple(shape[0])
  return tuple(shape)


@_op("reshape")
def _reshape(input, *shape):
  return jnp.reshape(input, _shape_args(shape))


@_op("view")
def _view(input, *shape, dtype=None):
  if dtype is None and len(shape) == 1 and isinstance(shape[0], (np.dtype, type)):
    dtype = shape[0]
  if dtype is not None:
    dt = jax_dtype(dtype)
    if np.dtype(dt).itemsize != np.dtype(input.dtype).itemsize:
      raise _unsupported("Tensor.view(dtype) with a different element size")
    return lax.bitcast_convert_type(input, dt)
  return jnp.reshape(input, _shape_args(shape))


@_op("view_as", "reshape_as")
def _view_as(input, other):
  return jnp.reshape(input, other.shape)


@_op("flatten")
def _flatten(input, start_dim=0, end_dim=-1):
  nd = input.ndim
  if nd == 0:
    return input.reshape(1)
  s, e = start_dim % nd, end_dim % nd
  shape = input.shape[:s] + (-1,) + input.shape[e + 1:]
  return input.reshape(shape)


@_op("unflatten")
def _unflatten(input, dim, sizes):
  dim = dim % input.ndim
  return input.reshape(input.shape[:dim] + tuple(sizes) + input.shape[dim + 1:])


@_op("squeeze")
def _squeeze(input, dim=None):
  if dim is None:
    return jnp.squeeze(input)
  dims = dim if isinstance(dim, (list, tuple)) else (dim,)
  dims = tuple(d for d in dims if input.shape[d] == 1)  # torch ignores non-1 dims
  return jnp.squeeze(input, dims) if dims else input


@_op("unsqueeze")
def _unsqueeze(input, dim):
  return jnp.expand_dims(input, dim)


@_op("transpose", "swapaxes", "swapdims")
def _transpose(input, dim0, dim1):
  return jnp.swapaxes(input, dim0, dim1)


@_op("t")
def _t(input):
  return jnp.transpose(input)


@_op("permute")
def _permute(input, *dims):
  return jnp.transpose(input, _shape_args(dims))


@_op("movedim", "moveaxis")
def _movedim(input, source, destination):
  return jnp.moveaxis(input, source, destination)


@_op("expand")
def _expand(input, *sizes):
  sizes = _shape_args(sizes)
  lead = len(sizes) - input.ndim
  shape = tuple(input.shape[i - lead] if s == -1 else s for i, s in enumerate(sizes))
  return jnp.broadcast_to(input, shape)


@_op("expand_as")
def _expand_as(input, other):
  return jnp.broadcast_to(input, other.shape)


@_op("broadcast_to")
def _broadcast_to(input, size):
  return jnp.broadcast_to(input, tuple(size))


@_op("repeat")
def _repeat(input, *sizes):
  sizes = _shape_args(sizes)
  x = input.reshape((1,) * (len(sizes) - input.ndim) + input.shape)
  return jnp.tile(x, sizes)


@_op("tile")
def _tile(input, dims):
  return jnp.tile(input, tuple(dims))


@_op("repeat_interleave")
def _repeat_interleave(input, repeats, dim=None, *, output_size=None):
  if not isinstance(repeats, int):
    raise _unsupported("repeat_interleave with tensor repeats")
  return jnp.repeat(input, repeats, axis=dim)


@_op("cat", "concat", "concatenate")
def _cat(tensors, dim=0, *, out=None):
  _no_out(out)
  return jnp.concatenate(list(tensors), axis=dim)


@_op("stack")
def _stack(tensors, dim=0, *, out=None):
  _no_out(out)
  # Via concatenate: keeps the kernel to primitives every interpreter has.
  return jnp.concatenate([jnp.expand_dims(t, dim) for t in tensors], axis=dim)


@_op("split")
def _split(input, split_size_or_sections, dim=0):
  n = input.shape[dim]
  if isinstance(split_size_or_sections, int):
    cuts = list(range(split_size_or_sections, n, split_size_or_sections))
  else:
    cuts = list(np.cumsum(split_size_or_sections)[:-1])
  return tuple(jnp.split(input, cuts, axis=dim))


@_op("chunk")
def _chunk(input, chunks, dim=0):
  n = input.shape[dim]
  size = -(-n // chunks)
  return _split(input, size, dim)


@_op("unbind")
def _unbind(input, dim=0):
  return tuple(jnp.moveaxis(input, dim, 0))


@_op("narrow")
def _narrow(input, dim, start, length):
  return lax.slice_in_dim(input, start, start + length, axis=dim)


@_op("flip")
def _flip(input, dims):
  return jnp.flip(input, tuple(dims) if isinstance(dims, (list, tuple)) else dims)


@_op("roll")
def _roll(input, shifts, dims=None):
  return jnp.roll(input, shifts, axis=dims)


@_op("tril")
def _tril(input, diagonal=0):
  return jnp.tril(input, diagonal)


@_op("triu")
def _triu(input, diagonal=0):
  return jnp.triu(input, diagonal)


@_op("gather")
def _gather(input, dim, index, *, sparse_grad=False):
  return jnp.take_along_axis(input, index, axis=dim)


@_op("index_select")
def _index_select(input, dim, index):
  return jnp.take(input, index, axis=dim)


@_op("take_along_dim")
def _take_along_dim(input, indices, dim=None):
  if dim is None:
    return jnp.take(input.reshape(-1), indices.reshape(-1))
  return jnp.take_along_axis(input, indices, axis=dim)


# dtype conversion and identity-like methods
def _dtype_in(args, kwargs):
  if kwargs.get("dtype") is not None:
    return kwargs["dtype"]
  for a in args:
    if isinstance(a, (torch.dtype, np.dtype)):
      return a
    if isinstance(a, (jax.Array, jc.Tracer)):  # .to(other_tensor)
      return a.dtype
  return None


@_op("to")
def _to(input, *args, **kwargs):
  return _astype(input, _dtype_in(args, kwargs))


@_op("type")
def _type(input, dtype=None, non_blocking=False):
  if dtype is None:
    raise _unsupported("Tensor.type() without a dtype")
  return _astype(input, dtype)


@_op("type_as")
def _type_as(input, other):
  return input.astype(other.dtype)


for _n, _dt in [("float", torch.float32), ("double", torch.float64), ("half", torch.float16),
                ("bfloat16", torch.bfloat16), ("int", torch.int32), ("long", torch.int64),
                ("short", torch.int16), ("char", torch.int8), ("byte", torch.uint8),
                ("bool", torch.bool)]:
  _op(_n)(lambda input, memory_format=None, _dt=_dt: _astype(input, _dt))

for _n in ("contiguous", "clone", "detach", "cpu", "requires_grad_", "cuda"):
  _op(_n)(lambda input, *args, **kwargs: input)


# factories (reached through the kernel-tracing mode)
def _factory_dtype(dtype, fill=None):
  if dtype is not None:
    return jax_dtype(dtype)
  if isinstance(fill, bool):
    return jnp.bool_
  if isinstance(fill, int):
    return jax_dtype(torch.int64)
  return jax_dtype(torch.get_default_dtype())


@_op("zeros", "empty")
def _zeros(*size, dtype=None, **_):
  return jnp.zeros(_shape_args(size), _factory_dtype(dtype))


@_op("ones")
def _ones(*size, dtype=None, **_):
  return jnp.ones(_shape_args(size), _factory_dtype(dtype))


@_op("full")
def _full(size, fill_value, *, dtype=None, **_):
  return jnp.full(tuple(size), fill_value, _factory_dtype(dtype, fill_value))


@_op("zeros_like", "empty_like")
def _zeros_like(input, *, dtype=None, **_):
  return jnp.zeros(input.shape, jax_dtype(dtype) or input.dtype)


@_op("ones_like")
def _ones_like(input, *, dtype=None, **_):
  return jnp.ones(input.shape, jax_dtype(dtype) or input.dtype)


@_op("full_like")
def _full_like(input, fill_value, *, dtype=None, **_):
  return jnp.full(input.shape, fill_value, jax_dtype(dtype) or input.dtype)


@_op("arange")
def _arange(start, end=None, step=1, *, dtype=None, **_):
  if end is None:
    start, end = 0, start
  if dtype is None:
    is_int = all(isinstance(v, (int, np.integer)) for v in (start, end, step))
    dtype = torch.int64 if is_int else torch.get_default_dtype()
  return jnp.arange(start, end, step, dtype=jax_dtype(dtype))


@_op("linspace")
def _linspace(start, end, steps, *, dtype=None, **_):
  return jnp.linspace(start, end, steps, dtype=_factory_dtype(dtype, 0.0))


@_op("eye")
def _eye(n, m=None, *, dtype=None, **_):
  return jnp.eye(n, m, dtype=_factory_dtype(dtype, 0.0))


@_op("tensor", "as_tensor")
def _tensor(data, *, dtype=None, **_):
  host = np.asarray(unwrap(data)) if not isinstance(data, (jax.Array, jc.Tracer)) else None
  if host is None or host.dtype == object:
    arr = jnp.asarray(data)
  else:
    if dtype is None:
      dtype = (torch.get_default_dtype() if host.dtype.kind == "f" else
               torch.int64 if host.dtype.kind in "iu" else host.dtype)
    dt = jax_dtype(dtype)
    # Pallas kernels cannot capture array constants: build it from scalars.
    flat = [jnp.full((1,), v, dt) for v in host.reshape(-1).tolist()]
    arr = (jnp.concatenate(flat) if flat else jnp.zeros((0,), dt)).reshape(host.shape)
  return arr if dtype is None else arr.astype(jax_dtype(dtype))


_FACTORIES = {"zeros", "empty", "ones", "full", "arange", "linspace", "eye", "tensor",
              "as_tensor", "zeros_like", "empty_like", "ones_like", "full_like"}


# -- dispatch -------------------------------------------------------------------
def _func_name(func) -> tuple[str, str]:
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
  name, qualified = _func_name(func)
  if name.startswith("__r"):  # reflected operator: swap operands
    base = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder",
            "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor",
            "lshift": "bitwise_left_shift", "rshift": "bitwise_right_shift"}.get(
                name[3:], name[3:])
    return _dispatch(base, qualified, (args[1], args[0]), kwargs)
  return _dispatch(name, qualified, args, kwargs)


def _dispatch(name, qualified, args, kwargs):
  impl = _OPS.get(name)
  inplace = False
  if impl is None and name.endswith("_") and name[:-1] in _INPLACE_OK:
    impl, inplace = _OPS[name[:-1]], True
  if impl is None:
    raise _unsupported(qualified)
  if kwargs.get("inplace") and name in _INPLACE_OK:
    inplace = True
  result = impl(*unwrap(args), **unwrap(kwargs))
  if inplace:
    target = args[0]
    if not isinstance(target, JaxTensor):
      raise _unsupported(f"{qualified} in place on a non-kernel tensor")
    target._value = jnp.asarray(result).astype(target._value.dtype)
    return target
  return wrap(result)


class KernelTorchMode(TorchFunctionMode):
  """Active while a torch-op kernel is traced: factory functions produce
  JaxTensors; ops on JaxTensors go to the table; everything else is torch."""

  def __torch_function__(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if any(t is JaxTensor for t in types) or _has_jax(args) or _has_jax(kwargs):
      return call_torch_op(func, args, kwargs)
    name, qualified = _func_name(func)
    if name in _FACTORIES:
      return _dispatch(name, qualified, args, kwargs)
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
