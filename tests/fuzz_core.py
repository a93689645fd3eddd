"""Differential fuzzing core: random elementwise / reduction / scan / shape /
gather-scatter / sort / ref-indexing kernels over random shapes and dtypes,
numpy mode vs interpret=True.

One hypothesis example is one kernel computing many independent ops (each op
writes its own output ref), so one interpret=True compile checks many cases.
A *case* is one op's output compared. Integer and bool results must be
bit-exact, float results too (raw bits: -0.0 is not +0.0, NaN matches NaN
whatever its payload), except the ops where XLA has an approximation numpy
mode does not reproduce ("xla_ulp": within pallas_np.conformance's bound)
and float sums (scaled by the input magnitude; zero signs still compared).
Inputs mix in ±0, ±inf, NaN, the extremes and denormals of every float dtype.
XLA's CPU backend flushes float32 denormals (those of bf16 too: its math runs
in float32), NumPy does not (docs/limits.md): a float32-range denormal
numpy mode returns where XLA returns the zero of its sign passes (any other
denormal must match bit for bit), and at positions where an elementwise op
reads a float32 denormal its result is not compared (XLA reads it as zero);
ops that mix positions (reductions, sorts, ...) read inputs whose float32
denormals were flushed beforehand.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from jax import lax
from jax.experimental import pallas as pl

FLOATS = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)]
INTS = [np.dtype(t) for t in (np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32)]
CONVERT_TARGETS = FLOATS + INTS + [np.dtype(np.bool_), np.dtype(ml_dtypes.float8_e4m3fn),
                                   np.dtype(ml_dtypes.float8_e5m2)]


@dataclasses.dataclass
class Op:
  name: str
  fn: Callable  # (x_ref, y_ref, i_ref) -> array
  kind: str     # "exact", "ulp" (IEEE arithmetic: exact too), "xla_ulp", "sum"
  elementwise: bool = False  # output position k reads input position k only


def _is_float(dt):
  return dt in FLOATS


# -- op catalogue ------------------------------------------------------------
# "exact": bit-exact with XLA of every version CI tests (pallas_np.conformance's
# BIT_EXACT: its formulas and C library calls follow the installed XLA);
# "xla_ulp": XLA's own approximations numpy mode does not reproduce, within
# the bound pallas_np.conformance claims for the primitive and dtype.
UNARY_F = {
    "neg": (jnp.negative, "exact"), "abs": (jnp.abs, "exact"), "floor": (jnp.floor, "exact"),
    "ceil": (jnp.ceil, "exact"), "round": (jnp.round, "exact"),
    "round_away": (lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO), "exact"),
    "sign": (jnp.sign, "exact"), "square": (jnp.square, "ulp"), "sqrt": (jnp.sqrt, "ulp"),
    "rsqrt": (lax.rsqrt, "xla_ulp"), "exp": (jnp.exp, "exact"),
    "exp2": (jnp.exp2, "exact"),
    "log": (jnp.log, "exact"), "log1p": (jnp.log1p, "exact"),
    "expm1": (jnp.expm1, "xla_ulp"), "tanh": (jnp.tanh, "exact"),
    "logistic": (jax.nn.sigmoid, "exact"), "sin": (jnp.sin, "exact"),
    "cos": (jnp.cos, "exact"), "atan": (jnp.arctan, "xla_ulp"),
    "erf": (lax.erf, "xla_ulp"), "is_finite": (jnp.isfinite, "exact"),
    "ipow2": (lambda x: lax.integer_pow(x, 2), "ulp"),
    "ipow3": (lambda x: lax.integer_pow(x, 3), "ulp"),
    "recip": (lambda x: 1 / x, "ulp"), "relu": (jax.nn.relu, "exact"),
}
BINARY_F = {
    "add": (jnp.add, "ulp"), "sub": (jnp.subtract, "ulp"), "mul": (jnp.multiply, "ulp"),
    "div": (jnp.divide, "ulp"), "max": (lax.max, "exact"), "min": (lax.min, "exact"),
    "rem": (lax.rem, "ulp"), "pow": (lax.pow, "exact"),
    "atan2": (jnp.arctan2, "exact"), "nextafter": (jnp.nextafter, "exact"),
    "eq": (jnp.equal, "exact"), "lt": (jnp.less, "exact"), "ge": (jnp.greater_equal, "exact"),
    "where": (lambda x, y: jnp.where(x > y, x, y * 2), "ulp"),
    "clamp": (lambda x, y: lax.clamp(jnp.minimum(y, 0).astype(x.dtype), x,
                                     jnp.maximum(y, 0).astype(x.dtype)), "exact"),
}
_UNARY_I = {
    "neg": lambda x: -x, "not": lambda x: ~x, "popcnt": lax.population_count, "clz": lax.clz,
    "sign": lax.sign, "ipow2": lambda x: lax.integer_pow(x, 2),
    "abs": lambda x: lax.abs(x) if jnp.issubdtype(x.dtype, jnp.signedinteger) else x,
}
_BINARY_I = {
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "div": lax.div, "rem": lax.rem,
    "and": jnp.bitwise_and, "or": jnp.bitwise_or, "xor": jnp.bitwise_xor, "max": lax.max,
    "min": lax.min, "shl": lax.shift_left, "shr_l": lax.shift_right_logical,
    "shr_a": lax.shift_right_arithmetic, "eq": jnp.equal, "lt": jnp.less,
    "mulhi": lax.mulhi,
}


def _value(ref):
  return ref[...]


def draw_ops(draw, dtype, shape, n_ops) -> list[Op]:
  """Draw ``n_ops`` ops applicable to inputs of ``dtype``/``shape``."""
  ndim = len(shape)
  families = ["unary", "binary", "convert", "reduce", "scan", "shape", "gather",
              "scatter", "sort", "ref_index", "dynamic_slice", "narrow_convert"]
  ops = []
  for _ in range(n_ops):
    fam = draw(st.sampled_from(families))
    ops.append(_draw_op(draw, fam, dtype, shape, ndim))
  return ops


def _draw_fn(draw, isf, float_table, int_table):
  """(name, fn, comparison kind) from the float table (fn, kind) or the
  integer table (fn; integers compare exactly)."""
  if isf:
    name = draw(st.sampled_from(sorted(float_table)))
    f, kind = float_table[name]
    return name, f, kind
  name = draw(st.sampled_from(sorted(int_table)))
  return name, int_table[name], "exact"


def _draw_op(draw, fam, dtype, shape, ndim) -> Op:
  isf = _is_float(dtype)
  axis = draw(st.integers(0, ndim - 1))
  if fam == "unary":
    name, f, kind = _draw_fn(draw, isf, UNARY_F, _UNARY_I)
    return Op(name, lambda x, y, i, f=f: f(x[...]), kind, True)
  if fam == "binary":
    name, f, kind = _draw_fn(draw, isf, BINARY_F, _BINARY_I)
    swap = draw(st.booleans())
    if swap:
      return Op(name + "_swapped", lambda x, y, i, f=f: f(y[...], x[...]), kind, True)
    return Op(name, lambda x, y, i, f=f: f(x[...], y[...]), kind, True)
  if fam == "narrow_convert":
    return draw_narrow_convert(draw)
  if fam == "convert":
    to = draw(st.sampled_from(CONVERT_TARGETS))
    return Op(f"convert_{to.name}", lambda x, y, i, to=to: lax.convert_element_type(x[...], to),
              "exact", True)
  if fam == "reduce":
    choices = ["sum", "max", "min", "argmax", "argmin"]
    if not isf:
      choices += ["prod", "and", "or", "xor"]
    name = draw(st.sampled_from(choices))
    f = {"sum": lambda v: jnp.sum(v, axis=axis), "max": lambda v: jnp.max(v, axis=axis),
         "min": lambda v: jnp.min(v, axis=axis), "argmax": lambda v: jnp.argmax(v, axis=axis),
         "argmin": lambda v: jnp.argmin(v, axis=axis), "prod": lambda v: jnp.prod(v, axis=axis),
         "and": lambda v: lax.reduce_and(v, (axis,)), "or": lambda v: lax.reduce_or(v, (axis,)),
         "xor": lambda v: lax.reduce_xor(v, (axis,))}[name]
    kind = "sum" if name in ("sum",) and isf else "exact"
    return Op(f"reduce_{name}_{axis}", lambda x, y, i, f=f: f(x[...]), kind)
  if fam == "scan":
    name = draw(st.sampled_from(["cumsum", "cummax", "cummin"]))
    reverse = draw(st.booleans())
    f = {"cumsum": lax.cumsum, "cummax": lax.cummax, "cummin": lax.cummin}[name]
    kind = "sum" if name == "cumsum" and isf else "exact"
    return Op(f"{name}_{axis}_{reverse}",
              lambda x, y, i, f=f: f(x[...], axis=axis, reverse=reverse), kind)
  if fam == "shape":
    name = draw(st.sampled_from(["transpose", "rev", "slice", "pad", "concat", "reshape",
                                 "broadcast", "select_n"]))
    if name == "transpose":
      perm = tuple(draw(st.permutations(range(ndim))))
      return Op(f"transpose{perm}", lambda x, y, i: jnp.transpose(x[...], perm), "exact")
    if name == "rev":
      dims = tuple(sorted(set(draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim)))))
      return Op(f"rev{dims}", lambda x, y, i: lax.rev(x[...], dims), "exact")
    if name == "slice":
      starts, limits, strides = [], [], []
      for n in shape:
        s = draw(st.integers(0, n - 1))
        l = draw(st.integers(s + 1, n))
        starts.append(s); limits.append(l); strides.append(draw(st.integers(1, 3)))
      return Op(f"slice{starts}{limits}{strides}",
                lambda x, y, i: lax.slice(x[...], starts, limits, strides), "exact")
    if name == "pad":
      cfg = []
      for n in shape:
        lo = draw(st.integers(-(n - 1) // 2, 2))
        hi = draw(st.integers(-(n - 1) // 2, 2))
        cfg.append((lo, hi, draw(st.integers(0, 2))))
      return Op(f"pad{cfg}", lambda x, y, i: lax.pad(x[...], jnp.zeros((), x.dtype) + 1, cfg),
                "exact")
    if name == "concat":
      return Op(f"concat{axis}", lambda x, y, i: jnp.concatenate([x[...], y[...]], axis=axis),
                "exact")
    if name == "reshape":
      return Op("reshape", lambda x, y, i: x[...].reshape(-1)[::-1], "exact")
    if name == "broadcast":
      return Op("broadcast", lambda x, y, i: lax.broadcast_in_dim(
          x[...], (2, *shape), tuple(range(1, ndim + 1))), "exact")
    return Op("select_n", lambda x, y, i: lax.select_n(x[...] < y[...], x[...], y[...]),
              "exact")
  if fam == "gather":
    mode = draw(st.sampled_from(["index", "clip", "fill"]))
    def gather(x, y, i, mode=mode):
      idx = i[...] % (shape[axis] + 3) - 2
      if mode == "index":  # plain x[idx]: negative wraps, out of range clamps
        return jnp.moveaxis(jnp.moveaxis(x[...], axis, 0)[idx], 0, axis)
      return jnp.take(x[...], idx, axis=axis, mode=mode)
    return Op(f"gather_{axis}_{mode}", gather, "exact")
  if fam == "scatter":
    mode = draw(st.sampled_from(["drop", "clip"]))
    how = draw(st.sampled_from(["set", "add", "max", "min"]))
    def scatter(x, y, i, mode=mode, how=how):
      idx = i[...] % (shape[0] + 2) - 1
      upd = y[...][:1] if shape[0] else y[...]
      upd = jnp.broadcast_to(upd, (idx.shape[0], *shape[1:]))
      at = x[...].at[idx]
      if how == "set":
        # duplicate indices make "set" order-dependent: use unique ones
        return x[...].at[jnp.arange(min(shape[0], 2))].set(upd[:min(shape[0], 2)], mode=mode)
      return getattr(at, how)(upd, mode=mode)
    return Op(f"scatter_{how}_{mode}", scatter, "sum" if isf and how == "add" else "exact")
  if fam == "sort":
    name = draw(st.sampled_from(["sort", "argsort", "sort2", "top_k"]))
    if name == "sort":
      return Op(f"sort{axis}", lambda x, y, i: jnp.sort(x[...], axis=axis), "exact")
    if name == "argsort":
      return Op(f"argsort{axis}", lambda x, y, i: jnp.argsort(x[...], axis=axis, stable=True),
                "exact")
    if name == "sort2":
      return Op(f"sort2_{axis}", lambda x, y, i: lax.sort((x[...], y[...]), dimension=axis,
                                                           num_keys=1, is_stable=True)[1], "exact")
    k = draw(st.integers(1, shape[-1]))
    return Op(f"top_k{k}", lambda x, y, i: lax.top_k(x[...], k)[1], "exact")
  if fam == "ref_index":
    idx = []
    for n in shape:
      kind = draw(st.sampled_from(["full", "int", "ds", "ds_stride"]))
      if kind == "full":
        idx.append(slice(None))
      elif kind == "int":
        idx.append(draw(st.integers(0, n - 1)))
      else:
        stride = 1 if kind == "ds" else draw(st.integers(2, 3))
        size = draw(st.integers(1, max(1, (n - 1) // stride + 1)))
        start = draw(st.integers(0, n - ((size - 1) * stride + 1)))
        idx.append(pl.ds(start, size, stride=stride))
    if any(isinstance(d, pl.Slice) and d.stride > 1 for d in idx):
      # interpret=True (JAX 0.10) cannot discharge a strided pl.ds mixed with
      # an int index ("Invalid type of idxer"); tests/test_cov_state_misc.py
      # checks that form against NumPy instead.
      idx = [pl.ds(d, 1) if isinstance(d, int) else d for d in idx]
    idx = tuple(idx)
    return Op(f"ref{idx}", lambda x, y, i: x[idx], "exact")
  # dynamic_slice with a data-dependent (possibly out-of-range) start: clamps.
  sizes = tuple(draw(st.integers(1, n)) for n in shape)
  def dyn(x, y, i):
    starts = [i[k % i.shape[0]] % 7 - 2 for k in range(ndim)]
    return lax.dynamic_slice(x[...], starts, sizes)
  return Op(f"dynamic_slice{sizes}", dyn, "exact")


# -- sub-byte and float8 conversions (issue 27) ---------------------------------
def _jnp_types(names):
  return [np.dtype(getattr(jnp, n)) for n in names if hasattr(jnp, n)]


SUB_BYTE_INTS = _jnp_types(["int2", "uint2", "int4", "uint4"])
NARROW_FLOATS = _jnp_types(["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                            "float8_e4m3b11fnuz", "float8_e4m3", "float8_e3m4",
                            "float8_e8m0fnu", "float4_e2m1fn"])
NARROW_TARGETS = SUB_BYTE_INTS + NARROW_FLOATS


def draw_narrow_convert(draw) -> Op:
  """x -> a sub-byte int or narrow float -> maybe a second narrow type ->
  maybe back to a wide type: saturation, wrap-around, rounding and NaN
  handling of each hop, compared exactly (NaN positions, not payloads)."""
  chain = [draw(st.sampled_from(NARROW_TARGETS))]
  if draw(st.booleans()):
    chain.append(draw(st.sampled_from(NARROW_TARGETS + CONVERT_TARGETS)))
  if draw(st.booleans()):
    chain.append(draw(st.sampled_from([np.dtype(np.float32), np.dtype(np.int32),
                                       np.dtype(np.uint8), np.dtype(np.bool_)])))
  def fn(x, y, i, chain=tuple(chain)):
    v = x[...]
    if len(chain) > 1 and v.dtype.kind in "iu" and chain[0] in NARROW_FLOATS:
      # XLA's CPU backend is inconsistent here: an int -> float8 conversion
      # fused with a following one saturates on overflow, unfused it gives
      # NaN (int16 100 -> e4m3b11fnuz -> float4: 6.0 fused, -0.0 hop by hop;
      # an exact float32 hop in between is simplified away). pallas_np
      # follows the unfused conversion; such chains get in-range ints only
      # (docs/limits.md). Single int -> float8 hops still see overflow.
      v = jnp.clip(v, -15, 15) if v.dtype.kind == "i" else jnp.minimum(v, 15)
    for to in chain:
      v = lax.convert_element_type(v, to)
    return v
  return Op("narrow_" + "_".join(t.name for t in chain), fn, "exact", True)
# -- end sub-byte and float8 conversions -----------------------------------------


# -- inputs ---------------------------------------------------------------------
_SPECIAL_F = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, 2.5, -2.5, np.inf, -np.inf, np.nan,
              3.0, 100.0, -1e4, 1e-3, 65504.0, 7.0, -1.5, -0.25, -3.0, -7.0,
              0.49999997, -0.49999997, -np.nan]


_F32_TINY = float(np.finfo(np.float32).tiny)


def special_floats(dtype):
  """_SPECIAL_F in ``dtype`` with its extremes: ±max, ±tiny (smallest
  normal), ±smallest denormal, a mid denormal, and float32 denormals (which
  are bf16 denormals, and zero in float16)."""
  fi = ml_dtypes.finfo(dtype)
  own = [float(fi.max), float(fi.tiny), float(fi.smallest_subnormal), float(fi.tiny) / 3]
  own += [-v for v in own] + [1e-40, -1e-40, 1.4e-45, -1.4e-45, 3e38, -3e38]
  with np.errstate(over="ignore"):
    return np.array(_SPECIAL_F + own, np.float64).astype(dtype)


def flush_f32_denormals(v):
  """Float32 denormals (of float32 and bf16 arrays) to zeros of their sign,
  as XLA's CPU backend reads them; float16 denormals are normal float32s."""
  if v.dtype not in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
    return v
  f = v.astype(np.float32)
  return np.where(np.abs(f) < _F32_TINY, np.copysign(np.float32(0), f), f).astype(v.dtype)


def make_inputs(seed, dtype, shape):
  rng = np.random.default_rng(seed)
  n = int(np.prod(shape))
  def one():
    if _is_float(dtype):
      scale = rng.choice([1.0, 4.0, 50.0])
      v = (rng.standard_normal(n) * scale).astype(np.float32).astype(dtype)
      mask = rng.random(n) < 0.3
      v[mask] = rng.choice(special_floats(dtype), mask.sum())
      return v.reshape(shape)
    info = np.iinfo(dtype)
    v = rng.integers(0, 2 ** 64, n, dtype=np.uint64).astype(dtype)
    mask = rng.random(n) < 0.4
    small = rng.integers(-3, 40, n).astype(np.int64)
    v[mask] = small[mask].astype(dtype)
    special = rng.random(n) < 0.1
    v[special] = np.array(rng.choice([info.min, info.max, 0, 1]), dtype=dtype)
    return v.reshape(shape)
  x, y = one(), one()
  idx = rng.integers(0, 1000, 4).astype(np.int32)
  return x, y, idx


# -- one kernel per program ---------------------------------------------------
def run_program(dtype, shape, ops, seed):
  """Run the ops both ways; a list of (op name, error or None), or None when
  interpret=True cannot run the kernel."""
  x, y, idx = make_inputs(seed, dtype, shape)
  xf, yf = flush_f32_denormals(x), flush_f32_denormals(y)
  out_structs = _out_structs(ops, x, y, idx)

  def kernel(x_ref, y_ref, i_ref, xf_ref, yf_ref, *outs):
    for op, o in zip(ops, outs):
      if op.elementwise:
        o[...] = op.fn(x_ref, y_ref, i_ref)
      else:
        o[...] = op.fn(xf_ref, yf_ref, i_ref)

  def call(interpret):
    return pl.pallas_call(kernel, out_shape=out_structs, interpret=interpret)(x, y, idx, xf, yf)

  try:
    want = [np.asarray(w) for w in call(True)]
  except Exception:
    # The oracle itself fails (e.g. JAX 0.10's discharge of some mixed
    # int/strided ref indexers raises "Invalid type of idxer"): nothing to
    # compare against. Callers count these as skipped kernels.
    return None
  got = [np.asarray(g) for g in call("numpy")]
  # Positions where XLA reads a float32 denormal as zero (not compared in
  # elementwise results: docs/limits.md).
  daz = (x != xf) | (y != yf)
  results = []
  for op, g, w in zip(ops, got, want):
    if op.elementwise and daz.any() and g.shape == daz.shape:
      g = np.where(daz, w, g)
    results.append((op.name, compare(g, w, op.kind, xf, op.name)))
  return results


def _out_structs(ops, x, y, idx):
  structs = []
  for op in ops:
    s = jax.eval_shape(lambda x, y, i, op=op: op.fn(_ValRef(x), _ValRef(y), _ValRef(i)),
                       *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, y, idx)])
    structs.append(jax.ShapeDtypeStruct(s.shape, s.dtype))
  return structs


class _ValRef:
  """Lets an op written against refs be shape-evaluated on values."""
  def __init__(self, v):
    self.v = v
    self.shape = v.shape
    self.dtype = v.dtype

  def __getitem__(self, idx):
    if idx is Ellipsis:
      return self.v
    if isinstance(idx, tuple) and any(isinstance(d, pl.Slice) for d in idx):
      idx = tuple(slice(d.start, d.start + (d.size - 1) * d.stride + 1, d.stride)
                  if isinstance(d, pl.Slice) else d for d in idx)
    return self.v[idx]


def raw_bits(a):
  """The bit pattern of each float as an int64; every NaN as -1 (payloads
  aside: XLA and NumPy do not promise them)."""
  a = np.asarray(a)
  u = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])
  return np.where(np.isnan(a.astype(np.float64)), -1, u.astype(np.int64))


def _ordered(a):
  """The float's position on the number line in ulps (-0.0 and +0.0 both 0):
  ulp distances are differences of these."""
  a = np.asarray(a)
  bits = a.dtype.itemsize * 8
  u = a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).astype(np.int64)
  mag = u & ((1 << (bits - 1)) - 1)
  return np.where(u >> (bits - 1) == 1, -mag, mag)


def _flushed_by_xla(g, w):
  """Where ``g`` (numpy mode) is a float32-range denormal and ``w`` (XLA) the
  zero of its sign: XLA's CPU backend flushes such results (float32, and
  bf16 whose math runs in float32), numpy mode keeps them (docs/limits.md).
  Nothing else about a denormal is excused: a denormal XLA moved or kept
  must come back with the same bits."""
  if g.dtype not in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
    return np.zeros(g.shape, bool)
  gf = np.abs(g.astype(np.float64))
  return (gf > 0) & (gf < _F32_TINY) & (w == 0) & (np.signbit(g) == np.signbit(w))


def ulp_bound(kind, op_name, dtype) -> int:
  """The ulps an op of ``kind`` may be off: 0 for "exact" and "ulp" (IEEE
  arithmetic rounds as XLA does); for "xla_ulp", the bound
  pallas_np.conformance claims (and tests/test_conformance.py measures
  against XLA) for that primitive and dtype."""
  if kind != "xla_ulp":
    return 0
  from pallas_np import conformance
  return conformance.bound(_XLA_NAMES.get(op_name, op_name), np.dtype(dtype).name)


_XLA_NAMES = {}  # fuzz op name -> conformance primitive name, where they differ


def compare(g, w, kind, x, op_name="") -> str | None:
  """An error message, or None when ``g`` (numpy mode) matches ``w``.
  Floats compare by raw bits (so -0.0 is not +0.0; NaN matches NaN), except
  a float32 denormal XLA flushed to the zero of its sign; "xla_ulp" ops may
  be ``ulp_bound`` ulps apart (zero signs still compared), float sums by
  their input magnitude."""
  if g.shape != w.shape or g.dtype != w.dtype:
    return f"shape/dtype {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
  if g.dtype in SUB_BYTE_INTS:
    g, w = g.astype(np.int8), w.astype(np.int8)
  if g.dtype.kind in "biu":
    bad = g != w
    if bad.any():
      i = np.argwhere(bad)[0]
      return f"{bad.sum()} mismatches, first at {tuple(i)}: {g[tuple(i)]} vs {w[tuple(i)]}"
    return None
  ok = (raw_bits(g) == raw_bits(w)) | _flushed_by_xla(g, w)
  gn, wn = np.isnan(g.astype(np.float64)), np.isnan(w.astype(np.float64))
  if (gn != wn).any():
    i = tuple(np.argwhere(gn != wn)[0])
    return f"NaN mismatch at {i}: {g[i]} vs {w[i]}"
  gf, wf = g.astype(np.float64), w.astype(np.float64)
  # Two zeros (a float32 denormal reads as a zero, as XLA would flush it)
  # must have the same sign in every kind; the tolerances below are for the
  # rest.
  f32_range = g.dtype in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))
  tiny = _F32_TINY if f32_range else 0.0
  zero_sign_differs = ((np.abs(gf) < tiny) | (gf == 0)) & ((np.abs(wf) < tiny) | (wf == 0)) \
      & (np.signbit(gf) != np.signbit(wf))
  if kind == "xla_ulp":
    ok |= np.abs(_ordered(g) - _ordered(w)) <= ulp_bound(kind, op_name, g.dtype)
  elif kind == "sum":
    eps = float(ml_dtypes.finfo(g.dtype).eps)
    # (at least the dtype's smallest normal: a denormal result's ulp is fixed)
    scale = np.maximum(np.abs(wf), float(ml_dtypes.finfo(g.dtype).tiny))
    xs = np.abs(np.asarray(x).astype(np.float64))
    xs = xs[np.isfinite(xs)]
    scale = np.maximum(scale, (xs.max() if xs.size else 0.0) * max(x.shape))
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, not near (raw bits decide)
      ok |= np.abs(gf - wf) <= 4 * eps * scale
  ok &= ~zero_sign_differs
  if not ok.all():
    i = tuple(np.argwhere(~ok)[0])
    return f"{(~ok).sum()} mismatches, first at {i}: {g[i]!r} vs {w[i]!r} (kind {kind})"
  return None


@st.composite
def programs(draw, max_ops=12):
  dtype = draw(st.sampled_from(FLOATS + INTS))
  ndim = draw(st.integers(1, 3))
  shape = tuple(draw(st.integers(1, 7)) for _ in range(ndim))
  n_ops = draw(st.integers(max_ops // 2, max_ops))
  ops = draw_ops(draw, dtype, shape, n_ops)
  seed = draw(st.integers(0, 2 ** 31 - 1))
  return dtype, shape, ops, seed


# == issue 27 cases (aliases with scalar prefetch, static negative indices,
# masked views crossing the edge); kept apart from the op families above ====
@st.composite
def negative_index_programs(draw, max_ops=6):
  """Programs of ref reads with static negative int indices (NumPy meaning:
  counted from the end), next to slices; run with ``run_program``."""
  dtype = draw(st.sampled_from(FLOATS + INTS))
  shape = tuple(draw(st.integers(1, 6)) for _ in range(draw(st.integers(1, 3))))
  ops = []
  for _ in range(draw(st.integers(1, max_ops))):
    idx = []
    for n in shape:
      kind = draw(st.sampled_from(["full", "neg", "int", "ds"]))
      if kind == "full":
        idx.append(slice(None))
      elif kind == "neg":
        idx.append(draw(st.integers(-n, -1)))
      elif kind == "int":
        idx.append(draw(st.integers(0, n - 1)))
      else:
        size = draw(st.integers(1, n))
        idx.append(pl.ds(draw(st.integers(0, n - size)), size))
    if draw(st.booleans()) and not any(isinstance(d, pl.Slice) for d in idx):
      idx = [*idx[:-1], Ellipsis, idx[-1]] if len(idx) > 1 else [Ellipsis, idx[-1]]
    idx = tuple(idx)
    ops.append(Op(f"neg_ref{idx}", lambda x, y, i, idx=idx: x[idx], "exact"))
  return dtype, shape, ops, draw(st.integers(0, 2 ** 31 - 1))
