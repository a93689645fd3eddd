"""pallas_np: a fast NumPy interpreter for JAX Pallas kernels.

``import pallas_np`` installs ``interpret="numpy"`` for ``pl.pallas_call``.
With ``PALLAS_NP_FORCE=1`` in the environment, importing it also routes every
pallas_call of the program to the NumPy interpreter (see ``__main__``).
"""
__version__ = "0.1.0"  # the one place it is written (pyproject.toml reads it)

# `python -m pallas_np --help` / `--version`: answered here, before JAX loads.
from pallas_np.cli_args import answer_without_jax as _answer_without_jax
_answer_without_jax(__version__)

from pallas_np.params import InterpretParams
from pallas_np.errors import PallasNumpyError, KernelError, UnsupportedError, RaceError
from pallas_np import primitives as _primitives  # noqa: F401  (registers rules)
from pallas_np import state as _state  # noqa: F401
from pallas_np import control_flow as _control_flow  # noqa: F401
from pallas_np.debugging import kernel_errors
from pallas_np.primitives.tpu import assume_tpu_chip
from pallas_np.whole_program import jit, install as _install_eager_jit, install_hooks as _install_hooks
from pallas_np.api import (pallas_call, force_numpy_interpret, set_numpy_interpret,
                           unset_numpy_interpret, clear_caches, grid_report,
                           install as _install)
from pallas_np.explainer import explain
from pallas_np.persona import emulate_device, set_emulated_device, unset_emulated_device
from pallas_np.env_switches import env_switch as _env_switch

_install()
_install_eager_jit()

if _env_switch("PALLAS_NP_FORCE", False):
  set_numpy_interpret()
  _install_hooks()

__all__ = ["pallas_call", "jit", "InterpretParams", "force_numpy_interpret",
           "set_numpy_interpret", "unset_numpy_interpret", "clear_caches",
           "PallasNumpyError", "KernelError", "UnsupportedError", "RaceError",
           "kernel_errors", "assume_tpu_chip", "grid_report", "explain",
           "emulate_device", "set_emulated_device", "unset_emulated_device"]
