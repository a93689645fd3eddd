"""jax.random inside kernels: key arrays, threefry2x32, random bits.

A key array is held as its uint32 key data (shape + (2,) for threefry), which
is what JAX lowers it to, so ``random_wrap``/``random_unwrap`` are identities.
The key operations (seed, split, fold_in, bits) are lowered by JAX as the PRNG
implementation's own functions traced to a jaxpr; we trace the same functions
and compile them with the same compiler, so results are bit-exact with JAX by
construction, down to the NumPy ``threefry2x32`` below.
"""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import memory, registry

prng = jc.jax_prng


def _allocate_keys(shape, dtype):
  """A fresh buffer of typed keys (a kernel output or scratch of dtype
  ``key<pl>``/``key<fry>``): its key data, zeroed."""
  phys = jc.physical_aval(jc.ShapedArray(tuple(shape), dtype))
  return np.zeros(phys.shape, np.dtype(phys.dtype))


memory.register_allocator(prng.KeyTy, _allocate_keys)


def _compile_traced(e, fn, in_avals):
  closed = jc.trace_to_jaxpr(fn, in_avals)
  plan = e.compiler.compile(closed).fn
  if any(jc.is_pallas_tpu_key(getattr(a, "dtype", None))
         for a in (*e.in_avals, *e.out_avals)):
    # pltpu's keys: their bits come from the kernel's PRNG state, and the
    # stateful key's seed function returns the int32 seed for a uint32 key.
    out_dtype = np.dtype(jc.physical_aval(e.out_aval).dtype)
    return registry.NeedsCtx(
        lambda ctx, *args: np.asarray(plan(ctx, *args)[0]).astype(out_dtype, copy=False))
  return lambda *args: plan(None, *args)[0]


_KEYS = registry.unbatched("PRNG key data carry trailing key dims: run lane by lane")


@registry.register(prng.random_seed_p, batch=_KEYS)
def _random_seed(e):
  aval, = e.in_avals
  impl = e.params["impl"]
  return _compile_traced(e, prng.iterated_vmap_unary(aval.ndim, impl.seed), [aval])


@registry.register(prng.random_split_p, batch=_KEYS)
def _random_split(e):
  aval, = e.in_avals
  impl = aval.dtype._impl
  shape = tuple(e.params["shape"])
  fn = prng.iterated_vmap_unary(aval.ndim, lambda k: impl.split(k, shape))
  return _compile_traced(e, fn, [jc.physical_aval(aval)])


@registry.register(prng.random_fold_in_p, batch=_KEYS)
def _random_fold_in(e):
  keys_aval, msgs_aval = e.in_avals
  impl = keys_aval.dtype._impl
  fn = prng.iterated_vmap_binary_bcast(keys_aval.shape, msgs_aval.shape, impl.fold_in)
  if jc.is_pallas_tpu_key(keys_aval.dtype):
    # pltpu's fold_in takes the typed key (it reads its words with
    # unwrap_pallas_seed, prng_split below) and returns one (prng_join).
    return _compile_traced(e, fn, [keys_aval, msgs_aval])
  return _compile_traced(e, fn, [jc.physical_aval(keys_aval), msgs_aval])


@registry.register(prng.random_bits_p, batch=_KEYS)
def _random_bits(e):
  aval, = e.in_avals
  impl = aval.dtype._impl
  bit_width = int(e.params["bit_width"])
  shape = tuple(e.params["shape"])
  fn = prng.iterated_vmap_unary(aval.ndim, lambda k: impl.random_bits(k, bit_width, shape))
  return _compile_traced(e, fn, [jc.physical_aval(aval)])


registry.register(prng.random_wrap_p, batch=registry.IDENTITY)(lambda e: (lambda x: x))
registry.register(prng.random_unwrap_p, batch=registry.IDENTITY)(lambda e: (lambda x: x))


@registry.register(prng.iota_2x32_shape_p, batch=registry.unbatched(
    "no operands: one value for every lane, computed once per pass"))
def _iota_2x32_shape(e):
  shape = tuple(e.params["shape"])
  counts = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.uint64).reshape(shape)
  hi = (counts >> np.uint64(32)).astype(np.uint32)
  lo = counts.astype(np.uint32)
  return lambda: (hi, lo)


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry2x32(k1, k2, x1, x2):
  """Threefry-2x32 with 20 rounds (Salmon et al. 2011), as JAX computes it."""
  shape = np.broadcast_shapes(np.shape(k1), np.shape(k2), np.shape(x1), np.shape(x2))
  u32 = np.uint32
  k1, k2, x1, x2 = (np.broadcast_to(np.asarray(a, u32), shape) for a in (k1, k2, x1, x2))
  ks = [k1, k2, k1 ^ k2 ^ u32(0x1BD11BDA)]
  x = [x1 + ks[0], x2 + ks[1]]
  with np.errstate(over="ignore"):
    for i in range(5):
      for r in _ROTATIONS[i % 2]:
        x[0] = x[0] + x[1]
        x[1] = (x[1] << u32(r)) | (x[1] >> u32(32 - r))
        x[1] = x[0] ^ x[1]
      x[0] = x[0] + ks[(i + 1) % 3]
      x[1] = x[1] + ks[(i + 2) % 3] + u32(i + 1)
  return [np.asarray(x[0], u32), np.asarray(x[1], u32)]


registry.register(jc.jax_threefry.threefry2x32_p, batch=registry.ELEMENTWISE)(lambda e: threefry2x32)


# pltpu's key <-> scalars (``unwrap_pallas_seed``/``wrap_pallas_seed``): a
# pallas_tpu key's data is uint32[..., 1, N]; the scalars are its N words.
_split_key_p = getattr(jc.mosaic_primitives, "split_key_p", None)
_join_key_p = getattr(jc.mosaic_primitives, "join_key_p", None)
_SCALAR_KEYS = registry.unbatched("pltpu key words: scalars of one key, run lane by lane")

if _split_key_p is not None:
  @registry.register(_split_key_p, batch=_SCALAR_KEYS)
  def _split_key(e):
    n = len(e.out_avals)

    def split_key(key):
      words = np.asarray(key, np.uint32).reshape(-1)
      return tuple(np.uint32(words[i]) for i in range(n))
    return split_key

if _join_key_p is not None:
  @registry.register(_join_key_p, batch=_SCALAR_KEYS)
  def _join_key(e):
    shape = tuple(jc.physical_aval(e.out_aval).shape)

    def join_key(*words):
      return np.asarray(words, np.uint32).reshape(shape)
    return join_key
