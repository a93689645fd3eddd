"""Loops generated as one function (``compiler.loop_codegen``), the idioms
and cheap forms that loop bodies use (``jnp.roll`` by a traced shift,
selects written into a dying operand, 0-d array constants, ``jnp.any`` as a
count): bit for bit against interpret=True, with 0/1/many iterations,
aliased carries, mixed dtypes, nesting, vectorized grids with equal and
per-lane trip counts, rolls by 0, negative and oversized shifts, integer
wrap-around and NaN/-0.0 data; and checks that the generated path is the one
that ran (each fails when its path is switched off)."""
import linecache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from pallas_np.compiler import sourcemap
from benchmarks.small_kernels import bitonic_fori_kernel as _bitonic_kernel
from tests.helpers import INLINED, assert_identical


@pytest.fixture(autouse=True)
def _fresh_plans():
  pallas_np.clear_caches()  # (the generated sources of earlier tests leave linecache)
  yield


def _loop_files(kernel_name):
  """Generated loop functions of a kernel: {file name: source}."""
  return {f: "".join(v[2]) for f, v in list(linecache.cache.items())
          if isinstance(f, str) and f.startswith("<pallas_np plan")
          and f.endswith(f"loop in {kernel_name}>")}


def _loop_eqn_names(kernel_name):
  """Primitive names of the eqns behind the generated loops' lines."""
  names = []
  for f in _loop_files(kernel_name):
    names += [e.primitive.name for e in sourcemap.lookup(f) or () if e is not None]
  return names


def _run(kernel, args, out_shape, interpret, **kw):
  return pl.pallas_call(kernel, out_shape=out_shape, interpret=interpret, **kw)(*args)


def _both(kernel, args, out_shape, params=None, **kw):
  params = params or pallas_np.InterpretParams()
  got = _run(kernel, args, out_shape, params, **kw)
  want = _run(kernel, args, out_shape, True, **kw)
  assert_identical(got, want)
  return got


def _specials(shape, dtype=np.float32, seed=0):
  x = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
  flat = x.reshape(-1)
  flat[:6] = [np.nan, -0.0, 0.0, np.inf, -np.inf, -np.nan]
  return x


@pytest.mark.parametrize("trips", [0, 1, 9])
def test_while_is_one_generated_function(trips):
  """A while loop with a cond const, body consts, carries of three dtypes
  (the input passed twice: aliased carries, one carry returned unchanged):
  interpret=True's bits, and its cond and body ran inlined in one function."""
  x = _specials((8, 128))

  def gen_while_kernel(x_ref, o_ref, p_ref):
    v = x_ref[...]
    lim = jnp.int32(trips)

    def cond(c):
      return c[0] < lim

    def body(c):
      i, a, b, same, s = c
      a = jnp.where(a > 0, a * 0.5, a - b)  # select of two fresh values: in place
      return i + 1, a, b * -1.0, same, s + jnp.int16(300)  # int16 wraps
    i, a, b, same, s = lax.while_loop(cond, body, (jnp.int32(0), v, v, v, jnp.int16(32000)))
    o_ref[...] = a + b + same
    p_ref[...] = jnp.full(p_ref.shape, s.astype(jnp.float32) + i.astype(jnp.float32))
  shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
  _both(gen_while_kernel, (x,), (shape, shape))
  files = _loop_files("gen_while_kernel")
  assert len(files) == 1
  (src,) = files.values()
  assert src.startswith("def while_loop(") and "    while True:" in src
  assert "lt" in _loop_eqn_names("gen_while_kernel")  # the cond's line, inlined


@pytest.mark.parametrize("upper", [0, 1, 4])
def test_nested_loops_generated(upper):
  """A static fori_loop (a scan) around a while-shaped one (bound depends on
  the outer index), reverse order, NaN/-0.0 data."""
  x = _specials((8, 128), seed=1)

  def gen_nested_kernel(x_ref, o_ref):
    def outer(p, acc):
      def inner(q, a):
        return jnp.maximum(a, jnp.roll(a, q + 1, axis=1)) - jnp.float32(q)
      return lax.fori_loop(0, p, inner, acc) * 0.5
    acc = lax.fori_loop(0, upper, outer, x_ref[...], unroll=False)
    o_ref[...] = lax.fori_loop(0, 3, lambda i, a: a - jnp.float32(i) * a, acc)
  _both(gen_nested_kernel, (x,), jax.ShapeDtypeStruct(x.shape, x.dtype))
  srcs = list(_loop_files("gen_nested_kernel").values())
  assert sum(s.startswith("def fori_loop(") for s in srcs) == 2
  assert sum(s.startswith("def while_loop(") for s in srcs) == 1


@pytest.mark.parametrize("shift", [0, 1, -1, -3, 127, 128, 129, 300, -300])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_roll_by_a_traced_shift(shift, axis, dtype):
  """``jnp.roll`` by a loop-carried shift: by 0, negative, equal to and
  beyond the axis size; NaN and -0.0 moved bit for bit. The roll's lines
  are one (no concatenate or dynamic_slice lines left in the loop)."""
  x = (_specials((16, 128), seed=2) if dtype == np.float32
       else np.random.default_rng(2).integers(-2**31, 2**31 - 1, (16, 128)).astype(dtype))

  def gen_roll_kernel(x_ref, o_ref):
    def body(i, c):
      return jnp.roll(c, i + shift, axis=axis) + jnp.roll(c, -i - shift, axis=axis)
    o_ref[...] = lax.fori_loop(0, 2, body, x_ref[...])
  _both(gen_roll_kernel, (x,), jax.ShapeDtypeStruct(x.shape, x.dtype))
  names = _loop_eqn_names("gen_roll_kernel")
  assert names and "concatenate" not in names and "dynamic_slice" not in names
  # Traced with jit calls inlined, the roll is a flat run of eqns: eqn by eqn.
  assert_identical(_run(gen_roll_kernel, (x,), jax.ShapeDtypeStruct(x.shape, x.dtype),
                        INLINED), _run(gen_roll_kernel, (x,),
                                       jax.ShapeDtypeStruct(x.shape, x.dtype), True))


def test_roll_look_alike_is_not_replaced():
  """A jitted function with a concatenate of its input with itself that is
  not jnp's roll body keeps its eqns."""
  @jax.jit
  def fake_roll(a, s):
    both = jnp.concatenate([a, a], axis=1)
    return lax.dynamic_slice_in_dim(both, s, a.shape[1], axis=1) * 2

  x = _specials((8, 128), seed=3)

  def gen_fake_roll_kernel(x_ref, o_ref):
    o_ref[...] = lax.fori_loop(0, 2, lambda i, c: fake_roll(c, i + 5), x_ref[...])
  _both(gen_fake_roll_kernel, (x,), jax.ShapeDtypeStruct(x.shape, x.dtype))
  assert "concatenate" in _loop_eqn_names("gen_fake_roll_kernel")


@pytest.mark.parametrize("vectorize", [False, True])
def test_bitonic_loops_in_a_vectorized_grid(vectorize):
  """Nested loops with rolls and selects, batched over 4 grid points (equal
  trip counts: the generated batched loops) and sequentially; NaN spreads
  through min/max as in XLA, -0.0 and +0.0 keep their order; rows without
  NaN come out sorted."""
  x = _specials((32, 128), seed=4)
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  got = _both(_bitonic_kernel, (x,), jax.ShapeDtypeStruct(x.shape, x.dtype),
              pallas_np.InterpretParams(vectorize=vectorize), grid=(4,), in_specs=[spec],
              out_specs=spec)
  np.testing.assert_array_equal(np.asarray(got)[1:], np.sort(x[1:], axis=-1))


def test_per_lane_trip_counts_in_a_vectorized_grid():
  """A while loop whose trip count depends on the grid point (lane groups)
  next to a fori_loop with the same count everywhere, int32 wrap-around."""
  x = np.random.default_rng(5).integers(-2**31, 2**31 - 1, (4 * 8, 128)).astype(np.int32)
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))

  def gen_lanes_kernel(x_ref, o_ref):
    i = pl.program_id(0)
    v = x_ref[...]
    _, v = lax.while_loop(lambda c: c[0] < 2 * i + 1,
                          lambda c: (c[0] + 1, c[1] * 1103515245 + 12345), (0, v))
    o_ref[...] = lax.fori_loop(0, 3, lambda k, a: (a ^ (a >> 3)) + k, v)
  _both(gen_lanes_kernel, (x,), jax.ShapeDtypeStruct(x.shape, x.dtype),
        pallas_np.InterpretParams(vectorize=True), grid=(4,), in_specs=[spec],
        out_specs=spec)


def test_collatz_any_condition_and_modulo():
  """``jnp.any`` in a while condition (one count of nonzero bytes), ``x %
  2`` (a bitwise and), ``x // 2`` and selects; every trip count from 0 up."""
  x = np.arange(1, 257, dtype=np.int32).reshape(2, 128)
  x[0, :4] = [1, 1, 27, 97]

  def gen_collatz_kernel(x_ref, o_ref):
    def body(c):
      x, steps = c
      done = x == 1
      nxt = jnp.where(x % 2 == 0, x // 2, 3 * x + 1)
      return jnp.where(done, x, nxt), steps + jnp.where(done, 0, 1)
    x = x_ref[...]
    o_ref[...] = lax.while_loop(lambda c: jnp.any(c[0] != 1), body,
                                (x, jnp.zeros_like(x)))[1]
  got = _both(gen_collatz_kernel, (x,), jax.ShapeDtypeStruct(x.shape, x.dtype))
  assert got[0, 2] == 111 and got[0, 0] == 0


@pytest.mark.parametrize("value", [0, 1, 2])
def test_all_and_any_of_bool_blocks(value):
  """``jnp.all``/``jnp.any`` of a whole bool block (count_nonzero) for all
  false, mixed and all true."""
  x = np.full((8, 128), value, np.int32)
  x[0, 0] = 1

  def gen_reduce_kernel(x_ref, o_ref):
    v = x_ref[...]
    a = jnp.all(v == 1).astype(jnp.int32)
    b = jnp.any(v == 2).astype(jnp.int32)
    c = jnp.any(v == 3).astype(jnp.int32)
    o_ref[...] = v + a * 10 + b * 100 + c * 1000
  _both(gen_reduce_kernel, (x,), jax.ShapeDtypeStruct(x.shape, x.dtype))


def test_error_in_a_generated_loop_names_the_primitive():
  """An out-of-bounds ``pl.ds`` in the 6th iteration of a generated loop
  body still names the primitive and the kernel line."""
  x = np.arange(8 * 128, dtype=np.float32).reshape(8, 128)

  def gen_oob_kernel(x_ref, o_ref):
    def body(r, acc):
      return acc + x_ref[pl.ds(r + 3, 1), :]  # BUG: r + 3 > 7 from r = 5
    o_ref[...] = jnp.broadcast_to(lax.fori_loop(0, 8, body, jnp.zeros((1, 128))), (8, 128))
  call = pallas_np.pallas_call(gen_oob_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))
  with pytest.raises(IndexError) as info:
    call(x)
  err = info.value
  assert isinstance(err, pallas_np.KernelError)
  assert err.primitive == "get"
  assert "BUG" in err.source or "r + 3" in str(err) or "gen_oob_kernel" in str(err)
  assert _loop_files("gen_oob_kernel")


def test_pdb_keeps_plans_per_body():
  """Under ``pdb`` the body runs as its own plan (every value inspectable):
  no generated loop, the same bits."""
  x = _specials((8, 128), seed=6)

  def gen_pdb_kernel(x_ref, o_ref):
    o_ref[...] = lax.fori_loop(0, 3, lambda i, a: jnp.where(a > 0, a * 2, a - 1), x_ref[...])
  _both(gen_pdb_kernel, (x,), jax.ShapeDtypeStruct(x.shape, x.dtype),
        pallas_np.InterpretParams(pdb=True))
  assert not _loop_files("gen_pdb_kernel")


def test_cheap_forms_in_a_plan():
  """The forms themselves, in a compiled plan: a select writing into its
  dying case-0 operand, a whole-block ``any`` as a count, ``% 4`` as ``&
  3`` in a loop body, ufunc constants as 0-d arrays; and their bits."""
  from pallas_np.compiler import Compiler
  x = np.arange(-128, 128, dtype=np.int32).reshape(2, 128)

  def fn(v):
    sel = jnp.where(v > 0, v * 3, v - 1)  # case 0 (v - 1) is fresh and dies here
    mod = lax.fori_loop(0, 1, lambda i, a: a % 4, v)
    return sel, jnp.any(v != 1), mod
  closed = jax.make_jaxpr(fn)(x)
  plan = Compiler().compile(closed)
  values = list(plan._text[4].values())
  names = [getattr(f, "__qualname__", "") for f in values]
  assert "_select_into_c0" in names
  assert any(n.startswith("_bool_all_axes.") for n in names)
  assert any(isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype == np.int32 for v in values)
  got = plan(None, x)
  want = jax.jit(fn)(x)
  assert_identical([np.asarray(g) for g in got], [np.asarray(w) for w in want])
  loop_fn = next(v for v in values if getattr(v, "__name__", "") == "fori_loop")
  assert np.bitwise_and in loop_fn.__globals__.values()
  assert np.remainder not in loop_fn.__globals__.values()


def _running_rows_kernel(shift):
  def gen_rows_kernel(x_ref, o_ref):
    def body(r, acc):
      acc = acc + x_ref[pl.ds(r + shift, 1), :]  # out of bounds from r = 8 - shift
      o_ref[pl.ds(r, 1), :] = acc
      return acc
    lax.fori_loop(0, 8, body, jnp.zeros((1, 128), jnp.float32))
  return gen_rows_kernel


def test_one_slice_accesses_in_a_loop_body():
  """A ``pl.ds(r, 1)`` read and store per iteration (the accesses build
  their slice inline): interpret=True's bits in bounds; out of bounds the
  checked index raises naming the primitive, and clamps under
  ``bounds_check="clamp"`` as XLA's dynamic slice does."""
  x = _specials((8, 128), seed=7)
  out = jax.ShapeDtypeStruct(x.shape, x.dtype)
  _both(_running_rows_kernel(0), (x,), out)
  call = pallas_np.pallas_call(_running_rows_kernel(2), out_shape=out)
  with pytest.raises(IndexError) as info:
    call(x)
  assert isinstance(info.value, pallas_np.KernelError) and info.value.primitive == "get"
  clamped = pallas_np.pallas_call(_running_rows_kernel(2), out_shape=out,
                                  interpret=pallas_np.InterpretParams(bounds_check="clamp"))(x)
  assert_identical(clamped, _run(_running_rows_kernel(2), (x,), out, True))

  def gen_store_kernel(x_ref, o_ref):
    def body(r, c):
      o_ref[pl.ds(r + 1, 1), :] = x_ref[pl.ds(r, 1), :]  # the last store is out of bounds
      return c
    lax.fori_loop(0, 8, body, 0)
  with pytest.raises(IndexError) as info:
    pallas_np.pallas_call(gen_store_kernel, out_shape=out)(x)
  assert isinstance(info.value, pallas_np.KernelError) and info.value.primitive == "swap"


def test_unbatched_initial_carries_lifted_in_a_vectorized_grid():
  """Loops in a batched pass whose initial carries are the same for every
  lane (constants) but whose bodies make them per-lane: the generated loops
  lift them to lanes once, before the loop; 0 and many trips."""
  x = _specials((4 * 8, 128), seed=8)
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))

  def gen_lift_kernel(x_ref, o_ref):
    v = x_ref[...]
    z = jnp.zeros((8, 128), jnp.float32)
    a = lax.fori_loop(0, 3, lambda k, acc: acc * 0.5 + v, z)
    _, b = lax.while_loop(lambda c: c[0] < 4, lambda c: (c[0] + 1, jnp.maximum(c[1], v - c[0])),
                          (jnp.int32(0), z))
    _, c = lax.while_loop(lambda c: c[0] < 0, lambda c: (c[0] + 1, c[1] + v), (jnp.int32(0), z))
    o_ref[...] = a + b + c
  _both(gen_lift_kernel, (x,), jax.ShapeDtypeStruct(x.shape, x.dtype),
        pallas_np.InterpretParams(vectorize=True), grid=(4,), in_specs=[spec], out_specs=spec)
  srcs = list(_loop_files("gen_lift_kernel").values())
  assert sum(s.startswith("def while_loop(") for s in srcs) == 2
  assert sum(s.startswith("def fori_loop(") for s in srcs) == 1


@pytest.mark.parametrize("trips", [0, 1, 5])
@pytest.mark.parametrize("kind", ["while", "fori"])
def test_loop_invariant_lines_run_once(trips, kind):
  """Lines computed only from loop constants run in the first iteration
  only (``if _first:``): ``idx * 3`` is written into by the in-place add
  that reads it (which must then allocate, or later iterations would read
  the sum), ``(idx & k) == 0`` is hoisted, ``(idx & c) == 0`` looks alike
  but reads a carry and stays in the loop. Bits against interpret=True."""
  x = np.arange(-512, 512, dtype=np.int32).reshape(8, 128)

  def gen_hoist_kernel(x_ref, o_ref):
    idx = lax.broadcasted_iota(jnp.int32, x_ref.shape, 1)
    k = x_ref[0, 5] & 7

    def body(i, c):
      v, acc = c
      m_inv = (idx & k) == 0
      m_carry = (idx & i) == 0
      acc = (idx * 3) + acc
      return jnp.where(m_inv == m_carry, v + 1, v - acc), acc
    start = (x_ref[...], jnp.zeros_like(x_ref))
    if kind == "fori":
      v, acc = lax.fori_loop(0, trips, body, start)
    else:
      v, acc = lax.fori_loop(0, x_ref[0, 0] * 0 + trips, body, start)
    o_ref[...] = v * 7 + acc
  _both(gen_hoist_kernel, (x,), jax.ShapeDtypeStruct(x.shape, x.dtype))
  src = "".join(_loop_files("gen_hoist_kernel").values())
  if trips:  # (a 0-trip static fori has no loop)
    assert "if _first:" in src
    hoisted = src.split("if _first:")[1].split("\n")[1:]
    hoisted = [h for h in hoisted if h.startswith(" " * 12)]
    assert len(hoisted) >= 3, src  # (_first = False, idx & k, == 0, idx * 3)


def test_row_accesses_keep_partial_trailing_slices():
  """``x_ref[pl.ds(r, n), ...]`` whose trailing slices cover their whole
  dims index as ``x_ref[r:r + n]`` (no index tuple); a partial trailing
  slice (``0:64``, ``64:``) or a 3-d ref's must still select its part."""
  x = _specials((8, 4, 128), seed=9)

  def gen_part_kernel(x_ref, o_ref):
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    def body(r, acc):
      acc = acc + x_ref[pl.ds(r, 1), :, :]
      o_ref[pl.ds(r, 1), :, 0:64] = acc[:, :, 64:] * 2.0
      o_ref[pl.ds(r, 1), 1:3, 64:] = x_ref[pl.ds(r, 1), 0:2, 0:64]
      return acc
    lax.fori_loop(0, 8, body, jnp.zeros((1, 4, 128), jnp.float32))
  _both(gen_part_kernel, (x,), jax.ShapeDtypeStruct(x.shape, x.dtype))
