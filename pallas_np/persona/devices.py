"""The devices a persona can stand in for: what JAX's device queries answer
under ``pallas_np.emulate_device(NAME)``.

Values are the hardware's (the device kind strings are those the devices
report to JAX; SM counts and compute capabilities NVIDIA's data sheets;
TensorCores per JAX device: 2 on megacore chips, else 1).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """One emulated device.

  Attributes:
    name: the persona's name (``h100``, ``tpu-v5e``, ...).
    platform: what the test utilities call the device under test
      (``"gpu"``, ``"tpu"``, or ``"cpu"`` for a persona with no device gates).
    device_kind: ``jax.devices()[0].device_kind`` under the persona.
    compute_capability: CUDA compute capability (``"9.0"``), GPUs only.
    core_count: streaming multiprocessors (``jax.devices()[0].core_count``),
      GPUs only.
    num_cores: TensorCores per JAX device (``jax.devices()[0].num_cores``,
      ``pltpu.get_tpu_info().num_cores``), TPUs only; also the interpreter's
      ``InterpretParams.num_cores`` (megacore kernels split over 2).
    tpu_version: the generation ``jtu.get_tpu_version()`` reports.
    smem_per_block: shared memory a block may opt in to, in bytes
      (``jax.local_devices()[0].shared_memory_per_block_optin``), GPUs only.
  """
  name: str
  platform: str
  device_kind: str
  compute_capability: str | None = None
  core_count: int | None = None
  num_cores: int | None = None
  tpu_version: int | None = None
  smem_per_block: int | None = None

  @property
  def tags(self) -> frozenset[str]:
    """The tags ``jtu.test_device_matches`` matches against."""
    if self.platform == "gpu":
      return frozenset(("gpu", "cuda"))
    return frozenset((self.platform,))


DEVICES: dict[str, DeviceSpec] = {d.name: d for d in (
    # 227 KiB of shared memory per block (opt-in) on sm_90 and sm_100.
    DeviceSpec("h100", "gpu", "NVIDIA H100 80GB HBM3", compute_capability="9.0",
               core_count=132, smem_per_block=232448),
    DeviceSpec("h200", "gpu", "NVIDIA H200", compute_capability="9.0", core_count=132,
               smem_per_block=232448),
    DeviceSpec("b200", "gpu", "NVIDIA B200", compute_capability="10.0", core_count=148,
               smem_per_block=232448),
    DeviceSpec("tpu-v4", "tpu", "TPU v4", num_cores=2, tpu_version=4),
    DeviceSpec("tpu-v5e", "tpu", "TPU v5 lite", num_cores=1, tpu_version=5),
    DeviceSpec("tpu-v5p", "tpu", "TPU v5", num_cores=2, tpu_version=5),
    DeviceSpec("tpu-v6e", "tpu", "TPU v6 lite", num_cores=1, tpu_version=6),
    DeviceSpec("tpu-v7x", "tpu", "TPU7x", num_cores=1, tpu_version=7),
    # No device gates changed: the CPU answers as itself; kernels still run in
    # numpy mode with the watchdog and JAX's interpret-mode state answered.
    DeviceSpec("cpu", "cpu", "cpu"),
)}


def lookup(name: str) -> DeviceSpec:
  spec = DEVICES.get(str(name).lower())
  if spec is None:
    raise ValueError(f"pallas_np: unknown device persona {name!r}; known: "
                     f"{', '.join(sorted(DEVICES))}")
  return spec
