"""pytest plugin: ``pytest --pallas-numpy`` runs every pallas_call of a test
suite in the NumPy interpreter, without editing the tests (kernels tested with
``interpret=True`` get bounds checks, NaN fills and, with
``--pallas-numpy-races``, race detection)."""
from __future__ import annotations


def pytest_addoption(parser):
  group = parser.getgroup("pallas_np")
  group.addoption("--pallas-numpy", action="store_true", default=False,
                  help="route every pallas_call to the pallas_np NumPy interpreter")
  group.addoption("--pallas-numpy-races", action="store_true", default=False,
                  help="--pallas-numpy with race detection on parallel grid axes")
  group.addoption("--pallas-device", default=None, metavar="NAME",
                  help="--pallas-numpy as a stand-in for device NAME (h100, b200, tpu-v5e, "
                       "...: pallas_np.emulate_device): JAX's device gates and hardware "
                       "queries answer as NAME, kernel loops have a watchdog")


def pytest_configure(config):
  races = config.getoption("--pallas-numpy-races", default=False)
  device = config.getoption("--pallas-device", default=None)
  if device:
    import pallas_np  # (imported only when asked for, as below)
    pallas_np.set_emulated_device(device, detect_races=races)
    config._pallas_np_device = device
    return
  if races or config.getoption("--pallas-numpy", default=False):
    # Imported only when asked for: suites not using the option skip pallas_np's set-up.
    import pallas_np
    from pallas_np.params import default_params
    pallas_np.set_numpy_interpret(default_params(detect_races=races))
    config._pallas_np_forced = True


def pytest_unconfigure(config):
  if getattr(config, "_pallas_np_device", None):
    import pallas_np  # already imported by pytest_configure
    pallas_np.unset_emulated_device()
  if getattr(config, "_pallas_np_forced", False):
    import pallas_np  # already imported by pytest_configure
    pallas_np.unset_numpy_interpret()
