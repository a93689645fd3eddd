"""The native tier: hot loops compiled to machine code with numba
(docs/native.md). numba is imported only when a
loop is compiled, never by ``import pallas_np``."""
from pallas_np.native import (  # noqa: F401 (emitters)
    control, dma, dots, elementwise, masked, narrow, reductions, refs, shapes, transcendental)
from pallas_np.native import refusals  # noqa: F401 (the primitives never compiled)
from pallas_np.native import bodies  # noqa: F401 (kernel bodies: the grid's plan wrapper)
from pallas_np.native.scheduler import stats, wait
from pallas_np.native.tier import HOT_RUNS, MODES, NativeLoop, enabled

__all__ = ["HOT_RUNS", "MODES", "NativeLoop", "enabled", "stats", "wait"]
