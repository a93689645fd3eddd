"""Which thread runs which part of a background build (native/build_steps.py):
the source's generation, the lookups and the job's files in the caller,
when the build is due; only the exchange with the compile process on the
tier's thread; the library's load and swap in the caller again, at the
loop's (or kernel body's) next run, or in ``native.wait()``. On the tier's
thread, beside a caller busy calling kernels, each of those Python steps
waited for the GIL, and a build whose compile took 0.06 s was swapped in
0.25 s after it was due (PERF_LOG 163, 164)."""
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_np
from benchmarks.small_kernels import collatz_kernel
from pallas_np import native
from pallas_np.lru import LRU
from pallas_np.native import (bodies, build_steps, codegen, disk_cache, lite_cache, lite_jit,
                              scheduler, tier)
from tests.native_elig_util import OFF, bits, free_lite_builds

pytestmark = pytest.mark.skipif(not lite_jit.available(), reason="llvmlite is not installed")
BACKGROUND = pallas_np.InterpretParams(native_loops="background", uninitialized="zero")
# (a sequential grid: a vectorized one runs a batched plan, not the body's)
BODY_BACKGROUND = pallas_np.InterpretParams(native_loops="background", vectorize=False)


@pytest.fixture
def threads(monkeypatch, tmp_path):
  """A cache of the test's own, lite's builds free (``free_lite_builds``),
  and the thread each build part ran on, by part."""
  assert native.wait(900)  # (no earlier test's build on the tier's thread meanwhile)
  pallas_np.clear_caches()
  monkeypatch.setattr(disk_cache, "_dir", [str(tmp_path)])
  monkeypatch.setattr(build_steps, "loaded", LRU(256))
  monkeypatch.setattr(build_steps, "prekeys", LRU(1024))
  monkeypatch.setattr(lite_cache, "_memo", {})
  free_lite_builds(monkeypatch)
  seen = {}

  def on(owner, name, part):
    real = getattr(owner, name)

    def recorded(*a, **k):
      seen.setdefault(part, []).append(threading.current_thread())
      return real(*a, **k)
    monkeypatch.setattr(owner, name, recorded)
  on(codegen, "loop_source", "generate")
  on(disk_cache, "write_job", "job files")
  on(scheduler.Compiler, "build", "compile process")
  on(tier.NativeLoop, "_swap", "swap")
  return seen


def _until(predicate, call, seconds=120.0):
  """Calls ``call`` until ``predicate()`` or ``seconds`` pass (a build's
  wall time on a busy machine), never ``native.wait``: the kernel's own
  next runs land the build."""
  end = time.monotonic() + seconds
  while not predicate() and time.monotonic() < end:
    call()
    time.sleep(0.005)
  return predicate()


def _calls_until_compiled(make, params, x, counters):
  """Calls ``make(params)`` on ``x`` until ``counters()`` shows a native
  call, and once more: every result has ``native_loops="off"``'s bits."""
  want = bits(make(OFF)(x))
  f = make(params)
  before = counters()["native_calls"]
  got = []
  assert _until(lambda: counters()["native_calls"] > before, lambda: got.append(bits(f(x))))
  got.append(bits(f(x)))
  for g in got:
    np.testing.assert_array_equal(g, want)


def _caller_did_all_but_the_exchange(seen):
  main, tier_thread = threading.main_thread(), scheduler._thread[0]  # noqa: SLF001
  for part in ("generate", "job files", "swap"):
    assert seen.get(part) and set(seen[part]) == {main}, (part, seen.get(part))
  assert seen.get("compile process") and set(seen["compile process"]) == {tier_thread}, seen


def test_a_loops_build_runs_in_the_caller_but_for_its_exchange(threads):
  """A loop's background lite build: generated, its job written, and its
  library swapped in on the caller's thread (its next run lands it, with
  no ``native.wait``); the compile process's reply awaited on the tier's
  thread. The compiled loop gives the NumPy path's bits."""
  x = jnp.asarray(np.random.default_rng(5).integers(1, 60, (2, 128)), jnp.int32)

  def make(interp):
    return pl.pallas_call(collatz_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=interp)
  before = native.stats()
  _calls_until_compiled(make, BACKGROUND, x, native.stats)
  assert native.stats()["lite"] == before["lite"] + 1
  _caller_did_all_but_the_exchange(threads)


def _norm_kernel(x_ref, o_ref):
  x = x_ref[...]
  o_ref[...] = (x - jnp.mean(x, axis=-1, keepdims=True)) * 0.5 + jnp.max(x)


def test_a_kernel_bodys_landed_build_is_swapped_in_by_its_next_grid_step(threads):
  """A kernel body's background build: once its reply is in (``"landed"``,
  set on the tier's thread), its plan routes the next grid step through
  ``entry``, which swaps the library in on the caller's thread; the body's
  steps then run compiled, with the NumPy plan's bits."""
  x = jnp.asarray(np.random.default_rng(6).standard_normal((16 * 8, 128)), jnp.float32)

  def make(interp):
    return pl.pallas_call(_norm_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(16,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), interpret=interp)
  _calls_until_compiled(make, BODY_BACKGROUND, x, bodies.stats)
  _caller_did_all_but_the_exchange(threads)


def test_a_landed_body_routes_its_grid_to_entry():
  """The tier's thread marks a body ``"landed"`` (its phase setter calls
  ``route``): the grid's ``fn`` becomes ``entry``, whose ``__call__``
  lands it; while the build is under way it is the plan's own ``fn``."""
  import types
  plan = types.SimpleNamespace(fn=lambda ctx, *refs: None)
  jaxpr = jax.make_jaxpr(lambda a: pl.pallas_call(
      _norm_kernel, out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype), interpret=BACKGROUND)(a))(
      jnp.zeros((8, 128), jnp.float32))
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
  body_plan = bodies.wrap(plan, eqn.params["jaxpr"], BACKGROUND)
  body = body_plan.body
  body.prechecked = True
  body.phase = "building"
  body_plan.route()
  assert body_plan.fn is plan.fn
  body.phase = "landed"
  assert body_plan.fn is body_plan.entry


def test_wait_lands_what_arrived(threads):
  """A build whose reply is in shows as ``landed`` in ``native.stats()``
  until it is swapped in; ``native.wait()`` lands it, in the calling
  thread, with no further run of the kernel: a test (or a user) that
  waits sees the loop compiled."""
  x = jnp.asarray(np.random.default_rng(7).integers(1, 60, (2, 128)), jnp.int32)
  f = pl.pallas_call(collatz_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                     interpret=BACKGROUND)
  before = native.stats()
  for _ in range(3):
    f(x)
  assert _until(lambda: native.stats()["landed"], lambda: None, seconds=300)
  assert native.stats()["compiled"] == before["compiled"]  # (in, not swapped in yet)
  assert native.wait(900)
  after = native.stats()
  assert after["compiled"] == before["compiled"] + 1, after
  assert set(threads["swap"]) == {threading.main_thread()}
  assert native.stats()["landed"] == 0
