"""Kernel bodies holding loops their author unrolled (``pl.loop(...,
unroll=True)``, ``fori_loop(..., unroll=True)``), compiled whole by the body
tier (pallas_np/native/body_loops.py, docs/native_bodies.md): JAX's TPU
flash attention's grid step, a one-trip ``pl.loop`` inside a ``pl.when``
between an initialising and a finishing ``pl.when``. Each grid step runs
compiled, with the bits of ``native_loops="off"``; in background mode the
body is kept without the probe; a rolled loop (a ``while``, a ``scan``
not unrolled) keeps the loop tier."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np import native
from pallas_np.native import bodies, body_loops, cost_rule, lite_jit
from tests.native_elig_util import OFF, SYNC, bits, free_lite_builds
from tests.test_native_lite_process import fresh  # noqa: F401 - a fixture: a cache of its own

_rng = np.random.default_rng(47)
BACKGROUND = pallas_np.InterpretParams(native_loops="background")


def _flash_like_kernel(q_ref, k_ref, o_ref, m_ref, l_ref):
  """Flash attention's grid step in small: scratch reset at the first kv
  step, an unrolled loop over two k slices below the diagonal (an online
  max and sum of exp), the output written at the last kv step."""
  i, j = pl.program_id(0), pl.program_id(1)
  last = pl.num_programs(1) - 1

  @pl.when(j == 0)
  def _():
    m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
    l_ref[...] = jnp.zeros_like(l_ref)

  @pl.when(j <= i)
  def _():
    @pl.loop(0, 16, step=8, unroll=True)
    def _(s):
      kb = k_ref[pl.ds(s, 8), :]
      sc = lax.dot_general(q_ref[...], kb, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32)
      m_prev = m_ref[...]
      m_next = jnp.maximum(m_prev, sc.max(axis=-1, keepdims=True))
      l_ref[...] = (l_ref[...] * jnp.exp(m_prev - m_next)
                    + jnp.exp(sc - m_next).sum(axis=-1, keepdims=True))
      m_ref[...] = m_next

  @pl.when(j == last)
  def _():
    o_ref[...] = jnp.broadcast_to(jnp.log(l_ref[...]) + m_ref[...], o_ref.shape)


def _flash_like_call(interp):
  return pl.pallas_call(
      _flash_like_kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32), grid=(2, 2),
      in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, 0)),
                pl.BlockSpec((16, 128), lambda i, j: (j, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, 0)),
      scratch_shapes=[pltpu.VMEM((8, 1), jnp.float32), pltpu.VMEM((8, 1), jnp.float32)],
      interpret=interp)


def _args():
  return (jnp.asarray(_rng.standard_normal((16, 128)).astype(np.float32)),
          jnp.asarray(_rng.standard_normal((32, 128)).astype(np.float32)))


def _kernel_jaxpr(make, *args):
  jaxpr = jax.make_jaxpr(make(SYNC))(*args)
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
  return eqn.params["jaxpr"]


def test_a_body_holding_an_unrolled_loop_runs_whole_with_the_numpy_bits():
  q, k = _args()
  before = bodies.stats()["native_calls"]
  got = [np.asarray(_flash_like_call(SYNC)(q, k)) for _ in range(2)]
  assert bodies.stats()["native_calls"] - before == 8, "a grid step did not run compiled"
  off = np.asarray(_flash_like_call(OFF)(q, k))
  for g in got:
    np.testing.assert_array_equal(bits(g), bits(off))
  np.testing.assert_allclose(got[0], np.asarray(_flash_like_call(True)(q, k)),
                             rtol=1e-5, atol=1e-5)


def test_only_unrolled_loops_or_call_sites_are_taken_by_the_body():
  """``takes_loops``: the flash-like body (an unrolled loop) yes; the same
  loop rolled, and a ``while`` loop, stay the loop tier's."""
  q, k = _args()
  assert body_loops.takes_loops(_kernel_jaxpr(_flash_like_call, q, k))

  def rolled_kernel(x_ref, o_ref):
    o_ref[...] = lax.fori_loop(0, 4, lambda t, a: a * 0.5 + x_ref[...], x_ref[...] * 2.0)

  def unrolled_kernel(x_ref, o_ref):
    o_ref[...] = lax.fori_loop(0, 4, lambda t, a: a * 0.5 + x_ref[...], x_ref[...] * 2.0,
                               unroll=True)

  def while_kernel(x_ref, o_ref):
    o_ref[...] = lax.while_loop(lambda a: a[0, 0] < 100.0, lambda a: a * 2.0 + 1.0,
                                jnp.abs(x_ref[...]) + 1.0)

  for kernel, taken in ((rolled_kernel, False), (unrolled_kernel, True), (while_kernel, False)):
    make = lambda interp, kernel=kernel: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), interpret=interp)
    kjaxpr = _kernel_jaxpr(make, q[:8])
    assert body_loops.takes_loops(kjaxpr) is taken, kernel.__name__
    plan = object()
    assert (bodies.wrap(plan, kjaxpr, BACKGROUND) is plan) is not taken, kernel.__name__


@pytest.mark.skipif(not lite_jit.available(), reason="llvmlite is not installed")
def test_a_background_body_holding_an_unrolled_loop_is_kept_without_a_probe(fresh, monkeypatch):
  """Background mode, prices zeroed, a cache of its own: once lite's build
  is swapped in, the grid's ``fn`` is the step function at once (no
  probe: it would time the body against its loop held on the NumPy path),
  and every later step runs compiled with off's bits."""
  free_lite_builds(monkeypatch)
  seen = []
  swapped = bodies.BodyPlan._swapped  # noqa: SLF001

  def record(self, body, fn):
    swapped(self, body, fn)
    seen.append((self, self.fn))
  monkeypatch.setattr(bodies.BodyPlan, "_swapped", record)
  q, k = _args()
  want = bits(_flash_like_call(OFF)(q, k))
  f = _flash_like_call(BACKGROUND)
  for _ in range(64 * cost_rule.HOT_RUNS):  # (the sampler times one step in SAMPLE_STEPS)
    np.testing.assert_array_equal(bits(f(q, k)), want)
    assert native.wait(900)
    if seen:
      break
  assert seen, "the body was never built"
  ((body_plan, fn_at_swap),) = seen
  assert fn_at_swap.__name__ == "native_step" and body_plan.fixed is fn_at_swap
  before = bodies.stats()["native_calls"]
  np.testing.assert_array_equal(bits(f(q, k)), want)
  assert bodies.stats()["native_calls"] - before == 4
