"""``pltpu.emit_pipeline`` traced as one primitive (``emit_pipeline_p``,
``jax_use_emit_pipeline_primitive``) and ``jax.empty_ref`` in kernels,
checked against NumPy references (integer-valued floats: exact sums).

JAX 0.10/0.11 bind the primitive with the operand layout
``primitives/tpu_pipeline.py`` reads; JAX 0.12 packs it differently and the
rule raises ``UnsupportedError`` there (tested too: never a wrong answer)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import config
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np.errors import UnsupportedError

_PRIMITIVE_LAYOUT = None


def _primitive_supported():
  """Whether this JAX binds emit_pipeline_p with the layout we read."""
  global _PRIMITIVE_LAYOUT
  if _PRIMITIVE_LAYOUT is None:
    def kernel(x_hbm, o_hbm):
      def body(x, o):
        o[...] = x[...]
      pltpu.emit_pipeline(body, grid=(1,), in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
                          out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)))(x_hbm, o_hbm)
    with config.use_emit_pipeline_primitive(True):
      jaxpr = jax.make_jaxpr(pl.pallas_call(
          kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
          in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=pl.BlockSpec(memory_space=pl.ANY), interpret=True))(
              jnp.zeros((8, 128), jnp.float32))
    kernel_jaxpr = jaxpr.jaxpr.eqns[0].params["jaxpr"]
    eqn = next(e for e in kernel_jaxpr.eqns if e.primitive.name == "emit_pipeline")
    _PRIMITIVE_LAYOUT = "body_consts_len" in eqn.params
  return _PRIMITIVE_LAYOUT


def _run(kernel, out_shape, *args, in_spaces=None, out_space=pl.ANY):
  in_spaces = in_spaces or [pl.ANY] * len(args)
  call = pl.pallas_call(kernel, out_shape=out_shape,
                        in_specs=[pl.BlockSpec(memory_space=s) for s in in_spaces],
                        out_specs=pl.BlockSpec(memory_space=out_space), interpret="numpy")
  with config.use_emit_pipeline_primitive(True):
    if not _primitive_supported():
      with pytest.raises(UnsupportedError, match="emit_pipeline"):
        jax.jit(call)(*args)
      return None
    return np.asarray(jax.jit(call)(*args))


def _ints(shape, seed):
  return np.random.default_rng(seed).integers(-4, 5, shape).astype(np.float32)


@pytest.mark.parametrize("space", [pl.ANY, pltpu.VMEM])
def test_matmul_accumulates_in_revisited_output_block(space):
  def kernel(x_hbm, y_hbm, o_hbm):
    def body(x, y, o):
      @pl.when(pl.program_id(2) == 0)
      def _():
        o[...] = jnp.zeros_like(o)
      o[...] += x[...] @ y[...]
    pltpu.emit_pipeline(
        body, grid=(2, 3, 2),
        in_specs=[pl.BlockSpec((64, 32), lambda i, j, k: (i, k)),
                  pl.BlockSpec((32, 48), lambda i, j, k: (k, j))],
        out_specs=pl.BlockSpec((64, 48), lambda i, j, k: (i, j)))(x_hbm, y_hbm, o_hbm)
  x, y = _ints((128, 64), 0), _ints((64, 144), 1)
  out = _run(kernel, jax.ShapeDtypeStruct((128, 144), jnp.float32), x, y,
             in_spaces=[space, space], out_space=space)
  if out is not None:
    np.testing.assert_array_equal(out, x @ y)


def test_edge_blocks_write_only_in_bounds_and_see_program_ids():
  def kernel(x_hbm, o_hbm):
    def body(x, o):
      o[...] = x[...] + 10 * pl.program_id(0) + pl.program_id(1)
    pltpu.emit_pipeline(
        body, grid=(4, 3),
        in_specs=[pl.BlockSpec((32, 128), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((32, 128), lambda i, j: (i, j)))(x_hbm, o_hbm)
  x = _ints((100, 300), 2)
  out = _run(kernel, jax.ShapeDtypeStruct((100, 300), jnp.float32), x)
  if out is not None:
    rows = np.arange(100)[:, None] // 32
    cols = np.arange(300)[None, :] // 128
    np.testing.assert_array_equal(out, x + 10 * rows + cols)


def test_transformed_operands_slice_and_width_changing_bitcast():
  """A copy through int16 views of int32 refs (a width-changing bitcast has
  no NumPy view: blocks go through pallas_np's lens) returns the input."""
  def kernel(x_hbm, o_hbm):
    def body(x, o):
      o[...] = x[...]
    pltpu.emit_pipeline(
        body, grid=(2,),
        in_specs=[pl.BlockSpec((16, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((16, 128), lambda i: (i, 0)))(
            x_hbm.at[1].bitcast(jnp.int16), o_hbm.bitcast(jnp.int16))
  x = np.random.default_rng(3).integers(-2**31, 2**31 - 1, (2, 16, 128)).astype(np.int32)
  out = _run(kernel, jax.ShapeDtypeStruct((16, 128), jnp.int32), x)
  if out is not None:
    np.testing.assert_array_equal(out, x[1])


def test_empty_ref_in_kernel():
  def kernel(x_ref, o_ref):
    scratch = jax.empty_ref(jax.ShapeDtypeStruct((8, 128), jnp.float32), pltpu.VMEM)
    scratch[...] = x_ref[...] + 1
    o_ref[...] = scratch[...] * 2
  x = _ints((8, 128), 4)
  out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                       interpret="numpy")(x)
  np.testing.assert_array_equal(np.asarray(out), (x + 1) * 2)
