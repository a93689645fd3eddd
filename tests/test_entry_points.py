"""Every way a kernel reaches (or must not reach) the NumPy interpreter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.extend.core import Primitive

import pallas_np
from tests.helpers import assert_no_xla_compiles, count_xla_compiles
from pallas_np.grid import KernelPlan
from tests.conftest import assert_same


@pytest.fixture
def numpy_runs(monkeypatch):
  """Counts grid runs of the NumPy interpreter (KernelPlan.run calls)."""
  calls = []
  original = KernelPlan.run

  def counting_run(self, *args):
    calls.append(self.name)
    return original(self, *args)
  monkeypatch.setattr(KernelPlan, "run", counting_run)
  return calls


def _sds(x):
  return jax.ShapeDtypeStruct(x.shape, x.dtype)


def scale_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...] * 3.0 + pl.program_id(0).astype(x_ref.dtype)


def scale(x, interpret):
  return pl.pallas_call(scale_kernel, out_shape=_sds(x), grid=(2,),
                        in_specs=[pl.BlockSpec((x.shape[0] // 2, x.shape[1]), lambda i: (i, 0))],
                        out_specs=pl.BlockSpec((x.shape[0] // 2, x.shape[1]), lambda i: (i, 0)),
                        interpret=interpret)(x)


X = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128) / 100

# Eager jit calls of numpy-mode kernels run whole in the NumPy evaluator;
# with whole_program=False XLA compiles them and the kernels run through
# the io_callback lowering. Both routes are tested.
NUMPY_MODES = pytest.mark.parametrize(
    "mode", ["numpy", pallas_np.InterpretParams(whole_program=False)],
    ids=["whole_program", "io_callback"])


@NUMPY_MODES
def test_eager_and_jit(numpy_runs, mode):
  want = scale(X, True)
  assert_same(scale(X, mode), want)
  n = count_xla_compiles(lambda: jax.jit(lambda x: scale(x, mode) + 1.0)(X))
  assert_same(jax.jit(lambda x: scale(x, mode))(X), want)
  assert len(numpy_runs) == 3
  assert (n > 0) == (mode != "numpy")


@NUMPY_MODES
def test_vmap(numpy_runs, mode):
  xs = jnp.stack([X, X + 1, X * 2])
  want = jax.vmap(lambda x: scale(x, True))(xs)
  assert_same(jax.vmap(lambda x: scale(x, mode))(xs), want)
  assert_same(jax.jit(jax.vmap(lambda x: scale(x, mode)))(xs), want)
  assert numpy_runs


def _square_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...] * x_ref[...]


def _square_bwd_kernel(x_ref, g_ref, o_ref):
  o_ref[...] = 2.0 * x_ref[...] * g_ref[...]


def _make_square(interpret):
  def fwd_call(x):
    return pl.pallas_call(_square_kernel, out_shape=_sds(x), interpret=interpret)(x)

  @jax.custom_vjp
  def square(x):
    return fwd_call(x)

  def fwd(x):
    return fwd_call(x), x

  def bwd(x, g):
    return (pl.pallas_call(_square_bwd_kernel, out_shape=_sds(x),
                           interpret=interpret)(x, g),)
  square.defvjp(fwd, bwd)
  return square


@NUMPY_MODES
def test_grad_of_custom_vjp_kernel(numpy_runs, mode):
  x = jnp.linspace(-2, 2, 8 * 128, dtype=jnp.float32).reshape(8, 128)
  loss = lambda f: (lambda x: jnp.sum(jnp.sin(f(x))))
  got = jax.grad(loss(_make_square(mode)))(x)
  want = jax.grad(loss(_make_square(True)))(x)
  assert_same(got, want)
  np.testing.assert_allclose(got, np.cos(np.asarray(x) ** 2) * 2 * np.asarray(x), rtol=1e-5)
  assert_same(jax.jit(jax.grad(loss(_make_square(mode))))(x), want)
  assert len(numpy_runs) >= 4  # forward and backward kernels, eager and jit


@NUMPY_MODES
def test_jvp_of_custom_jvp_kernel(mode):
  def make(interpret):
    @jax.custom_jvp
    def square(x):
      return pl.pallas_call(_square_kernel, out_shape=_sds(x), interpret=interpret)(x)

    @square.defjvp
    def square_jvp(primals, tangents):
      (x,), (t,) = primals, tangents
      return square(x), pl.pallas_call(_square_bwd_kernel, out_shape=_sds(x),
                                       interpret=interpret)(x, t)
    return square
  x = jnp.linspace(-1, 1, 8 * 128, dtype=jnp.float32).reshape(8, 128)
  t = jnp.ones_like(x) * 0.5
  got = jax.jvp(make(mode), (x,), (t,))
  want = jax.jvp(make(True), (x,), (t,))
  for g, w in zip(got, want):
    assert_same(g, w)


@NUMPY_MODES
def test_scan_around_kernel(numpy_runs, mode):
  def run(interpret):
    def step(carry, i):
      out = scale(carry, interpret) * 0.25 + i
      return out, out.sum()
    return lax.scan(step, X, jnp.arange(5, dtype=jnp.float32))
  got, want = run(mode), run(True)
  assert_same(got[0], want[0], rtol=1e-6)
  assert_same(got[1], want[1], rtol=1e-6)
  assert len(numpy_runs) == 5


def test_pallas_np_pallas_call_eager_jit_and_options():
  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
  f = pallas_np.pallas_call(k, out_shape=_sds(X))
  out = f(X)
  assert isinstance(out, jax.Array)
  assert_same(out, X + 1)
  assert_same(jax.jit(f)(X), X + 1)
  # interpret=True still means JAX's interpreter.
  assert_same(pallas_np.pallas_call(k, out_shape=_sds(X), interpret=True)(X), X + 1)


def _half_writer(x_ref, o_ref):
  @pl.when(pl.program_id(0) == 0)
  def _():
    o_ref[...] = x_ref[...]


def _half_written(interpret):
  x = jnp.arange(16, dtype=jnp.int32)
  return pl.pallas_call(_half_writer, out_shape=_sds(x), grid=(2,),
                        in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
                        out_specs=pl.BlockSpec((8,), lambda i: (i,)),
                        interpret=interpret)(x)


def test_interpret_params_accepted_and_honoured():
  # Unwritten output: interpret=True leaves the int32 minimum there; so does
  # the default; uninitialized="zero" leaves zeros.
  assert_same(_half_written(pallas_np.InterpretParams()), _half_written(True))
  zero = np.asarray(_half_written(pallas_np.InterpretParams(uninitialized="zero")))
  np.testing.assert_array_equal(zero, np.r_[np.arange(8), np.zeros(8)].astype(np.int32))
  with pytest.raises(ValueError):
    pallas_np.InterpretParams(bounds_check="wrap")


def _oob_kernel(x_ref, o_ref):
  # Reads past the end of the 16-element ref (a dynamic start: JAX itself
  # rejects static out-of-bounds slices when tracing).
  o_ref[...] = x_ref[pl.ds(pl.program_id(0) + 12, 8)]


def test_bounds_check_raise_and_clamp():
  x = jnp.arange(16, dtype=jnp.int32)
  call = lambda interp: pallas_np.pallas_call(
      _oob_kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.int32), grid=(1,),
      interpret=interp)(x)
  with pytest.raises(IndexError, match=r"test_entry_points.py:\d+"):
    call("numpy")
  assert_same(call(pallas_np.InterpretParams(bounds_check="clamp")), call(True))


def _library_op(x):
  """Stands for library code the user cannot edit: no interpret= at all."""
  return pl.pallas_call(scale_kernel, out_shape=_sds(x), grid=(2,),
                        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))(x)


_library_op_jitted = jax.jit(_library_op)


def test_force_numpy_interpret(numpy_runs):
  want = scale(X, True)
  with pytest.raises(Exception, match="interpret mode"):
    _library_op_jitted(X)  # no TPU/GPU: JAX's own lowering fails on CPU
  with pallas_np.force_numpy_interpret():
    assert_same(scale(X, False), want)  # written with interpret=False
    assert_same(_library_op_jitted(X), want)  # jitted outside the scope
    assert_same(_library_op(X), want)
  assert len(numpy_runs) == 3
  with pytest.raises(Exception, match="interpret mode"):
    _library_op_jitted(X)  # scope is over: back to JAX's lowering


def test_force_numpy_interpret_routes_prebuilt_call_and_params(numpy_runs):
  prebuilt = pl.pallas_call(_half_writer, out_shape=jax.ShapeDtypeStruct((16,), jnp.int32),
                            grid=(2,), in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
                            out_specs=pl.BlockSpec((8,), lambda i: (i,)))
  x = jnp.arange(16, dtype=jnp.int32)
  with pallas_np.force_numpy_interpret(pallas_np.InterpretParams(uninitialized="zero")):
    out = np.asarray(jax.jit(prebuilt)(x))
  np.testing.assert_array_equal(out, np.r_[np.arange(8), np.zeros(8)].astype(np.int32))
  assert numpy_runs


def test_set_and_unset_numpy_interpret(numpy_runs):
  want = scale(X, True)
  pallas_np.set_numpy_interpret()
  try:
    assert_same(_library_op(X), want)
  finally:
    pallas_np.unset_numpy_interpret()
  assert len(numpy_runs) == 1


def test_jax_interpret_modes_keep_jax_lowering(numpy_runs):
  want = np.asarray(X) * 3 + np.repeat([0.0, 1.0], 8)[:, None].astype(np.float32)
  assert_same(scale(X, True), want)
  assert_same(jax.jit(lambda x: scale(x, True))(X), want)
  assert_same(scale(X, pltpu.InterpretParams()), want)
  assert numpy_runs == []
  assert_same(scale(X, "numpy"), want)  # and the counter does count
  assert len(numpy_runs) == 1


_unsupported_p = Primitive("my_unsupported_op")
_unsupported_p.def_abstract_eval(lambda x: x)
_unsupported_p.def_impl(lambda x: x)


def _unsupported_kernel(x_ref, o_ref):
  o_ref[...] = _unsupported_p.bind(x_ref[...])


@pytest.mark.parametrize("how", ["pl_eager", "pl_jit", "pallas_np"])
def test_unsupported_primitive_names_primitive_and_line(how):
  f = {"pl_eager": lambda x: pl.pallas_call(_unsupported_kernel, out_shape=_sds(x),
                                            interpret="numpy")(x),
       "pl_jit": jax.jit(lambda x: pl.pallas_call(_unsupported_kernel, out_shape=_sds(x),
                                                  interpret="numpy")(x)),
       "pallas_np": pallas_np.pallas_call(_unsupported_kernel, out_shape=_sds(X))}[how]
  with pytest.raises(NotImplementedError,
                     match=r"my_unsupported_op.*test_entry_points\.py:\d+") as info:
    f(X)
  assert isinstance(info.value, pallas_np.UnsupportedError)




def test_eager_pallas_np_call_compiles_nothing():
  def k(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...]) + pl.program_id(0)
  x = jnp.ones((64, 32), jnp.float32)
  y = jnp.ones((32, 16), jnp.float32)
  x2 = jnp.full((64, 32), 2.0, jnp.float32)
  f = pallas_np.pallas_call(
      k, out_shape=jax.ShapeDtypeStruct((64, 16), jnp.float32), grid=(4,),
      in_specs=[pl.BlockSpec((16, 32), lambda i: (i, 0)), pl.BlockSpec((32, 16), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((16, 16), lambda i: (i, 0)))
  jax.block_until_ready((x, y, x2))
  with assert_no_xla_compiles():
    out = np.asarray(f(x, y))
    out2 = np.asarray(f(x2, y))
  np.testing.assert_array_equal(out, 32 + np.repeat(np.arange(4.0), 16)[:, None] * np.ones(16))
  np.testing.assert_array_equal(out2, 64 + np.repeat(np.arange(4.0), 16)[:, None] * np.ones(16))


def test_jvp_of_plain_kernel_uses_jax_jvp_rule():
  # JAX differentiates the kernel itself (its pallas_call JVP rule builds a
  # tangent kernel, which sums tangents with autodiff's add_any).
  def k(x_ref, o_ref):
    o_ref[...] = jnp.sin(x_ref[...]) * x_ref[...]
  x = jnp.linspace(0, 1, 8 * 128, dtype=jnp.float32).reshape(8, 128)
  f = lambda interp: pl.pallas_call(k, out_shape=_sds(x), interpret=interp)
  got = jax.jvp(f("numpy"), (x,), (jnp.ones_like(x),))
  want = jax.jvp(f(True), (x,), (jnp.ones_like(x),))
  for g, w in zip(got, want):
    assert_same(g, w, rtol=1e-6)


def test_eager_scalars_and_wide_numpy_inputs_take_jax_dtypes():
  # A Python float / np.float64 / Python int operand becomes float32/int32 in
  # the traced jaxpr (no x64); the eager path must feed the kernel that dtype.
  def k(x_ref, s_ref, o_ref):
    o_ref[...] = x_ref[...] * s_ref[...]
  x = jnp.arange(8, dtype=jnp.float32)
  out_shape = jax.ShapeDtypeStruct((8,), jnp.float32)
  for args in [(x, 2.5), (np.arange(8, dtype=np.float32), np.float64(2.5)), (x, 3)]:
    want = pl.pallas_call(k, out_shape=out_shape, interpret=True)(*args)
    assert_same(pallas_np.pallas_call(k, out_shape=out_shape)(*args), want)
