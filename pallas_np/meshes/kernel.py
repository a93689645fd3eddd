"""One mesh-kernel eqn (``mpmd_map``; JAX 0.10's ``core_map``) compiled for
the NumPy interpreter (``MeshKernel``), and the registry of *mesh runners*
by mesh type: how the kernels over one kind of mesh compile and run (TPU
cores and SparseCore subcores: ``meshes.tpu``; Mosaic GPU blocks and
warpgroups, and ``plgpu.warp_map`` inside them: ``mosaic_gpu.entry``)."""
from __future__ import annotations

from typing import Callable

import numpy as np

from pallas_np import _compat as jc
from pallas_np import blas, kernel_family, lru
from pallas_np.compiler import new_run
from pallas_np.errors import UnsupportedError
from pallas_np.grid import KernelPlan, run_strategies
from pallas_np.memory import allocate
from pallas_np.params import InterpretParams


def mesh_kernel_error(what: str, params, call_site: str = "") -> UnsupportedError:
  where = " and ".join(jc.mesh_kernel_sources(params)) or "<unknown kernel>"
  if call_site and call_site != "<unknown source>":
    where += f", called at {call_site}"
  return UnsupportedError(f"pallas_np: {what} (pl.kernel/pl.core_map mesh kernel {where}) "
                          "is not supported in numpy mode. pallas_np does not hand it to "
                          "another interpreter: run it outside numpy mode.")


# -- runners by mesh type ---------------------------------------------------------
class MeshRunner:
  """How the kernels over one kind of mesh compile and run. The defaults
  are those of meshes whose bodies run as programs (``program(i)``, one per
  point of the mesh: the TPU runner); a runner with its own executor
  (Mosaic GPU) overrides ``check``, ``compile``, ``device_features``,
  ``written_inputs``, ``run``."""
  default_name: str | None = None  # the kernel's name when the eqn has none

  def check(self, prim, params, call_site: str):
    """Raise ``UnsupportedError`` for an eqn this runner cannot run."""
    if prim is not jc.mpmd_map_p:  # a stateful core_map that was not discharged
      raise mesh_kernel_error(f"an undischarged {prim.name}", params, call_site)
    check_bodies(params)

  def inner_rule(self, e):
    """The evaluator's rule of a mesh eqn that is not a kernel of its own
    but a construct inside one (``plgpu.warp_map``), else None."""
    return None

  def written_inputs(self, kernel) -> frozenset:
    """Input positions the kernel may write (private copies per run)."""
    written = set()
    for j in kernel.jaxprs:
      written |= jc.written_invar_positions(j)
    return frozenset(i for i in written if i < kernel.num_inputs)

  def compile(self, kernel):
    """Compile every body now (an unsupported primitive raises from the
    ``jax.jit`` call); refuse bodies that read axes outside the mesh."""
    for b in range(len(kernel.jaxprs)):
      kernel.program(b)
    outside = kernel.axis_names()
    if outside:
      raise UnsupportedError(
          f"pallas_np: mesh kernel {kernel.source} reads jax.lax.axis_index of "
          f"{sorted(map(str, outside))}, not axes of its mesh: mesh kernels that talk to "
          "other devices (inside shard_map) are not supported")

  def device_features(self, kernel) -> tuple:
    """(axis names of other devices it reads, whether it talks to other
    devices): program meshes read none (``compile`` refused them)."""
    return (), False

  def run(self, kernel, buffers: list, placement) -> None:
    raise NotImplementedError


class _FunctionRunner(MeshRunner):
  """A runner given as ``runner(kernel, buffers)`` (programs meshes)."""

  def __init__(self, fn: Callable):
    self.fn = fn

  def run(self, kernel, buffers, placement):
    with np.errstate(all="ignore"), blas.kernel_run():
      self.fn(kernel, buffers)


_runners: list[tuple[Callable, MeshRunner]] = []


def register_mesh_runner(predicate: Callable[[object], bool], runner):
  """Run mesh kernels whose every mesh satisfies ``predicate`` with
  ``runner``: a ``MeshRunner``, or a function ``runner(kernel, buffers)``
  for meshes whose bodies run as programs (see the package docstring).
  Later registrations are tried first."""
  if not isinstance(runner, MeshRunner):
    runner = _FunctionRunner(runner)
  _runners.insert(0, (predicate, runner))


def runner_for(meshes) -> MeshRunner | None:
  for predicate, runner in _runners:
    if all(predicate(m) for m in meshes):
      return runner
  return None


def check_bodies(params):
  """What no mesh runner supports: meshes from outside, bodies closing over refs."""
  if params.get("external_meshes"):
    raise mesh_kernel_error("external meshes", params)
  for j in params["jaxprs"]:
    if j.constvars:
      raise mesh_kernel_error("a body that closes over refs", params)


# -- the kernel ---------------------------------------------------------------------
class MeshKernel:
  """An ``mpmd_map`` eqn's params, ready to run: one body (jaxpr) per mesh,
  run by its mesh type's runner (chosen here, at plan time).

  Operands of every body, in order: the inputs, the outputs, the scratch
  buffers (``scratch_avals[i]``, allocated by the runner: which programs share
  one is the mesh's business)."""

  def __init__(self, params: dict, interp: InterpretParams, runner: MeshRunner):
    self.params = interp
    self.runner = runner
    self.meshes = tuple(params["meshes"])
    self.jaxprs = tuple(params["jaxprs"])
    self.out_avals = tuple(params["out_avals"])
    self.compiler_params = params.get("compiler_params")
    self.debug = bool(params.get("debug"))
    # input index -> output index (an aliased output is its input's buffer)
    aliases = params.get("input_output_aliases") or {}
    self.aliases = dict(aliases.items() if hasattr(aliases, "items") else aliases)
    self.num_outputs = len(self.out_avals)
    self.source = " and ".join(jc.mesh_kernel_sources(params)) or "<unknown kernel>"
    self.name = str(params.get("name") or runner.default_name or _jaxpr_name(self.jaxprs[0]))
    self.num_scratch: list[int] = []
    self.num_inputs = None  # known from the operands (the eqn's invars): bind_inputs
    self.executable = None  # what the runner compiled, if it keeps its own (Mosaic GPU)
    self._programs: dict[int, KernelPlan] = {}
    self._written = frozenset()

  def bind_inputs(self, num_inputs: int):
    self.num_inputs = num_inputs
    self.num_scratch = [len(j.invars) - num_inputs - self.num_outputs for j in self.jaxprs]
    self._written = self.runner.written_inputs(self)
    return self

  def scratch_avals(self, body: int) -> list:
    j = self.jaxprs[body]
    return [v.aval for v in j.invars[self.num_inputs + self.num_outputs:]]

  def program(self, body: int) -> KernelPlan:
    """Body ``body`` as a KernelPlan over whole refs whose grid is the mesh
    (a program runs one point of it: ``pl.program_id`` is its coordinate;
    its run strategy, ``run_strategies.MeshProgram``, is chosen now);
    compiled once."""
    kp = self._programs.get(body)
    if kp is None:
      if self.num_scratch[body] < 0:
        raise UnsupportedError(f"pallas_np: mesh kernel {self.source}: a body has fewer "
                               "operands than the kernel's inputs and outputs")
      j, mesh = self.jaxprs[body], self.meshes[body]
      gm = jc.mesh_grid_mapping(j, self.num_inputs, self.num_outputs,
                                mesh.default_memory_space,
                                grid=tuple(int(s) for s in mesh.shape.values()),
                                debug=self.debug)
      kp = KernelPlan(jaxpr=j, grid_mapping=gm, input_output_aliases=(),
                      out_avals=self.out_avals, params=self.params, name=self.name,
                      debug=self.debug, compiler_params=self.compiler_params)
      kp.strategy = run_strategies.MeshProgram()
      kp.kernel  # noqa: B018 (compile now: unsupported primitives raise here)
      self._programs[body] = kp
    return kp

  def compile(self):
    """Everything compiled now (idempotent): see ``MeshRunner.compile``."""
    self.runner.compile(self)
    return self

  @property
  def device_features(self) -> tuple:
    """(axis names of other devices it reads, whether it talks to other
    devices): the lowering runs one instance per device inside shard_map."""
    return self.runner.device_features(self)

  def axis_names(self) -> frozenset:
    """Axis names the bodies read with axis_index that are not mesh axes."""
    names = set()
    for b in range(len(self.jaxprs)):
      read, _ = self.program(b).device_features
      names |= set(read)
    mesh_axes = {n for m in self.meshes for n in m.shape}
    return frozenset(names - mesh_axes)

  # -- running ---------------------------------------------------------------------
  def run(self, *args, placement=None) -> list[np.ndarray]:
    """Outputs of one invocation on NumPy operands; ``placement``: this
    device's place in a ``shard_map`` (``pallas_np.devices``)."""
    new_run()
    buffers = self._buffers(args)
    self.runner.run(self, buffers, placement)
    return buffers[self.num_inputs:]

  def _buffers(self, args) -> list[np.ndarray]:
    """The inputs (private copies of those the kernel may write, read-only
    views of the others), then the outputs (an aliased output *is* its
    input's buffer, as in HBM/GMEM; the others start uninitialised)."""
    if len(args) != self.num_inputs:
      raise ValueError(f"mesh kernel {self.name}: {len(args)} operands, expected "
                       f"{self.num_inputs}")
    ins = []
    for i, x in enumerate(args):
      x = np.asarray(x)
      if i in self.aliases or i in self._written:
        x = np.array(x)  # the kernel writes it: a private copy (HBM buffer)
      elif x.flags.writeable:
        x = x.view()
        x.flags.writeable = False
      ins.append(x)
    outs = [None] * self.num_outputs
    for i, o in self.aliases.items():
      outs[o] = ins[i]
    for o, aval in enumerate(self.out_avals):
      if outs[o] is None:
        outs[o] = allocate(aval.shape, aval.dtype, self.params)
    return ins + outs


def _jaxpr_name(jaxpr) -> str:
  dbg = getattr(jaxpr, "debug_info", None)
  return getattr(dbg, "func_name", None) or "mesh_kernel"


# -- plan: the mesh family's lower -> plan step ------------------------------------------
_cache = lru.LRU(256)


def get_mesh_kernel(params: dict, num_inputs: int, interp: InterpretParams, prim=None,
                    call_site: str = "") -> MeshKernel:
  """The compiled MeshKernel of an eqn's params (cached by identity of the
  body jaxprs and meshes, kept alive by the entry); its runner is picked by mesh type
  (``runner_for``), which refuses what it cannot run first."""
  meshes = jc.mesh_kernel_meshes(params)
  runner = runner_for(meshes)
  prim = jc.mpmd_map_p if prim is None else prim
  if runner is None:
    MeshRunner().check(prim, params, call_site)
    kinds = ", ".join(sorted({type(m).__name__ for m in meshes}))
    raise mesh_kernel_error(f"mesh type {kinds}", params)
  runner.check(prim, params, call_site)
  # JAX may trace one body once for several meshes: the meshes are part of the key.
  mesh_key = meshes  # equal meshes (frozen dataclasses) share a kernel
  try:
    hash(meshes)
  except TypeError:
    mesh_key = tuple(id(m) for m in meshes)
  key = (tuple(id(j) for j in params["jaxprs"]), mesh_key, num_inputs, interp,
         jc.debug_checks_enabled())  # as JAX's jit key: the checks are compiled in or not
  hit = _cache.get(key)
  if hit is not None:
    return hit[1]
  kernel = MeshKernel(params, interp, runner).bind_inputs(num_inputs).compile()
  _cache.put(key, ((params["jaxprs"], meshes), kernel))
  return kernel


# -- the family -------------------------------------------------------------------------
class MeshFamily(kernel_family.KernelFamily):
  """Mesh kernels (``pl.kernel(mesh=...)``, ``pl.core_map``, ``plgpu.kernel``):
  one ``MeshKernel`` per eqn, run by its mesh type's runner."""
  name = "mesh kernel"
  primitives = jc.mesh_kernel_primitives()
  sequential_reason = "a mesh kernel runs its own programs: the outer grid runs sequentially"

  def plan(self, prim, params, num_inputs, interp, call_site=""):
    return get_mesh_kernel(params, num_inputs, interp, prim, call_site)

  def inner_rule(self, e):
    runner = runner_for(jc.mesh_kernel_meshes(e.params))
    return runner.inner_rule(e) if runner is not None else None

  def check_eager(self, e):
    if e.primitive is not jc.mpmd_map_p:
      raise mesh_kernel_error(f"a stateful {e.primitive.name} outside pl.run_state", e.params,
                              e.source)
    if any(isinstance(a, jc.AbstractRef) for a in e.in_avals):
      # Its outputs would be values, the refs never written: never run it so.
      raise mesh_kernel_error("a stateful mpmd_map on refs outside pl.run_state",
                              e.params, e.source)


MESH_KERNELS = kernel_family.register_family(MeshFamily())
