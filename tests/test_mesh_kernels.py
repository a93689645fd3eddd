"""pl.kernel(mesh=...) / pl.core_map kernels in numpy mode (issue 30):
TensorCore meshes (megacore), run by pallas_np.meshes as one program per core.

Oracles: TPU interpret mode (``pltpu.InterpretParams``) runs pl.kernel over a
TensorCore mesh on both JAX versions, so the kernels are checked against it
*and* against a NumPy reference written from the semantics. interpret=True
(JAX's HLO interpreter) runs the mesh as a sequential grid, which cannot run
a kernel whose cores synchronise: it is not an oracle here. The debugging
checks (deadlocks, races, unwaited DMAs, semaphores left signalled) have no
JAX oracle: the expected outcome is written from TPU semantics.
"""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np import _compat as jc
from pallas_np import meshes
from pallas_np.grid import KernelPlan

f32 = jnp.float32
MESH1 = pltpu.create_tensorcore_mesh("core", num_cores=1)
MESH2 = pltpu.create_tensorcore_mesh("core", num_cores=2)
X = jnp.arange(16 * 128, dtype=f32).reshape(16, 128)
TPU = pltpu.InterpretParams()


@pytest.fixture
def no_jax_interpreter(monkeypatch):
  """numpy mode must never hand a mesh kernel to JAX's interpreters."""
  from jax._src.pallas import hlo_interpreter
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interp

  def boom(*a, **k):
    raise AssertionError("a mesh kernel reached one of JAX's interpreters")
  monkeypatch.setattr(hlo_interpreter, "pallas_call_hlo_interpret", boom)
  monkeypatch.setattr(tpu_interp, "interpret_pallas_call", boom)


# -- a megacore kernel, the way the core_map tutorial writes one ---------------------
def halves_body(x_hbm, o_hbm, sem):
  """Each core copies its half of the rows to VMEM, scales it, adds its core
  id, copies it back; then both cores meet at a barrier."""
  core = jax.lax.axis_index("core")
  rows = x_hbm.shape[0] // 2

  def scoped(buf):
    pltpu.sync_copy(x_hbm.at[pl.ds(core * rows, rows)], buf)
    buf[...] = buf[...] * 2.0 + core.astype(f32)
    pltpu.sync_copy(buf, o_hbm.at[pl.ds(core * rows, rows)])
  pl.run_scoped(scoped, pltpu.VMEM((rows, 128), f32))
  pltpu.core_barrier(sem, core_axis_name="core")


def halves(interpret, mesh=MESH2):
  return pl.kernel(halves_body, out_type=jax.ShapeDtypeStruct(X.shape, X.dtype), mesh=mesh,
                   scratch_types=[pltpu.SemaphoreType.REGULAR], interpret=interpret)


def halves_reference(x, cores=2):
  x = np.asarray(x)
  rows = x.shape[0] // cores
  return np.concatenate([x[c * rows:(c + 1) * rows] * 2 + c for c in range(cores)])


def test_primitives_are_detected():
  names = {p.name for p in jc.mesh_kernel_primitives()}
  assert "mpmd_map" in names


def test_megacore_kernel_matches_tpu_interpret_mode_and_reference(no_jax_interpreter):
  got = np.asarray(halves("numpy")(X))
  np.testing.assert_array_equal(got, halves_reference(X))


def test_tpu_interpret_mode_agrees():
  """The oracle itself (no patching: TPU interpret mode must run)."""
  np.testing.assert_array_equal(np.asarray(halves(TPU)(X)), halves_reference(X))


@pytest.mark.parametrize("entry", ["eager", "jit", "force", "force_jit", "set", "pallas_np.jit",
                                   "params", "whole_program"])
def test_every_entry_point(entry, no_jax_interpreter):
  want = halves_reference(X)
  if entry == "eager":
    got = halves("numpy")(X)
  elif entry == "jit":
    got = jax.jit(halves("numpy"))(X)
  elif entry == "force":
    with pallas_np.force_numpy_interpret():
      got = halves(False)(X)
  elif entry == "force_jit":
    with pallas_np.force_numpy_interpret():  # interpret=True is overridden too
      got = jax.jit(lambda x: halves(True)(x) + 1)(X) - 1
  elif entry == "set":
    pallas_np.set_numpy_interpret()
    try:
      got = halves(False)(X)
    finally:
      pallas_np.unset_numpy_interpret()
  elif entry == "pallas_np.jit":
    got = pallas_np.jit(lambda x: halves(False)(x) * 3)(X) / 3
  elif entry == "params":
    got = halves(pallas_np.InterpretParams())(X)
  else:  # an eagerly called jit with a numpy-mode pallas_call and a mesh kernel
    def add(x_ref, o_ref):
      o_ref[...] = x_ref[...] + 3.0
    k = pl.pallas_call(add, jax.ShapeDtypeStruct(X.shape, X.dtype), interpret="numpy")
    got = jax.jit(lambda x: halves("numpy")(k(x) - 3.0))(X)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_kernel_built_outside_the_scope_runs_inside(no_jax_interpreter):
  k = halves(True)
  f = jax.jit(lambda x: k(x))
  with pallas_np.force_numpy_interpret():
    np.testing.assert_array_equal(np.asarray(f(X)), halves_reference(X))


# -- pl.core_map on refs (through pl.run_state) ------------------------------------
def with_core_map(interpret=False, mesh=MESH2):
  def f(x):
    def stateful(refs):
      x_ref, o_ref = refs

      @pl.core_map(mesh, interpret=interpret)
      def _():
        core = jax.lax.axis_index("core")
        rows = x_ref.shape[0] // 2

        def scoped(buf):  # the refs are in HBM: DMA them through VMEM
          pltpu.sync_copy(x_ref.at[pl.ds(core * rows, rows)], buf)
          buf[...] = buf[...] * 2.0 + core.astype(f32)
          pltpu.sync_copy(buf, o_ref.at[pl.ds(core * rows, rows)])
        pl.run_scoped(scoped, pltpu.VMEM((rows, 128), f32))
    return pl.run_state(stateful)((x, jnp.zeros_like(x)))[1]
  return f


@pytest.mark.parametrize("entry", ["force", "numpy", "pallas_np.jit"])
def test_core_map(entry, no_jax_interpreter):
  if entry == "force":
    with pallas_np.force_numpy_interpret():
      got = jax.jit(with_core_map())(X)
  elif entry == "numpy":
    got = jax.jit(with_core_map("numpy"))(X)
  else:
    got = pallas_np.jit(with_core_map())(X)
  np.testing.assert_array_equal(np.asarray(got), halves_reference(X))


def test_core_map_matches_tpu_interpret_mode():
  want = jax.jit(with_core_map(TPU))(X)
  np.testing.assert_array_equal(np.asarray(jax.jit(with_core_map("numpy"))(X)),
                                np.asarray(want))


# -- run_on_first_core, collective run_scoped, core_index signals --------------------
@pytest.mark.parametrize("detect_races", [False, True])
def test_run_on_first_core_and_a_collective_scratch(detect_races, no_jax_interpreter):
  """Core 0 fills a buffer both cores share (run_scoped with collective_axes:
  one allocation for the programs that differ along those axes, as JAX
  defines it), then a core barrier (on a per-core scratch semaphore), then
  core 1 reads it. No race: the barrier orders the accesses."""
  def body(x_hbm, o_hbm, sem):
    core = jax.lax.axis_index("core")

    def scoped(shared):
      @pltpu.run_on_first_core("core")
      def _():
        pltpu.sync_copy(x_hbm, shared)
        shared[...] = shared[...] + 100.0
      pltpu.core_barrier(sem, core_axis_name="core")

      @pl.when(core == 1)
      def _():
        pltpu.sync_copy(shared, o_hbm)
      pltpu.core_barrier(sem, core_axis_name="core")
    pl.run_scoped(scoped, pltpu.VMEM(X.shape, f32), collective_axes="core")
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct(X.shape, f32), mesh=MESH2,
                scratch_types=[pltpu.SemaphoreType.REGULAR],
                interpret=pallas_np.InterpretParams(detect_races=detect_races))
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(k(X)), np.asarray(X) + 100)


def test_collective_scratch_written_by_both_cores_races():
  def body(x_hbm, o_hbm):
    core = jax.lax.axis_index("core")

    def scoped(shared):
      pltpu.sync_copy(x_hbm, shared)  # both cores write all of it
      pltpu.sync_copy(shared.at[pl.ds(core * 8, 8)], o_hbm.at[pl.ds(core * 8, 8)])
    pl.run_scoped(scoped, pltpu.VMEM(X.shape, f32), collective_axes="core")
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct(X.shape, f32), mesh=MESH2,
                interpret=pallas_np.InterpretParams(detect_races=True))
  with pytest.raises(pallas_np.RaceError, match="collective_axes"):
    k(X)


def test_collective_run_scoped_outside_a_mesh_raises():
  def kernel(x_ref, o_ref):
    def scoped(buf):
      buf[...] = x_ref[...]
      o_ref[...] = buf[...]
    pl.run_scoped(scoped, pltpu.VMEM((8, 128), f32), collective_axes="x")
  k = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), f32), interpret="numpy")
  with pytest.raises(pallas_np.UnsupportedError, match="collective_axes"):
    k(jnp.ones((8, 128), f32))


# -- emit_pipeline inside a mesh kernel -----------------------------------------------
def test_emit_pipeline_per_core():
  """Each core pipelines its half of the rows through VMEM blocks
  (pltpu.emit_pipeline), as the core_map tutorial's matmul does."""
  pallas_np.assume_tpu_chip("v5e")
  x = jnp.arange(64 * 256, dtype=f32).reshape(64, 256) / 7

  def body(x_hbm, o_hbm):
    core = jax.lax.axis_index("core")

    def inner(x_ref, o_ref):
      o_ref[...] = jnp.sin(x_ref[...]) + core.astype(f32)
    pltpu.emit_pipeline(
        inner, grid=(4, 2),
        in_specs=[pl.BlockSpec((8, 128), lambda i, j: (core * 4 + i, j))],
        out_specs=[pl.BlockSpec((8, 128), lambda i, j: (core * 4 + i, j))])(x_hbm, o_hbm)

  def make(interpret):
    return pl.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, f32), mesh=MESH2,
                     interpret=interpret)
  got = np.asarray(make("numpy")(x))
  want = np.sin(np.asarray(x)) + (np.arange(64)[:, None] >= 32)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got, np.asarray(make(TPU)(x)), rtol=1e-6, atol=1e-6)


# -- CORE_PARALLEL dimension semantics on a pallas_call grid ----------------------------
def test_core_parallel_grid_splits_across_cores():
  """A grid whose first axis is CORE_PARALLEL runs split over num_cores cores
  (each with its own scratch), like 'parallel' megacore grids."""
  def kernel(x_ref, o_ref, acc):
    @pl.when(pl.program_id(1) == 0)
    def _():
      acc[...] = jnp.zeros_like(acc)
    acc[...] += x_ref[...]
    o_ref[...] = acc[...]
  x = jnp.arange(4 * 3 * 8 * 128, dtype=f32).reshape(4 * 8, 3 * 128)

  def make(interpret):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((32, 128), f32), grid=(4, 3),
        in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, 0)),
        scratch_shapes=[pltpu.VMEM((8, 128), f32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=(pltpu.CORE_PARALLEL, pltpu.ARBITRARY)),
        interpret=interpret)
  want = np.asarray(x).reshape(32, 3, 128).sum(1)
  got = make(pallas_np.InterpretParams(num_cores=2))(x)
  np.testing.assert_array_equal(np.asarray(got), want)
  np.testing.assert_array_equal(np.asarray(make(True)(x)), want)


# -- errors name the kernel line and the core --------------------------------------
def oob_body(n_ref, x_hbm, o_hbm):
  core = jax.lax.axis_index("core")
  pltpu.sync_copy(x_hbm.at[pl.ds(core * 8, n_ref[0])], o_hbm.at[pl.ds(core * 8, n_ref[0])])  # OOB_LINE


OOB_LINE = next(i for i, l in enumerate(open(__file__), 1) if l.rstrip().endswith("# OOB_LINE"))


def test_out_of_bounds_dynamic_dma_names_line_and_core():
  k = pl.kernel(oob_body, out_type=jax.ShapeDtypeStruct(X.shape, f32), mesh=MESH2,
                interpret="numpy")
  np.testing.assert_array_equal(np.asarray(k(jnp.array([8], jnp.int32), X)), np.asarray(X))
  with pytest.raises(pallas_np.KernelError) as info:
    k(jnp.array([12], jnp.int32), X)  # core 1 reads rows 8..20 of 16
  msg = str(info.value)
  assert "core 1 (core=1)" in msg, msg
  assert f"{__file__}:{OOB_LINE}" in msg, msg


def test_deadlock_between_cores_is_reported_not_hung():
  """Core 0 waits for a signal only core 1 could send, and core 1 waits for
  core 0: on a TPU both hang; here both raise, naming each wait."""
  def body(x_hbm, o_hbm, sem):
    pl.semaphore_wait(sem, 1)  # DEADLOCK_LINE
    pltpu.sync_copy(x_hbm, o_hbm)
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct(X.shape, f32), mesh=MESH2,
                scratch_types=[pltpu.SemaphoreType.REGULAR], interpret="numpy")
  with pytest.raises(pallas_np.KernelError, match="deadlock across cores") as info:
    k(X)
  msg = str(info.value)
  assert "core 0 (core=0)" in msg and "core 1 (core=1)" in msg, msg
  line = next(i for i, l in enumerate(open(__file__), 1) if l.rstrip().endswith("# DEADLOCK_LINE"))
  assert f"{__file__}:{line}" in msg, msg


def test_unwaited_dma_is_reported_with_its_core():
  def body(x_hbm, o_hbm, sem):
    core = jax.lax.axis_index("core")

    @pl.when(core == 1)
    def _():
      pltpu.make_async_copy(x_hbm, o_hbm, sem).start()  # never waited
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct(X.shape, f32), mesh=MESH2,
                scratch_types=[pltpu.SemaphoreType.DMA], interpret="numpy")
  with pytest.raises(pallas_np.KernelError, match="still in flight") as info:
    k(X)
  assert "core 1 (core=1)" in str(info.value)


def test_semaphore_left_signalled_is_reported():
  def body(x_hbm, o_hbm, sem):
    pltpu.sync_copy(x_hbm, o_hbm)

    @pl.when(jax.lax.axis_index("core") == 0)
    def _():
      pl.semaphore_signal(sem, 2)  # nobody waits
  k = pl.kernel(body, out_type=jax.ShapeDtypeStruct(X.shape, f32), mesh=MESH2,
                scratch_types=[pltpu.SemaphoreType.REGULAR], interpret="numpy")
  with pytest.raises(pallas_np.KernelError, match="is 2, not 0") as info:
    k(X)
  assert "core 0 (core=0)" in str(info.value)


# -- races between cores on shared memory --------------------------------------------
def _race_kernel(barrier: bool):
  def body(x_hbm, o_hbm, sem):
    core = jax.lax.axis_index("core")

    @pl.when(core == 0)
    def _():
      pltpu.sync_copy(x_hbm, o_hbm)  # core 0 writes all of o
    if barrier:
      pltpu.core_barrier(sem, core_axis_name="core")

    @pl.when(core == 1)
    def _():
      def scoped(buf):
        pltpu.sync_copy(o_hbm.at[pl.ds(0, 8)], buf)  # core 1 reads what core 0 wrote
        buf[...] = buf[...] + 1.0
        pltpu.sync_copy(buf, o_hbm.at[pl.ds(8, 8)])
      pl.run_scoped(scoped, pltpu.VMEM((8, 128), f32))
    if barrier:
      pltpu.core_barrier(sem, core_axis_name="core")
  return pl.kernel(body, out_type=jax.ShapeDtypeStruct(X.shape, f32), mesh=MESH2,
                   scratch_types=[pltpu.SemaphoreType.REGULAR],
                   interpret=pallas_np.InterpretParams(detect_races=True))


def test_race_between_cores_is_detected():
  with pytest.raises(pallas_np.RaceError, match="core 1 .* core 0|core 0 .* core 1"):
    for _ in range(3):  # whichever core runs first, one of the accesses races
      _race_kernel(barrier=False)(X)


def test_barrier_orders_the_cores_no_race():
  got = np.asarray(_race_kernel(barrier=True)(X))
  want = np.asarray(X).copy()
  want[8:16] = want[0:8] + 1
  np.testing.assert_array_equal(got, want)


# -- outside numpy mode: JAX's own lowering ------------------------------------------
def test_outside_numpy_mode_jax_runs_it(monkeypatch):
  calls = []
  orig = meshes.MeshKernel.run
  monkeypatch.setattr(meshes.MeshKernel, "run",
                      lambda self, *a: calls.append(1) or orig(self, *a))

  def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  k = pl.kernel(add_one, out_type=jax.ShapeDtypeStruct(X.shape, f32), mesh=MESH1,
                interpret=True)
  np.testing.assert_array_equal(np.asarray(k(X)), np.asarray(X) + 1)
  assert not calls
  with pytest.raises(ValueError, match="Only interpret mode is supported on CPU"):
    pl.kernel(add_one, out_type=jax.ShapeDtypeStruct(X.shape, f32), mesh=MESH1)(X)


def test_other_forced_interpret_mode_goes_to_jax():
  """pltpu.force_tpu_interpret_mode is another interpreter's force: JAX's."""
  with pltpu.force_tpu_interpret_mode():  # pl.kernel reads it when built
    k = halves(False)
    got = k(X)
  np.testing.assert_array_equal(np.asarray(got), halves_reference(X))


def test_kernel_plan_refuses_a_pallas_call_over_a_mesh():
  """What the mesh kernels' fallback lowering builds (a pallas_call with
  ``mesh=``) is refused by the grid executor, not run as a plain grid."""
  def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  k = pl.pallas_call(add_one, jax.ShapeDtypeStruct(X.shape, X.dtype), interpret="numpy")
  eqn = jax.make_jaxpr(k)(X).eqns[0]
  params = {key: v for key, v in eqn.params.items() if key not in ("interpret", "mesh")}
  KernelPlan(params=pallas_np.InterpretParams(), **params)  # without a mesh: fine
  with pytest.raises(pallas_np.UnsupportedError, match="pallas_call over a mesh"):
    KernelPlan(params=pallas_np.InterpretParams(), mesh=MESH1, **params)


def test_unknown_mesh_type_raises_naming_it():
  """A mesh no runner handles: UnsupportedError naming it and the kernel."""
  class OddMesh(type(MESH1)):
    pass
  odd = OddMesh(MESH1.devices, MESH1.axis_names) if hasattr(MESH1, "devices") else None
  if odd is None:  # JAX 0.12's TensorCoreMesh has another constructor
    odd = OddMesh(axis_name="core", num_cores=1)

  def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  line = f"{__file__}:{inspect.getsourcelines(add_one)[1]}"
  saved = list(meshes.kernel._runners)
  meshes.kernel._runners[:] = [(lambda m: type(m) is not OddMesh, r) for _, r in saved]
  try:
    k = pl.kernel(add_one, out_type=jax.ShapeDtypeStruct(X.shape, f32), mesh=odd,
                  interpret="numpy")
    with pytest.raises(pallas_np.UnsupportedError, match="mesh type OddMesh") as info:
      k(X)
    assert line in str(info.value)
  finally:
    meshes.kernel._runners[:] = saved
