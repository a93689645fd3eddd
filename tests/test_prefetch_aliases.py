"""input_output_aliases with scalar-prefetch operands (issue 27, item 1).

JAX numbers aliased inputs over *all* operands, the scalar-prefetch ones
included: with ``num_scalar_prefetch=1``, ``{1: 0}`` is the first array
operand. interpret=True is the oracle."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np.grid import KernelPlan
from tests.conftest import assert_same

SEQ = pallas_np.InterpretParams(vectorize=False, num_threads=1, check_avals=True)
VEC = pallas_np.InterpretParams(vectorize=True, check_avals=True)
THREADS = pallas_np.InterpretParams(vectorize=False, num_threads=2, check_avals=True)
XLA = pallas_np.InterpretParams(whole_program=False, check_avals=True)  # io_callback path


def _randn(seed, *shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _half_written(n_prefetch, alias, nblocks=4):
  """Writes x + y + s[0] into the even blocks only; the odd ones keep
  whatever the output started as (the aliased operand)."""
  def kernel(*refs):
    s_ref, x_ref, y_ref, o_ref = refs[0], refs[n_prefetch], refs[n_prefetch + 1], refs[-1]

    @pl.when(pl.program_id(0) % 2 == 0)
    def _():
      o_ref[...] = x_ref[...] + y_ref[...] + s_ref[0].astype(jnp.float32)

  def make(interpret):
    spec = pl.BlockSpec((8, 128), lambda i, *_: (i, 0))
    gs = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=n_prefetch, grid=(nblocks,),
                                      in_specs=[spec, spec], out_specs=spec)
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((8 * nblocks, 128), jnp.float32),
                          grid_spec=gs, input_output_aliases=alias, interpret=interpret)
  return make


def _args(n_prefetch, nblocks=4):
  prefetch = [jnp.array([3, 1], jnp.int32), jnp.array([7], jnp.int32)][:n_prefetch]
  return (*prefetch, _randn(1, 8 * nblocks, 128), _randn(2, 8 * nblocks, 128))


@pytest.mark.parametrize("interp", ["numpy", SEQ, VEC, THREADS, XLA],
                         ids=["default", "seq", "vec", "threads", "io_callback"])
@pytest.mark.parametrize("n_prefetch,alias", [
    (1, {1: 0}),  # x: the first array operand
    (1, {2: 0}),  # y: the last operand (raised IndexError before)
    (2, {2: 0}),  # two prefetch operands
    (2, {3: 0}),
])
def test_alias_counts_scalar_prefetch_operands(interp, n_prefetch, alias):
  make = _half_written(n_prefetch, alias)
  args = _args(n_prefetch)
  want = make(True)(*args)
  got = make(interp)(*args)
  assert_same(got, want)
  # The odd blocks are the aliased operand itself, not another input.
  src = np.asarray(args[next(iter(alias))])
  np.testing.assert_array_equal(np.asarray(got)[8:16], src[8:16])


def test_alias_under_jit_and_pallas_np_pallas_call():
  make = _half_written(1, {2: 0})
  args = _args(1)
  want = make(True)(*args)
  assert_same(jax.jit(make("numpy"))(*args), want)
  spec = pl.BlockSpec((8, 128), lambda i, *_: (i, 0))
  gs = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(4,), in_specs=[spec, spec],
                                    out_specs=spec)

  def kernel(s_ref, x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(0) % 2 == 0)
    def _():
      o_ref[...] = x_ref[...] + y_ref[...] + s_ref[0].astype(jnp.float32)
  f = pallas_np.pallas_call(kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32),
                            grid_spec=gs, input_output_aliases={2: 0})
  assert_same(f(*args), want)
  assert_same(pallas_np.jit(make(True))(*args), want)


@pytest.mark.parametrize("interp", ["numpy", SEQ, VEC], ids=["default", "seq", "vec"])
def test_aliasing_the_scalar_prefetch_operand_itself(interp):
  """JAX allows aliasing a scalar-prefetch operand: the output starts as it."""
  def kernel(s_ref, x_ref, o_ref, p_ref):
    o_ref[...] = x_ref[...] * 2.0

    @pl.when(pl.program_id(0) == 1)
    def _():
      p_ref[1] = s_ref[0] + 10

  def make(interpret):
    spec = pl.BlockSpec((8, 128), lambda i, s: (i, 0))
    gs = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(2,), in_specs=[spec],
        out_specs=[spec, pl.BlockSpec(memory_space=pltpu.SMEM)])
    return pl.pallas_call(kernel, (jax.ShapeDtypeStruct((16, 128), jnp.float32),
                                   jax.ShapeDtypeStruct((4,), jnp.int32)),
                          grid_spec=gs, input_output_aliases={0: 1}, interpret=interpret)
  s = jnp.array([5, 6, 7, 8], jnp.int32)
  x = _randn(3, 16, 128)
  want = make(True)(s, x)
  got = make(interp)(s, x)
  for g, w in zip(got, want):
    assert_same(g, w)
  np.testing.assert_array_equal(np.asarray(got[1]), [5, 15, 7, 8])


@pytest.mark.parametrize("interp", ["numpy", SEQ, VEC], ids=["default", "seq", "vec"])
def test_kv_cache_update_in_place(interp):
  """Paged KV-cache update: token t's row goes to page ``page[t]`` row
  ``slot[t]``; the pages (and rows) not written must come from the aliased
  cache operand (operand 2, after two prefetch operands)."""
  num_pages, page_size, d, tokens = 6, 8, 128, 5

  def kernel(page_ref, slot_ref, cache_ref, new_ref, o_ref):
    t = pl.program_id(0)
    o_ref[0, pl.ds(slot_ref[t], 1), :] = new_ref[...]

  def make(interpret):
    gs = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(tokens,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec((1, d), lambda t, page, slot: (t, 0))],
        out_specs=pl.BlockSpec((1, page_size, d), lambda t, page, slot: (page[t], 0, 0)))
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((num_pages, page_size, d), jnp.float32),
                          grid_spec=gs, input_output_aliases={2: 0}, interpret=interpret)
  page = jnp.array([4, 1, 4, 0, 1], jnp.int32)
  slot = jnp.array([2, 7, 3, 0, 0], jnp.int32)
  cache = _randn(4, num_pages, page_size, d)
  new = _randn(5, tokens, d)
  want = make(True)(page, slot, cache, new)
  got = make(interp)(page, slot, cache, new)
  assert_same(got, want)
  # NumPy reference: the cache with five rows replaced.
  ref = np.array(cache)
  for t in range(tokens):
    ref[int(page[t]), int(slot[t])] = np.asarray(new)[t]
  np.testing.assert_array_equal(np.asarray(got), ref)


def test_kv_cache_update_threads_and_io_callback():
  """Same update on the threaded runner and the io_callback path (jit with
  whole_program off), checked against interpret=True."""
  def kernel(page_ref, cache_ref, new_ref, o_ref):
    o_ref[...] = o_ref[...] + new_ref[...]

  def make(interpret):
    gs = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(3,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec((1, 256, 512), lambda t, page: (t, 0, 0))],
        out_specs=pl.BlockSpec((1, 256, 512), lambda t, page: (page[t], 0, 0)))
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((5, 256, 512), jnp.float32),
                          grid_spec=gs, input_output_aliases={1: 0}, interpret=interpret)
  page = jnp.array([3, 0, 4], jnp.int32)
  cache, new = _randn(6, 5, 256, 512), _randn(7, 3, 256, 512)
  want = make(True)(page, cache, new)
  for interp in (THREADS, XLA):
    assert_same(jax.jit(make(interp))(page, cache, new), want)


def test_plan_reads_aliases_over_all_operands():
  """The grid executor itself (no entry point around it): a KernelPlan of
  a {1: 0} alias with one prefetch operand starts the output from x."""
  make = _half_written(1, {1: 0})
  args = _args(1)
  jaxpr = jax.make_jaxpr(make(SEQ))(*args)
  eqn = next(e for e in jaxpr.eqns if e.primitive.name == "pallas_call")
  plan = KernelPlan(params=SEQ, **{k: v for k, v in eqn.params.items() if k != "interpret"})
  out, = plan.run(*[np.asarray(a) for a in args])
  np.testing.assert_array_equal(out[8:16], np.asarray(args[1])[8:16])
