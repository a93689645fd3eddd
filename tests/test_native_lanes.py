"""Every lane of a vectorized pass through a compiled loop in one call
(pallas_np/native/lanes.py): the loop of a vectorized grid's batched plan,
with ``native_loops="sync"``, gives the bits of ``"off"`` and of the
sequential grid, raises the NumPy path's error naming the failing lane's
values, and makes one compiled call per pass (it made one per lane)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from benchmarks.small_kernels import bitonic_fori_kernel
from pallas_np import native
from pallas_np.native import codegen, lanes, loop_step, tier
from tests.native_elig_util import bits

_rng = np.random.default_rng(4141)


def _params(mode, vectorize=None):
  return pallas_np.InterpretParams(native_loops=mode, vectorize=vectorize)


def _calls_of_compiled_code(monkeypatch):
  """Counts the compiled calls of the lanes path (``lanes.run``), of
  the sequential one (``NativeLoop._run``) and of the loop's generated step
  (``loop_step.build``'s, for loops swapped in from now on)."""
  made = []
  real_run, real_seq = lanes.run, tier.NativeLoop._run

  def counted(fn):
    def call(*args):
      made.append(1)
      return fn(*args)
    return call

  def run(loop, fn, ctx, args):
    return real_run(loop, counted(fn), ctx, args)

  def seq(self, fn, args, ctx=None):
    return real_seq(self, counted(fn), args, ctx)
  real_build = loop_step.build
  monkeypatch.setattr(lanes, "run", run)
  monkeypatch.setattr(tier.NativeLoop, "_run", seq)

  def build(loop, fn):
    step = real_build(loop, fn)
    if step is not None:
      step.__globals__["_call"] = counted(fn)
    return step
  monkeypatch.setattr(loop_step, "build", build)
  return made


def _lane_passes(monkeypatch):
  """Counts the vectorized passes run by ``lanes.run`` (compiled or not)."""
  passes = []
  real = lanes.run

  def run(loop, fn, ctx, args):
    passes.append(ctx.batch_size)
    return real(loop, fn, ctx, args)
  monkeypatch.setattr(lanes, "run", run)
  return passes


def _bitonic(interp, x, rows=8):
  spec = pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))
  return pl.pallas_call(bitonic_fori_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(x.shape[0] // rows,), in_specs=[spec], out_specs=spec,
                        interpret=interp)


def test_bitonic_lanes_in_one_call_bit_equal(monkeypatch):
  """A 4-point vectorized grid: one compiled call a pass, the bits of off
  (vectorized or not) and of the sequential grid's compiled loop."""
  x = _rng.standard_normal((32, 128)).astype(np.float32)
  x.reshape(-1)[:6] = [np.nan, -0.0, 0.0, np.inf, -np.inf, -np.nan]
  x = jnp.asarray(x)
  fn = _bitonic(_params("sync"), x)
  made = _calls_of_compiled_code(monkeypatch)
  np.asarray(fn(x))  # (built, by lanes)
  made.clear()
  before = native.stats()["native_calls"]
  got = np.asarray(fn(x))
  assert native.stats()["native_calls"] - before == 4, "the compiled loop did not run"
  assert len(made) == 1, f"{len(made)} compiled calls for one pass of 4 lanes"
  for want in (_bitonic(_params("off"), x)(x), _bitonic(_params("off", False), x)(x),
               _bitonic(_params("sync", False), x)(x)):
    np.testing.assert_array_equal(bits(got), bits(np.asarray(want)))


def _lane_loop_kernel(x_ref, n_ref, o_ref):
  """A per-lane trip count (a batched scalar operand), a carry the lanes
  share (its trip count only) and per-lane carries, ref reads at a
  dynamic row."""
  pid = pl.program_id(0)

  def body(i, c):
    acc, cnt = c
    row = lax.rem(i + pid, 8)
    return acc * 0.5 + x_ref[pl.ds(row, 1), :] * n_ref[...], cnt + i
  acc, cnt = lax.fori_loop(0, 5, body, (jnp.zeros((1, 128), jnp.float32), jnp.int32(0)))
  o_ref[...] = jnp.broadcast_to(acc + cnt.astype(jnp.float32), o_ref.shape)


def test_lane_stacked_and_shared_operands_bit_equal(monkeypatch):
  passes = _lane_passes(monkeypatch)
  x = jnp.asarray(_rng.standard_normal((32, 128)).astype(np.float32))
  n = jnp.asarray(_rng.standard_normal((4, 128)).astype(np.float32))

  def make(interp):
    return pl.pallas_call(
        _lane_loop_kernel, out_shape=jax.ShapeDtypeStruct((32, 128), jnp.float32), grid=(4,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0)),
                  pl.BlockSpec((1, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), interpret=interp)
  before = native.stats()["native_calls"]
  got = [np.asarray(make(_params("sync"))(x, n)) for _ in range(2)]
  assert native.stats()["native_calls"] - before >= 4, "the compiled loop did not run"
  for want in (make(_params("off"))(x, n), make(_params("off", False))(x, n)):
    for g in got:
      np.testing.assert_array_equal(bits(g), bits(np.asarray(want)))
  np.testing.assert_allclose(got[0], np.asarray(make(True)(x, n)), rtol=1e-5, atol=1e-5)
  assert passes and set(passes) == {4}, "not run as one vectorized pass of 4 lanes"


def _oob_lane_kernel(x_ref, o_ref):
  """Lanes 0 and 1 read in bounds; lanes 2 and 3 read rows 7..8 of 8 at
  the last iteration."""
  late = (pl.program_id(0) >= 2).astype(jnp.int32)

  def body(i, acc):
    return acc + x_ref[pl.ds(i * 2 + late, 2), :]
  o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros((2, 128), jnp.float32))


@pytest.mark.parametrize("vectorize", [None, False])
def test_out_of_bounds_in_one_lane_raises_the_numpy_error(vectorize, monkeypatch):
  """A bounds check failing in lane 2 of one compiled call raises the
  NumPy path's IndexError with that lane's values (the per-lane message)."""
  x = jnp.asarray(_rng.standard_normal((32, 128)).astype(np.float32))

  def make(interp):
    return pl.pallas_call(
        _oob_lane_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), grid=(4,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((2, 128), lambda i: (i, 0)), interpret=interp)
  messages = []
  passes = _lane_passes(monkeypatch)
  for mode in ("sync", "off"):
    with pytest.raises(IndexError) as info:
      make(_params(mode, vectorize))(x)
    messages.append(str(info.value))
  assert bool(passes) == (vectorize is None)
  assert messages[0] == messages[1]
  assert "7" in messages[0]


def test_lanes_eqn_refuses_a_loop_without_stacked_operands():
  """Every operand shared by the lanes: nothing to run per lane (the NumPy
  path runs it)."""
  jaxpr = jax.make_jaxpr(lambda a: lax.fori_loop(0, 3, lambda i, v: v * 2.0, a))(
      jnp.zeros((4,), jnp.float32))
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("while", "scan")]
  lanes_eqn = lanes.LanesEqn(eqn, [False] * len(eqn.invars), [False] * len(eqn.outvars))
  with pytest.raises(codegen.Refused):
    lanes_eqn.loop_source(False, "nan")
