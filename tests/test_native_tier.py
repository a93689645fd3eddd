"""The native tier's scheduling and its on-disk cache (pallas_np.native.tier,
disk_cache): when a loop is looked up and built, what ``stats()`` shows
meanwhile, and that a second process loads the library the first built
(no numba import, no build). Bit-exactness of the compiled loops is
tests/test_native_loops.py's."""
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
from pallas_np.native import cost_rule, scheduler, tier

OFF = pallas_np.InterpretParams(native_loops="off")
BACKGROUND = pallas_np.InterpretParams(native_loops="background")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _no_set_up_price(monkeypatch):
  """The cost rule of builds, not of the process's one-off set-up
  (``cost_rule.SETUP_PRICE``: test_native_tier_speed.py's own test), nor
  of lite's process start and the looks at it while it starts."""
  monkeypatch.setattr(cost_rule, "SETUP_PRICE", 0.0)
  monkeypatch.setattr(cost_rule, "PRESTART_PRICE", 0.0)
  monkeypatch.setattr(cost_rule, "STARTING_RECHECK", 0.0)
  monkeypatch.setattr(scheduler, "NEIGHBOUR_SHARE", 0.0)


def _kernel(salt):
  """A small loop kernel whose source is new to the disk cache (``salt``:
  a constant of the loop body), so its build is really queued."""
  def kernel(x_ref, o_ref):
    def body(i, x):
      return jnp.where(x % 2 == 0, x // 2, 3 * x + salt)
    o_ref[...] = lax.fori_loop(0, 7, body, x_ref[...])
  return kernel


def _call(salt, interpret, x):
  return pl.pallas_call(_kernel(salt), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        interpret=interpret)


def test_build_waits_for_hot_runs_then_shows_queued(monkeypatch):
  """Once the NumPy path's cost pays for it (prices 0 here) and the loop
  ran HOT_RUNS kernel runs, its build is queued: ``stats()`` counts it as
  queued or compiling until it is done, the NumPy path's results meanwhile,
  the compiled loop's afterwards."""
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "COMPILE_WEIGHT", 0.0)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", 0.0)
  # (a compile process at normal priority: a niced one may wait minutes on a busy machine)
  monkeypatch.setattr(scheduler, "compiler", scheduler.Compiler(nice=False))
  salt = int(np.random.default_rng().integers(1 << 20, 1 << 30))
  x = jnp.asarray(np.arange(256).reshape(2, 128) % 97 + 1, jnp.int32)
  want = np.asarray(_call(salt, OFF, x)(x))
  f = _call(salt, BACKGROUND, x)
  before = native.stats()
  for _ in range(cost_rule.HOT_RUNS - 1):
    np.testing.assert_array_equal(np.asarray(f(x)), want)
  assert native.wait(timeout=900)
  mid = native.stats()
  assert mid["compiled"] == before["compiled"] and mid["compiling"] == 0
  np.testing.assert_array_equal(np.asarray(f(x)), want)  # the HOT_RUNS-th run
  now = native.stats()
  assert now["queued"] + now["compiling"] >= 1
  assert native.wait(timeout=900)
  after = native.stats()
  assert after["compiled"] == before["compiled"] + 1, after
  assert after["queued"] == after["compiling"] == 0
  np.testing.assert_array_equal(np.asarray(f(x)), want)
  assert native.stats()["native_calls"] == after["native_calls"] + 1


def test_no_build_while_numpy_path_is_cheaper(monkeypatch):
  """A loop whose NumPy path has cost less than its build's price (the
  caller's own part, and numba's weighted seconds) is never built: the
  caller keeps the NumPy path."""
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "COMPILE_WEIGHT", 1e9)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", 1e9)
  salt = int(np.random.default_rng().integers(1 << 20, 1 << 30))
  x = jnp.asarray(np.arange(256).reshape(2, 128) % 89 + 1, jnp.int32)
  f = _call(salt, BACKGROUND, x)
  before = native.stats()
  for _ in range(3 * cost_rule.HOT_RUNS):
    f(x)
  assert native.wait(timeout=900)
  after = native.stats()
  assert after["compiled"] == before["compiled"]
  assert after["native_calls"] == before["native_calls"]


_SECOND_PROCESS = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from jax.experimental import pallas as pl
    import pallas_np
    from pallas_np import native
    from pallas_np.native import cost_rule, scheduler, tier
    cost_rule.LOOKUP_PRICE = 0.0
    cost_rule.SETUP_PRICE = cost_rule.PRESTART_PRICE = 0.0
    scheduler.COMPILE_WEIGHT = 0.0
    scheduler.CALLER_PRICE = scheduler.NEIGHBOUR_SHARE = 0.0
    scheduler.compiler = scheduler.Compiler(nice=False)
    scheduler.lite_compiler = scheduler.Compiler(nice=False, lite=True)
    from tests.test_native_tier import _call
    x = jnp.asarray(np.arange(256).reshape(2, 128) % 83 + 1, jnp.int32)
    f = _call(int(sys.argv[1]), pallas_np.InterpretParams(native_loops="background"), x)
    for _ in range(2 * cost_rule.HOT_RUNS):  # (each step may queue the next: wait for it)
        f(x)
        assert native.wait(900)
    f(x)
    s = native.stats()
    print(s["disk_hits"], s["compiled"], s["native_calls"], 'numba' in sys.modules,
          'llvmlite.binding' in sys.modules)
""")


@pytest.mark.parametrize("compiler,suffix,cc", [("numba", ".so", None), ("auto", ".so", None),
                                                ("auto", ".o", "false")])
def test_second_process_loads_the_library_from_disk(tmp_path, compiler, suffix, cc):
  """The first process builds the loop into the cache directory (numba's
  library, or lite's, linked by the C compiler: native/lite_cache.py); a
  second one finds it there at its first lookup: no build, no numba
  import, and the compiled loop runs. Neither process imports llvmlite's
  LLVM binding (lite's build is the compile process's, its library a
  dlopen; libm's loops come from their own warm cache), except
  where no C compiler links lite's object (``CC=false``): both processes
  then load the object with llvmlite's MCJIT."""
  salt = int(np.random.default_rng().integers(1 << 20, 1 << 30))
  env = dict(os.environ, PALLAS_NP_NATIVE_CACHE=str(tmp_path), PALLAS_NP_CHECK_AVALS="0",
             PALLAS_NP_NATIVE_COMPILER=compiler,
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  if cc is not None:
    env["CC"] = cc
  runs = []
  for _ in range(2):
    out = subprocess.run([sys.executable, "-c", _SECOND_PROCESS, str(salt)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    runs.append(out.stdout.split())
  assert runs[0][:2] == ["0", "1"] and runs[0][3] == "False"  # built in the compile process
  assert runs[1][:2] == ["1", "1"] and runs[1][3] == "False"  # loaded from disk
  # native from the first run on (its pre-key: tests/test_native_tier_speed.py)
  assert int(runs[1][2]) == 2 * cost_rule.HOT_RUNS + 1
  assert int(runs[0][2]) < int(runs[1][2])
  files = os.listdir(next(tmp_path.iterdir()))
  assert any(p.endswith(suffix) for p in files)
  if compiler == "auto":
    assert any(".lite" in p and p.endswith(suffix) for p in files), files
    assert runs[0][4] == runs[1][4] == ("True" if suffix == ".o" else "False")


def test_a_body_its_operands_refuse_is_refused_when_priced(monkeypatch):
  """A kernel body whose refs are bfloat16 (no generated function takes
  one: ``codegen.operand_refusal``) is refused when it is priced, with no
  source generated, no compile process started ahead of its build and no
  build submitted (it had paid lite's process start and its build's caller
  part, ~20 ms of a caller's time, to be refused at the source's
  generation); its results are the NumPy plan's bits."""
  assert native.wait(timeout=900)  # (no earlier test's build on the tier's thread meanwhile)
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "weight", lambda: scheduler.COMPILE_WEIGHT)  # (a core idle)
  started, submitted, generated = [], [], []
  monkeypatch.setattr(scheduler, "prestart", lambda which=None: started.append(which))
  monkeypatch.setattr(scheduler, "submit_build", submitted.append)
  monkeypatch.setattr(scheduler.lite_compiler, "proc", None)
  real = tier.codegen.loop_source
  monkeypatch.setattr(tier.codegen, "loop_source", lambda *a: generated.append(1) or real(*a))
  salt = float(np.random.default_rng().integers(1, 1 << 10))

  def kernel(x_ref, o_ref):
    o_ref[...] = (x_ref[...].astype(jnp.float32) * 2 + salt).astype(jnp.bfloat16)
  x = jnp.asarray(np.linspace(-4, 4, 16 * 128).reshape(16, 128), jnp.bfloat16)

  def make(interpret):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                          in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                          interpret=interpret)
  want = np.asarray(make(OFF)(x)).view(np.uint16)
  before = native.stats()
  f = make(BACKGROUND)
  for _ in range(cost_rule.HOT_RUNS + 3):
    np.testing.assert_array_equal(np.asarray(f(x)).view(np.uint16), want)
  assert native.stats()["refused"] == before["refused"] + 1
  assert not started and not submitted and not generated


def test_prerefusal_leaves_an_aval_it_does_not_foresee_to_the_generation():
  """``codegen.prerefusal`` runs in the caller's kernel run: an operand
  whose aval it cannot read is no refusal there (the generation, on the
  tier's thread, decides), never an exception in the caller's call."""
  import types

  from pallas_np.native import codegen

  class Unreadable:
    @property
    def dtype(self):
      raise TypeError("an aval prerefusal does not foresee")
  eqn = types.SimpleNamespace(invars=[types.SimpleNamespace(aval=Unreadable())])
  assert codegen.prerefusal(eqn) is None
