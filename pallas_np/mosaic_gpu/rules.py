"""Every Mosaic GPU rule module (each registers its primitives' rules as it
is imported) and the executor they need; imported by
``pallas_np.mosaic_gpu`` with the first Mosaic GPU kernel."""
from pallas_np.mosaic_gpu import (atomics, barriers, cluster, collectives, copies,  # noqa: F401
                                  inline, kernel, layout, smem_stores, tcgen05, wgmma, warps)
