import os

# Every eqn's NumPy result is checked against its abstract value (shape and
# dtype) in the test-suite: a rule that drifts from JAX's dtype rules fails.
os.environ.setdefault("PALLAS_NP_CHECK_AVALS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A fast path (vectorized/threaded grid) that fails where the sequential loop
# succeeds is a bug, not a fallback: raise it (pallas_np.errors.FallbackError).
os.environ.setdefault("PALLAS_NP_STRICT_FALLBACKS", "1")

import numpy as np
import pytest

import pallas_np  # noqa: F401  (installs interpret="numpy")


def assert_same(numpy_result, reference, *, rtol=1e-5, atol=1e-5):
  """Bitwise for integers/bools, tight tolerance for floats."""
  a = np.asarray(numpy_result)
  b = np.asarray(reference)
  assert a.shape == b.shape, (a.shape, b.shape)
  assert a.dtype == b.dtype, (a.dtype, b.dtype)
  if a.dtype.kind in "biu":
    np.testing.assert_array_equal(a, b)
  else:
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64),
                               rtol=rtol, atol=atol, equal_nan=True)


@pytest.fixture
def same():
  return assert_same


@pytest.fixture
def bitcast_sizes(monkeypatch):
  """The sizes of the arrays ``state.lens.tpu_bitcast`` converts during a
  test: a bitcast view must convert only what an access touches."""
  from pallas_np.state import lens
  sizes = []
  real = lens.tpu_bitcast

  def recording(x, dtype):
    sizes.append(x.size)
    return real(x, dtype)
  monkeypatch.setattr(lens, "tpu_bitcast", recording)
  return sizes


@pytest.fixture
def dma_callbacks(monkeypatch):
  """The number of DMA call sites the compiled loops called back
  (``native.dma_calls._call``): 0 where a loop's DMAs ran compiled."""
  from pallas_np.native import dma_calls
  count = [0]
  real = dma_calls._call

  def counted(run, k):
    count[0] += 1
    return real(run, k)
  monkeypatch.setattr(dma_calls, "_call", counted)
  return count


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
  """A native cache directory of the test's own, empty (as a first
  process's), with the tier's in-memory pre-keys and libraries forgotten."""
  from pallas_np.lru import LRU
  from pallas_np.native import build_steps, disk_cache
  monkeypatch.setenv("PALLAS_NP_NATIVE_CACHE", str(tmp_path))
  monkeypatch.setattr(disk_cache, "_dir", [])
  monkeypatch.setattr(build_steps, "prekeys", LRU(1024))
  monkeypatch.setattr(build_steps, "loaded", LRU(256))
  return tmp_path
