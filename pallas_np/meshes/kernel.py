"""One mesh-kernel eqn (``mpmd_map``) compiled for the NumPy interpreter, and
the registry of runners by mesh type."""
from __future__ import annotations

from typing import Callable

import numpy as np

from pallas_np import _compat as jc
from pallas_np import blas, lru
from pallas_np.compiler import new_run
from pallas_np.errors import UnsupportedError
from pallas_np.grid import KernelPlan
from pallas_np.memory import allocate
from pallas_np.params import InterpretParams

# -- runners by mesh type ---------------------------------------------------------
_runners: list[tuple[Callable, Callable]] = []


def register_mesh_runner(predicate: Callable[[object], bool], runner: Callable):
  """Run mesh kernels whose every mesh satisfies ``predicate`` with
  ``runner(kernel, buffers)`` (see the package docstring). Later
  registrations are tried first."""
  _runners.insert(0, (predicate, runner))


def runner_for(meshes) -> Callable | None:
  for predicate, runner in _runners:
    if all(predicate(m) for m in meshes):
      return runner
  return None


def mesh_kernel_error(what: str, params, call_site: str = "") -> UnsupportedError:
  where = " and ".join(jc.mesh_kernel_sources(params)) or "<unknown kernel>"
  if call_site and call_site != "<unknown source>":
    where += f", called at {call_site}"
  return UnsupportedError(f"pallas_np: {what} (pl.kernel/pl.core_map mesh kernel {where}) "
                          "is not supported in numpy mode. pallas_np does not hand it to "
                          "another interpreter: run it outside numpy mode.")


# -- the kernel ---------------------------------------------------------------------
class MeshKernel:
  """An ``mpmd_map`` eqn's params, ready to run: one body (jaxpr) per mesh.

  Operands of every body, in order: the inputs, the outputs, the scratch
  buffers (``scratch_avals[i]``, allocated by the runner: which programs share
  one is the mesh's business)."""

  def __init__(self, params: dict, interp: InterpretParams):
    self.params = interp
    self.meshes = tuple(params["meshes"])
    self.jaxprs = tuple(params["jaxprs"])
    self.out_avals = tuple(params["out_avals"])
    self.compiler_params = params.get("compiler_params")
    self.debug = bool(params.get("debug"))
    # input index -> output index (an aliased output is its input's buffer)
    self.aliases = dict(params.get("input_output_aliases") or {})
    self.num_outputs = len(self.out_avals)
    self.source = " and ".join(jc.mesh_kernel_sources(params)) or "<unknown kernel>"
    first = self.jaxprs[0]
    self.name = params.get("name") or _jaxpr_name(first)
    if params.get("external_meshes"):
      raise mesh_kernel_error("external meshes", params)
    for j in self.jaxprs:
      if j.constvars:
        raise mesh_kernel_error("a body that closes over refs", params)
    self.runner = runner_for(self.meshes)
    if self.runner is None:
      kinds = ", ".join(sorted({type(m).__name__ for m in self.meshes}))
      raise mesh_kernel_error(f"mesh type {kinds}", params)
    self.num_scratch: list[int] = []
    self.num_inputs = None  # known from the operands (the eqn's invars): bind_inputs
    self._programs: dict[int, KernelPlan] = {}
    self._written = frozenset()

  def bind_inputs(self, num_inputs: int):
    self.num_inputs = num_inputs
    self.num_scratch = [len(j.invars) - num_inputs - self.num_outputs for j in self.jaxprs]
    if any(n < 0 for n in self.num_scratch):
      raise UnsupportedError(f"pallas_np: mesh kernel {self.source}: a body has fewer "
                             "operands than the kernel's inputs and outputs")
    written = set()
    for j in self.jaxprs:
      written |= jc.written_invar_positions(j)
    self._written = frozenset(i for i in written if i < num_inputs)
    return self

  def scratch_avals(self, body: int) -> list:
    j = self.jaxprs[body]
    return [v.aval for v in j.invars[self.num_inputs + self.num_outputs:]]

  def program(self, body: int) -> KernelPlan:
    """Body ``body`` as a KernelPlan over whole refs whose grid is the mesh
    (a program runs one point of it: ``pl.program_id`` is its coordinate);
    compiled once."""
    kp = self._programs.get(body)
    if kp is None:
      j, mesh = self.jaxprs[body], self.meshes[body]
      gm = jc.mesh_grid_mapping(j, self.num_inputs, self.num_outputs,
                                mesh.default_memory_space,
                                grid=tuple(int(s) for s in mesh.shape.values()),
                                debug=self.debug)
      kp = KernelPlan(jaxpr=j, grid_mapping=gm, input_output_aliases=(),
                      out_avals=self.out_avals, params=self.params, name=self.name,
                      debug=self.debug, compiler_params=self.compiler_params)
      kp.kernel  # noqa: B018 (compile now: unsupported primitives raise here)
      self._programs[body] = kp
    return kp

  def compile(self):
    for b in range(len(self.jaxprs)):
      self.program(b)
    return self

  def axis_names(self) -> frozenset:
    """Axis names the bodies read with axis_index that are not mesh axes."""
    names = set()
    for b in range(len(self.jaxprs)):
      read, _ = self.program(b).device_features
      names |= set(read)
    mesh_axes = {n for m in self.meshes for n in m.shape}
    return frozenset(names - mesh_axes)

  # -- running ---------------------------------------------------------------------
  def run(self, *args) -> list[np.ndarray]:
    """Outputs of one invocation on NumPy operands."""
    new_run()
    with np.errstate(all="ignore"), blas.kernel_run():
      buffers = self._buffers(args)
      self.runner(self, buffers)
      return buffers[self.num_inputs:]

  def _buffers(self, args) -> list[np.ndarray]:
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


# -- cache ------------------------------------------------------------------------------
_cache = lru.LRU(256)


def get_mesh_kernel(params: dict, num_inputs: int, interp: InterpretParams) -> MeshKernel:
  """The compiled MeshKernel of an eqn's params (cached by identity of the
  body jaxprs, kept alive by the entry)."""
  key = (tuple(id(j) for j in params["jaxprs"]), num_inputs, interp)
  hit = _cache.get(key)
  if hit is not None:
    return hit[1]
  kernel = MeshKernel(params, interp).bind_inputs(num_inputs).compile()
  _cache.put(key, (params["jaxprs"], kernel))
  return kernel
