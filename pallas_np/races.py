"""Race detection: ``InterpretParams(detect_races=True)``.

Grid points whose coordinates differ on a *parallel* axis may run at the same
time on hardware (TPU megacore cores, GPU thread blocks), so the order the
interpreter picks hides bugs that bite there. With detection on, every tracked
buffer (operands, outputs, scratch) gets a shadow array holding, per element,
the grid step that last wrote it. Ref accesses report the elements they touch:

* a write to an element another parallel group wrote  -> race (not for
  scratch, which is private to a core on hardware);
* a read of an element another parallel group wrote   -> race;
* (TPU semantics) two parallel groups visiting the same pipelined output
  block -> race, even if they write disjoint elements: each core writes the
  whole block back.

"Parallel group" = the grid point's coordinates on the parallel axes (and
vmapped axes): points of one group run in order on one core.

Cost: a shadow int64 array per buffer and O(accessed elements) work per ref
access, paid only when enabled: the ref rules install the hook at compile time
(``wrap_resolve``), so plans compiled without detection run unchanged.
Other engines that write refs (DMA, atomics) report through ``note(view,
index, kind)``.

``InterpretParams(race_policy="record")`` records a race in ``RECORD`` and
lets the kernel go on (JAX's interpreters' behaviour, whose ``get_races()``
the ``cpu`` device persona answers from it) instead of raising.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Sequence

import numpy as np

from pallas_np.clocks import Shadow, accessed_elements, byte_offsets  # noqa: F401 - races.*'s
from pallas_np.errors import RaceError


class _State(threading.local):
  """Per thread: the active detector (a class default, so that ``current``
  finds None without the failed lookup ``getattr``'s default costs, ~1 µs:
  a compiled DMA loop asks at every call)."""
  detector = None


_state = _State()
_PARALLEL_NAMES = ("parallel", "core_parallel", "subcore_parallel")


class RaceRecord:
  """The races found by the kernels run with ``race_policy="record"``:
  like JAX's interpreters' race state, it holds the last such kernel run's
  (each run starts it afresh). Process-wide, as JAX's is: kernels run in
  XLA's callback threads."""

  KEPT = 16  # races kept per run (the first ones)

  def __init__(self):
    self._lock = threading.Lock()
    self.races: list[RaceError] = []

  def begin_run(self) -> None:
    with self._lock:
      self.races = []

  def add(self, err: RaceError) -> None:
    with self._lock:
      if len(self.races) < self.KEPT:
        self.races.append(err)

  @property
  def found(self) -> bool:
    return bool(self.races)


RECORD = RaceRecord()


def current() -> "RaceDetector | None":
  return getattr(_state, "detector", None)


def parallel_axes(compiler_params, num_local_dims: int, override=None) -> tuple[int, ...]:
  """Kernel-local grid axes that may run concurrently.

  ``override`` (InterpretParams.parallel_axes) wins; otherwise TPU-style
  ``dimension_semantics`` decide, and GPU compiler params (Triton, Mosaic
  GPU) without semantics make every axis parallel. No compiler params: none
  (TPU's default is "arbitrary").
  """
  if override is not None:
    return tuple(sorted(int(a) for a in override))
  sem = getattr(compiler_params, "dimension_semantics", None)
  if sem is not None:
    return tuple(i for i, s in enumerate(sem)
                 if str(getattr(s, "value", s)).lower() in _PARALLEL_NAMES)
  if is_gpu(compiler_params):
    return tuple(range(num_local_dims))
  return ()


def is_gpu(compiler_params) -> bool:
  module = type(compiler_params).__module__ if compiler_params is not None else ""
  return "triton" in module or "mosaic_gpu" in module


class RaceDetector:
  """Shadow memory for one run of one kernel over its grid."""

  def __init__(self, kernel: str, grid: Sequence[int], group_axes: Sequence[int],
               semantics_note: str = ""):
    self.kernel = kernel
    self.grid = tuple(int(g) for g in grid)
    self.group_axes = tuple(group_axes)
    self.group_shape = tuple(self.grid[a] for a in self.group_axes)
    self.semantics_note = semantics_note
    self.regions: list[Shadow] = []
    self.step = 0
    self.point: tuple[int, ...] = ()
    self.group = 0
    # TPU pipelining writes every visited output block back whole: block
    # index -> (group, step) of its first visitor, per written-back output.
    self.writeback: list[tuple[int, str, int, dict]] = []
    # (data pointer, shape, strides) of a view -> (region, ptr, shadows)
    self._views: dict = {}
    # (view, index, kind) -> None: also told every unmasked access (the
    # cross-device check of a multi-device run, pallas_np.device_races)
    self.device_hook = None
    self.record = False  # race_policy="record": found() records, the run goes on

  def found(self, err: RaceError) -> None:
    """A race: raised, or recorded in ``RECORD`` (``race_policy="record"``)."""
    if not self.record:
      raise err
    RECORD.add(err)

  def track_writeback(self, block: int, name: str, ndim: int):
    self.writeback.append((block, name, ndim, {}))

  def track(self, name: str, arr: np.ndarray, *, scratch: bool = False):
    if isinstance(arr, np.ndarray) and arr.size:
      self.regions.append(Shadow(name, arr, scratch))

  def begin(self, step: int, point: Sequence[int], block_indices=()):
    """Enter grid point ``point``; ``block_indices[b]`` is operand b's
    current block index (None: its index map is constant)."""
    self.point = tuple(int(p) for p in point)
    step = 0  # linear grid index: steps of megacore chunks restart at 0
    for c, n in zip(self.point, self.grid):
      step = step * n + c
    self.step = step
    coords = tuple(self.point[a] for a in self.group_axes)
    group = 0
    for c, n in zip(coords, self.group_shape):
      group = group * n + c
    self.group = group
    for b, name, ndim, owners in self.writeback:
      bidx = block_indices[b] if b < len(block_indices) else None
      key = tuple(int(i) for i in bidx) if bidx is not None else (0,) * ndim
      first = owners.setdefault(key, (self.group, step))
      if first[0] != self.group:
        other = self._point_of(first[1])
        axes = [a for a in self.group_axes if self.point[a] != other[a]]
        self.found(RaceError(
            f"data race on {name} in kernel '{self.kernel}': grid points {other} and "
            f"{self.point} both map its block {key}; they differ on parallel grid axis "
            f"{axes[0] if len(axes) == 1 else axes}{self.semantics_note}, may run on "
            "different cores, and each core writes the whole output block back.",
            buffer=name, grid_points=(other, self.point), element=None))

  def release(self, semaphore_key):
    """A semaphore is signalled (a mesh kernel's detector orders the
    programs' accesses by these; the grid's detector has nothing to do)."""

  def acquire(self, semaphore_key):
    """A semaphore wait returned (see ``release``)."""

  def _point_of(self, step: int) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(step, self.grid)) if self.grid else ()

  def _region(self, view: np.ndarray):
    ptr = view.__array_interface__["data"][0]
    for r in self.regions:
      if r.start <= ptr < r.end:
        return r, ptr
    return None, ptr

  def access(self, view, index, kind: str, mask=None):
    """Check (and for writes record) the elements ``view[index]`` touches."""
    if not isinstance(view, np.ndarray) or view.size == 0:
      return
    if self.device_hook is not None and mask is None:
      self.device_hook(view, index, kind)
    ptr = view.__array_interface__["data"][0]
    key = (ptr, view.shape, view.strides, view.dtype)
    hit = self._views.get(key)
    if hit is None or hit[1] is None and hit[0] is not None and hit[0].written:
      region = hit[0] if hit is not None else self._region(view)[0]
      shadows = _shadow_views(region, ptr, view) if region is not None and region.written \
          else None
      hit = self._views[key] = (region, shadows)
    region, shadows = hit
    if region is None:  # run_scoped / private memory: not shared
      return
    if not region.written:
      if kind == "read":
        return
      region.ensure()
      shadows = None
    if shadows is None or (mask is not None and not _is_basic(index)):
      return self._access_general(region, ptr, view, index, kind, mask)
    group_view, step_view = shadows
    groups = group_view[index]
    if mask is not None and not isinstance(groups, np.ndarray):  # one element
      return self._access_general(region, ptr, view, index, kind, mask)
    if mask is not None:
      mask = np.broadcast_to(np.asarray(mask, bool), np.shape(groups))
    seen = groups if mask is None else np.asarray(groups)[mask]
    if (kind != "write" or not region.scratch) and region.written and np.any(
        seen != self.group) and np.any((seen >= 0) & (seen != self.group)):
      return self._access_general(region, ptr, view, index, kind, mask)  # reports
    if kind != "read":
      if mask is None:
        group_view[index] = self.group
        step_view[index] = self.step
      else:  # basic index: groups and step_view[index] are views
        groups[mask] = self.group
        step_view[index][mask] = self.step

  def _access_general(self, region, ptr, view, index, kind, mask):
    """Element-offset version: any view (bitcast ones too) and index."""
    elems = accessed_elements(view, index, mask, ptr, region.start, region.itemsize)
    if elems.size == 0:
      return
    writer_group = region.group[elems]
    foreign = (writer_group >= 0) & (writer_group != self.group)
    check = kind != "write" or not region.scratch
    if check and foreign.any():
      k = int(np.argmax(foreign))
      self._report(region, int(elems[k]), int(region.step[elems[k]]), kind)
    if kind != "read":
      region.step[elems] = self.step
      region.group[elems] = self.group

  def _report(self, region: Shadow, elem: int, other_step: int, kind: str):
    other = self._point_of(other_step)
    where = tuple(int(i) for i in np.unravel_index(elem, region.shape))
    verb = {"read": "reads", "write": "writes", "readwrite": "updates"}[kind]
    axes = [a for a in self.group_axes if self.point[a] != other[a]]
    self.found(RaceError(
        f"data race on {region.name} in kernel '{self.kernel}': grid point "
        f"{self.point} {verb} element {where} that grid point {other} wrote; "
        f"they differ on parallel grid axis {axes[0] if len(axes) == 1 else axes}"
        f"{self.semantics_note}, so they may run concurrently on hardware.",
        buffer=region.name, grid_points=(other, self.point), element=where))


def _is_basic(index) -> bool:
  if index is Ellipsis:
    return True
  items = index if isinstance(index, tuple) else (index,)
  return not any(isinstance(i, np.ndarray) or isinstance(i, (list, tuple)) for i in items)


def _shadow_views(region: Shadow, ptr: int, view: np.ndarray):
  """(group, step) shadow arrays laid out like ``view`` (same shape, strides
  scaled), so ``shadow[index]`` selects exactly what ``view[index]`` does;
  None when the view's element size differs from the buffer's (bitcasts)."""
  size = region.itemsize
  if view.itemsize != size or any(st % size for st in view.strides):
    return None
  start = (ptr - region.start) // size
  strides = tuple(st // size * 4 for st in view.strides)  # int32 shadows
  as_strided = np.lib.stride_tricks.as_strided
  return (as_strided(region.group[start:], view.shape, strides),
          as_strided(region.step[start:], view.shape, strides))


def note(view, index, kind: str, mask=None):
  """Report a ref access to the active detector (no-op when none)."""
  det = current()
  if det is not None:
    det.access(view, index, kind, mask)


def wrap_resolve(resolve, kind: str):
  """A RefAccess resolver that also reports what it resolves."""
  def tracked(ref, leaves):
    view, idx = resolve(ref, leaves)
    det = current()
    if det is not None:
      det.access(view, idx, kind)
    return view, idx
  return tracked


class activate:
  """Context manager making ``detector`` the current one (per thread)."""

  def __init__(self, detector):
    self.detector = detector

  def __enter__(self):
    self.prev = current()
    _state.detector = self.detector
    return self.detector

  def __exit__(self, *exc):
    _state.detector = self.prev
    return False


def for_run(plan, grid, buffers, scratch) -> RaceDetector | None:
  """The detector for one ``KernelPlan.run`` (None when detection is off)."""
  params = plan.params
  if params.explain is not None:  # pallas_np.explain: record instead of checking
    return params.explain.start_run(plan, grid, buffers, scratch)
  if params.race_policy == "record":
    RECORD.begin_run()
  if not params.detect_races:
    return None
  local = plan.local_dims
  par_local = parallel_axes(plan.compiler_params, len(local), params.parallel_axes)
  group_axes = tuple(sorted(set(plan.vmapped_dims) | {local[a] for a in par_local
                                                        if a < len(local)}))
  sem = getattr(plan.compiler_params, "dimension_semantics", None)
  if not par_local and sem is None and params.parallel_axes is None:
    warnings.warn(
        f"pallas_np: detect_races=True but kernel '{plan.name}' has no parallel "
        "grid axis (no dimension_semantics / GPU compiler params); pass "
        "InterpretParams(parallel_axes=...) to say which axes run concurrently.",
        stacklevel=4)
  note_ = f" (dimension_semantics={tuple(str(getattr(s, 'value', s)) for s in sem)})" \
      if sem is not None and params.parallel_axes is None else ""
  det = RaceDetector(plan.name, grid, group_axes, note_)
  det.record = params.race_policy == "record"
  for geo, buf in zip(plan.blocks, buffers):
    det.track(str(geo.origin), buf)
  for i, buf in enumerate(scratch):
    det.track(f"scratch_operands[{i}]", buf, scratch=True)
  if par_local and not is_gpu(plan.compiler_params):
    bms = plan.grid_mapping.block_mappings
    for b in range(plan.num_inputs, len(plan.blocks)):
      space = getattr(bms[b].transformed_block_aval, "memory_space", None)
      space = str(getattr(space, "value", space)).lower()
      if "any" not in space and "hbm" not in space:  # pipelined (VMEM/SMEM) block
        det.track_writeback(b, str(plan.blocks[b].origin), len(plan.blocks[b].sizes))
  return det
