"""What the native tier costs a caller before and after its switch
(pallas_np.native.tier): a loop on the NumPy path only adds its run time
(no system call per run), the load average's reading counts the caller
itself, and a deferred build is looked at again. Scheduling and the disk
cache's basics: tests/test_native_tier.py."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from pallas_np import native
from pallas_np.native import tier

OFF = pallas_np.InterpretParams(native_loops="off")
BACKGROUND = pallas_np.InterpretParams(native_loops="background")


def _kernel(salt):
  """A small loop kernel new to the disk cache (``salt``: a body constant)."""
  def kernel(x_ref, o_ref):
    def body(i, x):
      return jnp.where(x % 2 == 0, x // 2, 3 * x + salt)
    o_ref[...] = lax.fori_loop(0, 5, body, x_ref[...])
  return kernel


def _call(salt, interpret, x):
  return pl.pallas_call(_kernel(salt), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        interpret=interpret)


def _salt():
  return int(np.random.default_rng().integers(1 << 20, 1 << 30))


class _Builds:
  """``tier._submit`` with its build steps recorded, not run (lookups run)."""

  def __init__(self, monkeypatch):
    self.loops = []
    real = tier._submit

    def submit(loop, step):
      if step == "build":
        self.loops.append(loop)
        loop.phase = "done"  # (as a failed build leaves it: the NumPy path)
      else:
        real(loop, step)
    monkeypatch.setattr(tier, "_submit", submit)


def _load_reader(monkeypatch, load):
  """``os.getloadavg`` answering ``load[0]``, its calls counted."""
  calls = []

  def getloadavg():
    calls.append(1)
    return (load[0],) * 3
  monkeypatch.setattr(tier.os, "getloadavg", getloadavg)
  return calls


def test_priced_loop_reads_no_load_per_run(monkeypatch):
  """Before its cost reaches the build's price at the least weight, a run
  of a priced loop only adds its time: the load average (a system call,
  and os.cpu_count ~20 us) is not read per run."""
  monkeypatch.setattr(tier, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(tier, "price", lambda lines: 1000.0)
  builds = _Builds(monkeypatch)
  calls = _load_reader(monkeypatch, [0.0])
  x = jnp.asarray(np.arange(256).reshape(2, 128) % 97 + 1, jnp.int32)
  salt = _salt()
  want = np.asarray(_call(salt, OFF, x)(x))
  f = _call(salt, BACKGROUND, x)
  f(x)
  assert native.wait(timeout=900)  # (the lookup: a miss, then priced)
  for _ in range(40):
    np.testing.assert_array_equal(np.asarray(f(x)), want)
  assert not builds.loops
  assert len(calls) <= 1, len(calls)


def test_the_callers_own_load_leaves_a_core_idle(monkeypatch):
  """On two cores, a load of 1.2 is the caller (~1) and a little more: a
  core is idle and the build's price counts at COMPILE_WEIGHT; at 1.8 no
  core is idle (BUSY_FACTOR times more)."""
  monkeypatch.setattr(tier, "_CPUS", 2)
  load = [1.2]
  _load_reader(monkeypatch, load)
  assert tier.weight() == tier.COMPILE_WEIGHT
  load[0] = 1.8
  assert tier.weight() == tier.COMPILE_WEIGHT * tier.BUSY_FACTOR


def test_a_build_deferred_by_load_is_queued_once_a_core_is_idle(monkeypatch):
  """A loop whose cost pays for its build only at the idle weight waits
  while the machine is busy and is queued once the load falls (the load
  is looked at again as the loop's cost grows)."""
  monkeypatch.setattr(tier, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(tier, "price", lambda lines: 1e-6)
  monkeypatch.setattr(tier, "COMPILE_WEIGHT", 1.0)
  monkeypatch.setattr(tier, "BUSY_FACTOR", 1e9)
  monkeypatch.setattr(tier, "_CPUS", 2)
  builds = _Builds(monkeypatch)
  load = [5.0]
  _load_reader(monkeypatch, load)
  x = jnp.asarray(np.arange(256).reshape(2, 128) % 89 + 1, jnp.int32)
  f = _call(_salt(), BACKGROUND, x)
  f(x)
  assert native.wait(timeout=900)
  for _ in range(2 * tier.HOT_RUNS):
    f(x)
  assert not builds.loops
  load[0] = 0.5
  for _ in range(3):
    f(x)
  assert len(builds.loops) == 1
