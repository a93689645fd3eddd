"""NumPy rules for lax and Pallas primitives, one family per module; each
module registers its rules in ``pallas_np.registry`` when imported."""
from pallas_np.primitives import (  # noqa: F401
<<<<<<< HEAD
    elementwise, shape, reductions, dot, pallas, misc, debug, triton, tpu)
=======
    elementwise, shape, reductions, dot, pallas, misc, debug, triton, gather_scatter,
    sorting, random, windowed)
>>>>>>> 9fe80d6 (Coverage: gather/scatter, sort/top_k, random/threefry, windowed reductions, special functions, mulhi, platform_index, callbacks, generic reduce; XLA semantics fixes (signed-zero max/min, exp2, digamma, popcount, unsigned arithmetic shift, low-precision scans); dynamic integer-array ref indices; differential tests, hypothesis fuzzing, python -m pallas_np.coverage)
