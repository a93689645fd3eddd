"""On/off switches read from ``PALLAS_NP_*`` environment variables, with one
reading for all of them (docs/options.md lists the switches).

Why one parser: each switch used to compare strings its own way, so
``PALLAS_NP_FORCE=off`` turned forcing off while ``PALLAS_NP_STRICT_FALLBACKS=true``
did nothing and ``PALLAS_NP_TUNE_MALLOC=off`` tuned malloc. Now every switch
takes the same words, and a value that is none of them raises instead of
being guessed at. A leaf: imports nothing of pallas_np.
"""
from __future__ import annotations

import os

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")

# Every switch, with what "on" does and its default (docs/options.md).
SWITCHES = {
    "PALLAS_NP_FORCE": "every pallas_call runs in numpy mode (read at import pallas_np); default off",
    "PALLAS_NP_CHECK_AVALS": "default params check every eqn's shape and dtype; default off",
    "PALLAS_NP_PROGRESS": "progress bars for long grids; default on",
    "PALLAS_NP_NATIVE_LOOPS": "hot loops may be compiled with numba; default on",
    "PALLAS_NP_STRICT_FALLBACKS": "a fast path failing where the grid loop succeeds raises; default off",
    "PALLAS_NP_TUNE_MALLOC": "raise glibc's malloc thresholds at the first kernel plan; default off",
    "PALLAS_NP_LIBM_CACHE": "compiled float loops cached on disk (primitives/libm_cache.py); default on",
    "PALLAS_NP_GC_PAUSE": "automatic garbage collection paused during a kernel's first call; default on",
    "PALLAS_NP_BLAS_WARM": "one small GEMM warms OpenBLAS's buffer at the first kernel run; default on",
}


def env_switch(name: str, default: bool) -> bool:
  """The value of switch ``name``: ``default`` when unset or empty; True for
  1/true/yes/on, False for 0/false/no/off (any case, surrounding spaces
  ignored); anything else raises ``ValueError`` naming the variable."""
  raw = os.environ.get(name)
  if raw is None:
    return default
  value = raw.strip().lower()
  if not value:
    return default
  if value in ON:
    return True
  if value in OFF:
    return False
  raise ValueError(f"environment variable {name}={raw!r}: expected one of "
                   f"{', '.join(ON)} (on) or {', '.join(OFF)} (off), or unset/empty "
                   f"for the default ({'on' if default else 'off'})")
