"""Run TPU kernels under each interpreter: numpy mode, interpret=True (the
HLO interpreter) and TPU interpret mode (pltpu.InterpretParams)."""
import contextlib

import jax
import numpy as np
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np import _compat as jc
from tests.conftest import assert_same


@contextlib.contextmanager
def hlo_interpret():
  """Like force_numpy_interpret, but routes every pallas_call to interpret=True."""
  prev = jc.interpret_mode_config.swap_local(True)
  try:
    yield
  finally:
    jc.interpret_mode_config.set_local(prev)


def numpy_mode(**kw):
  return pallas_np.force_numpy_interpret(
      pallas_np.InterpretParams(check_avals=True, **kw))


def tpu_interpret():
  return pltpu.force_tpu_interpret_mode(pltpu.InterpretParams())


def compare(fn, *, oracle=hlo_interpret, rtol=1e-5, atol=1e-5, **numpy_kw):
  """fn() under numpy mode vs under ``oracle``; returns the numpy result."""
  with numpy_mode(**numpy_kw):
    got = jax.block_until_ready(fn())
  with oracle():
    want = jax.block_until_ready(fn())
  g, w = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
  assert len(g) == len(w)
  for a, b in zip(g, w):
    assert_same(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)
  return got
