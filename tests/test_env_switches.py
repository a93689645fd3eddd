"""The PALLAS_NP_* on/off environment switches: one reading for all of them
(pallas_np.env_switches), each switch honouring every spelling, each one
documented, and no module reading one its own way."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

import pallas_np
from pallas_np import debugging, errors
from pallas_np.env_switches import OFF, ON, SWITCHES, env_switch
from pallas_np.native import tier
from pallas_np.params import default_params
from tests.helpers import concurrently

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAME = "PALLAS_NP_TEST_SWITCH"


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "Yes", "on", " on "])
def test_on_spellings(monkeypatch, value):
  monkeypatch.setenv(NAME, value)
  assert env_switch(NAME, False) is True


@pytest.mark.parametrize("value", ["0", "false", "False", "NO", "off", "Off "])
def test_off_spellings(monkeypatch, value):
  monkeypatch.setenv(NAME, value)
  assert env_switch(NAME, True) is False


def test_unset_or_empty_is_the_default(monkeypatch):
  monkeypatch.delenv(NAME, raising=False)
  assert env_switch(NAME, True) is True and env_switch(NAME, False) is False
  monkeypatch.setenv(NAME, " ")
  assert env_switch(NAME, True) is True and env_switch(NAME, False) is False


@pytest.mark.parametrize("value", ["2", "of", "enable", "y"])
def test_other_values_raise_naming_the_variable(monkeypatch, value):
  monkeypatch.setenv(NAME, value)
  with pytest.raises(ValueError, match=rf"{NAME}={value!r}.*1, true, yes, on"):
    env_switch(NAME, True)


# -- every switch reads every spelling (each of these misread one before) ------
def test_strict_fallbacks_takes_true(monkeypatch):
  failure = RuntimeError("batched rule broke")
  monkeypatch.setenv("PALLAS_NP_STRICT_FALLBACKS", "true")  # was: only "1"
  with pytest.raises(errors.FallbackError, match="batched rule broke"):
    errors.check_fallback(failure, "vectorized", "k")
  monkeypatch.setenv("PALLAS_NP_STRICT_FALLBACKS", "off")
  errors.check_fallback(failure, "vectorized", "k")  # kept for grid_report()


def test_check_avals_takes_no_and_yes(monkeypatch):
  monkeypatch.setenv("PALLAS_NP_CHECK_AVALS", "no")  # was: on (anything but "" or "0")
  assert default_params().check_avals is False
  monkeypatch.setenv("PALLAS_NP_CHECK_AVALS", "yes")
  assert default_params().check_avals is True


def test_native_loops_and_progress_take_any_case(monkeypatch):
  params = pallas_np.InterpretParams()
  monkeypatch.setenv("PALLAS_NP_NATIVE_LOOPS", "No")
  assert not tier.enabled(params)
  monkeypatch.setenv("PALLAS_NP_NATIVE_LOOPS", "on")
  assert tier.enabled(params)
  monkeypatch.setenv("PALLAS_NP_PROGRESS", "OFF")
  assert debugging._progress_enabled() is False
  monkeypatch.setenv("PALLAS_NP_PROGRESS", "yes")
  assert debugging._progress_enabled() is True


def _in_fresh_process(code, **env):
  env = dict(os.environ, JAX_PLATFORMS="cpu", **env)
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout.strip().splitlines()[-1]


_RUN_A_KERNEL = (
    "import jax, jax.numpy as jnp, pallas_np\n"
    "from pallas_np import memory\n"
    "def k(x_ref, o_ref): o_ref[...] = x_ref[...] + 1\n"
    "assert not memory.tuned  # importing alone changes nothing\n"
    "f = pallas_np.pallas_call(k, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))\n"
    "assert float(f(jnp.ones((8, 128)))[0, 0]) == 2.0\n"
    "print(memory.tuned)\n")


def test_malloc_is_left_alone_unless_asked(monkeypatch):
  """Retuning glibc's malloc is process-wide: opt-in (was: on by default,
  and PALLAS_NP_TUNE_MALLOC=off still tuned it), done on the first plan,
  not at import. (tests/test_performance.py had the same check with "1"
  and "0": spellings env_switch reads as "on" and "off", test_on_spellings.)"""
  env = {k: v for k, v in os.environ.items() if k != "PALLAS_NP_TUNE_MALLOC"}
  monkeypatch.setattr(os, "environ", env)
  import platform
  glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
  unset, off, on = concurrently(
      lambda: _in_fresh_process(_RUN_A_KERNEL),
      lambda: _in_fresh_process(_RUN_A_KERNEL, PALLAS_NP_TUNE_MALLOC="off"),
      lambda: _in_fresh_process(_RUN_A_KERNEL, PALLAS_NP_TUNE_MALLOC="on") if glibc else None)
  assert unset == "False"
  assert off == "False"
  if glibc:
    assert on == "True"


def test_force_switch_takes_true():
  """PALLAS_NP_FORCE routes even interpret=False calls (no TPU here) to numpy mode."""
  code = ("import jax, jax.numpy as jnp, pallas_np\n"
          "from jax.experimental import pallas as pl\n"
          "def k(x_ref, o_ref): o_ref[...] = x_ref[...] * 2\n"
          "f = pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=False)\n"
          "try:\n"
          "  print('forced', float(f(jnp.ones(8))[0]))\n"
          "except Exception as e:\n"
          "  print('not forced')\n")
  forced, not_forced = concurrently(lambda: _in_fresh_process(code, PALLAS_NP_FORCE="true"),
                                    lambda: _in_fresh_process(code, PALLAS_NP_FORCE="off"))
  assert forced == "forced 2.0"
  assert not_forced == "not forced"


# -- one parser, every switch documented -----------------------------------------
def test_no_module_parses_a_switch_its_own_way():
  """Every PALLAS_NP_* variable read in pallas_np goes through env_switch,
  except PALLAS_NP_DEVICE_TIMEOUT (a number of seconds, not a switch)."""
  own_reads = []
  for path in (ROOT / "pallas_np").rglob("*.py"):
    if path.name == "env_switches.py":
      continue
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
      if re.search(r"environ(\.get\(|\[)\s*['\"]PALLAS_NP_(?!DEVICE_TIMEOUT)", line):
        own_reads.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
  assert not own_reads, "\n".join(own_reads)
  used = set()
  for path in (ROOT / "pallas_np").rglob("*.py"):
    used.update(re.findall(r"env_switch\(\s*['\"](PALLAS_NP_\w+)", path.read_text()))
  used.add(tier.ENV_OFF)
  assert used == set(SWITCHES)


def test_every_switch_is_documented():
  options = (ROOT / "docs" / "options.md").read_text()
  for name in SWITCHES:
    assert f"`{name}" in options, name
  for word in (*ON, *OFF):
    assert f"`{word}`" in options
