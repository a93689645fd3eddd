"""pl.kernel(mesh=...) / pl.core_map kernels in numpy mode (issue 27, item 6).

They bind ``mpmd_map`` (JAX 0.10), whose CPU lowering calls JAX's own
pallas_call lowering directly: without pallas_np's interception they ran in
JAX's HLO interpreter under force_numpy_interpret and with
``interpret="numpy"``. Until they are supported every numpy-mode entry
point must raise UnsupportedError naming the construct and the kernel's
line; outside numpy mode JAX's lowering runs them untouched."""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np import _compat as jc
from pallas_np.grid import KernelPlan

MESH = pltpu.create_tensorcore_mesh("core", num_cores=1)
X = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)


def add_one_body(x_ref, o_ref):
  o_ref[...] = x_ref[...] + 1.0


BODY_LINE = f"{__file__}:{inspect.getsourcelines(add_one_body)[1]}"


def mesh_kernel(interpret=False):
  return pl.kernel(add_one_body, out_type=jax.ShapeDtypeStruct(X.shape, X.dtype), mesh=MESH,
                   interpret=interpret)


def with_core_map(interpret=False):
  def f(x):
    def stateful(refs):
      x_ref, o_ref = refs

      @pl.core_map(MESH, interpret=interpret)
      def _():
        o_ref[...] = x_ref[...] * 2.0  # CORE_MAP_LINE
    return pl.run_state(stateful)((x, jnp.zeros_like(x)))[1]
  return f


CORE_MAP_LINE = next(i for i, l in enumerate(open(__file__), 1) if "# CORE_MAP_LINE" in l
                     and "next(" not in l)


def _check(info, *lines):
  """The message names the construct and one of ``lines`` (the kernel)."""
  msg = str(info.value)
  assert ("pl.kernel/pl.core_map mesh kernels (mpmd_map)" in msg
          or "pl.kernel/pl.core_map mesh kernels (core_map)" in msg)
  assert "not supported in numpy mode yet" in msg
  assert any(line in msg for line in (lines or (BODY_LINE,))), msg


@pytest.fixture
def no_numpy_runs(monkeypatch):
  """Any KernelPlan run fails the test: the mesh kernel must not reach ours."""
  def run(self, *args):
    raise AssertionError("a mesh kernel reached the NumPy interpreter")
  monkeypatch.setattr(KernelPlan, "run", run)


def test_primitives_are_detected():
  names = {p.name for p in jc.mesh_kernel_primitives()}
  assert "mpmd_map" in names


def test_force_numpy_interpret_raises(no_numpy_runs):
  with pallas_np.force_numpy_interpret():
    with pytest.raises(pallas_np.UnsupportedError) as info:
      mesh_kernel()(X)
  _check(info)
  with pallas_np.force_numpy_interpret():
    with pytest.raises(pallas_np.UnsupportedError) as info:
      jax.jit(lambda x: mesh_kernel(True)(x) * 2)(X)  # interpret=True is overridden too
  _check(info)


def test_kernel_built_outside_the_scope_raises_inside(no_numpy_runs):
  k = mesh_kernel(True)
  f = jax.jit(lambda x: k(x))
  np.testing.assert_array_equal(np.asarray(f(X)), np.asarray(X) + 1)  # JAX's interpreter
  with pallas_np.force_numpy_interpret():
    with pytest.raises(pallas_np.UnsupportedError) as info:
      f(X)
  _check(info)


def test_set_numpy_interpret_raises(no_numpy_runs):
  pallas_np.set_numpy_interpret()
  try:
    with pytest.raises(pallas_np.UnsupportedError) as info:
      mesh_kernel()(X)
  finally:
    pallas_np.unset_numpy_interpret()
  _check(info)


def test_interpret_numpy_raises(no_numpy_runs):
  with pytest.raises(pallas_np.UnsupportedError) as info:
    mesh_kernel("numpy")(X)
  _check(info)
  with pytest.raises(pallas_np.UnsupportedError) as info:
    mesh_kernel(pallas_np.InterpretParams())(X)
  _check(info)


def test_pallas_np_jit_raises(no_numpy_runs):
  with pytest.raises(pallas_np.UnsupportedError) as info:
    pallas_np.jit(lambda x: mesh_kernel()(x) + 1)(X)
  _check(info)


def test_whole_program_eager_jit_raises():
  """An eagerly called jit with a numpy-mode pallas_call and a mesh kernel:
  the eager evaluator must not take it quietly, nor XLA run the mesh kernel."""
  def add(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 3.0
  k = pl.pallas_call(add, jax.ShapeDtypeStruct(X.shape, X.dtype), interpret="numpy")
  with pytest.raises(pallas_np.UnsupportedError) as info:
    jax.jit(lambda x: mesh_kernel("numpy")(k(x)))(X)
  _check(info)
  with pallas_np.force_numpy_interpret():
    with pytest.raises(pallas_np.UnsupportedError) as info:
      jax.jit(lambda x: mesh_kernel()(k(x)))(X)
  _check(info)


@pytest.mark.parametrize("entry", ["force", "numpy", "pallas_np.jit"])
def test_core_map_raises(entry, no_numpy_runs):
  with pytest.raises(pallas_np.UnsupportedError) as info:
    if entry == "force":
      with pallas_np.force_numpy_interpret():
        jax.jit(with_core_map())(X)
    elif entry == "numpy":
      jax.jit(with_core_map("numpy"))(X)
    else:
      pallas_np.jit(with_core_map())(X)
  # The body's line, or the decorated function's (the core_map eqn's own body jaxpr).
  _check(info, *(f"{__file__}:{CORE_MAP_LINE - k}" for k in range(3)))


def test_outside_numpy_mode_jax_runs_it(no_numpy_runs):
  """interpret=True without a force scope: JAX's own lowering, untouched."""
  got = mesh_kernel(True)(X)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(X) + 1)
  got = jax.jit(mesh_kernel(True))(X)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(X) + 1)
  # interpret=False reaches JAX's CPU lowering, which refuses (as without pallas_np).
  with pytest.raises(ValueError, match="Only interpret mode is supported on CPU"):
    mesh_kernel(False)(X)


def test_other_forced_interpret_mode_goes_to_jax(no_numpy_runs):
  """pltpu.force_tpu_interpret_mode is another interpreter's force: JAX's."""
  def copy_body(x_hbm, o_hbm):
    pltpu.sync_copy(x_hbm, o_hbm)

  with pltpu.force_tpu_interpret_mode():  # pl.kernel reads it when built
    k = pl.kernel(copy_body, out_type=jax.ShapeDtypeStruct(X.shape, X.dtype), mesh=MESH)
    got = k(X)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(X))


def test_kernel_plan_refuses_a_pallas_call_over_a_mesh():
  """What the mesh kernels' fallback lowering builds (a pallas_call with
  ``mesh=``) is refused by the grid executor too, not run as a plain grid."""
  k = pl.pallas_call(add_one_body, jax.ShapeDtypeStruct(X.shape, X.dtype), interpret="numpy")
  eqn = jax.make_jaxpr(k)(X).eqns[0]
  params = {key: v for key, v in eqn.params.items() if key not in ("interpret", "mesh")}
  KernelPlan(params=pallas_np.InterpretParams(), **params)  # without a mesh: fine
  with pytest.raises(pallas_np.UnsupportedError, match="pallas_call over a mesh"):
    KernelPlan(params=pallas_np.InterpretParams(), mesh=MESH, **params)
