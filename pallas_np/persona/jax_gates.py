"""JAX BOUNDARY CODE for the device persona: every JAX internal the persona
reaches (the test utilities' device gates, the ``Device`` class's
properties, Mosaic TPU's cached chip info, the lowering/export/profiler
APIs that cannot be emulated) is named here and nowhere else.

Kept apart from ``pallas_np/_compat`` (which another change turns into a
package) so the two merge cleanly; it follows the same rule: features are
detected (``getattr``), never keyed on version strings. Every change goes
through a ``PatchSet`` and is undone when the persona is left.
"""
from __future__ import annotations

import functools
import importlib
import unittest

import jax

from pallas_np import races
from pallas_np.errors import UnsupportedError
from pallas_np.persona.devices import DeviceSpec
from pallas_np.persona.patches import PatchSet

# Why each API cannot be emulated (docs/persona.md lists them): the reason a
# test calling it is skipped with.
CANNOT_EMULATE = {
    "lowering": "the lowered/compiled module of a kernel is a host callback into "
                "pallas_np under the device persona, not the device's custom call "
                "(Mosaic / Mosaic GPU / Triton): its text cannot be emulated",
    "export": "jax.export of a kernel needs the device's serialized custom call; under the "
              "device persona the kernel is a host callback, which cannot be exported",
    "profiler": "Mosaic GPU's in-kernel profiler (profile_space) records device clock "
                "stamps: it cannot be emulated",
    "cross_lowering": "lowering for a platform this machine's XLA does not have "
                      "(lowering_platforms=('gpu',) / ('tpu',)) needs that backend: under the "
                      "device persona XLA has the CPU only",
    "tma_threads": "num_tma_threads_per_device > 1 is an option of JAX's GPU interpreter "
                   "(a pool of TMA threads per device, whose copies it leaves unordered); "
                   "pallas_np orders the TMA copies a warpgroup issues as one agent (a pool of "
                   "one)",
    "skip_fp": "skip_floating_point_ops is a debugging option of JAX's own interpreters "
               "(float results come out as inf by design); pallas_np, which runs the kernels "
               "under the persona, computes them",
}

# Custom-call targets of host callbacks (the io_callback a numpy-mode kernel
# lowers to), in the lowered text.
_CALLBACK_MARKERS = ("python_cpu_callback", "python_gpu_callback", "xla_ffi_python")


def _skip(what: str):
  raise unittest.SkipTest(f"pallas_np device persona: {CANNOT_EMULATE[what]}")


def _optional_module(name: str):
  try:
    return importlib.import_module(name)
  except ImportError:
    return None


def test_util():
  """``jax._src.test_util`` (needs absl; None where it cannot be imported)."""
  return _optional_module("jax._src.test_util")


def device_class() -> type:
  """The class whose ``device_kind`` property every JAX device uses."""
  cls = type(jax.devices()[0])
  for c in cls.__mro__:
    if "device_kind" in vars(c):
      return c
  return cls


def _cc(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in str(text).split("."))


def patch_test_util(ps: PatchSet, spec: DeviceSpec) -> None:
  """JAX's test utilities' device gates answer as ``spec``."""
  jtu = test_util()
  if jtu is None:
    return
  gpu = spec.platform == "gpu"
  cc = _cc(spec.compute_capability) if gpu else None

  def device_under_test():
    return spec.platform

  def get_device_tags():
    return set(spec.tags)

  def cc_at_least(capability):
    return gpu and cc >= _cc(capability)

  def cc_equal(capability):
    return gpu and cc == _cc(capability)

  def cuda_version_at_least(major, minor):
    return gpu and (major, minor) <= (12, 9)  # a current CUDA 12 toolkit

  def skip_unless_tcgen05(self):
    if not gpu:
      self.skipTest("Only works on GPU")
    elif cc[0] not in (10, 11):
      self.skipTest("Only works on GPU with tcgen05 instructions")

  for name, fn in (("device_under_test", device_under_test),
                   ("_get_device_tags", get_device_tags),
                   ("is_device_cuda", lambda: gpu),
                   ("is_device_rocm", lambda: False),
                   ("is_cuda_compute_capability_at_least", cc_at_least),
                   ("is_cuda_compute_capability_equal", cc_equal),
                   ("is_cuda_version_at_least", cuda_version_at_least)):
    if hasattr(jtu, name):
      ps.set(jtu, name, fn)
  arch = getattr(jtu, "CudaArchSpecificTest", None)
  if arch is not None and hasattr(arch, "skip_unless_tcgen05"):
    ps.set(arch, "skip_unless_tcgen05", skip_unless_tcgen05)
  # get_tpu_version, is_device_tpu(_at_least), device_kind_match read
  # device_under_test() and jax.devices()[0].device_kind: both answer as spec.


def patch_devices(ps: PatchSet, spec: DeviceSpec) -> None:
  """``jax.devices()[i].device_kind`` (and ``core_count``,
  ``compute_capability``, ``num_cores``) answer as ``spec``; the platform
  stays ``cpu``, so XLA still compiles and runs everything around the
  kernels on the CPU."""
  cls = device_class()
  values = {"device_kind": spec.device_kind, "core_count": spec.core_count,
            "compute_capability": spec.compute_capability, "num_cores": spec.num_cores,
            "shared_memory_per_block_optin": spec.smem_per_block}
  for name, value in values.items():
    if value is not None:
      ps.set(cls, name, property(lambda self, v=value: v))


def clear_device_caches() -> None:
  """Caches keyed on the device: Mosaic TPU's chip info."""
  tpu_info = _optional_module("jax._src.pallas.mosaic.tpu_info")
  for name in ("get_tpu_info", "is_tpu_device"):
    fn = getattr(tpu_info, name, None) if tpu_info is not None else None
    clear = getattr(fn, "cache_clear", None)
    if clear is not None:
      clear()


def _has_callback(text) -> bool:
  text = str(text)
  return any(m in text for m in _CALLBACK_MARKERS)


def patch_cannot_emulate(ps: PatchSet) -> None:
  """The APIs whose answer would be the device's (lowering text, export,
  the Mosaic GPU profiler) raise ``unittest.SkipTest`` with the reason, so a
  test calling them is skipped rather than failed."""
  stages = _optional_module("jax._src.stages")
  if stages is not None:
    def text_or_skip(original):
      @functools.wraps(original)
      def wrapper(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if _has_callback(out):
          _skip("lowering")
        return out
      return wrapper
    for cls_name, names in (("Lowered", ("as_text", "compiler_ir")),
                            ("Compiled", ("as_text",))):
      cls = getattr(stages, cls_name, None)
      for name in names:
        if cls is not None:
          ps.wrap(cls, name, text_or_skip)

  traced = getattr(stages, "Traced", None) if stages is not None else None
  if traced is not None and hasattr(traced, "lower"):
    def lower_or_skip(original):
      @functools.wraps(original)
      def lower(self, *args, **kwargs):
        try:
          return original(self, *args, **kwargs)
        except RuntimeError as e:  # only a missing backend of a cross-platform lowering
          if kwargs.get("lowering_platforms") and "Unknown backend" in str(e):
            _skip("cross_lowering")
          raise
      return lower
    ps.wrap(traced, "lower", lower_or_skip)

  export_mod = _optional_module("jax.export")
  if export_mod is not None:
    def export_or_skip(original):
      @functools.wraps(original)
      def export(*args, **kwargs):
        exporter = original(*args, **kwargs)

        @functools.wraps(exporter)
        def run(*a, **k):
          try:
            return exporter(*a, **k)
          except Exception as e:  # noqa: BLE001 - only the callback refusal is a skip
            if "callback" in str(e).lower():
              _skip("export")
            raise
        return run
      return export
    ps.wrap(export_mod, "export", export_or_skip)

  gpu_core = _optional_module("jax._src.pallas.mosaic_gpu.core")
  params_cls = getattr(gpu_core, "CompilerParams", None) if gpu_core is not None else None
  if params_cls is not None and "profile_space" in getattr(
      params_cls, "__dataclass_fields__", {}):
    def init_or_skip(original):
      @functools.wraps(original)
      def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "profile_space", 0):
          _skip("profiler")
      return __init__
    ps.wrap(params_cls, "__init__", init_or_skip)


def _races_unchecked():
  return UnsupportedError(
      "pallas_np device persona: the race detector's result was asked for, and pallas_np "
      "ran these kernels without race detection: run with pytest --pallas-numpy-races (or "
      "emulate_device(NAME, detect_races=True)); a race then raises pallas_np.RaceError "
      "from the kernel call")


class RaceState:
  """What JAX's interpreters' ``get_races()`` (GPU) or ``races`` (TPU)
  hold, answered by pallas_np. With ``race_policy="record"`` (the ``cpu``
  persona): whether the last kernel run found a race (``races.RECORD``, as
  JAX's state holds the last kernel's). With race detection that raises: no
  race (a race raises ``RaceError`` from the kernel call itself, so a test
  that reads it afterwards saw none). Without race detection, reading it
  raises (pallas_np checked nothing it could report)."""

  def __init__(self, params):
    self._checked = params.detect_races
    self._record = params.race_policy == "record"

  @property
  def races_found(self) -> bool:
    if not self._checked:
      raise _races_unchecked()
    return races.RECORD.found if self._record else False

  @property
  def races(self) -> list:
    """The recorded races (``RaceError``s, the first ones of the last run)."""
    return list(races.RECORD.races) if self._record else []

  def __repr__(self):
    return f"pallas_np.RaceState(checked={self._checked}, record={self._record})"


def patch_interpret_state(ps: PatchSet, params) -> None:
  """JAX's GPU/TPU interpreters' race state (``get_races``) answered from
  pallas_np, which runs the kernels under the persona (``RaceState``). The
  reset functions stay JAX's (they clear JAX's own state, harmless here)."""
  state = RaceState(params)

  def get_races():
    if not params.detect_races:
      raise _races_unchecked()
    return state

  for module_name in ("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call",
                      "jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks",
                      "jax._src.pallas.mosaic.interpret.interpret_pallas_call"):
    module = _optional_module(module_name)
    if module is not None and hasattr(module, "get_races"):
      ps.set(module, "get_races", get_races)
    if module is not None and hasattr(module, "races"):  # TPU: a module attribute
      ps.set(module, "races", state)


def patch_interpreter_options(ps: PatchSet) -> None:
  """JAX's interpret params whose meaning is specific to JAX's own
  interpreters make the test that builds them skip, with the reason:
  ``skip_floating_point_ops`` (pallas_np runs the kernels and computes the
  floats) and an explicit ``num_tma_threads_per_device`` above 1 (JAX's
  model of a pool of TMA threads; pallas_np orders a warpgroup's copies as
  one agent, as a pool of one)."""
  for module_name, cls_name in (("jax._src.pallas.mosaic_gpu.interpret.params",
                                 "InterpretGPUParams"),
                                ("jax._src.pallas.mosaic.interpret.interpret_pallas_call",
                                 "InterpretParams")):
    module = _optional_module(module_name)
    cls = getattr(module, cls_name, None) if module is not None else None
    if cls is None or "skip_floating_point_ops" not in getattr(cls, "__dataclass_fields__", {}):
      continue

    def init_or_skip(original):
      @functools.wraps(original)
      def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "skip_floating_point_ops", False):
          _skip("skip_fp")
        if int(kwargs.get("num_tma_threads_per_device", 1)) > 1:
          _skip("tma_threads")
      return __init__
    ps.wrap(cls, "__init__", init_or_skip)
