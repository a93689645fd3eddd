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


def scratch_reset_only_at_origin(rows):
  """``make(interpret)`` of a buggy (rows, 8) kernel over a (rows, 3) grid,
  "parallel" x "arbitrary": its scratch accumulator is zeroed only at grid
  point (0, 0) (it should be at j == 0 for every i), so each i carries on
  from what the previous i left: a race across the parallel axis, and a
  kernel that must not be vectorized over it."""
  import jax.numpy as jnp
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref, acc_ref):
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when((i == 0) & (j == 0))  # BUG: should be j == 0 for every i
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += x_ref[...]
    o_ref[...] = acc_ref[...]

  def make(interpret):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows, 8), jnp.float32), grid=(rows, 3),
        in_specs=[pl.BlockSpec((1, 8), lambda i, j: (i, 0))],
        out_specs=pl.BlockSpec((1, 8), lambda i, j: (i, 0)),
        scratch_shapes=[pltpu.VMEM((1, 8), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret)
  return make
