"""The eager-jit fast path (issue 33, the per-call floor): a warm eager
call of a ``jax.jit`` function whose program pallas_np runs whole is
answered in front of ``pjit._run_python_pjit`` (``_compat.install_jit_run_hook``,
``whole_program._run_routed``), skipping JAX's per-argument checks and the
jit call hook. Each test checks the path is taken (JAX's
``_pjit_call_impl_python`` is not reached on warm calls) and compares bit
for bit with interpret=True while what JAX's caches key on changes between
calls: shapes, dtypes, weak types, static arguments, keyword arguments,
closures, pytrees, constants, forced options, donation.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_np
from pallas_np import _compat as jc
from pallas_np import whole_program
from tests.helpers import assert_identical

rng = np.random.default_rng(331)


def _f32(*shape):
  return rng.standard_normal(shape).astype(np.float32)


@pytest.fixture
def slow_path(monkeypatch):
  """Every eager jit call that reaches JAX's ``_pjit_call_impl_python``
  (the jit call hook): warm calls on the fast path never do."""
  seen = []
  whole_program.install_hooks()  # (in with the first numpy-mode kernel; this may run first)
  orig = jc.jax_pjit._pjit_call_impl_python

  def counted(*args, **params):
    seen.append(params.get("name"))
    return orig(*args, **params)
  monkeypatch.setattr(jc.jax_pjit, "_pjit_call_impl_python", counted)
  return seen


def scale_kernel(x_ref, o_ref):
  o_ref[...] = (x_ref[...] * 2 + x_ref.shape[0]).astype(o_ref.dtype)


def _scale(interpret, factor=1.0):
  def f(x):
    out = pl.pallas_call(scale_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                         interpret=interpret)(x)
    return out * factor
  return f


def test_warm_calls_skip_the_jit_hook(slow_path):
  fn = jax.jit(_scale(pallas_np.InterpretParams()))
  want_fn = jax.jit(_scale(True))
  x = jnp.asarray(_f32(8, 128))
  want = want_fn(x)
  assert_identical(fn(x), want)
  slow_path.clear()
  for _ in range(4):
    assert_identical(fn(x), want)
  assert slow_path == []


def test_signatures_change_between_calls(slow_path):
  """Shapes, dtypes, weak types and NumPy arguments back to back."""
  fn = jax.jit(_scale(pallas_np.InterpretParams()))
  want_fn = jax.jit(_scale(True))
  args = [jnp.asarray(_f32(8, 128)), jnp.asarray(_f32(16, 128)),
          jnp.asarray(rng.integers(-9, 9, (8, 128)), jnp.int32),
          jnp.broadcast_to(jnp.asarray(1.5), (8, 128)),  # weak-typed
          _f32(8, 128),  # NumPy argument
          jnp.asarray(_f32(8, 128)).astype(jnp.bfloat16)]
  for _ in range(3):
    for x in args:
      got, want = fn(x), want_fn(x)
      assert got.dtype == want.dtype and got.weak_type == want.weak_type
      assert_identical(got, want)


def test_static_kwargs_closures_pytrees():
  def make(interpret):
    @jax.jit
    def g(tree, *, scale):
      a = _scale(interpret)(tree["a"])
      # (no multiply-add: XLA's interpret=True fuses it into an FMA)
      return {"sum": a + tree["b"], "a": a * scale}
    return g
  fn, want_fn = make(pallas_np.InterpretParams()), make(True)
  tree = {"a": jnp.asarray(_f32(8, 128)), "b": jnp.asarray(_f32(8, 128))}
  for scale in (1.0, 2.0, 1.0, 3.0):
    assert_identical(fn(tree, scale=scale), want_fn(tree, scale=scale))

  def make_static(interpret):
    return jax.jit(lambda x, k: _scale(interpret, k)(x), static_argnums=1)
  fn, want_fn = make_static(pallas_np.InterpretParams()), make_static(True)
  x = jnp.asarray(_f32(8, 128))
  for k in (1.0, 3.0, 1.0, 5.0):
    assert_identical(fn(x, k), want_fn(x, k))

  # A closed-over value that changes: each closure is its own jit with its
  # own program. NumPy reference written from the semantics (interpret=True
  # differs by an ulp here: XLA reassociates the fused (x*2+8)*1+c).
  for c in (1.0, 2.0, 1.0):
    const = jnp.full((8, 128), c, jnp.float32)
    want = (np.asarray(x) * np.float32(2) + np.float32(8)) + np.float32(c)
    for _ in range(2):
      assert_identical(jax.jit(lambda v: _scale(pallas_np.InterpretParams())(v) + const)(x),
                       want)


def test_outputs_fresh_every_call_and_inputs_untouched():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  fn = jax.jit(pallas_np.pallas_call(kernel, out))
  x = jnp.asarray(_f32(8, 128))
  a, b = fn(x), fn(x)
  assert not np.shares_memory(np.asarray(a), np.asarray(b))
  assert not np.shares_memory(np.asarray(a), np.asarray(x))
  assert_identical(a, x)
  assert_identical(b, x)


def test_donated_and_deleted_inputs():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  fn = jax.jit(pallas_np.pallas_call(kernel, out, input_output_aliases={0: 0}),
               donate_argnums=0)
  want_fn = jax.jit(pl.pallas_call(kernel, out, input_output_aliases={0: 0}, interpret=True))
  for _ in range(3):
    x = _f32(8, 128)
    assert_identical(fn(jnp.asarray(x)), want_fn(jnp.asarray(x)))
  plain = jax.jit(pallas_np.pallas_call(kernel, out))
  y = jnp.asarray(_f32(8, 128))
  plain(y)
  y.delete()
  with pytest.raises(RuntimeError):  # JAX's own error for a deleted array
    plain(y)


def test_forced_options_and_x64_between_warm_calls():
  def kernel(x_ref, o_ref):
    o_ref[0:4, :] = x_ref[0:4, :] * 2
  x = jnp.asarray(_f32(8, 128))
  make = lambda interpret: jax.jit(lambda v: pl.pallas_call(
      kernel, jax.ShapeDtypeStruct(v.shape, v.dtype), interpret=interpret)(v))
  fn, want_fn = make(pallas_np.InterpretParams()), make(True)
  zero = pallas_np.InterpretParams(uninitialized="zero")
  want_zero = np.zeros((8, 128), np.float32)  # NumPy reference of uninitialized="zero"
  want_zero[:4] = np.asarray(x)[:4] * 2
  for _ in range(3):
    assert_identical(fn(x), want_fn(x))
    with pallas_np.force_numpy_interpret(zero):
      assert_identical(fn(x), want_zero)
  was_x64 = bool(jnp.arange(1).dtype == np.int64)
  g = jax.jit(lambda v: (pl.pallas_call(kernel, jax.ShapeDtypeStruct(v.shape, v.dtype),
                                        interpret=pallas_np.InterpretParams())(v),
                         jnp.arange(3)))
  try:
    for x64 in (False, True, False):
      jax.config.update("jax_enable_x64", x64)
      got = g(x)
      assert got[1].dtype == (np.int64 if x64 else np.int32)
      assert_identical(got[0], want_fn(x))
  finally:
    jax.config.update("jax_enable_x64", was_x64)


def test_traced_calls_still_trace():
  """Inside another jit or vmap the hook is not asked (not top level).
  NumPy reference from the semantics (XLA may reassociate the fused
  (x*2+8)*1+1 of interpret=True by an ulp)."""
  fn = jax.jit(_scale(pallas_np.InterpretParams()))
  x = jnp.asarray(_f32(8, 128))
  fn(x)
  want = np.asarray(x) * np.float32(2) + np.float32(8)
  assert_identical(jax.jit(lambda v: fn(v) + 1)(x), want + np.float32(1))
  xs = jnp.asarray(_f32(3, 8, 128))
  assert_identical(jax.vmap(fn)(xs), np.asarray(xs) * np.float32(2) + np.float32(8))


def test_weak_typed_outputs_stay_weak():
  """A program output that is weakly typed (Python-scalar arithmetic) is
  weak as XLA returns it, so later promotion (here with bfloat16) agrees."""
  def make(interpret):
    def f(x, s):
      y = pl.pallas_call(scale_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                         interpret=interpret)(x)
      return y, s * 2.0
    return f
  x = jnp.asarray(_f32(8, 128))
  s = jnp.asarray(1.5)  # weak-typed float32 scalar
  half = jnp.ones((4,), jnp.bfloat16)
  want = jax.jit(make(True))(x, s)
  for fn in (jax.jit(make(pallas_np.InterpretParams())), pallas_np.jit(make("numpy"))):
    for _ in range(3):
      got = fn(x, s)
      assert [g.weak_type for g in got] == [w.weak_type for w in want] == [False, True]
      assert_identical(got, want)
      assert (got[1] * half).dtype == (want[1] * half).dtype == jnp.bfloat16
