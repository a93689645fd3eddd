"""Kernel bodies holding loops, compiled whole (pallas_np/native/bodies.py,
body_loops.py; docs/native_bodies.md, "Bodies holding loops"): one native
call per grid step, loop included, with the bits and errors of the NumPy
plan (``native_loops="off"``); the loop tier's own loop in the NumPy plan
is held while the body is in play and released where the body is refused.
A body with DMAs inside its loop may read an HBM ref wider than
``MAX_ELEMENTS`` (JAX's TPU paged attention). Each test checks that the
compiled body ran (``bodies.stats()["native_calls"]``), or did not."""
import gc
import importlib.util
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np import native
from pallas_np.compiler import Compiler
from pallas_np.native import bodies, body_loops
from tests.native_elig_util import OFF, SYNC, bits

_rng = np.random.default_rng(43)
BACKGROUND = pallas_np.InterpretParams(native_loops="background")
# A body with DMA/semaphore call sites is built by numba's AOT compiler
# (lite refuses call sites), whose ``numba.pycc`` needs setuptools at run
# time from Python 3.12 on: without it every such build fails (the body,
# then its released loop: the NumPy path's bits, nothing compiled), as in
# tests/test_native_elig_dma.py.
needs_aot = pytest.mark.skipif(
    sys.version_info >= (3, 12) and importlib.util.find_spec("setuptools") is None,
    reason="numba.pycc needs setuptools on Python >= 3.12")


def _f32(*shape):
  return jnp.asarray(_rng.standard_normal(shape).astype(np.float32))


def _steps():
  return bodies.stats()["native_calls"]


def _signal(sem, k):
  """A semaphore signalled and waited in a loop (compiled in place, no
  callback): a body holding it takes its loop (``body_loops.takes_loops``)."""
  pl.semaphore_signal(sem, k + 1)
  pl.semaphore_wait(sem, k + 1)


def _loop_kernel(x_ref, o_ref, carry_ref, sem):
  """A grid step: a few eqns around a fori_loop over the block, and a
  scratch row carried across grid steps (the grid stays sequential)."""
  @pl.when(pl.program_id(0) == 0)
  def _():
    carry_ref[...] = jnp.zeros_like(carry_ref)
  s = x_ref[...] * 0.5 + pl.program_id(0).astype(jnp.float32)

  def body(k, a):
    _signal(sem, k)
    return a * 0.75 + s * k.astype(jnp.float32)
  acc = lax.fori_loop(0, 5, body, jnp.zeros_like(s))
  o_ref[...] = acc + jnp.max(s, axis=-1, keepdims=True) + carry_ref[...]
  carry_ref[...] = carry_ref[...] + acc[:1]


def _loop_call(interp, kernel=_loop_kernel):
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((24, 128), jnp.float32), grid=(3,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
      scratch_shapes=[pltpu.VMEM((1, 128), jnp.float32), pltpu.SemaphoreType.REGULAR],
      interpret=interp)


def _body_plans(kernel_name, compiled):
  """The BodyPlans of the kernel ``kernel_name`` that ran, with a library
  (``compiled``) or refused."""
  found = []
  for o in gc.get_objects():
    # (the type, not isinstance: a dead weak proxy among the objects raises on its __class__)
    if issubclass(type(o), bodies.BodyPlan) and o.body.phase == "done" and (
        (o.body.native is not None) == compiled):
      jaxpr = getattr(o.plan, "jaxpr", None)  # (other tests wrap stand-in plans)
      where = str(getattr(getattr(jaxpr, "debug_info", None), "func_src_info", ""))
      if where.split(" ")[0] == kernel_name:
        found.append(o)
  return found


@needs_aot
def test_a_body_holding_a_loop_runs_whole_with_the_numpy_bits():
  x = _f32(24, 128)
  fn = _loop_call(SYNC)
  before = _steps()
  got = [np.asarray(fn(x)) for _ in range(2)]
  assert _steps() - before == 6, "the compiled body did not run every grid step"
  # (one library, the body's: the NumPy plan's loop, held, was not built too)
  (body_plan,) = _body_plans("_loop_kernel", compiled=True)
  assert [loop.native for loop in body_plan.loops] == [None] and body_plan.loops[0].waiting
  off = np.asarray(_loop_call(OFF)(x))
  for g in got:
    np.testing.assert_array_equal(bits(g), bits(off))
  np.testing.assert_allclose(got[0], np.asarray(_loop_call(True)(x)), rtol=1e-5, atol=1e-5)


def _kernel_plan(kernel, params):
  x = _f32(24, 128)
  jaxpr = jax.make_jaxpr(_loop_call(params, kernel))(x)
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
  kjaxpr = eqn.params["jaxpr"]
  return Compiler(params, "k").compile(kjaxpr, first_calls=True), kjaxpr


def test_the_plans_loop_is_held_while_the_body_is_in_play_and_released_after():
  plan, kjaxpr = _kernel_plan(_loop_kernel, BACKGROUND)
  body_plan = bodies.wrap(plan, kjaxpr, BACKGROUND)
  assert isinstance(body_plan, bodies.BodyPlan)
  (loop,) = body_plan.loops
  assert loop.waiting and not loop.timing  # (its NumPy path, untimed: never built)
  body_plan.release()
  assert not loop.waiting and body_plan.loops == []
  # (a watchdog keeps the body's loop on the NumPy path: no body at all)
  watched = pallas_np.InterpretParams(native_loops="background", loop_watchdog_s=5.0)
  plan, kjaxpr = _kernel_plan(_loop_kernel, watched)
  assert bodies.wrap(plan, kjaxpr, watched) is plan


def test_a_body_priced_again_is_timed_again():
  """Background mode: lite refuses a body with call sites, and the tier's
  thread prices it again for numba's build (``phase = "priced"``). The
  grid's ``fn`` was the plan's own while lite's build was under way; it
  must be the sampler again, or the NumPy plan is never timed and the
  build never comes due (the body's, and its held loop's: every call on
  the NumPy path)."""
  plan, kjaxpr = _kernel_plan(_loop_kernel, BACKGROUND)
  body_plan = bodies.wrap(plan, kjaxpr, BACKGROUND)
  body = body_plan.body
  body.prechecked = True  # (its first run looked its pre-key up)
  body.phase = "building"  # (lite's build submitted)
  body_plan.route()
  assert body_plan.fn is body_plan.own()
  body.phase = "priced"  # (tier._price, after lite's refusal)
  assert body_plan.fn is body_plan.sampler


def _refused_loop_kernel(x_ref, o_ref, carry_ref, sem):
  @pl.when(pl.program_id(0) == 0)
  def _():
    carry_ref[...] = jnp.zeros_like(carry_ref)
  s = jnp.sin(x_ref[...]) + 1.0  # (sin: native_refused: the body is refused)

  def body(k, a):
    _signal(sem, k)
    return a * 0.5 + 1.0
  acc = lax.fori_loop(0, 4, body, x_ref[...])
  o_ref[...] = acc * 2.0 + s + carry_ref[...]
  carry_ref[...] = carry_ref[...] + acc[:1]


@needs_aot
def test_a_refused_body_releases_its_loop_to_the_loop_tier():
  x = _f32(24, 128)
  fn = _loop_call(SYNC, _refused_loop_kernel)
  before, refused = _steps(), bodies.stats()["refused"]
  got = np.asarray(fn(x))
  assert bodies.stats()["refused"] == refused + 1 and _steps() == before
  (body_plan,) = _body_plans("_refused_loop_kernel", compiled=False)
  (loop,) = body_loops.inner_loops(body_plan.plan)
  assert body_plan.loops == [] and not loop.waiting
  assert loop.native is not None, "the released loop was not compiled by the loop tier"
  np.testing.assert_array_equal(bits(got), bits(_loop_call(OFF, _refused_loop_kernel)(x)))


@needs_aot
def test_an_out_of_bounds_read_in_the_loop_is_the_numpy_plans_error():
  def kernel(i_ref, x_ref, o_ref, carry_ref, sem):
    @pl.when(pl.program_id(0) == 0)
    def _():
      carry_ref[...] = jnp.zeros_like(carry_ref)

    base = i_ref[pl.program_id(0)]  # (a program id at the top level: an argument)

    def body(k, a):
      _signal(sem, k)
      return a + x_ref[pl.ds(base + k, 1), :]
    acc = lax.fori_loop(0, 4, body, jnp.zeros((1, 128), jnp.float32))
    o_ref[...] = acc * 2.0 + carry_ref[...]
    carry_ref[...] = carry_ref[...] + acc

  def make(interp):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((3, 128), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(3,),
            in_specs=[pl.BlockSpec((16, 128), lambda i, idx: (0, 0))],
            out_specs=pl.BlockSpec((1, 128), lambda i, idx: (i, 0)),
            scratch_shapes=[pltpu.VMEM((1, 128), jnp.float32), pltpu.SemaphoreType.REGULAR]),
        interpret=interp)
  x = _f32(16, 128)
  ok = jnp.asarray([0, 5, 12], jnp.int32)
  before = _steps()
  np.testing.assert_array_equal(bits(make(SYNC)(ok, x)), bits(make(OFF)(ok, x)))
  assert _steps() - before == 3
  bad = jnp.asarray([0, 14, 12], jnp.int32)  # (grid point 1 reads rows 14..17 of 16)
  with pytest.raises(Exception) as native_error:
    make(SYNC)(bad, x)
  with pytest.raises(Exception) as numpy_error:
    make(OFF)(bad, x)
  assert type(native_error.value) is type(numpy_error.value)
  assert str(native_error.value) == str(numpy_error.value)


PAGES = 80  # (80 pages of (8, 128): 81920 elements, wider than MAX_ELEMENTS)


def _paged_kernel(idx_ref, x_hbm, o_ref, buf, sem):
  """Paged attention's shape: per grid step, the block's output cleared,
  then a loop DMAs pages chosen by a scalar-prefetch table from an HBM ref
  and accumulates them."""
  b = pl.program_id(0)
  o_ref[...] = jnp.zeros_like(o_ref)

  def body(k, c):
    cp = pltpu.make_async_copy(x_hbm.at[idx_ref[b * 4 + k]], buf.at[k % 2], sem.at[k % 2])
    cp.start()
    cp.wait()
    o_ref[...] = o_ref[...] * 0.5 + buf[k % 2] * (k + 1).astype(jnp.float32)
    return c
  lax.fori_loop(0, idx_ref[16 + b], body, 0)
  o_ref[...] = o_ref[...] + 1.0


def _paged_call(interp):
  return pl.pallas_call(
      _paged_kernel, out_shape=jax.ShapeDtypeStruct((4, 8, 128), jnp.float32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(4,),
          in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=pl.BlockSpec((None, 8, 128), lambda b, idx: (b, 0, 0)),
          scratch_shapes=[pltpu.VMEM((2, 8, 128), jnp.float32),
                          pltpu.SemaphoreType.DMA((2,))]),
      interpret=interp)


@needs_aot
def test_a_body_with_dmas_in_its_loop_and_a_wide_hbm_ref():
  x = _f32(PAGES, 8, 128)
  pages = _rng.permutation(PAGES)[:16].astype(np.int32)
  idx = jnp.asarray(np.concatenate([pages, [4, 2, 0, 3]]).astype(np.int32))
  fn = _paged_call(SYNC)
  before = _steps()
  got = [np.asarray(fn(idx, x)) for _ in range(2)]
  assert _steps() - before == 8, "the compiled body did not run every grid step"
  off = np.asarray(_paged_call(OFF)(idx, x))
  for g in got:
    np.testing.assert_array_equal(bits(g), bits(off))
  np.testing.assert_allclose(got[0], np.asarray(_paged_call(True)(idx, x)), rtol=1e-5, atol=1e-5)
  # An out-of-bounds page at grid point 2: the DMA's own error, at that point.
  bad = np.asarray(idx).copy()
  bad[2 * 4 + 0] = PAGES + 3
  bad[16 + 2] = 1
  with pytest.raises(Exception) as native_error:
    _paged_call(SYNC)(jnp.asarray(bad), x)
  with pytest.raises(Exception) as numpy_error:
    _paged_call(OFF)(jnp.asarray(bad), x)
  assert type(native_error.value) is type(numpy_error.value)
  assert str(native_error.value) == str(numpy_error.value)
  assert "(2,)" in str(numpy_error.value)  # (the grid point)


def test_hbm_refs_do_not_count_toward_max_elements():
  """The paged kernel is wrapped although its HBM ref is wider than
  MAX_ELEMENTS; the same ref in VMEM (a blocked operand) is not."""
  x = _f32(PAGES, 8, 128)
  idx = jnp.zeros((20,), jnp.int32)
  jaxpr = jax.make_jaxpr(_paged_call(SYNC))(idx, x)
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
  kjaxpr = eqn.params["jaxpr"]
  assert body_loops.holds_loop(kjaxpr)
  assert bodies.body_jaxpr(kjaxpr) is not None
  hbm = [v for v in kjaxpr.invars if bodies._in_hbm(v.aval)]  # noqa: SLF001
  assert len(hbm) == 1 and math.prod(hbm[0].aval.shape) > bodies.MAX_ELEMENTS
  assert bodies._widest(kjaxpr) <= bodies.MAX_ELEMENTS  # noqa: SLF001
