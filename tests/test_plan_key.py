"""The kernel-plan cache's structural key (pallas_np.grid.plan_key).

A re-traced identical kernel (a new jaxpr and GridMapping each trace)
reuses its plan; kernels that differ in anything that changes what they
compute (literals, avals, block shapes, index-map constants, compiler
params, aliases) get plans of their own, and their results stay right."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np import api
from pallas_np.grid.plan_key import structural_key

INTERP = pallas_np.params.resolve("numpy")


def _eqn_params(fn, *args):
  (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "pallas_call"]
  return dict(eqn.params)


def _call(add=1.0, block=8, shift=None, aliases=None, compiler_params=None, name=None):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + add

  def index_map(i):
    return (i if shift is None else (i + shift[0]) % 2, 0)

  def f(x):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                          in_specs=[pl.BlockSpec((block, 128), index_map)],
                          out_specs=pl.BlockSpec((block, 128), lambda i: (i, 0)),
                          input_output_aliases=aliases or {}, compiler_params=compiler_params,
                          name=name, interpret="numpy")(x)
  return f


def _x(rows=16, dtype=jnp.float32):
  return jnp.asarray(np.arange(rows * 128).reshape(rows, 128) % 7, dtype)


def test_retraced_kernel_reuses_its_plan():
  x = _x()
  p1, p2 = _eqn_params(_call(), x), _eqn_params(_call(), x)
  assert p1["jaxpr"] is not p2["jaxpr"] and p1["grid_mapping"] is not p2["grid_mapping"]
  assert api.get_kernel_plan(p1, INTERP) is api.get_kernel_plan(p2, INTERP)


def test_retraced_shard_map_program_reuses_the_plan():
  """A program re-traced on every call (jit of a fresh function) runs the
  same plan each time."""
  x = _x()
  api.clear_caches()
  outs = [jax.jit(lambda x: _call()(x))(x) for _ in range(3)]
  plans = {id(e[1]) for e in api._plan_cache.values()}
  assert len(plans) == 1
  for out in outs:
    np.testing.assert_array_equal(out, np.asarray(x) * 2 + 1)


@pytest.mark.parametrize("other", [
    dict(add=2.0),                                            # a literal in the kernel
    dict(block=16),                                           # the block shape
    dict(shift=(1,)),                                         # the index map
    dict(aliases={0: 0}),                                     # the aliases
    dict(compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",))),
    dict(name="other_name"),
], ids=["literal", "block", "index-map", "aliases", "compiler-params", "name"])
def test_different_kernels_do_not_share_plans(other):
  x = _x()
  base = _eqn_params(_call(), x)
  changed = _eqn_params(_call(**other), x)
  assert structural_key(base) != structural_key(changed)
  assert api.get_kernel_plan(base, INTERP) is not api.get_kernel_plan(changed, INTERP)


@pytest.mark.parametrize("dtype,rows", [(jnp.bfloat16, 16), (jnp.float32, 32)],
                         ids=["dtype", "shape"])
def test_different_avals_do_not_share_plans(dtype, rows):
  base = _eqn_params(_call(), _x())
  changed = _eqn_params(_call(), _x(rows, dtype))
  assert structural_key(base) != structural_key(changed)


def test_nested_constants_compare_by_value():
  """Constants of a nested jaxpr (an eqn param) are compared by value:
  different arrays are different keys, equal ones the same."""
  def closed(table):
    return jax.make_jaxpr(lambda x: x + np.asarray(table, np.float32))(
        np.zeros(16, np.float32))
  a, b, c = (closed(t) for t in (np.arange(16), np.arange(16)[::-1], np.arange(16)))
  assert structural_key({"jaxpr": a}) != structural_key({"jaxpr": b})
  assert structural_key({"jaxpr": a}) == structural_key({"jaxpr": c})
