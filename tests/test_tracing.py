"""``pallas_np.pallas_call`` traces kernel bodies with their jit calls inlined
(``InterpretParams.inline_jit``, pallas_np/tracing.py): the same primitives
without jit's per-call machinery, except where a loop helper would unroll.

The broad differential coverage of inlined traces is in tests/helpers.py
(``run_both``) and tests/kernel_fn.py (``both``): every kernel of
test_differential.py and the test_cov_* files also runs inlined and must
reproduce numpy mode bit for bit."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.lax import fori_loop as _aliased_fori_loop

import pallas_np
from pallas_np import _compat as jc
from pallas_np.tracing import JitInlinedKernel, kernel_to_trace, names_loop_helper
from tests.conftest import assert_same

F32 = jnp.float32


def _kernel_eqn_names(fn, *args):
  """Primitive names of the kernel jaxpr (nested jaxprs included) that
  ``fn`` (a pallas_np.pallas_call) traces."""
  closed = jax.make_jaxpr(fn.jax_callable)(*args)
  (eqn,) = closed.eqns
  names = []

  def walk(jaxpr):
    for e in jaxpr.eqns:
      names.append(e.primitive.name)
      for p in e.params.values():
        for sub in (p if isinstance(p, (tuple, list)) else (p,)):
          if isinstance(sub, jc.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jc.Jaxpr):
            walk(sub)
  walk(eqn.params["jaxpr"])
  return names


# -- which kernels the automatic choice inlines ----------------------------------
def _plain(x_ref, o_ref):
  o_ref[...] = jnp.sort(jnp.cumsum(x_ref[...], axis=-1), axis=-1)


def _with_fori(x_ref, o_ref):
  o_ref[...] = lax.fori_loop(0, 4, lambda i, c: c + 1.0, x_ref[...])


def _with_scan(x_ref, o_ref):
  o_ref[...] = jax.lax.scan(lambda c, _: (c * 2.0, None), x_ref[...], None, length=3)[0]


def _with_map(x_ref, o_ref):
  o_ref[...] = lax.map(lambda r: r + 1.0, x_ref[...])


def _with_pl_loop(x_ref, o_ref):
  o_ref[...] = x_ref[...]

  @pl.loop(0, 3)
  def _(i):
    o_ref[...] += 1.0


def _with_alias(x_ref, o_ref):
  o_ref[...] = _aliased_fori_loop(0, 2, lambda i, c: c + 1.0, x_ref[...])


def _helper_with_loop(x):
  return lax.fori_loop(0, 2, lambda i, c: c * 2.0, x)


def _helper_calling_helper(x):
  return _helper_with_loop(x) + 1.0


def _calls_helper(x_ref, o_ref):
  o_ref[...] = _helper_calling_helper(x_ref[...])


def _with_while_and_cond(x_ref, o_ref):
  x = x_ref[...]
  n = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))[1]
  o_ref[...] = lax.cond(x[0, 0] > 0, lambda: n, lambda: -n)


class _CallableKernel:
  def __call__(self, x_ref, o_ref):
    o_ref[...] = lax.fori_loop(0, 2, lambda i, c: c + 1.0, x_ref[...])

  def method_kernel(self, x_ref, o_ref):
    o_ref[...] = lax.scan(lambda c, _: (c + 1.0, None), x_ref[...], None, length=2)[0]


def _kernel_taking_body(x_ref, o_ref, *, body):
  o_ref[...] = body(x_ref[...])


@pytest.mark.parametrize("kernel, loops", [
    (_plain, False),
    (_with_while_and_cond, False),  # no unrolling: the loop falls back to the primitive
    (_with_fori, True),
    (_with_scan, True),
    (_with_map, True),
    (_with_pl_loop, True),
    (_with_alias, True),  # ``from jax.lax import fori_loop as ...``
    (_calls_helper, True),  # through two module-level helpers
    (_CallableKernel(), True),
    (_CallableKernel().method_kernel, True),
    (jax.jit(_helper_with_loop), True),
    (functools.partial(_kernel_taking_body, body=_helper_with_loop), True),
    (functools.partial(_kernel_taking_body, body=jnp.tanh), False),
])
def test_names_loop_helper(kernel, loops):
  assert names_loop_helper(kernel) is loops
  chosen = kernel_to_trace(kernel, None)
  assert isinstance(chosen, JitInlinedKernel) is (not loops)
  assert isinstance(kernel_to_trace(kernel, True), JitInlinedKernel)
  assert kernel_to_trace(kernel, False) is kernel


def test_names_loop_helper_follows_closures():
  def body(x):
    return lax.scan(lambda c, _: (c + 1.0, None), x, None, length=2)[0]

  def kernel(x_ref, o_ref):
    o_ref[...] = body(x_ref[...])

  def kernel_without(x_ref, o_ref):
    o_ref[...] = jnp.tanh(x_ref[...])
  assert names_loop_helper(kernel)
  assert not names_loop_helper(kernel_without)


# -- what the trace looks like, and that results do not change ----------------------
def _jit_heavy(x_ref, o_ref):
  x = x_ref[...]
  y = jnp.concatenate([jnp.flip(x[:, :64], 1), x[:, 64:]], axis=1)
  o_ref[...] = jax.jit(lambda v, s: v * s, static_argnums=1)(y, 3) + jax.nn.relu(x)


def test_inlined_trace_has_no_jit_eqns_and_the_same_result():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 128)), F32)
  out = jax.ShapeDtypeStruct(x.shape, F32)
  inlined = pallas_np.pallas_call(_jit_heavy, out)
  through_jit = pallas_np.pallas_call(
      _jit_heavy, out, interpret=pallas_np.InterpretParams(inline_jit=False))
  names_inlined = _kernel_eqn_names(inlined, x)
  names_jit = _kernel_eqn_names(through_jit, x)
  assert "jit" in names_jit and "jit" not in names_inlined
  assert [n for n in names_jit if n != "jit"] == names_inlined  # the same primitives
  want = pl.pallas_call(_jit_heavy, out, interpret=True)(x)
  got = inlined(x)
  assert_same(got, want)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(through_jit(x)))
  # Under jax.jit (the io_callback path) too.
  np.testing.assert_array_equal(np.asarray(jax.jit(inlined)(x)), np.asarray(got))


def test_automatic_choice_keeps_static_loops_rolled():
  x = jnp.ones((8, 128), F32)
  out = jax.ShapeDtypeStruct(x.shape, F32)
  auto = pallas_np.pallas_call(_with_fori, out)
  forced = pallas_np.pallas_call(_with_fori, out,
                                 interpret=pallas_np.InterpretParams(inline_jit=True))
  assert "scan" in _kernel_eqn_names(auto, x)
  unrolled = _kernel_eqn_names(forced, x)
  assert "scan" not in unrolled and "while" not in unrolled
  want = pl.pallas_call(_with_fori, out, interpret=True)(x)
  assert_same(auto(x), want)
  assert_same(forced(x), want)


def test_traced_bounds_keep_their_loop_when_inlined():
  # fori_loop with a traced trip count is a while loop even under
  # disable_jit, so forcing inline_jit is safe for it.
  def kernel(n_ref, x_ref, o_ref):
    o_ref[...] = lax.fori_loop(0, n_ref[0], lambda i, c: c * 1.5 + i, x_ref[...])
  n = jnp.array([5], jnp.int32)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 128)), F32)
  out = jax.ShapeDtypeStruct(x.shape, F32)
  forced = pallas_np.pallas_call(kernel, out, interpret=pallas_np.InterpretParams(
      inline_jit=True))
  assert "while" in _kernel_eqn_names(forced, n, x)
  want = pl.pallas_call(kernel, out, interpret=True)(n, x)
  assert_same(forced(n, x), want)


def test_inlined_kernel_keeps_its_name_and_source_lines():
  def my_named_kernel(x_ref, o_ref, *, scale):
    o_ref[...] = jnp.flip(x_ref[...], 0) * scale
  kernel = functools.partial(my_named_kernel, scale=2.0)
  x = jnp.arange(16.0, dtype=F32).reshape(2, 8)
  fn = pallas_np.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, F32))
  got = fn(x)
  assert_same(got, jnp.flip(x, 0) * 2.0)
  report = pallas_np.grid_report()[-1]
  assert report["kernel"].startswith("my_named_kernel"), report
  closed = jax.make_jaxpr(fn.jax_callable)(x)
  kernel_jaxpr = closed.eqns[0].params["jaxpr"]
  lines = [jc.source_summary(e.source_info) for e in kernel_jaxpr.eqns]
  assert any("test_tracing.py" in s for s in lines), lines
