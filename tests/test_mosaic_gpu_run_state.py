"""``pl.run_state`` over ``plgpu.ACC`` accumulators in Mosaic GPU kernels:
the accumulator carried through loops, and Mosaic GPU's calling convention
for a body that returns values (its lowering hands the body's return values
out in place of the accumulators' final values; JAX's
``test_fori_loop_accumulator`` passes on an H100 with 5.0, where JAX's
discharge rule would give 1.0). Expected values: NumPy written from the
semantics."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from tests.mgpu_helpers import plgpu

from pallas_np.errors import UnsupportedError

F16, F32 = jnp.float16, jnp.float32
TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _call(body, out_shape, *args, in_specs=None):
  kwargs = {} if in_specs is None else {"in_specs": in_specs}
  fn = pl.pallas_call(body, out_shape=out_shape, interpret="numpy",
                      compiler_params=plgpu.CompilerParams(), **kwargs)
  return np.asarray(fn(*args))


def _loop(force_while, lo, hi, body, init):
  if force_while:
    return jax.lax.while_loop(lambda c: c[0] < hi, lambda c: (c[0] + 1, body(c[0], c[1])),
                              (lo, init))[1]
  return jax.lax.fori_loop(lo, hi, body, init)


@pytest.mark.parametrize("force_while", [False, True])
def test_loop_carry_read_from_accumulator_is_returned(force_while):
  """The body's return value (init + 4 reads of the accumulator) is the
  result, as on the GPU."""
  def kernel(i_ref, o_ref):
    def scope(acc_ref):
      return _loop(force_while, 0, 4, lambda _, v: v + acc_ref[...], acc_ref[...])
    o_ref[...] = pl.run_state(scope)(plgpu.ACC.init(i_ref[...]))

  x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) % 7
  out = _call(kernel, jax.ShapeDtypeStruct((64, 64), F32), jnp.asarray(x))
  np.testing.assert_array_equal(out, 5 * x)


def test_body_returning_nothing_gives_accumulator_final_value():
  """wgmma into the accumulator inside a fori_loop; the result is the
  accumulator's final value: init + 3 a @ b (f32 accumulation)."""
  rng = np.random.default_rng(0)
  a = rng.integers(-3, 4, (64, 64)).astype(np.float16)
  b = rng.integers(-3, 4, (64, 128)).astype(np.float16)
  c = rng.integers(-3, 4, (64, 128)).astype(np.float32)

  def kernel(a_ref, b_ref, c_ref, o_ref):
    def scope(acc_ref):
      def step(_, carry):
        plgpu.wgmma(acc_ref, a_ref, b_ref)
        plgpu.wgmma_wait(0)
        return carry
      jax.lax.fori_loop(0, 3, step, 0)
    o_ref[...] = pl.run_state(scope)(plgpu.ACC.init(c_ref[...]))

  specs = [plgpu.BlockSpec(transforms=TILED), plgpu.BlockSpec(transforms=TILED),
           plgpu.BlockSpec()]
  out = _call(kernel, jax.ShapeDtypeStruct((64, 128), F32), a, b, c, in_specs=specs)
  np.testing.assert_array_equal(out, c + 3 * (a.astype(np.float32) @ b.astype(np.float32)))


def test_returned_values_fill_accumulators_in_order():
  """Two accumulators, a body returning one value: the lowering's results
  are (returned, acc0 final, acc1 final) and the first two go to the two
  accumulators, so acc1's result is acc0's final value."""
  x = np.full((64, 64), 2.0, np.float32)

  def kernel(i_ref, o0_ref, o1_ref):
    def scope(refs):
      acc0, acc1 = refs
      acc0[...] = acc0[...] + 1.0   # 3
      acc1[...] = acc1[...] * 10.0  # 20
      return acc0[...] + acc1[...]  # 23
    o0, o1 = pl.run_state(scope)((plgpu.ACC.init(i_ref[...]), plgpu.ACC.init(i_ref[...])))
    o0_ref[...] = o0
    o1_ref[...] = o1

  shape = jax.ShapeDtypeStruct((64, 64), F32)
  fn = pl.pallas_call(kernel, out_shape=(shape, shape), interpret="numpy",
                      compiler_params=plgpu.CompilerParams())
  o0, o1 = fn(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(o0), np.full((64, 64), 23.0, np.float32))
  np.testing.assert_array_equal(np.asarray(o1), np.full((64, 64), 3.0, np.float32))


def test_accumulator_carried_by_nested_run_state_in_loop():
  """A run_state inside a fori_loop whose carry is the accumulator value
  (the body returns nothing): each iteration adds i + 1."""
  def kernel(i_ref, o_ref):
    def step(i, v):
      def scope(acc_ref):
        acc_ref[...] = acc_ref[...] + (i + 1).astype(jnp.float32)
      return pl.run_state(scope)(plgpu.ACC.init(v))
    o_ref[...] = jax.lax.fori_loop(0, 4, step, i_ref[...])

  x = np.ones((64, 64), np.float32)
  out = _call(kernel, jax.ShapeDtypeStruct((64, 64), F32), jnp.asarray(x))
  np.testing.assert_array_equal(out, x + 10)


def test_returned_value_of_another_type_is_refused():
  def kernel(i_ref, o_ref):
    def scope(acc_ref):
      return acc_ref[0, :]  # a row, not the accumulator's shape
    o_ref[...] = pl.run_state(scope)(plgpu.ACC.init(i_ref[...]))

  with pytest.raises(UnsupportedError, match="run_state over a plgpu.ACC"):
    _call(kernel, jax.ShapeDtypeStruct((64, 64), F32), jnp.ones((64, 64), F32))


def test_run_state_without_accumulator_drops_return_values():
  """JAX's own rule (no accumulator, so not Mosaic GPU's lowering): the
  body's return value is dropped and the result is the ref's final value
  (``run_state``'s contract; interpret=True fails on such a body)."""
  def kernel(x_ref, o_ref):
    def scope(ref):
      ref[...] = ref[...] + 1
      return ref[...] * 100
    o_ref[...] = pl.run_state(scope)(x_ref[...])

  x = jnp.arange(8 * 128, dtype=F32).reshape(8, 128)
  shape = jax.ShapeDtypeStruct((8, 128), F32)
  ours = pl.pallas_call(kernel, out_shape=shape, interpret="numpy")(x)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(x) + 1)
