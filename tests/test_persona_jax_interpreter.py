"""pallas_np standing in for JAX's own interpreters (the ``cpu`` persona,
which runs JAX's interpret-mode test files): races are recorded and the
kernel goes on, as JAX's interpreters do, and ``get_races()`` answers from
the record. Expectations come from the semantics (two warpgroups writing
one element with nothing ordering them race; a barrier orders them)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from tests.mgpu_helpers import plgpu

import pallas_np
from pallas_np import races

gpu_interpret = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")


def _both_write(order: bool):
  """Warpgroups 0 and 1 write the same output element; with ``order`` a
  barrier orders 1 after 0 (so 1's value is the result)."""
  def body(o_ref, bar):
    wg = jax.lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
      o_ref[0] = jnp.int32(10)
      plgpu.barrier_arrive(bar)

    @pl.when(wg == 1)
    def _():
      if order:
        plgpu.barrier_wait(bar)
      o_ref[0] = jnp.int32(11)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((1,), jnp.int32),
                      scratch_types=[plgpu.Barrier(num_arrivals=1)],
                      num_threads=2, thread_name="wg")


def test_cpu_persona_records_races_and_get_races_reports_them():
  with pallas_np.emulate_device("cpu"):
    racy = _both_write(order=False)()  # recorded: no RaceError
    assert np.asarray(racy).shape == (1,)
    assert gpu_interpret.get_races().races_found is True
    assert "warpgroup" in str(gpu_interpret.get_races().races[0])
    # Each kernel run starts the record afresh (JAX's state is the last kernel's).
    np.testing.assert_array_equal(_both_write(order=True)(), [11])
    assert gpu_interpret.get_races().races_found is False


def test_raise_policy_still_raises():
  """Outside the cpu persona, race detection raises from the kernel call."""
  with pallas_np.emulate_device("h100", detect_races=True):
    with pytest.raises(pallas_np.RaceError):
      _both_write(order=False)()
  with pallas_np.emulate_device("cpu", race_policy="raise"):
    with pytest.raises(pallas_np.RaceError):
      _both_write(order=False)()


def _same_block(x_ref, o_ref):
  o_ref[...] = x_ref[...] + pl.program_id(0).astype(jnp.float32)


def test_record_policy_on_a_pallas_call_grid():
  """Two parallel grid points writing the same output block: recorded, the
  grid runs to the end (the last point's values), as JAX's interpreter."""
  x = np.zeros((8, 128), np.float32)

  def call(params):
    return pallas_np.pallas_call(
        _same_block, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(3,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
        interpret=params)(x)
  record = pallas_np.InterpretParams(detect_races=True, race_policy="record",
                                     parallel_axes=(0,))
  np.testing.assert_array_equal(call(record), x + 2)
  assert races.RECORD.found
  with pytest.raises(pallas_np.RaceError):
    call(pallas_np.InterpretParams(detect_races=True, parallel_axes=(0,)))
  with pytest.raises(ValueError, match="race_policy"):
    pallas_np.InterpretParams(race_policy="ignore")


def test_get_races_without_detection_says_how_to_turn_it_on():
  with pallas_np.emulate_device("cpu", detect_races=False):
    with pytest.raises(pallas_np.UnsupportedError, match="pallas-numpy-races"):
      gpu_interpret.get_races()


def test_jax_interpreter_only_options_skip():
  import unittest
  params_mod = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params")
  with pallas_np.emulate_device("cpu"):
    with pytest.raises(unittest.SkipTest, match="num_tma_threads_per_device"):
      params_mod.InterpretGPUParams(num_tma_threads_per_device=2)
    params_mod.InterpretGPUParams(num_tma_threads_per_device=1)  # one TMA agent: as ours
  params_mod.InterpretGPUParams(num_tma_threads_per_device=2)  # outside: JAX's own


def test_gpu_persona_answers_shared_memory_and_skips_gpu_cross_lowering():
  import unittest
  with pallas_np.emulate_device("h100"):
    assert jax.local_devices()[0].shared_memory_per_block_optin == 232448
    traced = jax.jit(lambda x: x + 1).trace(jnp.zeros(4))
    with pytest.raises(unittest.SkipTest, match="lowering for a platform"):
      traced.lower(lowering_platforms=("gpu",))
    traced.lower(lowering_platforms=("cpu",))  # a platform XLA has lowers as usual
  assert not hasattr(jax.local_devices()[0], "shared_memory_per_block_optin") or \
      jax.local_devices()[0].shared_memory_per_block_optin != 232448
