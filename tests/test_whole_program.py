"""pallas_np.jit: the whole traced program in the NumPy evaluator."""
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_np
from tests.helpers import assert_no_xla_compiles, count_xla_compiles
from tests.conftest import assert_same


def _scale_kernel(x_ref, o_ref, *, factor):
  o_ref[...] = x_ref[...] * factor + pl.program_id(0)


def _program(x, w, factor=2.0, interpret=False):
  # XLA work around the kernel: a matmul, a reduction, a reshape.
  h = jnp.tanh(x @ w)
  y = pl.pallas_call(functools.partial(_scale_kernel, factor=factor),
                     out_shape=jax.ShapeDtypeStruct(h.shape, h.dtype), grid=(h.shape[0] // 8,),
                     in_specs=[pl.BlockSpec((8, h.shape[1]), lambda i: (i, 0))],
                     out_specs=pl.BlockSpec((8, h.shape[1]), lambda i: (i, 0)),
                     interpret=interpret)(h)
  return {"y": y.reshape(-1, 2 * h.shape[1]), "total": y.sum(axis=0)}


def _args(seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((32, 16)), jnp.float32),
          jnp.asarray(rng.standard_normal((16, 24)), jnp.float32))




def test_matches_jax_jit_interpret_true_and_compiles_nothing():
  x, w = _args()
  want = jax.jit(functools.partial(_program, interpret=True))(x, w)
  f = pallas_np.jit(_program)  # interpret=False inside: forced to numpy mode
  x2, w2 = _args(1)
  jax.block_until_ready((x2, w2))
  with assert_no_xla_compiles():
    got = f(x, w)
    got2 = f(x2, w2)
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  assert isinstance(got["y"], jax.Array)
  for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert_same(g, e, rtol=1e-5, atol=1e-5)
  want2 = jax.jit(functools.partial(_program, interpret=True))(x2, w2)
  assert_same(got2["total"], want2["total"], rtol=1e-5, atol=1e-5)


def test_static_argnums_and_argnames():
  x, w = _args(2)
  f = pallas_np.jit(_program, static_argnums=(2,), static_argnames=("interpret",))
  ref = jax.jit(_program, static_argnums=(2,), static_argnames=("interpret",))
  for factor in (3.0, -0.5):
    got = f(x, w, factor, interpret=False)
    want = ref(x, w, factor, interpret=True)
    assert_same(got["y"], want["y"], rtol=1e-5, atol=1e-5)
  # static by name (inferred from the signature like jax.jit does)
  got = pallas_np.jit(_program, static_argnames=("factor",))(x, w, factor=4.0)
  assert_same(got["total"], ref(x, w, 4.0, interpret=True)["total"], rtol=1e-5, atol=1e-5)


def test_under_outer_transform_falls_back_to_forced_jax_jit():
  x, w = _args(3)
  f = pallas_np.jit(_program, static_argnums=(2,))
  got = jax.jit(lambda a, b: f(a, b, 1.5)["total"])(x, w)
  want = jax.jit(lambda a, b: _program(a, b, 1.5, interpret=True)["total"])(x, w)
  assert_same(got, want, rtol=1e-5, atol=1e-5)


def test_megablox_gmm_vs_reference():
  # the package's ``gmm`` attribute is the function, not the module
  gmm_mod = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((3, 128, 128)), jnp.float32)
  group_sizes = jnp.array([128, 0, 128], jnp.int32)
  f = pallas_np.jit(lambda a, b, g: gmm_mod.gmm(a, b, g, tiling=(128, 128, 128)))
  jax.block_until_ready((lhs, rhs, group_sizes))
  with assert_no_xla_compiles():  # gmm's group metadata etc. run in NumPy too
    got = np.asarray(f(lhs, rhs, group_sizes))
  want = np.concatenate([np.asarray(lhs[:128]) @ np.asarray(rhs[0]),
                         np.asarray(lhs[128:]) @ np.asarray(rhs[2])])
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_unsupported_outer_primitive_raises():
  f = pallas_np.jit(lambda x: jnp.linalg.eigh(x)[0])
  with pytest.raises(pallas_np.UnsupportedError):
    f(jnp.eye(4, dtype=jnp.float32))


# -- eager jit calls (InterpretParams.whole_program) -----------------------------
def _lone_kernel(interpret):
  return pl.pallas_call(functools.partial(_scale_kernel, factor=3.0),
                        out_shape=jax.ShapeDtypeStruct((32, 16), jnp.float32), grid=(4,),
                        in_specs=[pl.BlockSpec((8, 16), lambda i: (i, 0))],
                        out_specs=pl.BlockSpec((8, 16), lambda i: (i, 0)),
                        interpret=interpret)


def test_eager_pl_pallas_call_numpy_compiles_nothing():
  # JAX runs an eager pl.pallas_call through a jit of the lone primitive.
  x, _ = _args(4)
  want = _lone_kernel(True)(x)
  f = _lone_kernel("numpy")
  x1 = jax.block_until_ready(x + 1.0)
  with assert_no_xla_compiles():
    got = f(x)
    got_jit = jax.jit(f)(x)  # a jit that is only the kernel: the same
    again = f(x1)
  assert isinstance(got, jax.Array)
  assert_same(got, want, rtol=1e-6, atol=1e-6)
  assert_same(got_jit, want, rtol=1e-6, atol=1e-6)
  assert_same(again, _lone_kernel(True)(x1), rtol=1e-6, atol=1e-6)


def test_forced_eager_jit_runs_whole_program_in_numpy():
  x, w = _args(5)
  want = jax.jit(functools.partial(_program, interpret=True))(x, w)
  f = jax.jit(_program)  # interpret=False inside, as library code is
  x2 = x * 2.0
  jax.block_until_ready(x2)
  with pallas_np.force_numpy_interpret():
    f(x, w)  # (one call to warm JAX's own tracing caches)
    with assert_no_xla_compiles():
      got = f(x, w)
      got2 = f(x2, w)
  for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert isinstance(g, jax.Array)
    assert_same(g, e, rtol=1e-5, atol=1e-5)
  want2 = jax.jit(functools.partial(_program, interpret=True))(x2, w)
  assert_same(got2["y"], want2["y"], rtol=1e-5, atol=1e-5)


def test_forced_eager_jit_outputs_do_not_alias_inputs():
  # Outputs forwarded from inputs (or constants) are copies: a jax.Array
  # handed out zero-copy must not share memory with the caller's arrays.
  x, _ = _args(6)
  f = jax.jit(lambda a: (_lone_kernel(False)(a), a, jnp.arange(3.0)))
  with pallas_np.force_numpy_interpret():
    y, same, const = f(x)
    _, _, const2 = f(x)
  assert_same(y, _lone_kernel(True)(x), rtol=1e-6, atol=1e-6)
  assert_same(same, x, rtol=0, atol=0)
  assert not np.shares_memory(np.asarray(same), np.asarray(x))
  assert not np.shares_memory(np.asarray(const), np.asarray(const2))


def test_closed_over_jax_array_is_folded_without_xla_on_the_first_call():
  # A jax.Array the program closes over is a const of its jaxpr; folding a
  # reshape of it used to dispatch a JAX op, i.e. an XLA compile on every
  # new program's first call (splash attention's mask tables did this).
  x, _ = _args(9)
  table = jax.block_until_ready(jnp.asarray(np.arange(512, dtype=np.float32).reshape(16, 32)))
  prog = lambda interpret: jax.jit(
      lambda a: _lone_kernel(interpret)(a + table.reshape(32, 16) * 0.5))
  want = prog(True)(x)
  with pallas_np.force_numpy_interpret():
    with assert_no_xla_compiles():
      got = prog(False)(x)
  assert_same(got, want, rtol=1e-6, atol=1e-6)


def test_eager_jit_of_numpy_kernels_runs_whole_program_in_numpy():
  # Not forced: a jit whose kernels are all numpy mode (here with XLA ops
  # around them, as JAX's GPU ops are) runs whole in NumPy too.
  x, w = _args(8)
  f = jax.jit(functools.partial(_program, interpret="numpy"))
  f(x, w)
  with assert_no_xla_compiles():
    got = f(x, w)
  want = jax.jit(functools.partial(_program, interpret=True))(x, w)
  for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert_same(g, e, rtol=1e-5, atol=1e-5)


def test_eager_jit_keeps_each_kernels_own_options():
  # Outside a force scope each kernel runs with its own InterpretParams: the
  # same out-of-bounds kernel clamps in one call and raises in the other.
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(pl.program_id(0) * 4 + 1, 4)]  # one past the end at i=1

  def call(params):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                          grid=(2,), in_specs=[pl.BlockSpec((8,), lambda i: (0,))],
                          out_specs=pl.BlockSpec((4,), lambda i: (i,)), interpret=params)
  clamp = pallas_np.InterpretParams(bounds_check="clamp")
  x = jnp.arange(8.0)
  f = jax.jit(lambda v: call(clamp)(v) + call("numpy")(v * 0.0 + 1.0)[:1].sum() * 0)
  with pytest.raises(IndexError):
    f(x)
  g = jax.jit(lambda v: call(clamp)(v) * 2.0)
  with assert_no_xla_compiles():
    got = g(x)
  assert_same(got, jax.jit(lambda v: call(True)(v) * 2.0)(x), rtol=0, atol=0)


@pytest.mark.parametrize("case", ["opt_out", "unsupported_outer", "explicit_sharding",
                                  "mixed_modes"])
def test_eager_jit_keeps_xla_where_it_should(case):
  x, w = _args(7)
  params = pallas_np.InterpretParams()
  program = _program
  forced = case != "mixed_modes"
  if case == "opt_out":
    params = pallas_np.InterpretParams(whole_program=False)
  elif case == "unsupported_outer":  # eigh has no NumPy rule: XLA around the kernel
    program = lambda a, b, interpret=False: _program(
        a + jnp.linalg.eigh(jnp.eye(16))[0].sum() / 100, b, interpret=interpret)
  f = jax.jit(program)
  if case == "explicit_sharding":
    f = jax.jit(program, out_shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  elif case == "mixed_modes":  # not forced, one kernel for JAX's interpreter: XLA
    f = jax.jit(lambda a, b: jax.tree_util.tree_map(
        lambda u, v: u + 0 * v, _program(a, b, interpret="numpy"), _program(a, b, interpret=True)))
  want = jax.jit(functools.partial(program, interpret=True))(x, w)
  if forced:
    with pallas_np.force_numpy_interpret(params):
      n = count_xla_compiles(lambda: f(x, w))
      got = f(x, w)
  else:
    n = count_xla_compiles(lambda: f(x, w))
    got = f(x, w)
  assert n >= 1
  assert_same(got["y"], want["y"], rtol=1e-5, atol=1e-5)


def test_eager_plan_never_hands_out_its_constants():
  # A folded constant output (next to a kernel, whose effects used to defeat
  # the old DCE-based check) and a pass-through input are copied every call,
  # so a jax.Array made from them zero-copy never aliases the plan.
  from pallas_np.api import EagerPlan
  x, _ = _args(9)
  closed = jax.make_jaxpr(lambda a: (_lone_kernel(False)(a), a, jnp.arange(3.0)))(x)
  with pallas_np.force_numpy_interpret():
    plan = EagerPlan(closed, pallas_np.InterpretParams())
  first = plan.run([x], own_outputs=True)
  second = plan.run([x], own_outputs=True)
  assert plan.plan.const_outputs == {2}
  assert not np.shares_memory(first[2], second[2])
  assert not np.shares_memory(first[1], np.asarray(x))
  assert not np.shares_memory(first[0], second[0])
  np.testing.assert_array_equal(second[2], np.arange(3.0, dtype=np.float32))
