"""Ref indexers, transforms, masked load/store, swap, run_scoped, atomics,
random, debug printing and call-like primitives."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

import pallas_np
from tests.helpers import run_both
from tests.kernel_fn import both

rng = np.random.default_rng(2)


def _call(kernel, out_shape, *args, interpret, **kw):
  return pl.pallas_call(kernel, out_shape=out_shape, interpret=interpret, **kw)(*args)


def test_ndindexer_forms():
  x = rng.standard_normal((8, 16)).astype(np.float32)
  idx = np.array([5, 1, 7], np.int32)

  def kernel(x_ref, i_ref, o1, o2, o3, o4, o5, o6):
    i = i_ref[0]
    o1[...] = x_ref[pl.ds(1, 4, stride=2), :]                    # strided pl.ds
    o2[...] = x_ref[pl.ds(i, 2), pl.ds(i + 1, 8, stride=1)]      # dynamic starts
    o3[...] = x_ref[i_ref[...], :]                                # integer array
    o4[...] = x_ref[..., 3]                                       # ellipsis + int
    o5[...] = x_ref.at[2:6][1:3, ::4]                             # .at then index
    o6[...] = x_ref[::2, 1::3]                                    # strided slices

  outs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in
          [(4, 16), (2, 8), (3, 16), (8,), (2, 4), (4, 5)]]
  run_both(lambda interp: functools.partial(_call, kernel, outs, interpret=interp), x, idx)


def test_strided_ds_mixed_with_int_index_vs_numpy():
  # interpret=True cannot run this form (JAX 0.10 discharge bug): NumPy reference.
  x = rng.standard_normal((4, 3, 7)).astype(np.float32)

  def kernel(x_ref, o1, o2):
    o1[...] = x_ref[1, pl.ds(0, 2), pl.ds(1, 3, stride=2)]
    o2[...] = x_ref[pl.ds(0, 2, stride=3), :, 6]

  o1, o2 = pallas_np.pallas_call(kernel, out_shape=[
      jax.ShapeDtypeStruct((2, 3), jnp.float32), jax.ShapeDtypeStruct((2, 3), jnp.float32)])(x)
  np.testing.assert_array_equal(np.asarray(o1), x[1, 0:2, 1:6:2])
  np.testing.assert_array_equal(np.asarray(o2), x[0:4:3, :, 6])


def test_ref_transforms_bitcast_reshape_and_stores():
  x = rng.standard_normal((8, 16)).astype(np.float32)

  def kernel(x_ref, o_bits, o_resh, o_store, o_swap):
    o_bits[...] = x_ref.bitcast(jnp.int32)[...]
    o_resh[...] = x_ref.reshape(4, 32)[...]
    o_store[...] = jnp.zeros_like(o_store)
    o_store[pl.ds(1, 3, stride=3), 2:6] = x_ref[:3, :4] * 2     # strided store
    o_store.at[5][pl.ds(0, 4)] = jnp.full((4,), 9.0)
    o_swap[...] = x_ref[...]
    prev = plgpu.load(o_swap.at[0:2, :])
    o_swap[0:2, :] = prev + 1

  outs = [jax.ShapeDtypeStruct((8, 16), jnp.int32), jax.ShapeDtypeStruct((4, 32), jnp.float32),
          jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((8, 16), jnp.float32)]
  run_both(lambda interp: functools.partial(_call, kernel, outs, interpret=interp), x)


def test_swap_returns_old_value_and_addupdate():
  from jax._src.state import primitives as sp
  x = rng.standard_normal((4, 8)).astype(np.float32)

  def kernel(x_ref, o_ref, old_ref):
    o_ref[...] = x_ref[...]
    old_ref[...] = sp.ref_swap(o_ref, (slice(1, 3),), jnp.ones((2, 8), jnp.float32))[...] \
        if False else jnp.zeros((2, 8), jnp.float32)
    old = sp.ref_swap(o_ref, (pl.ds(1, 2),), jnp.ones((2, 8), jnp.float32))
    old_ref[...] = old
    sp.ref_addupdate(o_ref, (pl.ds(0, 2),), jnp.full((2, 8), 3.0, jnp.float32))

  outs = [jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((2, 8), jnp.float32)]
  got = run_both(lambda interp: functools.partial(_call, kernel, outs, interpret=interp), x)
  np.testing.assert_array_equal(np.asarray(got[1]), x[1:3])


def test_masked_load_store_with_other():
  x = rng.standard_normal((32,)).astype(np.float32)

  def kernel(x_ref, o_ref):
    offs = jnp.arange(16)
    mask = offs < 11
    v = plgpu.load(x_ref.at[pl.ds(0, 16)], mask=mask, other=-7.0)
    o_ref[pl.ds(0, 16)] = v
    o_ref[pl.ds(16, 16)] = jnp.zeros((16,), jnp.float32)
    plgpu.store(o_ref.at[pl.ds(16, 16)], v * 2, mask=offs % 3 == 0)

  out = jax.ShapeDtypeStruct((32,), jnp.float32)
  run_both(lambda interp: functools.partial(_call, kernel, out, interpret=interp), x)


def test_run_scoped():
  x = rng.standard_normal((8, 8)).astype(np.float32)

  def kernel(x_ref, o_ref):
    def body(tmp_ref):
      tmp_ref[...] = x_ref[...] * 2
      tmp_ref[0:2, :] = tmp_ref[2:4, :] + 1
      o_ref[...] = tmp_ref[...]
    pl.run_scoped(body, pltpu.VMEM((8, 8), jnp.float32))

  out = jax.ShapeDtypeStruct((8, 8), jnp.float32)
  run_both(lambda interp: functools.partial(_call, kernel, out, interpret=interp), x)


@pytest.mark.parametrize("op", ["add", "max", "min"])
def test_atomics_vs_interpret(op):
  x = rng.integers(-20, 20, (16,)).astype(np.int32)
  fn = getattr(plgpu, f"atomic_{op}")

  def kernel(x_ref, o_ref, old_ref):
    o_ref[...] = x_ref[...]
    old_ref[...] = fn(o_ref, pl.ds(2, 8), jnp.arange(8, dtype=jnp.int32) - 3)

  outs = [jax.ShapeDtypeStruct((16,), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32)]
  run_both(lambda interp: functools.partial(_call, kernel, outs, interpret=interp), x)


def test_atomics_bitwise_xchg_cas_vs_numpy():
  # interpret=True cannot discharge these; a NumPy reference instead.
  x = rng.integers(0, 1 << 20, (8,)).astype(np.int32)
  v = rng.integers(0, 1 << 20, (8,)).astype(np.int32)

  def kernel(x_ref, v_ref, o_and, o_or, o_xor, o_xchg, olds, cas_ref, cas_old):
    for ref in (o_and, o_or, o_xor, o_xchg):
      ref[...] = x_ref[...]
    olds[0, :] = plgpu.atomic_and(o_and, pl.ds(0, 8), v_ref[...])
    olds[1, :] = plgpu.atomic_or(o_or, pl.ds(0, 8), v_ref[...])
    olds[2, :] = plgpu.atomic_xor(o_xor, pl.ds(0, 8), v_ref[...])
    olds[3, :] = plgpu.atomic_xchg(o_xchg, pl.ds(0, 8), v_ref[...], mask=jnp.arange(8) < 5)
    cas_ref[...] = jnp.int32(5)
    a = plgpu.atomic_cas(cas_ref, jnp.int32(4), jnp.int32(10))   # no swap
    b = plgpu.atomic_cas(cas_ref, jnp.int32(5), jnp.int32(11))   # swap
    cas_old[0] = a
    cas_old[1] = b

  outs = [jax.ShapeDtypeStruct((8,), jnp.int32)] * 4 + [
      jax.ShapeDtypeStruct((4, 8), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32),
      jax.ShapeDtypeStruct((2,), jnp.int32)]
  o_and, o_or, o_xor, o_xchg, olds, cas, cas_old = pallas_np.pallas_call(
      kernel, out_shape=outs)(x, v)
  np.testing.assert_array_equal(o_and, x & v)
  np.testing.assert_array_equal(o_or, x | v)
  np.testing.assert_array_equal(o_xor, x ^ v)
  np.testing.assert_array_equal(o_xchg, np.where(np.arange(8) < 5, v, x))
  np.testing.assert_array_equal(olds, np.stack([x] * 4))
  assert int(cas) == 11 and list(np.asarray(cas_old)) == [5, 5]


def test_atomic_add_repeated_indices_accumulate():
  def kernel(i_ref, o_ref):
    o_ref[...] = jnp.zeros((4,), jnp.float32)
    plgpu.atomic_add(o_ref, i_ref[...], jnp.ones((4,), jnp.float32))

  out = pallas_np.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32))(
      np.array([1, 1, 3, 1], np.int32))
  np.testing.assert_array_equal(np.asarray(out), [0, 3, 0, 1])


def test_random_bit_exact():
  seeds = np.array([0, 42, 2 ** 31 - 1], np.int32)
  data = np.array([[1, 2], [3, 4]], np.uint32)

  def fn(seeds, data):
    k = jax.random.key(seeds[1])
    k2 = jax.random.fold_in(k, 7)
    a, b = jax.random.split(k2)
    kd = jax.random.wrap_key_data(data[0])
    raw = jax.random.PRNGKey(seeds[2])
    return [jax.random.bits(a, (4, 8)), jax.random.bits(b, (3,), jnp.uint8),
            jax.random.bits(kd, (5,), jnp.uint16), jax.random.key_data(jax.random.split(kd, 3)),
            jax.random.uniform(k, (2, 4)), jax.random.randint(b, (6,), -5, 5),
            raw, jax.random.bits(raw, (2, 2)),
            jax.vmap(lambda s: jax.random.bits(jax.random.key(s), (2,)))(seeds),
            jax.random.normal(a, (4,))]
  got, want = both(fn, seeds, data)
  for g, w in zip(got[:-1], want[:-1]):
    np.testing.assert_array_equal(g, w)
  # normal() goes through erf_inv: a few ulp apart.
  np.testing.assert_allclose(got[-1], want[-1], rtol=1e-6)


def test_threefry_matches_jax_reference():
  from pallas_np.primitives.random import threefry2x32
  from jax._src.random import threefry2x32 as tf
  k = np.array([0x13198A2E, 0x03707344], np.uint32)
  count = np.arange(10, dtype=np.uint32)
  want = np.asarray(tf.threefry_2x32(k, count))
  x = [count[:5], count[5:]]
  got = np.concatenate(threefry2x32(k[0], k[1], x[0], x[1]))
  np.testing.assert_array_equal(got, want)


def test_debug_print_in_grid_order(capfd):
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    j = pl.program_id(1)
    pl.debug_print("point {} {}", i, j)
    jax.debug.print("val {x}", x=x_ref[0])
    o_ref[...] = x_ref[...]

  x = np.arange(4, dtype=np.int32).reshape(1, 4)
  pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1, 4), jnp.int32), grid=(2, 3),
                 in_specs=[pl.BlockSpec((1, 4), lambda i, j: (0, 0))],
                 out_specs=pl.BlockSpec((1, 4), lambda i, j: (0, 0)), interpret="numpy")(x)
  out = capfd.readouterr().out
  # Lines may carry a "[kernel (i, j)] " prefix; the order is what matters.
  points = [l[l.index("point"):] for l in out.splitlines() if "point" in l]
  assert points == [f"point {i} {j}" for i in range(2) for j in range(3)]
  assert out.count("val [0 1 2 3]") == 6


def test_debug_callback_and_calls():
  seen = []
  x = rng.standard_normal((4, 4)).astype(np.float32)

  @jax.custom_jvp
  def f(v):
    return jnp.sin(v) * 2

  f.defjvp(lambda p, t: (f(p[0]), t[0]))

  @jax.custom_vjp
  def g(v):
    return v * 3

  g.defvjp(lambda v: (g(v), None), lambda r, ct: (ct,))

  def fn(x):
    jax.debug.callback(lambda v: seen.append(np.asarray(v).copy()), x[0])
    y = lax.optimization_barrier(x + 1)
    z = jax.checkpoint(lambda v: jnp.cos(v))(y)
    w = jax.jit(lambda v: v * 2)(z)
    p = lax.platform_dependent(x, cpu=lambda v: v + 100, default=lambda v: v - 100)
    return [f(x), g(x), w, p, pl.multiple_of(jnp.int32(8), 8) + jnp.zeros((), jnp.int32)]
  got, want = both(fn, x)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  # numpy mode, numpy mode with jit calls inlined (kernel_fn.both), interpret=True
  assert len(seen) == 3 and all(np.array_equal(s, x[0]) for s in seen)


def test_masked_out_of_bounds_lanes_triton_style():
  x = rng.standard_normal((20,)).astype(np.float32)

  def kernel(x_ref, o_ref):
    offs = jnp.arange(32)
    mask = offs < 20
    # A traced start (0 here): JAX >= 0.12 rejects a static slice past the
    # end at trace time, a dynamic one is the masked Triton idiom.
    start = pl.program_id(0) * 32
    v = plgpu.load(x_ref.at[pl.ds(start, 32)], mask=mask, other=0.0)  # slice past the end
    w = plgpu.load(x_ref.at[offs], mask=mask, other=1.0)               # pointer-style array
    plgpu.store(o_ref.at[pl.ds(start, 32)], v * 2 + w, mask=mask)

  out = jax.ShapeDtypeStruct((20,), jnp.float32)
  run_both(lambda interp: functools.partial(_call, kernel, out, interpret=interp, grid=(1,)), x)


def test_masked_enabled_out_of_bounds_lane_raises():
  def kernel(x_ref, o_ref):
    start = pl.program_id(0) * 16  # traced: see the test above
    o_ref[...] = plgpu.load(x_ref.at[pl.ds(start, 16)], mask=jnp.arange(16) < 12, other=0.0)

  with pytest.raises(IndexError, match="masked on"):
    pallas_np.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                          grid=(1,))(np.zeros((10,), np.float32))
