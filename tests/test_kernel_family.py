"""The one kernel-family interface (``pallas_np.kernel_family``): every kind
of kernel eqn is lowered, planned and run the same way; mesh kernels of
every mesh type (TPU, Mosaic GPU, a user's) are one ``MeshKernel`` class
whose runner is registered by mesh type and chosen at plan time; rules get
a typed run context (no string keys); kernel errors have one formatter."""
from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np import kernel_family, meshes
from pallas_np.compiler import RunContext
from pallas_np.grid import KernelPlan, run_strategies
from pallas_np.kernel_context import RuleState, ThreadContext

PACKAGE = pathlib.Path(pallas_np.__file__).resolve().parent
MESH1 = pltpu.create_tensorcore_mesh("core", num_cores=1)
f32 = jnp.float32
X = jnp.arange(8 * 128, dtype=f32).reshape(8, 128)


def _modules():
  for path in sorted(PACKAGE.rglob("*.py")):
    yield path, ast.parse(path.read_text(), filename=str(path))


def _add_one(x_ref, o_ref):
  o_ref[...] = x_ref[...] + 1.0


# -- structure ----------------------------------------------------------------------------
def test_one_mesh_kernel_class():
  found = [f"{p.relative_to(PACKAGE)}" for p, tree in _modules() for node in ast.walk(tree)
           if isinstance(node, ast.ClassDef) and node.name == "MeshKernel"]
  assert found == ["meshes/kernel.py"]


def test_rules_get_a_typed_context_not_string_keys():
  """No ``ctx.extra[...]`` / ``ctx.extra.get(...)`` anywhere: a family's
  thread context and the rules' run state are dataclasses with named fields."""
  uses = []
  for path, tree in _modules():
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute) and node.attr == "extra" and \
          isinstance(node.value, ast.Name) and node.value.id.endswith("ctx"):
        uses.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
  assert uses == []
  ctx = RunContext("k")
  assert not hasattr(ctx, "extra")
  assert ctx.family is None and ctx.rules is None
  assert {f for f in ThreadContext.__dataclass_fields__} >= {
      "mesh_axes", "block", "slot", "task", "shared_scope", "private_scope"}
  assert {f for f in RuleState.__dataclass_fields__} == {"dma", "mxu", "prng", "gpu_block"}


def test_kernel_errors_have_one_formatter():
  """Only ``debugging.kernel_error`` reads which eqn failed to word an error
  (``post_mortem`` reads it to position pdb)."""
  callers = set()
  for path, tree in _modules():
    for node in ast.walk(tree):
      if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "failing_eqns":
        callers.add(str(path.relative_to(PACKAGE)))
  assert callers == {"debugging.py"}


# -- every family through the same interface -----------------------------------------------
def test_families_registered_for_their_primitives():
  from pallas_np import _compat as jc, api
  assert api.PALLAS_CALLS.primitives == (jc.pallas_call_p,)
  assert set(meshes.MESH_KERNELS.primitives) == set(jc.mesh_kernel_primitives())
  plan = api.PALLAS_CALLS.plan  # a pallas_call's kernel is its KernelPlan
  assert plan.__func__ is api.PallasCallFamily.plan


class _OddMesh(type(MESH1)):
  """A mesh type pallas_np does not know: a user's runner handles it."""


def _odd_mesh():
  if hasattr(MESH1, "devices"):
    return _OddMesh(MESH1.devices, MESH1.axis_names)
  return _OddMesh(axis_name="core", num_cores=1)  # JAX 0.12's TensorCoreMesh


class _AddTwoRunner(meshes.MeshRunner):
  """Runs every kernel as ``out = in + 2`` (not what the body says), so a
  result shows which runner ran it."""

  def __init__(self):
    self.calls = []

  def run(self, kernel, buffers, placement):
    self.calls.append((kernel.name, placement))
    buffers[kernel.num_inputs][...] = buffers[0] + 2.0


def test_a_registered_mesh_runner_runs_jit_and_eager_calls():
  runner = _AddTwoRunner()
  saved = list(meshes.kernel._runners)
  meshes.register_mesh_runner(lambda m: isinstance(m, _OddMesh), runner)
  try:
    k = pl.kernel(_add_one, out_type=jax.ShapeDtypeStruct(X.shape, f32), mesh=_odd_mesh(),
                  interpret="numpy")
    want = np.asarray(X) + 2.0
    np.testing.assert_array_equal(np.asarray(jax.jit(k)(X)), want)  # traced: lowering
    np.testing.assert_array_equal(np.asarray(pallas_np.jit(k)(X)), want)  # eager evaluator
    assert len(runner.calls) == 2
    assert all(placement is None for _, placement in runner.calls)
    kernel = meshes.get_mesh_kernel(_eqn_params(k), 1, pallas_np.InterpretParams())
    assert isinstance(kernel, meshes.MeshKernel) and kernel.runner is runner
  finally:
    meshes.kernel._runners[:] = saved


def _eqn_params(k):
  eqn = jax.make_jaxpr(k)(X).jaxpr.eqns[0]
  while "meshes" not in eqn.params:  # a pjit around the mesh kernel
    eqn = eqn.params["jaxpr"].jaxpr.eqns[0]
  return dict(eqn.params)


def test_mesh_programs_run_with_a_strategy_chosen_at_plan_time(monkeypatch):
  """A TPU mesh kernel's programs are KernelPlans whose strategy is
  ``MeshProgram`` from the start; the grid loop (``run_grid``) and its mode
  flags are not used for them."""
  def no_grid_loop(*args, **kwargs):
    raise AssertionError("a mesh program went through KernelPlan.run_grid")
  monkeypatch.setattr(KernelPlan, "run_grid", no_grid_loop)
  k = pl.kernel(_add_one, out_type=jax.ShapeDtypeStruct(X.shape, f32), mesh=MESH1,
                interpret="numpy")
  np.testing.assert_array_equal(np.asarray(jax.jit(k)(X)), np.asarray(X) + 1.0)
  kernel = meshes.get_mesh_kernel(_eqn_params(k), 1, pallas_np.InterpretParams())
  assert isinstance(kernel.program(0).strategy, run_strategies.MeshProgram)


def test_lowering_rules_are_the_family_rules():
  from pallas_np import _compat as jc
  for prim in jc.mesh_kernel_primitives():
    rule = jc.lowering_rule(prim)
    assert getattr(rule, "pallas_np_family", None) is meshes.MESH_KERNELS
  assert kernel_family.lowering_rule(meshes.MESH_KERNELS, None, None).pallas_np_family \
      is meshes.MESH_KERNELS


# -- Mosaic GPU: a mesh runner like any other ------------------------------------------------
def test_mosaic_gpu_kernels_are_mesh_kernels_of_the_registered_runner(monkeypatch):
  plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  from pallas_np.mosaic_gpu import entry
  assert isinstance(meshes.runner_for((plgpu.Mesh(),)), entry.MosaicGpuRunner)
  ran = []
  orig = meshes.MeshKernel.run
  monkeypatch.setattr(meshes.MeshKernel, "run",
                      lambda self, *a, **kw: ran.append(self.runner) or orig(self, *a, **kw))
  f = plgpu.kernel(_add_one, out_type=jax.ShapeDtypeStruct(X.shape, f32))
  with pallas_np.force_numpy_interpret():
    got = jax.jit(f)(X)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(X) + 1.0)
  assert len(ran) == 1 and isinstance(ran[0], entry.MosaicGpuRunner)


def test_mosaic_gpu_error_names_the_call_chain():
  """A Mosaic GPU kernel's error is worded by the one formatter: the failing
  line inside a loop body, and the lines that called it."""
  plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

  def body(x_ref, o_ref):
    def step(i, acc):
      return acc + x_ref[pl.ds(i * 4, 8)]  # BUG: reads past the end at i = 1
    o_ref[...] = jax.lax.fori_loop(0, 2, step, jnp.zeros((8,), f32))
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8,), f32))
  with pallas_np.force_numpy_interpret(), pytest.raises(IndexError) as info:
    pallas_np.jit(f)(jnp.arange(8, dtype=f32))
  msg = str(info.value)
  assert "in Mosaic GPU kernel" in msg and "at block ()" in msg
  assert "called from" in msg and "test_kernel_family.py" in msg
