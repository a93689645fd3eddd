"""What the native tier costs a caller before and after its switch
(pallas_np.native.tier): a loop on the NumPy path only adds its run time
(no system call per run), the load average's reading counts the caller
itself, and a deferred build is looked at again. Scheduling and the disk
cache's basics: tests/test_native_tier.py."""
import gc
import io
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from pallas_np import native
from pallas_np.native import codegen, cost_rule, lite_cache, prekey, scheduler, tier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFF = pallas_np.InterpretParams(native_loops="off")
BACKGROUND = pallas_np.InterpretParams(native_loops="background")


@pytest.fixture(autouse=True)
def _no_set_up_price(monkeypatch):
  """The cost rule of builds, not of the process's one-off set-up
  (``cost_rule.SETUP_PRICE``: test_native_tier_speed.py's own test) nor of
  lite's process start (``cost_rule.PRESTART_PRICE``: its own tests here),
  nor the wait between looks at lite's process while it starts
  (``cost_rule.STARTING_RECHECK``: test_native_lite_process.py's test)."""
  monkeypatch.setattr(cost_rule, "SETUP_PRICE", 0.0)
  monkeypatch.setattr(cost_rule, "PRESTART_PRICE", 0.0)
  monkeypatch.setattr(cost_rule, "STARTING_RECHECK", 0.0)
  monkeypatch.setattr(scheduler, "NEIGHBOUR_SHARE", 0.0)


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
  """``scheduler.submit_build`` with its builds recorded, not run (and no compile
  process started ahead of them: ``scheduler.prestart``)."""

  def __init__(self, monkeypatch):
    self.loops = []
    self.prestarts = []
    monkeypatch.setattr(scheduler, "prestart",
                        lambda which=None: self.prestarts.append(which or scheduler.compiler))
    def submit_build(loop):
      self.loops.append(loop)
      loop.phase = "done"  # (as a failed build leaves it: the NumPy path)
    monkeypatch.setattr(scheduler, "submit_build", submit_build)


def _load_reader(monkeypatch, load):
  """``os.getloadavg`` answering ``load[0]``, its calls counted."""
  calls = []

  def getloadavg():
    calls.append(1)
    return (load[0],) * 3
  monkeypatch.setattr(scheduler.os, "getloadavg", getloadavg)
  return calls


def _lite_machine(monkeypatch, load, modulus, cpus=2):
  """lite on (``auto``), ``cpus`` cores at the load average ``load``, the
  builds and prestarts recorded (``_Builds``); a (2, 128) int32 operand whose
  values (mod ``modulus``) give each test a loop of its own."""
  monkeypatch.setenv(lite_cache.ENV, "auto")
  monkeypatch.setattr(scheduler, "_CPUS", cpus)
  builds = _Builds(monkeypatch)
  _load_reader(monkeypatch, [load])
  return builds, jnp.asarray(np.arange(256).reshape(2, 128) % modulus + 1, jnp.int32)


def test_priced_loop_costs_a_run_nothing_until_its_build_is_due(monkeypatch):
  """Before its cost reaches the build's price at the least weight, a run
  of a priced loop only adds its time: no source generated (1-20 ms), no
  load average read (a system call; os.cpu_count ~20 us) per run."""
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "price", lambda lines: 1000.0)
  builds = _Builds(monkeypatch)
  calls = _load_reader(monkeypatch, [0.0])
  generated = []
  real = codegen.loop_source
  monkeypatch.setattr(codegen, "loop_source", lambda *a: generated.append(1) or real(*a))
  x = jnp.asarray(np.arange(256).reshape(2, 128) % 97 + 1, jnp.int32)
  salt = _salt()
  want = np.asarray(_call(salt, OFF, x)(x))
  f = _call(salt, BACKGROUND, x)
  for _ in range(40):
    np.testing.assert_array_equal(np.asarray(f(x)), want)
  assert native.wait(timeout=900)
  assert not builds.loops and not generated
  assert len(calls) <= 1, len(calls)


@pytest.mark.parametrize("load,started", [(0.5, True), (5.0, False)])
def test_compile_process_started_when_a_loop_is_priced(monkeypatch, load, started):
  """A priced loop has the background compile process started (its warm-up,
  numba's import and first compile, ~2-4 s, then runs while the loop's
  NumPy path runs on toward its build's price), where a core is idle; on a
  busy machine it is started with the build."""
  monkeypatch.setenv(lite_cache.ENV, "numba")  # (the numba build's pricing)
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "price", lambda lines: 1000.0)
  monkeypatch.setattr(scheduler, "_CPUS", 2)
  monkeypatch.setattr(scheduler.compiler, "proc", None)
  builds = _Builds(monkeypatch)
  _load_reader(monkeypatch, [load])
  x = jnp.asarray(np.arange(256).reshape(2, 128) % 97 + 1, jnp.int32)
  f = _call(_salt(), BACKGROUND, x)
  for _ in range(5):
    f(x)
  assert not builds.loops
  assert builds.prestarts == ([scheduler.compiler] if started else []), builds.prestarts


def test_the_callers_own_load_leaves_a_core_idle(monkeypatch):
  """On two cores, a load of 1.2 is the caller (~1) and a little more: a
  core is idle and the build's price counts at COMPILE_WEIGHT; at 1.8 no
  core is idle (BUSY_FACTOR times more)."""
  monkeypatch.setattr(scheduler, "_CPUS", 2)
  load = [1.2]
  _load_reader(monkeypatch, load)
  assert scheduler.weight() == scheduler.COMPILE_WEIGHT
  load[0] = 1.8
  assert scheduler.weight() == scheduler.COMPILE_WEIGHT * scheduler.BUSY_FACTOR


def test_lite_compile_process_started_when_the_loop_is_priced(monkeypatch):
  """lite's compile process (its ~0.05-0.15 s start: the latency of the
  loop's first build) is started when the loop is priced
  (``LOOKUP_PRICE``: 0 here, at its first run, inside the kernel's first
  call; by default ``START_LEAD`` before its build is due), where a core
  is idle (its start is then not the caller's cost but the build's
  latency); once, however many runs follow."""
  load = 0.5
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(cost_rule, "PRESTART_PRICE", 0.0)
  monkeypatch.setattr(scheduler.lite_compiler, "proc", None)
  builds, x = _lite_machine(monkeypatch, load, 67)
  f = _call(_salt(), BACKGROUND, x)
  f(x)
  assert builds.prestarts == [scheduler.lite_compiler]
  for _ in range(3):
    f(x)
  assert builds.prestarts == [scheduler.lite_compiler] and not builds.loops


@pytest.mark.parametrize("lookup,prestart", [(1e9, 0.0), (1e9, 1e9), (0.0, 1e9)])
def test_no_compile_process_before_the_loop_is_priced_and_cost_its_prestart_price(
    monkeypatch, lookup, prestart):
  """A loop not yet priced (``LOOKUP_PRICE``), or whose caller's seconds
  are below ``PRESTART_PRICE`` over the share, starts no compile process
  (its start, beside the caller on a 2-vCPU machine, slowed the first
  20-100 calls of every loop kernel, and every call of a cheap one whose
  build was not due within them: PERF_LOG "[never]"; at ~0.17 s of calls,
  before the pricing, the first 20 calls of a 10 ms kernel: PERF_LOG 163);
  nor does a kernel with no loop."""
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", lookup)
  monkeypatch.setattr(cost_rule, "PRESTART_PRICE", prestart)
  monkeypatch.setattr(scheduler.lite_compiler, "proc", None)
  builds, x = _lite_machine(monkeypatch, 0.5, 67)
  f = _call(_salt(), BACKGROUND, x)
  for _ in range(cost_rule.HOT_RUNS + 3):
    f(x)
  copy = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1),
                        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=BACKGROUND)
  for _ in range(cost_rule.HOT_RUNS + 3):
    copy(x)
  assert not builds.prestarts and not builds.loops
  assert scheduler.lite_compiler.proc is None


def test_lite_compile_process_waits_for_the_build_on_a_busy_machine(monkeypatch):
  """Where no core is idle at the loop's first run nor when it is priced,
  lite's compile process is not started ahead of the build (its start
  would take the caller's share of a core); the build's price then
  includes it (``lite_cache.START_PRICE``)."""
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(scheduler.lite_compiler, "proc", None)
  builds, x = _lite_machine(monkeypatch, 5.0, 67)
  f = _call(_salt(), BACKGROUND, x)
  f(x)
  f(x)
  # (the type, not isinstance: a dead weak proxy among the objects raises on its __class__)
  loop = next(v for v in gc.get_objects() if issubclass(type(v), tier.NativeLoop) and v.phase == "priced"
              and v.price == lite_cache.PRICE + lite_cache.START_PRICE)
  assert loop is not None and not builds.prestarts


def test_a_lite_build_waits_for_its_compile_process_to_start(monkeypatch):
  """While lite's compile process, started at the loop's first run, is
  still starting (``Compiler.starting``: its imports, ~0.15 s), a loop
  whose build is due is not built (its source, the caller's part, is
  generated only once the process can take it: a kernel called only that
  long never pays it); it is queued at the first run after."""
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", 0.0)
  monkeypatch.setattr(scheduler.lite_compiler, "starting", True)
  builds, x = _lite_machine(monkeypatch, 0.5, 53)
  f = _call(_salt(), BACKGROUND, x)
  for _ in range(cost_rule.HOT_RUNS + 3):
    f(x)
  assert not builds.loops
  scheduler.lite_compiler.starting = False
  f(x)
  assert len(builds.loops) == 1


def test_no_compile_process_for_a_loop_found_by_its_prekey(monkeypatch):
  """A loop whose library is found at its first run (its pre-key: a
  second process, a re-run test suite) starts no compile process, nor
  does a loop of the numba compiler (started when priced, as before), nor
  ``"off"``."""
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 1e9)
  monkeypatch.setattr(scheduler.lite_compiler, "proc", None)
  x = jnp.asarray(np.arange(256).reshape(2, 128) % 61 + 1, jnp.int32)
  salt = _salt()
  _call(salt, pallas_np.InterpretParams(native_loops="sync"), x)(x)  # (built: its pre-key kept)
  builds = _Builds(monkeypatch)
  pallas_np.clear_caches()  # (a new plan: its loop's first run again)
  before = native.stats()
  f = _call(salt, BACKGROUND, x)
  f(x)
  assert native.stats()["compiled"] == before["compiled"] + 1  # (loaded at the first run)
  _call(_salt(), OFF, x)(x)
  monkeypatch.setenv(lite_cache.ENV, "numba")
  _call(_salt(), BACKGROUND, x)(x)
  assert not builds.prestarts, builds.prestarts


def test_a_build_deferred_by_load_is_queued_once_a_core_is_idle(monkeypatch):
  """A loop whose cost pays for its build only at the idle weight waits
  while the machine is busy and is queued once the load falls (the load
  is looked at again as the loop's cost grows)."""
  monkeypatch.setenv(lite_cache.ENV, "numba")  # (the numba build's pricing)
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "price", lambda lines: 1e-6)
  monkeypatch.setattr(scheduler, "COMPILE_WEIGHT", 1.0)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "BUSY_FACTOR", 1e9)
  monkeypatch.setattr(scheduler, "_CPUS", 2)
  builds = _Builds(monkeypatch)
  load = [5.0]
  _load_reader(monkeypatch, load)
  x = jnp.asarray(np.arange(256).reshape(2, 128) % 89 + 1, jnp.int32)
  f = _call(_salt(), BACKGROUND, x)
  f(x)
  assert native.wait(timeout=900)
  for _ in range(2 * cost_rule.HOT_RUNS):
    f(x)
  assert not builds.loops
  load[0] = 0.5
  for _ in range(3):
    f(x)
  assert len(builds.loops) == 1


_PREKEY_PROCESS = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp, numpy as np
    import pallas_np
    from pallas_np import native
    from pallas_np.native import codegen, cost_rule, prekey, scheduler, tier
    from tests.test_native_tier_speed import _call
    salt, second = int(sys.argv[1]), sys.argv[2] == "second"
    if second:  # (the library must be found with no source generated)
        def generate(*a, **k):
            raise AssertionError("source generated")
        codegen.loop_source = generate
    x = jnp.asarray(np.arange(256).reshape(2, 128) % 83 + 1, jnp.int32)
    mode = "background" if second else "sync"
    f = _call(salt, pallas_np.InterpretParams(native_loops=mode), x)
    want = np.asarray(_call(salt, pallas_np.InterpretParams(native_loops="off"), x)(x))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(x)), want)
    s = native.stats()
    print(s["disk_hits"], s["compiled"], s["native_calls"], s["failed"])
""")


def test_second_process_runs_native_from_its_first_run(tmp_path):
  """A second process finds the loop's library by its pre-key at the
  loop's first run: every run is native, and no source is generated
  (the generator raises there)."""
  salt = _salt()
  env = dict(os.environ, PALLAS_NP_NATIVE_CACHE=str(tmp_path), PALLAS_NP_CHECK_AVALS="0",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  runs = []
  for which in ("first", "second"):
    out = subprocess.run([sys.executable, "-c", _PREKEY_PROCESS, str(salt), which], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    runs.append(out.stdout.split())
  assert runs[0] == ["0", "1", "3", "0"]  # built ("sync": at the first run)
  assert runs[1] == ["1", "1", "3", "0"]  # loaded by pre-key: native from the first run


def _refused_kernel(salt):
  def kernel(x_ref, o_ref):
    def body(i, x):
      return jnp.sin(x) + salt  # (sin: refused, native/refusals.py)
    o_ref[...] = lax.fori_loop(0, 3, body, x_ref[...])
  return kernel


def test_a_refused_loop_is_known_by_its_prekey(monkeypatch):
  """A loop refused once is refused again by its pre-key in the next plan
  (a re-trace, another process) with no source generated. (numba's
  builds: a lite build waits for lite's compile process, which an earlier
  test may or may not have started; the refusal is the generator's
  either way.)"""
  monkeypatch.setenv(lite_cache.ENV, "numba")
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "COMPILE_WEIGHT", 0.0)  # (its source generated at HOT_RUNS)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", 0.0)
  salt = float(_salt())
  x = jnp.asarray(np.linspace(0, 1, 256).reshape(2, 128), jnp.float32)

  def call():
    return pl.pallas_call(_refused_kernel(salt), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=BACKGROUND)(x)
  want = np.asarray(call())
  for _ in range(cost_rule.HOT_RUNS):
    call()
  assert native.wait(timeout=900)
  before = native.stats()
  assert before["refused"] >= 1
  pallas_np.clear_caches()  # (a new plan, a new loop: as in another process)

  def generate(*a, **k):
    raise AssertionError("source generated")
  monkeypatch.setattr(codegen, "loop_source", generate)
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(call()), want)
  assert native.wait(timeout=900)
  after = native.stats()
  assert after["refused"] == before["refused"] + 1
  assert after["failed"] == before["failed"]


def _loop_eqn(c, n=4, dtype=jnp.int32):
  def f(x):
    return lax.fori_loop(0, n, lambda i, x: x * 3 + jnp.asarray(c, dtype), x)
  jaxpr = jax.make_jaxpr(f)(jnp.zeros((2, 8), dtype))
  (eqn,) = [e for e in jaxpr.eqns if e.primitive.name in ("scan", "while")]
  return eqn


def test_prekeys_tell_loops_apart():
  """Equal for a loop traced twice; different for another constant, trip
  count, dtype, bounds-check mode, operand layout or masked-off fill (a
  pre-key names one generated source)."""
  key = lambda e, clamp=False, layouts=((True, True),): prekey.loop_prekey(e, clamp, layouts, "nan")
  k = key(_loop_eqn(5))
  assert k is not None and k == key(_loop_eqn(5))
  others = [key(_loop_eqn(6)), key(_loop_eqn(5, n=5)), key(_loop_eqn(5, dtype=jnp.int16)),
            key(_loop_eqn(5), clamp=True), key(_loop_eqn(5), layouts=((False, True),)),
            prekey.loop_prekey(_loop_eqn(5), False, ((True, True),), "zero")]
  assert None not in others and len({k, *others}) == 1 + len(others)


class _FakeCompileProcess:
  """A compile process answering one build: ``seconds`` with ``setup``."""

  def __init__(self, seconds, setup):
    self.stdin = io.StringIO()
    self.stdout = io.StringIO(json.dumps({"ok": True, "seconds": seconds,
                                          "setup_seconds": setup}) + "\n")

  def poll(self):
    return None


def test_the_next_price_leaves_out_one_off_setup(monkeypatch):
  """A measured build's numba import and pycc C helpers (once per process
  and cache directory) are not charged to the next loop's price."""
  monkeypatch.setattr(scheduler, "builds", [])
  compiler = scheduler.Compiler(nice=True)
  compiler.proc = _FakeCompileProcess(12.0, 10.5)
  assert compiler.build({"src": "x"})["ok"]
  assert scheduler.builds == [1.5]


def _count_calls(monkeypatch) -> list:
  """``NativeLoop.__call__`` with its calls counted (the list's length)."""
  calls = []
  real = tier.NativeLoop.__call__

  def counted(self, ctx, *args):
    calls.append(1)
    return real(self, ctx, *args)
  monkeypatch.setattr(tier.NativeLoop, "__call__", counted)
  return calls


def test_usual_run_on_the_numpy_path_is_the_entrys_own(monkeypatch):
  """After its first run, a loop on the NumPy path whose next step is not
  due runs through its entry function alone (timed, counted), never the
  NativeLoop object's ``__call__`` (a Python-level call more per run)."""
  monkeypatch.setattr(scheduler, "price", lambda lines: 1000.0)
  calls = _count_calls(monkeypatch)
  x = jnp.asarray(np.arange(256).reshape(2, 128) % 79 + 1, jnp.int32)
  salt = _salt()
  want = np.asarray(_call(salt, OFF, x)(x))
  f = _call(salt, BACKGROUND, x)
  for _ in range(20):
    np.testing.assert_array_equal(np.asarray(f(x)), want)
  assert len(calls) == 1  # (the first run: its pre-key lookup)


def test_a_loop_waiting_for_its_build_runs_through_its_entry_alone(monkeypatch):
  """While its background build is under way (``phase == "building"``:
  seconds, or minutes on a machine with no idle core), a loop's runs take
  the NumPy path from its entry function, untimed, never ``__call__``; and
  so do a refused loop's or a failed build's, for good (``__call__``'s
  checks cost each run ~0.5 us more)."""
  monkeypatch.setenv(lite_cache.ENV, "numba")  # (the numba build's pricing)
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "price", lambda lines: 1e-6)
  monkeypatch.setattr(scheduler, "prestart", lambda which=None: None)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", 0.0)
  building = []
  monkeypatch.setattr(scheduler, "submit_build", building.append)
  calls = _count_calls(monkeypatch)
  x = jnp.asarray(np.arange(256).reshape(2, 128) % 79 + 1, jnp.int32)
  salt = _salt()
  want = np.asarray(_call(salt, OFF, x)(x))
  f = _call(salt, BACKGROUND, x)
  for _ in range(cost_rule.HOT_RUNS + 1):
    np.testing.assert_array_equal(np.asarray(f(x)), want)
  assert len(building) == 1 and building[0].phase == "building" and building[0].waiting
  before = len(calls)
  for _ in range(20):
    np.testing.assert_array_equal(np.asarray(f(x)), want)
  assert len(calls) == before
  building[0].phase = "done"  # (its build failed: the NumPy path for good, from its entry too)
  assert building[0].waiting
  np.testing.assert_array_equal(np.asarray(f(x)), want)
  assert len(calls) == before


def test_a_loop_loaded_by_prekey_raises_the_numpy_error(tmp_path, monkeypatch):
  """A loop loaded by its pre-key has no bounds-check sites (no source was
  generated): an out-of-bounds index generates them then and raises the
  NumPy path's IndexError, message included."""
  from tests.test_native_loops import _floats, _oob_call
  monkeypatch.setenv("PALLAS_NP_NATIVE_CACHE", str(tmp_path))
  monkeypatch.setattr(tier.disk_cache, "_dir", [])  # (this test's own cache directory)
  x = _floats((8, 128))
  with pytest.raises(IndexError) as want:
    _oob_call(OFF, x)(x)
  # (params of its own: the plans it leaves in the caches are no other test's)
  sync = pallas_np.InterpretParams(native_loops="sync", uninitialized="zero")
  with pytest.raises(IndexError):  # (built: the library and its pre-key recorded)
    _oob_call(sync, x)(x)
  pallas_np.clear_caches()  # (a new plan, nothing in memory: as in a second process)
  before = native.stats()
  with pytest.raises(IndexError) as got:
    _oob_call(sync, x)(x)
  after = native.stats()
  assert after["disk_hits"] == before["disk_hits"] + 1  # (loaded by its pre-key, not built)
  assert str(got.value) == str(want.value)


def test_a_lite_build_is_due_within_the_first_runs(monkeypatch):
  """With lite (the default compiler), a loop is priced at lite's build
  (``lite_cache.PRICE``, ~0.3 s of lite's compile process) instead of
  numba's seconds, and lite's compile process (not numba's) is started
  when the loop is priced, ahead of its build: the build is queued as
  soon as the loop ran ``HOT_RUNS`` times and cost ``COMPILE_WEIGHT`` x
  that price and ``CALLER_PRICE`` (the caller's own part)."""
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", 1e-6)
  monkeypatch.setattr(scheduler.lite_compiler, "proc", None)
  monkeypatch.setattr(scheduler, "price", lambda lines: 1000.0)  # (numba's: never due here)
  monkeypatch.setattr(lite_cache, "PRICE", 1e-6)
  builds, x = _lite_machine(monkeypatch, 0.5, 73)
  f = _call(_salt(), BACKGROUND, x)
  for _ in range(cost_rule.HOT_RUNS + 1):
    f(x)
  assert len(builds.loops) == 1 and builds.loops[0].price == 1e-6
  assert builds.prestarts == [scheduler.lite_compiler]


@pytest.mark.parametrize("cpus,load,queued", [(2, 0.5, True), (2, 5.0, False), (1, 0.5, False)])
def test_a_lite_build_is_priced_at_the_callers_own_part(monkeypatch, cpus, load, queued):
  """A lite build's seconds run in lite's compile process, on an idle
  core: its wall time is the build's latency, not the caller's cost, so
  however long it takes (``lite_cache.PRICE``), the build is due once the
  loop ran ``HOT_RUNS`` times and cost the caller's own part
  (``CALLER_PRICE``: the source's generation, the load). On one core, or
  where no core is idle, its seconds take the caller's share: priced in
  full."""
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", 1e-6)
  monkeypatch.setattr(lite_cache, "PRICE", 1000.0)
  monkeypatch.setattr(scheduler, "price", lambda lines: 1000.0)
  builds, x = _lite_machine(monkeypatch, load, 71, cpus=cpus)
  f = _call(_salt(), BACKGROUND, x)
  for _ in range(cost_rule.HOT_RUNS + 1):
    f(x)
  assert len(builds.loops) == (1 if queued else 0), builds.loops


def test_a_failing_one_off_set_up_leaves_the_call_to_the_numpy_path(monkeypatch):
  """The one-off set-up a priced loop does in the caller (the pre-key's
  source digest, the BLAS addresses: ``NativeLoop._one_off_set_up``)
  never raises into the kernel's call: where it fails, the loop's calls go
  on with the NumPy path's results."""
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(cost_rule, "SETUP_PRICE", 0.0)
  monkeypatch.setattr(cost_rule, "set_up_done", [])
  set_up = []

  def broken():
    set_up.append(1)
    raise OSError("no sources to read")
  monkeypatch.setattr(prekey, "code_version", broken)
  _Builds(monkeypatch)  # (builds recorded, not run)
  x = jnp.asarray(np.arange(256).reshape(2, 128) % 97 + 1, jnp.int32)
  salt = _salt()
  want = np.asarray(_call(salt, OFF, x)(x))
  f = _call(salt, BACKGROUND, x)
  for _ in range(5):
    np.testing.assert_array_equal(np.asarray(f(x)), want)
  assert set_up, "the set-up was not reached: the test tests nothing"


def test_the_first_build_waits_for_the_set_up_price(monkeypatch):
  """A process's first build (its one-off set-up in the caller: the
  pre-key's digest, the BLAS addresses, ~0.01 s) is due only once the loop's NumPy
  path cost ``SETUP_PRICE`` beyond the build's own price: a kernel called
  a few dozen times never pays the set-up. Once it is done, the next
  loops' builds are due at their price alone."""
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "COMPILE_WEIGHT", 0.0)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", 0.0)
  monkeypatch.setattr(cost_rule, "set_up_done", [])
  monkeypatch.setattr(cost_rule, "SETUP_PRICE", 1e9)
  builds = _Builds(monkeypatch)
  x = jnp.asarray(np.arange(256).reshape(2, 128) % 97 + 1, jnp.int32)
  f = _call(_salt(), BACKGROUND, x)
  for _ in range(cost_rule.HOT_RUNS + 3):
    f(x)
  assert not builds.loops and not cost_rule.set_up_done, "built before its set-up's price was spent"
  monkeypatch.setattr(cost_rule, "SETUP_PRICE", 0.0)
  g = _call(_salt(), BACKGROUND, x)
  for _ in range(cost_rule.HOT_RUNS + 3):
    g(x)
  assert len(builds.loops) == 1 and cost_rule.set_up_done == [1]
  monkeypatch.setattr(cost_rule, "SETUP_PRICE", 1e9)  # (done: not priced again)
  h = _call(_salt(), BACKGROUND, x)
  for _ in range(cost_rule.HOT_RUNS + 3):
    h(x)
  assert len(builds.loops) == 2


def test_numbas_price_grows_faster_than_the_lines(monkeypatch):
  """numba's build time grows faster than linearly with a loop's lines
  (822 lines took 157 s, 600 lines 14.8 s): each line's price grows with
  the lines before it, before and after builds were measured."""
  for measured in ([], [2.0, 3.0, 4.0]):
    monkeypatch.setattr(scheduler, "builds", list(measured))
    base = scheduler.price(0)
    short, long_ = scheduler.price(100) - base, scheduler.price(800) - base
    assert long_ > 8 * short * (1 + 700 / scheduler.LONG_LINES) / 2
