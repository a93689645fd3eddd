"""The evaluator's peepholes (``evaluator._Fusion``): ufunc results written
straight into a concatenate's buffer (through flips), and squeeze(slice(x))
as one indexing op. Each kernel is checked against interpret=True bit for bit
and the plan is checked to have actually fused."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_np.compiler import Compiler
from pallas_np.compiler.fusion import Fusion as _Fusion

_rng = np.random.default_rng(7)


def _run(kernel, x, y):
  def call(interpret):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((2 * x.shape[0], x.shape[1]), x.dtype),
                          interpret=interpret)(x, y)
  got, want = np.asarray(call("numpy")), np.asarray(call(True))
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want)) if got.dtype.kind == "f" else None
  assert got.tobytes() == want.tobytes() or np.array_equal(got, want, equal_nan=True)
  return got, want


def _merge(x_ref, y_ref, o_ref):
  """min/max of a pair written to the halves of the output, one flipped; a
  sum that is also read elsewhere (not fusable) and a plain input operand."""
  x, y = x_ref[...], y_ref[...]
  n = x.shape[0]
  a, b = x[: n // 2], jnp.flip(y[n // 2:], axis=0)
  s = a + b
  top = jnp.concatenate([jnp.minimum(a, b), jnp.flip(jnp.maximum(a, b), axis=0)], axis=0)
  bottom = jnp.concatenate([s * 2, s - x[n // 2:]], axis=0)
  o_ref[...] = jnp.concatenate([top, bottom + s[:1]], axis=0)


@pytest.mark.parametrize("dtype", [np.float32, np.int32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("zeros", [False, True])
def test_concat_of_ufuncs_matches_interpret(dtype, zeros):
  x = (_rng.standard_normal((16, 128)) * 4).astype(dtype)
  y = (_rng.standard_normal((16, 128)) * 4).astype(dtype)
  if zeros:  # the signed-zero exact path, writing into its slot
    x[::3, ::5] = 0
    y[1::3, ::5] = -0.0 if np.dtype(dtype).kind != "i" else 0
  got, want = _run(_merge, jnp.asarray(x), jnp.asarray(y))
  if np.dtype(dtype) == np.float32:
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def _fusion_of(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return jaxpr, _Fusion(jaxpr, [True] * len(jaxpr.eqns))


def test_plan_fuses_concat_operands_and_squeezed_slices():
  x = jnp.ones((8, 2, 4), jnp.float32)

  def network(x):
    a, b = x[:, 0], x[:, 1]  # slice + squeeze each
    return jnp.concatenate([jnp.minimum(a, b), jnp.flip(jnp.maximum(a, b), 1)], 1)

  jaxpr, fusion = _fusion_of(network, x)
  names = [e.primitive.name for e in jaxpr.eqns]
  assert len(fusion.squeeze_of) == 2
  assert sorted(names[j] for j in fusion.into) == ["max", "min"]
  assert [names[j] for j in fusion.rev_of] in (["jit"], ["rev"])
  # And the generated plan has no concatenate call: two indexing ops, one
  # allocation, the input's has-zero flag, then two ufunc writes.
  plan = Compiler().compile(jax.make_jaxpr(network)(x))
  assert plan.source.count(" = ") == 4, plan.source
  assert plan.source.count("_nz[z") == 2, plan.source
  np.testing.assert_array_equal(
      plan(None, np.arange(64, dtype=np.float32).reshape(8, 2, 4))[0],
      np.asarray(network(jnp.arange(64, dtype=jnp.float32).reshape(8, 2, 4))))


def test_no_fusion_for_shared_or_output_values():
  x = jnp.ones((4, 8), jnp.float32)

  def shared(x):
    m = x * 2
    return jnp.concatenate([m, x + 1], 0), m  # m is also an output

  _, fusion = _fusion_of(shared, x)
  jaxpr = jax.make_jaxpr(shared)(x).jaxpr
  assert [jaxpr.eqns[j].primitive.name for j in fusion.into] == ["add"]


@pytest.mark.parametrize("index", ["row", "col", "strided", "middle"])
def test_squeezed_slices_match_interpret(index):
  x = jnp.asarray(_rng.standard_normal((8, 6, 128)).astype(np.float32))

  def kernel(x_ref, o_ref):
    v = x_ref[...]
    part = {"row": lambda: v[3], "col": lambda: v[:, 2],
            "strided": lambda: v[1::2, 5], "middle": lambda: v[2:6, 4]}[index]()
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
    o_ref[: part.shape[0], :] = part

  def call(interpret):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                          interpret=interpret)(x)
  np.testing.assert_array_equal(np.asarray(call("numpy")), np.asarray(call(True)))


def test_fused_non_movement_operand_as_zero_source():
  """max(concatenate([x * 2, y]), z): the fused product has no value name of
  its own, so the zero check of the max must look at the concatenate."""
  def kernel(x_ref, y_ref, o_ref):
    x, y = x_ref[...], y_ref[...]
    c = jnp.concatenate([x * 2, y], axis=0)
    o_ref[...] = jnp.maximum(c, jnp.flip(c, 0))

  x = np.asarray(_rng.standard_normal((8, 128)), np.float32)
  y = np.asarray(_rng.standard_normal((8, 128)), np.float32)
  x[0, :3] = [0.0, -0.0, 0.0]
  y[-1, :3] = [-0.0, 0.0, -0.0]
  got, want = _run(kernel, jnp.asarray(x), jnp.asarray(y))
  np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def _batch_plan(fn, *args, in_batched):
  import pallas_np
  from pallas_np.batching import BatchCompiler
  comp = BatchCompiler(pallas_np.InterpretParams(), "batched", frozenset())
  return comp.compile(jax.make_jaxpr(fn)(*args), in_batched=in_batched)


def test_batched_plan_fuses_concat_operands():
  """In a batched (vectorized-grid) plan the concatenate's buffer gets a lane
  axis sized at run time, slots and flips skip it; a concatenate whose first
  operand is the same for every lane stays unfused (a later batched operand
  would not fit). Lane by lane equal to the unbatched plan."""
  x = jnp.ones((8, 2, 4), jnp.float32)
  c = jnp.ones((8, 4), jnp.float32)

  def network(x, c):
    a, b = x[:, 0], x[:, 1]
    lanes = jnp.concatenate([jnp.minimum(a, b), jnp.flip(jnp.maximum(a, b), 1)], 1)
    shared_first = jnp.concatenate([c * 2, a + 1], 1)  # c is not batched
    return lanes, shared_first

  plan = _batch_plan(network, x, c, in_batched=(True, False))
  # two indexing ops, the lane-sized buffer, the zero flag, then the two
  # ufunc writes (no assignment); the shared-first concatenate keeps its own
  # three lines (c * 2, a + 1, concatenate).
  assert plan.source.count(".shape[0])") == 1, plan.source
  assert plan.source.count(" = ") == 7, plan.source
  xs = _rng.standard_normal((5, 8, 2, 4)).astype(np.float32)
  xs[1, :, 0, ::2] = -0.0  # signed zeros through the exact path
  xs[1, :, 1, ::2] = 0.0
  cv = _rng.standard_normal((8, 4)).astype(np.float32)
  got_lanes, got_shared = plan(None, xs, cv)
  assert got_lanes.shape == (5, 8, 8) and got_shared.shape == (5, 8, 8)
  single = Compiler().compile(jax.make_jaxpr(network)(x, c))
  for k in range(5):
    want_lanes, want_shared = single(None, xs[k], cv)
    assert got_lanes[k].tobytes() == np.asarray(want_lanes).tobytes()
    assert got_shared[k].tobytes() == np.asarray(want_shared).tobytes()
