"""The device persona: pallas_np stands in for a GPU or TPU.

``with pallas_np.emulate_device("h100"):`` (or ``set_emulated_device`` for
the whole process, ``pytest --pallas-device=NAME``, ``PALLAS_NP_DEVICE=NAME
python -m pallas_np ...``) makes a test suite written for an accelerator run
on a CPU:

* JAX's test utilities' device gates answer as that device
  (``jtu.test_device_matches``, ``is_cuda_compute_capability_at_least``,
  ``skip_unless_sm90a``/``tcgen05``, ``is_device_tpu*``, ``get_tpu_version``,
  ``device_under_test``), and so do the trace-time hardware queries
  (``jax.devices()[0].device_kind``/``core_count``/``compute_capability``/
  ``num_cores``, ``pltpu.get_tpu_info()``);
* every Pallas kernel runs in numpy mode (``force_numpy_interpret``), with
  the loop watchdog on; XLA still runs the ops around the kernels on the CPU;
* APIs whose answer would be the device's own (lowering text, export, the
  Mosaic GPU profiler) raise ``unittest.SkipTest`` with the reason.

Leaving the persona restores every patched attribute and the previous force
setting. See docs/persona.md.
"""
from __future__ import annotations

import os

import jax

from pallas_np import _compat as jc
from pallas_np import races
from pallas_np.params import InterpretParams, default_params
from pallas_np.persona import jax_gates
from pallas_np.persona.devices import DEVICES, DeviceSpec, lookup
from pallas_np.persona.patches import PatchSet

# Wall-clock seconds a kernel's while_loop may run under the persona before
# the loop watchdog stops it (InterpretParams.loop_watchdog_s): generous,
# since an interpreted loop is far slower than the device's.
WATCHDOG_S = 120.0

ENV_VAR = "PALLAS_NP_DEVICE"

_active: list["emulate_device"] = []


def current_device() -> DeviceSpec | None:
  """The innermost active persona's device, or None."""
  return _active[-1].spec if _active else None


def persona_params(spec: DeviceSpec, **options) -> InterpretParams:
  """The interpreter options under ``spec``: the watchdog on, TensorCores
  per device as the chip has; ``options`` override.

  The ``cpu`` persona stands in for JAX's own interpreters (their test
  files): races are detected and recorded, not raised, as JAX's
  interpreters do, and ``get_races()`` answers from the record. (A
  kernel's own ``InterpretGPUParams(detect_races=...)`` cannot be read:
  JAX replaces a kernel's ``interpret=`` with the forced mode when the
  kernel is built.)"""
  base = {"loop_watchdog_s": WATCHDOG_S, "num_cores": spec.num_cores or 1}
  if spec.platform == "cpu":
    base.update(detect_races=True, race_policy="record")
  base.update(options)
  return default_params(**base)


class emulate_device:
  """Context manager: pallas_np stands in for the device ``name`` (one of
  ``pallas_np.persona.DEVICES``: h100, h200, b200, tpu-v4, tpu-v5e, tpu-v5p,
  tpu-v6e, tpu-v7x, cpu). ``options`` are ``InterpretParams`` fields for
  every kernel (e.g. ``detect_races=True``). ``process_wide=True`` sets the
  numpy-mode switch for every thread (as ``set_emulated_device`` does)
  rather than for this thread's scope.

  Entering returns the ``DeviceSpec``. Personas nest; leave them in reverse
  order."""

  def __init__(self, name: str, *, process_wide: bool = False, **options):
    self.spec = lookup(name)
    self.params = persona_params(self.spec, **options)
    self.process_wide = process_wide
    self._patches: PatchSet | None = None
    self._prev_force = None

  def __enter__(self) -> DeviceSpec:
    if self._patches is not None:
      raise RuntimeError("pallas_np: this emulate_device is already active")
    ps = PatchSet()
    try:
      if self.spec.platform != "cpu":
        jax_gates.patch_test_util(ps, self.spec)
        jax_gates.patch_devices(ps, self.spec)
        jax_gates.patch_cannot_emulate(ps)
      jax_gates.patch_interpret_state(ps, self.params)
      jax_gates.patch_interpreter_options(ps)
    except BaseException:
      ps.undo()
      raise
    self._patches = ps
    if self.params.race_policy == "record":
      races.RECORD.begin_run()  # get_races() answers for the kernels run from here
    config = jc.interpret_mode_config
    if self.process_wide:
      self._prev_force = config.get_global()
      config.set_global(self.params)
    else:
      self._prev_force = config.swap_local(self.params)
    self._changed_devices()
    _active.append(self)
    return self.spec

  def __exit__(self, *exc) -> None:
    if self._patches is None:
      return
    if _active and _active[-1] is self:
      _active.pop()
    elif self in _active:
      _active.remove(self)
    self._patches.undo()
    self._patches = None
    config = jc.interpret_mode_config
    if self.process_wide:
      config.set_global(self._prev_force)
    else:
      config.set_local(self._prev_force)
    self._changed_devices()

  def _changed_devices(self) -> None:
    if self.spec.platform != "cpu":
      # Traces and cached chip info hold the device's answers of before.
      jax_gates.clear_device_caches()
      jax.clear_caches()


_process_persona: list[emulate_device] = []


def set_emulated_device(name: str | None, **options) -> DeviceSpec | None:
  """Process-wide persona (what ``pytest --pallas-device`` and
  ``PALLAS_NP_DEVICE`` use); ``None`` leaves the current one."""
  unset_emulated_device()
  if name is None:
    return None
  persona = emulate_device(name, process_wide=True, **options)
  spec = persona.__enter__()
  _process_persona.append(persona)
  return spec


def unset_emulated_device() -> None:
  while _process_persona:
    _process_persona.pop().__exit__(None, None, None)


def from_environment(**options) -> DeviceSpec | None:
  """``PALLAS_NP_DEVICE=NAME``: set that persona process-wide."""
  name = os.environ.get(ENV_VAR, "").strip()
  return set_emulated_device(name, **options) if name else None


__all__ = ["DEVICES", "DeviceSpec", "WATCHDOG_S", "current_device", "emulate_device",
           "from_environment", "persona_params", "set_emulated_device",
           "unset_emulated_device"]
