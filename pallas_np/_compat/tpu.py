"""Pallas TPU (Mosaic): its primitives, meshes (TensorCore, SparseCore),
chip info and PRNG keys."""
from __future__ import annotations

from jax._src.pallas.mosaic import core as mosaic_core
from jax._src.pallas.mosaic import primitives as mosaic_primitives  # noqa: F401
from jax._src.pallas.mosaic import random as mosaic_random
from jax._src.pallas.mosaic import tpu_info as mosaic_tpu_info

from pallas_np._compat.core import internal_module

TensorCoreMesh = mosaic_core.TensorCoreMesh
_sc_core = internal_module("pallas.mosaic.sc_core")
VectorSubcoreMesh = getattr(_sc_core, "VectorSubcoreMesh", None)
ScalarSubcoreMesh = getattr(_sc_core, "ScalarSubcoreMesh", None)
# plsc.Indices(values, ignored_value=) (JAX 0.12): an indexed DMA's indices.
SCIndices = getattr(_sc_core, "Indices", None)
# plsc.slice_subcore_vmem_from_shared's ref transform (JAX 0.12).
SharedMemRefSliceTransform = getattr(_sc_core, "SharedMemRefSliceTransform", None)
try:
  sc_primitives = internal_module("pallas.mosaic.sc_primitives")
except ImportError:  # pragma: no cover - a JAX without SparseCore support
  sc_primitives = None


def register_tpu_device_kind(kind: str, make_info):
  """Let TPU-only tracing helpers (emit_pipeline's tiling inference) run on a
  non-TPU default device by naming the TpuInfo to assume for it."""
  mosaic_tpu_info.registry[kind] = make_info
  # JAX >= 0.12 caches get_tpu_info(): a chip assumed earlier would stick.
  clear = getattr(mosaic_tpu_info.get_tpu_info, "cache_clear", None)
  if clear is not None:
    clear()


def is_pallas_tpu_key(dtype) -> bool:
  """Keys of pltpu's PRNG impls (the stateful samplers' placeholder key and
  ``pltpu.to_pallas_key``/``sample_block`` keys): their random_bits seeds and
  draws the kernel's hardware PRNG, which needs the run context."""
  impl = getattr(dtype, "_impl", None)
  return impl is mosaic_random.tpu_internal_stateful_impl or impl is mosaic_random.tpu_key_impl
