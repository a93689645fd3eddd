"""Mosaic GPU (``plgpu``), never imported by pallas_np itself.

JAX's Mosaic GPU modules cost about as much to import as ``jax`` does, and a
value of their types (a ``plgpu.Mesh``, a barrier dtype, a layout transform)
can exist only once the user's code imported them. So every predicate here
answers from ``sys.modules`` (False while plgpu is not imported), and the
modules themselves (``core_module``/``primitives_module``, the package's
``mgpu_core``/``mgpu_primitives``) are imported only when asked for: by the
Mosaic GPU rules, which register with the first Mosaic GPU kernel
(``families.on_first_use(CORE_MODULE, ...)``, see ``pallas_np.mosaic_gpu``).
"""
from __future__ import annotations

import importlib
import sys

CORE_MODULE = "jax._src.pallas.mosaic_gpu.core"
PRIMITIVES_MODULE = "jax._src.pallas.mosaic_gpu.primitives"


def _module(name):
  # plgpu needs absl-py to import; where it cannot be imported, Mosaic GPU
  # kernels never reach pallas_np (nothing refers to these as None).
  try:
    return importlib.import_module(name)
  except ImportError:  # pragma: no cover - absl-py missing
    return None


def core_module():
  """``jax._src.pallas.mosaic_gpu.core`` (imported now), or None without plgpu."""
  return _module(CORE_MODULE)


def primitives_module():
  return _module(PRIMITIVES_MODULE)


def lowering_error(message: str) -> Exception:
  """Mosaic GPU's ``LoweringError`` (what its lowering raises for a kernel
  the hardware cannot run), or ``ValueError`` where the module is missing."""
  lowering = _module("jax._src.pallas.mosaic_gpu.lowering")
  cls = getattr(lowering, "LoweringError", None) if lowering is not None else None
  return (cls or ValueError)(message)


def is_mgpu_imported() -> bool:
  """Whether user code imported plgpu: before, no Mosaic GPU kernel exists."""
  return CORE_MODULE in sys.modules


def _imported_core():
  """The core module if user code imported it, else None (never imports)."""
  return sys.modules.get(CORE_MODULE)


def mgpu_primitive(name: str):
  """plgpu primitive ``name`` (e.g. ``"barrier_wait_p"``); None where this
  JAX version (or a missing plgpu) does not have it."""
  prims = primitives_module()
  return getattr(prims, name, None) if prims is not None else None


def is_mgpu_mesh(mesh) -> bool:
  core = _imported_core()
  return core is not None and isinstance(mesh, core.Mesh)


def is_mgpu_compiler_params(cp) -> bool:
  core = _imported_core()
  return core is not None and isinstance(cp, core.CompilerParams)


def is_barrier_dtype(dtype) -> bool:
  core = _imported_core()
  return core is not None and isinstance(
      dtype, (core.BarrierType, getattr(core, "ClusterBarrierType", ())))


def barrier_arrivals(dtype) -> int:
  return int(dtype.num_arrivals)


def is_peer_transform(t) -> bool:
  """``plgpu.remote_ref``'s transform: the same ref on another device."""
  core = _imported_core()
  cls = getattr(core, "PeerMemRef", None) if core is not None else None
  return cls is not None and isinstance(t, cls)


def is_layout_only_transform(t) -> bool:
  """Mosaic GPU's SMEM layout transforms (tiling, swizzle): they change how
  a buffer lies in memory, never which element an index names. pallas_np
  keeps such buffers in their logical shape."""
  core = _imported_core()
  if core is None:
    return False
  return isinstance(t, (core.UntilingTransform, core.UnswizzleRef,
                        core.TilingTransform, core.SwizzleTransform))


def is_wgmma_acc_aval(aval) -> bool:
  core = _imported_core()
  return core is not None and isinstance(aval, core.WGMMAAbstractAccumulatorRef)
