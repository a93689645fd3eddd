"""lite's builds in the compile process (native/lite_worker.py, run by
aot_worker): the process imports lite without JAX or pallas_np's package;
a loop it built gives the NumPy path's bits and numba's build's, in
background and "sync" builds; a compile process that fails or exits is a
refused lite build (numba's then, or the NumPy path), never an exception in
the caller; and a process that exits while a build is pending exits.
(tests/test_native_lite.py's differential tests run through the same
process: its "sync" builds are the compile process's.)"""
import functools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pallas_np
from benchmarks.small_kernels import collatz_kernel, cumsum_fori_kernel
from pallas_np import native
from pallas_np.lru import LRU
from pallas_np.native import (aot_worker, build_steps, cost_rule, disk_cache, lite_cache,
                              lite_jit, scheduler, tier)
from tests.native_elig_util import free_lite_builds
from tests.test_native_lite import _floats, _kernel_call

pytestmark = pytest.mark.skipif(not lite_jit.available(), reason="llvmlite is not installed")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFF = pallas_np.InterpretParams(native_loops="off")
SYNC = pallas_np.InterpretParams(native_loops="sync", uninitialized="zero")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
  """A cache of the test's own, nothing loaded or planned in memory."""
  pallas_np.clear_caches()
  monkeypatch.setattr(disk_cache, "_dir", [str(tmp_path)])
  monkeypatch.setattr(build_steps, "loaded", LRU(256))
  monkeypatch.setattr(build_steps, "prekeys", LRU(1024))
  monkeypatch.setattr(lite_cache, "_memo", {})
  return tmp_path


def _bits(a):
  a = np.asarray(a)
  return a.view(f"u{a.itemsize}") if a.dtype.kind == "f" else a


def _x_collatz():
  import jax.numpy as jnp
  return jnp.asarray(np.random.default_rng(3).integers(1, 60, (2, 128)), jnp.int32)


def test_the_compile_process_imports_lite_without_jax():
  """``aot_worker._lite`` (what a lite job imports) brings lite's modules
  in with neither JAX nor pallas_np's package (``__init__``) nor numba."""
  code = textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {os.path.dirname(aot_worker.__file__)!r})
      import aot_worker
      w = aot_worker._lite()
      print(w.__name__, 'jax' in sys.modules, 'numba' in sys.modules,
            'pallas_np.native.codegen' in sys.modules, hasattr(sys.modules['pallas_np'], 'native'))
  """)
  out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split() == ["pallas_np.native.lite_worker", "False", "False", "False",
                                "False"]


@pytest.mark.parametrize("kernel,make_x", [(collatz_kernel, _x_collatz),
                                           (cumsum_fori_kernel, lambda: _floats((16, 128)))])
def test_a_background_lite_build_gives_the_bits_of_off_and_numba(fresh, monkeypatch, kernel,
                                                                  make_x):
  """A background build by lite's compile process (its shared library
  loaded with a dlopen) gives the NumPy path's bits, and numba's build of
  the same loop gives the same."""
  free_lite_builds(monkeypatch)
  x = make_x()
  make = functools.partial(_kernel_call, kernel, x)
  want = _bits(make(OFF)(x))
  f = make(pallas_np.InterpretParams(native_loops="background", uninitialized="zero"))
  before = native.stats()
  for _ in range(2 * cost_rule.HOT_RUNS):
    np.testing.assert_array_equal(_bits(f(x)), want)
    assert native.wait(900)
  got = _bits(f(x))
  after = native.stats()
  assert after["lite"] == before["lite"] + 1 and after["native_calls"] > before["native_calls"]
  assert any(p.endswith(".so") and ".lite" in p for p in os.listdir(fresh))
  np.testing.assert_array_equal(got, want)
  monkeypatch.setenv(lite_cache.ENV, "numba")
  pallas_np.clear_caches()
  build_steps.loaded.clear()
  build_steps.prekeys.clear()
  before = native.stats()
  got_numba = _bits(make(SYNC)(x))
  after = native.stats()
  assert after["lite"] == before["lite"] and after["native_calls"] > before["native_calls"]
  np.testing.assert_array_equal(got_numba, want)


def _collatz_sync_and_off():
  """The Collatz kernel's bits with a "sync" build and with ``off``, and
  the tier's counters around the "sync" call."""
  x = _x_collatz()
  make = functools.partial(_kernel_call, collatz_kernel, x)
  want = _bits(make(OFF)(x))
  before = native.stats()
  got = _bits(make(SYNC)(x))
  return got, want, before, native.stats()


class _Exiting(scheduler.Compiler):
  """A compile process that exits before it answers (a crash, a kill)."""

  def _start(self):
    if self.proc is None or self.proc.poll() is not None:
      self.proc = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
      self.proc.wait()


def test_a_compile_process_that_exits_is_a_refused_build(fresh, monkeypatch):
  """A lite build whose process exits is refused (counted), and the
  numba build that follows in the same process fails (counted): the call
  returns the NumPy path's bits, nothing raised."""
  monkeypatch.setenv(lite_cache.ENV, "lite")
  monkeypatch.setattr(scheduler, "sync_compiler", _Exiting(nice=False))
  got, want, before, after = _collatz_sync_and_off()
  assert after["lite_refused"] == before["lite_refused"] + 1
  assert after["failed"] == before["failed"] + 1
  assert after["native_calls"] == before["native_calls"]
  np.testing.assert_array_equal(got, want)


def test_an_error_in_the_compile_process_is_a_refused_build(fresh, monkeypatch):
  """An error inside lite's compile process (here: its job names a source
  file that is not there) is answered, not raised: lite's build is
  refused and numba builds the loop, with the NumPy path's bits."""
  monkeypatch.setenv(lite_cache.ENV, "lite")
  real = lite_cache.job

  def broken(k, src, descs):
    job = real(k, src, descs)
    job["src"] += ".missing"
    return job
  monkeypatch.setattr(lite_cache, "job", broken)
  got, want, before, after = _collatz_sync_and_off()
  assert after["lite_refused"] == before["lite_refused"] + 1 and after["lite"] == before["lite"]
  assert after["native_calls"] > before["native_calls"]  # (numba's build ran)
  np.testing.assert_array_equal(got, want)


_EXIT_WHILE_BUILDING = textwrap.dedent("""
    import sys, jax.numpy as jnp, numpy as np
    import pallas_np
    from pallas_np import native
    from pallas_np.native import cost_rule, scheduler, tier
    cost_rule.LOOKUP_PRICE = cost_rule.SETUP_PRICE = cost_rule.PRESTART_PRICE = 0.0
    scheduler.COMPILE_WEIGHT = scheduler.CALLER_PRICE = scheduler.NEIGHBOUR_SHARE = 0.0
    from tests.test_native_tier import _call
    x = jnp.asarray(np.arange(256).reshape(2, 128) % 61 + 1, jnp.int32)
    f = _call(int(sys.argv[1]), pallas_np.InterpretParams(native_loops="background"), x)
    for _ in range(cost_rule.HOT_RUNS + 1):
        f(x)
    s = native.stats()
    print(s["queued"] + s["compiling"] + s["compiled"])
""")


def test_a_process_exits_while_its_lite_build_is_pending(tmp_path):
  """A process that exits with its loop's lite build queued or in the
  compile process exits at once, with status 0 (no wait for LLVM, no
  abort in its destructors: LLVM runs in the other process)."""
  env = dict(os.environ, PALLAS_NP_NATIVE_CACHE=str(tmp_path), PALLAS_NP_CHECK_AVALS="0",
             PALLAS_NP_NATIVE_COMPILER="lite",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  salt = int(np.random.default_rng().integers(1 << 20, 1 << 30))
  out = subprocess.run([sys.executable, "-c", _EXIT_WHILE_BUILDING, str(salt)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert int(out.stdout.split()[-1]) >= 1  # (the build was queued, under way or done)


def test_the_compile_process_builds_without_numpy(fresh, monkeypatch):
  """lite's compile process builds a loop (the cumsum kernel's job, with
  a constant array and scalars) importing no NumPy (``lite_dtype``: its
  import was a third of the process's start, on the path of a fresh
  process's first build), and writes the library the caller loads."""
  jobs = []
  real = scheduler.sync_compiler.build
  monkeypatch.setattr(scheduler.sync_compiler, "build", lambda job: jobs.append(job) or real(job))
  x = _floats((16, 128))
  make = functools.partial(_kernel_call, cumsum_fori_kernel, x)
  make(SYNC)(x)
  job = next(j for j in jobs if j.get("kind") == "lite")
  job["out"] = str(fresh / "again")
  code = textwrap.dedent(f"""
      import json, sys
      sys.path.insert(0, {os.path.dirname(aot_worker.__file__)!r})
      import aot_worker
      reply = aot_worker._lite().build(json.loads(sys.argv[1]))
      print(json.dumps(reply), 'numpy' in sys.modules)
  """)
  out = subprocess.run([sys.executable, "-I", "-c", code, __import__("json").dumps(job)],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split() == ['{"ok":', 'true}', "False"], out.stdout
  assert os.path.exists(str(fresh / "again.json"))


_ONE_CALL = textwrap.dedent("""
    import sys, jax.numpy as jnp, numpy as np
    import pallas_np
    from pallas_np import native
    from pallas_np.native import cost_rule, scheduler, tier
    from tests.test_native_tier import _call
    scheduler.weight = lambda: scheduler.COMPILE_WEIGHT  # (a core idle, however busy the machine)
    # (priced, and the process started, at the loop's first run)
    cost_rule.LOOKUP_PRICE = cost_rule.PRESTART_PRICE = 0.0
    x = jnp.asarray(np.arange(256).reshape(2, 128) % 59 + 1, jnp.int32)
    _call(int(sys.argv[1]), pallas_np.InterpretParams(native_loops="background"), x)(x)
    native.wait(timeout=60)
    print(scheduler.lite_compiler.proc.pid)
""")


def _gone(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # (a zombie: exited)
  except OSError:
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_one_call_process_starts_the_compile_process_and_leaves_none(tmp_path):
  """A process that calls a loop kernel once (its loop's first run: no
  library on disk, a core idle, ``cost_rule.LOOKUP_PRICE`` and ``PRESTART_PRICE`` 0) starts lite's
  compile process, which
  exits with the caller (during its start and warm-up too:
  ``aot_worker``'s orphan watch)."""
  env = dict(os.environ, PALLAS_NP_NATIVE_CACHE=str(tmp_path), PALLAS_NP_NATIVE_COMPILER="lite",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  salt = int(np.random.default_rng().integers(1 << 20, 1 << 30))
  out = subprocess.run([sys.executable, "-c", _ONE_CALL, str(salt)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  pid = int(out.stdout.split()[-1])
  for _ in range(600):  # (up to 60 s: the orphan watch looks every 0.2 s)
    if _gone(pid):
      break
    __import__("time").sleep(0.1)
  assert _gone(pid), f"the compile process {pid} outlived its caller"


def test_lite_warm_up_gives_way_to_a_pending_job(monkeypatch):
  """lite's warm-up (LLVM on a small module, a first link) is cut short
  where a job already waits on the process's input: the build does that
  work itself, and would wait for it."""
  from pallas_np.native import lite_worker
  calls = []
  monkeypatch.setattr(lite_jit, "compile_ir", lambda *a: calls.append("llvm") or b"")
  monkeypatch.setattr(lite_jit, "link_shared", lambda *a: calls.append("link") or False)
  lite_worker.warm_up(lambda: True)
  assert not calls
  lite_worker.warm_up()
  assert calls == ["llvm", "link"]


def test_lite_process_ready_while_llvmlite_is_set_up(monkeypatch):
  """lite's compile process says it is ready once lite's modules are
  imported, with llvmlite's binding still being set up on a thread (its
  ``dlopen``, ~0.06 s, overlaps the caller's source generation and the
  job's translation); its warm-up gives way to a job meanwhile, and a
  build waits for the binding before LLVM runs."""
  import threading
  from pallas_np.native import lite_worker
  gate = threading.Event()
  monkeypatch.setattr(lite_jit, "ready", lambda: gate.wait(60))
  monkeypatch.setattr(lite_worker, "_binding", [])
  lite_worker.ready()  # (returns with the binding's thread waiting on the gate)
  assert lite_worker._binding[0].is_alive()
  assert lite_worker.binding_set_up(lambda: True) is False  # (a job pending: no wait)
  gate.set()
  assert lite_worker.binding_set_up() is True and not lite_worker._binding[0].is_alive()


def test_prestart_spawns_lites_process_in_the_caller(monkeypatch):
  """``scheduler.prestart`` spawns lite's compile process in the caller
  (its ``Popen``, ~1 ms there): on the tier's thread, behind a caller busy
  calling kernels, the ``Popen`` waited 0.07-0.25 s for the GIL (PERF_LOG
  163). The tier's thread only reads its ready line: here it is held by a
  job still running, and the process is spawned all the same; it is ready
  (``starting`` False) once the thread gets to it."""
  import threading
  compiler = scheduler.Compiler(nice=False, lite=True, warm=True)
  monkeypatch.setattr(scheduler, "lite_compiler", compiler)
  held = threading.Event()
  scheduler.submit(None, lambda: held.wait(60))  # (the tier's thread busy with a job)
  try:
    scheduler.prestart(compiler)
    assert compiler.proc is not None and compiler.starting and compiler.unready
  finally:
    held.set()
  assert native.wait(timeout=120)
  assert not compiler.starting and not compiler.unready
  assert compiler.proc is not None and compiler.proc.poll() is None  # (ready for a build)
  compiler.proc.stdin.close()  # (the end of its input: it exits)
  compiler.proc.wait(timeout=60)
  compiler._drop()  # noqa: SLF001 - its pipes closed


def test_a_prestart_that_cannot_spawn_leaves_the_call_alone(monkeypatch):
  """A compile process that cannot be started in the caller (``Popen``
  raising: no executable, no file descriptor left) is the tier's failure,
  never the kernel call's: ``prestart`` returns, nothing is starting, and
  a build starts the process again on the tier's thread."""
  compiler = scheduler.Compiler(nice=False, lite=True, warm=True)

  def popen(*args, **kwargs):
    raise OSError("no process today")
  monkeypatch.setattr(scheduler.subprocess, "Popen", popen)
  scheduler.prestart(compiler)
  assert compiler.proc is None and not compiler.starting and not compiler.unready
