"""pytest plugin: ``pytest --pallas-numpy`` runs every pallas_call of a test
suite in the NumPy interpreter, without editing the tests."""
from __future__ import annotations


def pytest_addoption(parser):
  group = parser.getgroup("pallas_np")
  group.addoption("--pallas-numpy", action="store_true", default=False,
                  help="route every pallas_call to the pallas_np NumPy interpreter")


def pytest_configure(config):
  if config.getoption("--pallas-numpy", default=False):
    import pallas_np
    pallas_np.set_numpy_interpret()
