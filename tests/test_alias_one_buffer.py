"""An aliased input and its output are one buffer (``input_output_aliases``).

On a TPU, and in JAX's TPU interpret mode (the oracle here), the aliased
input's HBM buffer *is* the output: a kernel may update it through its
input ref (ANY/HBM memory space, by DMA) and never touch the output ref. On a
GPU every ref points into global memory, so the same holds for any block.
Each runner of ``KernelPlan`` is covered (one grid point, the grid loop, the
fast paths' order check, megacore, one device's instance inside shard_map)
and GPU kernels. (Mesh kernels and Mosaic GPU kernels hand an aliased output
its input's buffer in their own buffer setup.) The caller's array is never
modified."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np.grid import KernelPlan
from tests.conftest import assert_same

TPU = pltpu.InterpretParams()
SEQ = pallas_np.InterpretParams(vectorize=False, num_threads=1)
AUTO = pallas_np.InterpretParams()
THREADS = pallas_np.InterpretParams(vectorize=False, num_threads=2)
XLA = pallas_np.InterpretParams(whole_program=False)  # the io_callback path


def _x(rows=16, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((rows, 128)), jnp.float32)


def _dma_add_one(x_ref, o_ref, buf):
  """Rows of this grid point out to VMEM, +1, back through the *input* ref."""
  rows = pl.ds(pl.program_id(0) * 8, 8)
  pltpu.sync_copy(x_ref.at[rows], buf)
  buf[...] += 1
  pltpu.sync_copy(buf, x_ref.at[rows])


def _any_call(kernel, x, interpret, grid=(), scratch=(), compiler_params=None):
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=grid,
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pl.ANY), scratch_shapes=list(scratch),
      input_output_aliases={0: 0}, compiler_params=compiler_params,
      interpret=interpret)(x)


@pytest.mark.parametrize("params", [SEQ, AUTO, THREADS, XLA], ids=["seq", "auto", "threads", "xla"])
@pytest.mark.parametrize("grid", [(1,), (2,)], ids=["one-point", "grid"])
def test_dma_through_input_ref(params, grid):
  x = _x()
  before = np.array(x)
  call = functools.partial(_any_call, _dma_add_one, grid=grid,
                           scratch=[pltpu.VMEM((8, 128), jnp.float32)])
  expected = call(x, TPU)
  assert_same(call(x, params), expected)
  assert_same(jax.jit(lambda x: call(x, params))(x), expected)
  np.testing.assert_array_equal(np.asarray(x), before)  # the caller's array is untouched
  assert not np.array_equal(np.asarray(expected), before)  # (the oracle did update it)


def _prefix_kernel(x_ref, o_ref, buf, prev):
  """Point i adds row block i-1 of the *aliased buffer* (read through the
  input ref) into block i, written through the output ref: a running sum,
  because the input ref sees the earlier points' output writes."""
  i = pl.program_id(0)
  pltpu.sync_copy(x_ref.at[pl.ds(i * 8, 8)], buf)

  @pl.when(i > 0)
  def _():
    pltpu.sync_copy(x_ref.at[pl.ds((i - 1) * 8, 8)], prev)
    buf[...] += prev[...]
  pltpu.sync_copy(buf, o_ref.at[pl.ds(i * 8, 8)])


@pytest.mark.parametrize("params", [SEQ, AUTO, THREADS], ids=["seq", "auto", "threads"])
def test_input_ref_reads_earlier_output_writes(params):
  """A fast path (batched or threaded grid) would read the input before
  other points wrote it: they must not run such a kernel."""
  x = _x(32)
  call = functools.partial(_any_call, _prefix_kernel, grid=(4,),
                           scratch=[pltpu.VMEM((8, 128), jnp.float32)] * 2)
  expected = call(x, TPU)
  assert_same(call(x, params), expected)
  np.testing.assert_allclose(np.asarray(expected),
                             np.cumsum(np.asarray(x).reshape(4, 8, 128), 0).reshape(32, 128),
                             rtol=1e-5)


def _dma_and_store(x_ref, o_ref, buf):
  """Both: a DMA through the input ref, then a store into the output ref."""
  pltpu.sync_copy(x_ref.at[0:8], buf)
  buf[...] *= 2
  pltpu.sync_copy(buf, x_ref.at[0:8])
  pltpu.sync_copy(x_ref.at[8:16], buf)
  buf[...] += 3
  pltpu.sync_copy(buf, o_ref.at[8:16])


def test_dma_through_input_and_output_refs():
  x = _x()
  call = functools.partial(_any_call, _dma_and_store,
                           scratch=[pltpu.VMEM((8, 128), jnp.float32)])
  assert_same(call(x, SEQ), call(x, TPU))


def _store_input(x_ref, o_ref):
  """A direct store into the ANY input ref (no DMA). JAX's TPU interpret
  mode refuses direct access to ANY refs, so the reference is NumPy: the
  ref is the aliased HBM buffer itself."""
  x_ref[0:8, :] = x_ref[0:8, :] + 1


def test_direct_store_through_input_ref():
  x = _x()
  expected = np.array(x)
  expected[0:8] += 1
  assert_same(_any_call(_store_input, x, SEQ), expected)
  assert_same(jax.jit(lambda x: _any_call(_store_input, x, XLA))(x), expected)


def test_megacore_dma_through_input_ref():
  """num_cores=2 splits the parallel grid axis between cores: both write
  the one shared buffer through their input refs."""
  x = _x(32)
  params = pallas_np.InterpretParams(num_cores=2)
  call = functools.partial(_any_call, _dma_add_one, grid=(4,),
                           scratch=[pltpu.VMEM((8, 128), jnp.float32)],
                           compiler_params=pltpu.CompilerParams(
                               dimension_semantics=("parallel",)))
  assert_same(call(x, params), call(x, TPU))


def test_on_device_instance_dma_through_input_ref():
  """One device's instance inside shard_map (a kernel reading axis_index
  runs through ``KernelPlan.run(placement=...)``)."""
  def kernel(x_ref, o_ref, buf):
    pltpu.sync_copy(x_ref, buf)
    buf[...] += jax.lax.axis_index("x").astype(jnp.float32) + 1
    pltpu.sync_copy(buf, x_ref)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  x = _x(8)

  def body(x):
    return _any_call(kernel, x, "numpy", scratch=[pltpu.VMEM((8, 128), jnp.float32)])
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.sharding.PartitionSpec("x"),
                            out_specs=jax.sharding.PartitionSpec("x"), check_vma=False))
  assert_same(f(x), np.asarray(x) + 1)


def test_gpu_kernel_blocked_store_through_input_ref():
  """A GPU (Triton) kernel's refs point into global memory: a store into
  an aliased input block lands in the output, for every block."""
  from jax.experimental.pallas import triton as pltriton

  def kernel(x_ref, o_ref):
    x_ref[...] = x_ref[...] * 2 + 1
  x = _x()
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                       in_specs=[spec], out_specs=spec, input_output_aliases={0: 0},
                       compiler_params=pltriton.CompilerParams(), interpret="numpy")(x)
  assert_same(out, np.asarray(x) * 2 + 1)


def test_plan_shares_only_buffer_refs():
  """The plan's pairs: ANY aliased pairs share, VMEM ones do not."""
  def plan_of(space):
    def kernel(x_ref, o_ref):
      pass
    x = _x()
    spec = pl.BlockSpec(memory_space=space)
    jaxpr = jax.make_jaxpr(lambda x: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), in_specs=[spec],
        out_specs=spec, input_output_aliases={0: 0}, interpret="numpy")(x))(x)
    params = dict(jaxpr.eqns[0].params)
    params.pop("interpret")
    return KernelPlan(params=SEQ, **params)
  assert plan_of(pl.ANY).shared_aliases == {0: 0}
  assert plan_of(pltpu.VMEM).shared_aliases == {}


@pytest.mark.parametrize("params", [SEQ, AUTO, THREADS], ids=["seq", "auto", "threads"])
def test_gpu_blocks_read_earlier_writes(params):
  """GPU kernel, one buffer: point i reads block i-1 of the input, which
  point i-1 wrote through the output ref. The batched and threaded grids
  (which read every input block first) must not run it."""
  from jax.experimental.pallas import triton as pltriton

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
  x = _x(64)
  out = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(8,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (jnp.maximum(i - 1, 0), 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), input_output_aliases={0: 0},
      compiler_params=pltriton.CompilerParams(), interpret=params)(x)
  expected = np.asarray(x).reshape(8, 8, 128).copy()
  for i in range(8):  # the sequential grid on the one buffer
    expected[i] = expected[max(i - 1, 0)] + 1
  assert_same(out, expected.reshape(64, 128))
