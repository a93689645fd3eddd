"""Mosaic GPU (``jax.experimental.pallas.mosaic_gpu``, "plgpu") kernels in
numpy mode: one module per primitive family, the block/warpgroup executor
(``threads``, ``kernel``) and the mesh-kernel entry (``entry``).

See docs/gpu.md, "Mosaic GPU". The rule modules (``rules`` lists them)
register with the first Mosaic GPU kernel, not at ``import pallas_np``: they
read JAX's plgpu modules, which cost about as much to import as ``jax``, and
such a kernel exists only once user code imported them
(``_compat.families``). Without plgpu (absl-py missing) nothing here
registers and Mosaic GPU kernels never reach pallas_np."""
from pallas_np import _compat as jc


def _register_rules():
  from pallas_np.mosaic_gpu import rules  # noqa: F401  (registers as it imports)


jc.on_first_use(jc.MGPU_MODULE, _register_rules)
