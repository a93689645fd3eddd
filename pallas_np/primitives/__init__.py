"""NumPy rules for lax and Pallas primitives, one family per module; each
module registers its rules in ``pallas_np.registry`` when imported."""
from pallas_np.primitives import (  # noqa: F401
    elementwise, casts, shape, reductions, dot, pallas, misc, debug, triton, tpu, gather_scatter,
    sorting, random, windowed, special, xla_math, sparsecore, sparsecore_vector, tpu_packing, mxu,
    debug_checks, tpu_pipeline)
