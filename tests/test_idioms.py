"""jnp's integer ``x // c`` and ``x % c`` (constant positive divisor) run as
one NumPy ufunc (``compiler.idioms``): bit for bit against interpret=True,
traced both as jit calls and inlined, in loop bodies and vectorized grids;
look-alikes that are not jnp's body keep the eqn-by-eqn rules."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from pallas_np.compiler import idioms
from benchmarks.small_kernels import collatz_kernel as _collatz_kernel
from tests.helpers import INLINED, assert_identical
from tests.kernel_fn import both

DTYPES = [np.int8, np.uint8, np.int16, np.int32, np.uint32]


def _dividends(dtype, n=256):
  info = np.iinfo(dtype)
  x = np.random.default_rng(7).integers(info.min, info.max, n, endpoint=True,
                                        dtype=np.int64).astype(dtype)
  specials = [0, 1, 2, 3, info.max, info.min, info.max - 1]
  if info.min < 0:
    specials += [-1, -2, -3, -7, info.min + 1]
  x[:len(specials)] = np.array(specials).astype(dtype)
  return x


def _in_a_loop(ops):
  """Idioms apply in loop bodies only (hot code; elsewhere their one-time
  reference trace would slow first calls): compute ``ops`` in a 1-trip loop."""
  def fn(a):
    n = len(jax.eval_shape(ops, a))
    return lax.fori_loop(0, 1, lambda i, outs: ops(a), [jnp.zeros_like(a)] * n)
  return fn


@pytest.mark.parametrize("dtype", DTYPES)
def test_floor_div_and_mod_by_constants(dtype):
  x = _dividends(dtype)
  cs = [1, 2, 3, 7, 64, min(int(np.iinfo(dtype).max), 2**31 - 1)]

  def ops(a):
    return [op for c in cs for op in (a // c, a % c, jnp.floor_divide(a, dtype(c)),
                                      jnp.remainder(a, dtype(c)))]
  got, want = both(_in_a_loop(ops), x)
  for i, (g, w) in enumerate(zip(got, want)):
    assert g.dtype == w.dtype, i
    np.testing.assert_array_equal(g, w, err_msg=str(i))


def test_negative_and_runtime_divisors_keep_the_rule():
  """Negative constants (INT_MIN // -1) and divisors read at run time are
  not replaced; their results still match."""
  x = _dividends(np.int32)

  def ops(a):
    return [a // -1, a % -1, a // -3, a % -3, a // (a | 1), a % (a | 1)]
  got, want = both(_in_a_loop(ops), x)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


def test_recognised_in_both_traces():
  """The feature itself: jnp's bodies are found (jit call and inlined run),
  and a run whose intermediate is read elsewhere is left alone."""
  aval = jax.ShapeDtypeStruct((8, 128), jnp.int32)
  jaxpr = jax.make_jaxpr(lambda x: (x // 2, x % 3))(aval).jaxpr
  found = [idioms.integer_division(e, np.int32(c)) for e, c in zip(jaxpr.eqns, (2, 3))]
  assert [f[0] for f in found] == [np.floor_divide, np.remainder]
  with jax.disable_jit():
    flat = jax.make_jaxpr(lambda x: (x // 2, x % 3))(aval).jaxpr
  runs = idioms.find(flat)
  assert [r[1] for r in runs.values()] == [np.floor_divide, np.remainder]
  assert max(r[0] for r in runs.values()) == len(flat.eqns)
  with jax.disable_jit():
    div = jax.make_jaxpr(lambda x: x // 2)(aval).jaxpr
  assert len(idioms.find(div)) == 1
  # the same run with an intermediate value (the truncating div) read outside it
  leaky = div.replace(outvars=[*div.outvars, div.eqns[0].outvars[0]])
  assert idioms.find(leaky) == {}
  with jax.disable_jit():
    only_div = jax.make_jaxpr(lambda x: lax.div(x, 2) - 1)(aval).jaxpr
  assert idioms.find(only_div) == {}


def test_look_alike_jit_named_remainder_is_inlined():
  """A user function called ``remainder`` with another body: no match."""
  @jax.jit
  def remainder(a, b):
    return a - b * 2
  x = _dividends(np.int32)
  got, want = both(lambda a: remainder(a, 3), x)
  np.testing.assert_array_equal(got[0], want[0])
  eqn = jax.make_jaxpr(lambda a: remainder(a, 3))(x).jaxpr.eqns[0]
  assert eqn.params["name"] == "remainder"
  assert idioms.integer_division(eqn, np.int32(3)) is None


@pytest.mark.parametrize("interpret", ["numpy", INLINED], ids=["jit", "inlined"])
def test_while_body_in_a_vectorized_grid(interpret):
  """In a while body over a grid whose lanes need different trip counts
  (one block of all ones: 0 iterations)."""
  x = np.random.default_rng(3).integers(1, 60, (4, 8, 128)).astype(np.int32)
  x[2] = 1

  def call(interp):
    entry = pallas_np.pallas_call if interp is INLINED else pl.pallas_call
    spec = pl.BlockSpec((None, 8, 128), lambda i: (i, 0, 0))
    return entry(_collatz_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                 grid=(4,), in_specs=[spec], out_specs=spec, interpret=interp)(x)
  got, want = np.asarray(call(interpret)), np.asarray(call(True))
  assert_identical(want, got)
  assert got[2].max() == 0 and got.max() > 10


@pytest.mark.parametrize("dtype", DTYPES)
def test_floor_div_by_every_power_of_two_is_a_shift(dtype):
  """``x // 2**k`` runs as ``x >> k`` (arithmetic for signed types: rounds
  toward minus infinity, INT_MIN included; logical for unsigned), checked
  against interpret=True for every k the type holds."""
  bits = np.iinfo(dtype).bits - (1 if np.iinfo(dtype).min < 0 else 0)
  ks = list(range(bits))
  ufunc, k = idioms.by_power_of_two(np.floor_divide, dtype(2 ** ks[-1]))
  assert ufunc is np.right_shift and int(k) == ks[-1]  # (the path under test is taken)
  x = _dividends(dtype)

  def ops(a):
    return ([a // (2 ** k) for k in ks if k < 31]  # (a weak Python int must fit int32)
            + [jnp.floor_divide(a, dtype(2 ** k)) for k in ks])
  got, want = both(_in_a_loop(ops), x)
  for i, (g, w) in enumerate(zip(got, want)):
    assert g.dtype == w.dtype, i
    np.testing.assert_array_equal(g, w, err_msg=str(i))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_template_has_a_division(dtype):
  """``find`` skips jaxprs without a ``div``/``rem`` eqn before tracing any
  template (first calls): that holds only if every template of the installed
  JAX contains one."""
  for name in idioms._IDIOMS:
    for divisor in (3, 4):
      t = idioms._flat_template(name, jax.ShapeDtypeStruct((8, 128), dtype), divisor)
      assert t is not None, (name, divisor)
      assert idioms._DIVISION_PRIMITIVES & {e.primitive.name for e in t.eqns}, (name, divisor)


def test_loop_without_division_traces_no_template():
  """A loop body with no integer division compiles without tracing jnp's
  reference bodies (a few ms of a first call), and gives interpret=True's
  bits; one with a division still runs as one ufunc."""
  x = np.random.default_rng(5).integers(-50, 50, (8, 128)).astype(np.int32)
  idioms._templates.clear()
  got, want = both(_in_a_loop(lambda a: [a * 3 + 1, jnp.maximum(a, 2)]), x)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  assert len(idioms._templates) == 0
  with jax.disable_jit():
    flat = jax.make_jaxpr(lambda a: (a * 3 + 1) // 3)(x).jaxpr
  assert [r[1] for r in idioms.find(flat).values()] == [np.floor_divide]
  assert len(idioms._templates) > 0
