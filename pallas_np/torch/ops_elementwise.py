"""Element-wise torch ops: arithmetic, comparisons, math functions, clamping
and masking, activations (``F.*``) and softmax; and which of them have
in-place (``name_``) variants.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_np.torch.ops_table import INPLACE_OK, no_out, op, unsupported
from pallas_np.torch.values import astype


# element-wise binary
@op("add")
def _add(input, other, *, alpha=1, out=None):
  no_out(out)
  return input + other * alpha if alpha != 1 else jnp.add(input, other)


@op("sub", "subtract")
def _sub(input, other, *, alpha=1, out=None):
  no_out(out)
  return input - other * alpha if alpha != 1 else jnp.subtract(input, other)


@op("rsub")
def _rsub(input, other, *, alpha=1):
  return other - input * alpha


@op("mul", "multiply")
def _mul(input, other, *, out=None):
  no_out(out)
  return jnp.multiply(input, other)


@op("div", "divide", "true_divide")
def _div(input, other, *, rounding_mode=None, out=None):
  no_out(out)
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
  op(_n)(lambda input, other, *, out=None, _f=_f: (no_out(out), _f(input, other))[1])

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
  op(_n)(lambda input, *, inplace=False, out=None, _f=_f: (no_out(out), _f(input))[1])
  INPLACE_OK.add(_n)
INPLACE_OK.update(_SIMPLE_BINARY)
INPLACE_OK.update(("add", "sub", "subtract", "mul", "multiply", "div", "divide",
                    "true_divide", "clamp", "clip", "clamp_min", "clamp_max", "lerp",
                    "round", "nan_to_num", "fill", "zero", "copy", "masked_fill",
                    "leaky_relu", "elu", "hardtanh", "gelu", "softplus", "celu", "selu"))


@op("round")
def _round(input, *, decimals=0):
  return jnp.round(input, decimals)


@op("clamp", "clip")
def _clamp(input, min=None, max=None):
  if min is not None:
    input = jnp.maximum(input, jnp.asarray(min, input.dtype) if np.ndim(min) == 0 else min)
  if max is not None:
    input = jnp.minimum(input, jnp.asarray(max, input.dtype) if np.ndim(max) == 0 else max)
  return input


@op("clamp_min")
def _clamp_min(input, min):
  return _clamp(input, min=min)


@op("clamp_max")
def _clamp_max(input, max):
  return _clamp(input, max=max)


@op("lerp")
def _lerp(input, end, weight):
  return input + weight * (end - input)


@op("nan_to_num")
def _nan_to_num(input, nan=0.0, posinf=None, neginf=None):
  return jnp.nan_to_num(input, nan=nan, posinf=posinf, neginf=neginf)


@op("where")
def _where(condition, input=None, other=None):
  if input is None or other is None:
    raise unsupported("torch.where(condition) (data-dependent shape)")
  return jnp.where(condition, input, other)


@op("masked_fill")
def _masked_fill(input, mask, value):
  return jnp.where(mask, jnp.asarray(value, input.dtype), input)


@op("fill")
def _fill(input, value):
  return jnp.full_like(input, value)


@op("zero")
def _zero(input):
  return jnp.zeros_like(input)


@op("copy")
def _copy(input, src, non_blocking=False):
  return jnp.broadcast_to(jnp.asarray(src), input.shape).astype(input.dtype)


# activations (F.*)
@op("gelu")
def _gelu(input, approximate="none"):
  return jax.nn.gelu(input, approximate=approximate == "tanh")


@op("leaky_relu")
def _leaky_relu(input, negative_slope=0.01, inplace=False):
  return jax.nn.leaky_relu(input, negative_slope)


@op("elu")
def _elu(input, alpha=1.0, inplace=False):
  return jax.nn.elu(input, alpha)


@op("celu")
def _celu(input, alpha=1.0, inplace=False):
  return jax.nn.celu(input, alpha)


@op("selu")
def _selu(input, inplace=False):
  return jax.nn.selu(input)


@op("hardtanh")
def _hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False):
  return jnp.clip(input, min_val, max_val)


@op("softplus")
def _softplus(input, beta=1.0, threshold=20.0):
  scaled = input * beta
  return jnp.where(scaled > threshold, input, jnp.log1p(jnp.exp(scaled)) / beta)


@op("softmax")
def _softmax(input, dim=None, _stacklevel=3, dtype=None):
  return jax.nn.softmax(astype(input, dtype), axis=-1 if dim is None else dim)


@op("log_softmax")
def _log_softmax(input, dim=None, _stacklevel=3, dtype=None):
  return jax.nn.log_softmax(astype(input, dtype), axis=-1 if dim is None else dim)
