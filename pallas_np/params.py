"""Options of the NumPy interpreter.

An ``InterpretParams`` (or the string ``"numpy"``) is what the user passes as
``interpret=`` to ``pl.pallas_call``; it travels inside the pallas_call
primitive's params, so it must be hashable: a frozen dataclass.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal

from pallas_np.env_switches import env_switch

NUMPY_MODE_STRINGS = ("numpy", "np")


@dataclasses.dataclass(frozen=True)
class InterpretParams:
  """Options of ``interpret="numpy"``.

  Attributes:
    bounds_check: ``"raise"`` (default) makes any out-of-range block index,
      ``pl.ds`` or DMA slice raise ``IndexError``; ``"clamp"`` clamps start
      indices the way ``interpret=True`` (XLA's dynamic_slice) does.
    uninitialized: fill of scratch buffers and unwritten output blocks:
      ``"nan"`` (default, same values as interpret=True: NaN for floats,
      the dtype minimum for signed ints, 0 for unsigned/semaphores, False for
      bool) or ``"zero"``.
    oob_reads: what a *load* (``x_ref[i]``, ``ref.at[...][...]``) past the
      end of a ref does. ``"raise"`` (default): ``IndexError``, like every
      out-of-bounds access. ``"fill"``: the out-of-bounds elements read the
      ``uninitialized`` fill (NaN, int min), as a TPU reads whatever memory
      follows the ref; for kernels that load speculatively and discard the
      value (``lax.select`` evaluates both sides). Stores, DMAs and masked
      Triton loads still raise (see docs/debugging.md).
    buffer_bounds: what bounds a TPU DMA (TPU interpret mode's option of that
      name). ``"logical"`` (default): the array's shape. ``"padded"``: the
      buffer's tile-padded shape (the hardware stores arrays in (8, 128)
      tiles): a DMA window past the logical end inside the padding reads the
      ``uninitialized`` fill there and its writes there are dropped
      (``state/past_end.py``).
    check_avals: after every eqn, check that the NumPy value has the shape and
      dtype of the eqn's abstract value (slow; used by the test-suite).
    vectorize: evaluate independent grid points in one batched pass.
      ``None`` (default) decides automatically, ``False`` never.
    detect_races: report parallel grid points that write the same output
      element or read what another parallel grid point wrote (raises
      ``RaceError``).
    race_policy: what a race found by ``detect_races`` does. ``"raise"``
      (default): ``RaceError`` from the kernel call. ``"record"``: the race
      is recorded (``pallas_np.races.RECORD``) and the kernel goes on, as
      JAX's own interpreters do; JAX's ``get_races()`` answers from the
      record under the ``cpu`` device persona (pallas_np.persona).
    parallel_axes: grid axes that may run concurrently, for detect_races.
      ``None`` (default): from ``dimension_semantics`` ("parallel"), or every
      axis for GPU compiler params.
    pdb: drop into pdb at the failing eqn.
    trace: callable invoked per grid point with (kernel_name, program_ids).
    progress: show a progress bar for grids that run longer than ~2 s
      (``PALLAS_NP_PROGRESS=0`` turns it off everywhere).
    num_threads: threads over independent grid points. ``None`` (default,
      auto): as many as there are cores, only for kernels whose blocks are too
      big to batch, whose NumPy calls are long and that do no GEMMs (see
      pallas_np.grid.threads); ``1``: off; ``n``: up to ``n`` threads wherever
      legal (vectorized slabs, or whole lanes of the sequential grid).
    num_cores: TensorCores per device (like ``pltpu.InterpretParams(
      num_cores_or_threads=...)``): the leading 'parallel' grid dims are split
      across cores, each with its own scratch and scalar-prefetch copies.
      Kernels written for megacore (e.g. paged attention's ``megacore_mode``)
      need 2.
    whole_program: a ``jax.jit`` function called eagerly on CPU arrays runs
      entirely in the NumPy evaluator, with no XLA compilation, when every
      ``pallas_call`` in it is numpy mode (an eager ``pl.pallas_call(...,
      interpret="numpy")`` is such a jit), or under ``force_numpy_interpret``
      when it contains any ``pallas_call``; unless a primitive around the
      kernels has no NumPy rule (then XLA compiles the code around the
      kernels, which reach the interpreter through ``io_callback``).
      ``False``: always the latter.
    inline_jit: ``pallas_np.pallas_call`` only: have JAX trace the kernel
      body under ``jax.disable_jit()``, so the jitted functions it calls
      (every ``jnp`` function) are traced inline rather than through jit's
      machinery: the same primitives, a much cheaper first call. ``None``
      (default): unless the kernel's code names a loop helper (``fori_loop``,
      ``scan``, ``map``, ``pl.loop``, ``emit_pipeline``) that would unroll
      under ``disable_jit``; ``True``/``False``: always/never (see
      pallas_np.tracing).
    native_loops: hot ``while``/``fori_loop`` loops compiled to machine code
      with numba (pallas_np.native; same bits and errors as the NumPy path):
      ``"background"`` (default): a loop whose NumPy path has cost enough
      (its build's weighted price) is built in a compile process and used once
      ready, or loaded from the disk cache (``PALLAS_NP_NATIVE_CACHE``);
      ``"sync"``: built at its first run, the caller waiting; ``"off"``: never.
      Small kernel bodies without loops likewise (docs/native_bodies.md).
      ``PALLAS_NP_NATIVE_LOOPS=0`` turns it off everywhere. Never under
      ``pdb``, ``detect_races``, ``explain``, ``check_avals`` or ``trace``.
    loop_watchdog_s: wall-clock seconds one execution of a ``while_loop``
      in a kernel may run before it raises ``LoopWatchdogError`` naming the
      loop's line and the grid point (a condition that never becomes false
      would otherwise hang the program). ``None`` (default): no watchdog, no
      cost. The device persona (``pallas_np.emulate_device``) sets 120.
      While it is on, loops run their NumPy path (no native tier, no
      single-function loop codegen).
    explain: set by ``pallas_np.explain`` only: the session that records
      every grid step's block indices and ref accesses (the run goes point by
      point, like ``detect_races``). ``None`` (default): nothing recorded.
  """
  bounds_check: Literal["raise", "clamp"] = "raise"
  uninitialized: Literal["nan", "zero"] = "nan"
  oob_reads: Literal["raise", "fill"] = "raise"
  buffer_bounds: Literal["logical", "padded"] = "logical"
  check_avals: bool = False
  vectorize: bool | None = None
  detect_races: bool = False
  race_policy: Literal["raise", "record"] = "raise"
  parallel_axes: tuple[int, ...] | None = None
  pdb: bool = False
  trace: Callable[..., Any] | None = None
  progress: bool = True
  num_threads: int | None = None
  num_cores: int = 1
  whole_program: bool = True
  inline_jit: bool | None = None
  explain: Any = None
  native_loops: Literal["background", "sync", "off"] = "background"
  loop_watchdog_s: float | None = None

  @property
  def records_accesses(self) -> bool:
    """Ref rules report accesses (compiled in only when something listens)."""
    return self.detect_races or self.explain is not None

  def __post_init__(self):
    if self.bounds_check not in ("raise", "clamp"):
      raise ValueError(f"bounds_check must be 'raise' or 'clamp', got {self.bounds_check!r}")
    if self.oob_reads not in ("raise", "fill"):
      raise ValueError(f"oob_reads must be 'raise' or 'fill', got {self.oob_reads!r}")
    if self.buffer_bounds not in ("logical", "padded"):
      raise ValueError(f"buffer_bounds must be 'logical' or 'padded', got {self.buffer_bounds!r}")
    if self.uninitialized not in ("nan", "zero"):
      raise ValueError(f"uninitialized must be 'nan' or 'zero', got {self.uninitialized!r}")
    if self.race_policy not in ("raise", "record"):
      raise ValueError(f"race_policy must be 'raise' or 'record', got {self.race_policy!r}")
    if self.native_loops not in ("background", "sync", "off"):
      raise ValueError("native_loops must be 'background', 'sync' or 'off', "
                       f"got {self.native_loops!r}")
    if self.loop_watchdog_s is not None and not float(self.loop_watchdog_s) > 0:
      raise ValueError(f"loop_watchdog_s must be None or > 0, got {self.loop_watchdog_s!r}")
    if self.num_threads is not None and int(self.num_threads) < 1:
      raise ValueError(f"num_threads must be None or >= 1, got {self.num_threads!r}")
    if self.parallel_axes is not None:  # hashable: the params are a cache key
      object.__setattr__(self, "parallel_axes", tuple(int(a) for a in self.parallel_axes))

  def __bool__(self):
    # JAX tests `if interpret:`; numpy mode is an interpret mode.
    return True


def _default_params() -> InterpretParams:
  check = env_switch("PALLAS_NP_CHECK_AVALS", False)
  return InterpretParams(check_avals=check)


def default_params(**options) -> InterpretParams:
  """The params of ``interpret="numpy"`` with ``options`` changed (used by
  the whole-program switches: ``python -m pallas_np``, the pytest plugin)."""
  return dataclasses.replace(_default_params(), **options)


def is_numpy_mode(interpret: Any) -> bool:
  return isinstance(interpret, InterpretParams) or (
      isinstance(interpret, str) and interpret.lower() in NUMPY_MODE_STRINGS)


def resolve(interpret: Any) -> InterpretParams:
  """The InterpretParams for an ``interpret=`` value in numpy mode."""
  if isinstance(interpret, InterpretParams):
    return interpret
  return _default_params()
