"""Pallas GPU (Triton) primitives; importable on CPU-only installs too."""
triton_primitives = None
try:
  from jax._src.pallas.triton import primitives as triton_primitives  # noqa: F811
except Exception:  # pragma: no cover - a jaxlib without the Triton dialect
  triton_primitives = None
