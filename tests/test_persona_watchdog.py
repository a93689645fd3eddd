"""The loop watchdog (InterpretParams.loop_watchdog_s): a kernel's
while_loop whose condition never becomes false raises, naming the loop's
line and the grid point, on every path that runs a loop (sequential,
vectorized, lane groups, pdb's per-plan loops); a loop that ends gives the
NumPy reference's result with the watchdog on."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_np
from pallas_np.control_flow.loops import LoopWatchdogError
from jax.experimental import pallas as pl

SECONDS = 0.3


def _kernel(stuck_at, lane_dependent):
  """``o = x + trips``; grid point ``stuck_at`` loops forever."""
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    trips = (i + 1) * 3 if lane_dependent else 3

    def cond(c):
      return jnp.logical_or(c[0] < trips, i == stuck_at)

    def body(c):
      return (c[0] + 1,)
    (n,) = jax.lax.while_loop(cond, body, (jnp.int32(0),))
    o_ref[...] = x_ref[...] + n
  return kernel


def _call(kernel, params, x):
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(8,),
                        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                        interpret=params)(x)


PATHS = [dict(vectorize=False), dict(vectorize=None), dict(vectorize=False, native_loops="sync")]


@pytest.mark.parametrize("lane_dependent", [False, True])
@pytest.mark.parametrize("options", PATHS)
def test_watchdog_stops_an_endless_loop(options, lane_dependent):
  x = np.zeros((64, 128), np.int32)
  params = pallas_np.InterpretParams(loop_watchdog_s=SECONDS, **options)
  start = time.monotonic()
  with pytest.raises(LoopWatchdogError) as info:
    _call(_kernel(5, lane_dependent), params, x)
  assert time.monotonic() - start < 30 * SECONDS + 10
  msg = str(info.value)
  assert "grid point (5,)" in msg and "while_loop at" in msg
  assert "test_persona_watchdog.py" in msg and "loop_watchdog_s" in msg
  assert isinstance(info.value, TimeoutError)


@pytest.mark.parametrize("lane_dependent", [False, True])
@pytest.mark.parametrize("options", PATHS)
def test_watchdog_keeps_results(options, lane_dependent):
  x = np.arange(64 * 128, dtype=np.int32).reshape(64, 128)
  params = pallas_np.InterpretParams(loop_watchdog_s=60.0, **options)
  out = np.asarray(_call(_kernel(-1, lane_dependent), params, x))
  trips = np.repeat((np.arange(8) + 1) * 3 if lane_dependent else np.full(8, 3), 8)[:, None]
  np.testing.assert_array_equal(out, x + trips)


def test_watchdog_under_pdb_plans():
  """pdb runs each loop as plans (no generated loop function): watched too."""
  x = np.zeros((64, 128), np.int32)
  params = pallas_np.InterpretParams(loop_watchdog_s=SECONDS, vectorize=False)
  with pytest.raises(LoopWatchdogError, match="grid point"):
    _call(_kernel(0, False), params, x)


def test_persona_turns_it_on():
  x = jnp.zeros((64, 128), jnp.int32)
  with pallas_np.emulate_device("tpu-v5e", loop_watchdog_s=SECONDS):
    with pytest.raises(LoopWatchdogError):
      _call(_kernel(2, False), False, x)  # interpret=False: the persona runs it


def test_watchdog_option_checked():
  with pytest.raises(ValueError):
    pallas_np.InterpretParams(loop_watchdog_s=0)
  assert pallas_np.InterpretParams().loop_watchdog_s is None
