"""The device persona (pallas_np.emulate_device): JAX's device gates and
hardware queries answer as the emulated device inside it, every kernel runs
in numpy mode, and leaving it restores everything. References are NumPy."""
import unittest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_np
from pallas_np import _compat as jc
from pallas_np.persona import WATCHDOG_S, current_device, jax_gates
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

jtu = pytest.importorskip("jax._src.test_util")

GATES = ("device_under_test", "_get_device_tags", "test_device_matches", "is_device_cuda",
         "is_cuda_compute_capability_at_least", "is_cuda_compute_capability_equal",
         "is_device_tpu", "is_device_tpu_at_least", "get_tpu_version")


def _snapshot():
  """JAX's functions and the device class's own attributes, by identity."""
  cls = jax_gates.device_class()
  return ({n: getattr(jtu, n, None) for n in GATES},
          dict(vars(jtu.CudaArchSpecificTest)),
          {n: vars(cls).get(n) for n in ("device_kind", "core_count", "compute_capability",
                                         "num_cores")},
          jc.interpret_mode_config.value)


def _double_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...] * 2 + 1


class GpuGatedTest(unittest.TestCase):
  """Written like JAX's Mosaic GPU tests: skips unless on an sm90+ GPU
  (run by the tests below, not collected by pytest)."""
  __test__ = False

  def setUp(self):
    if not jtu.test_device_matches(["cuda"]):
      self.skipTest("Only works on GPU")
    if not jtu.is_cuda_compute_capability_at_least("9.0"):
      self.skipTest("Only works on a GPU with capability >= sm90")

  def test_kernel(self):
    x = np.arange(256, dtype=np.float32).reshape(2, 128)
    # interpret=False: the device's compiler; on a CPU only the persona runs it.
    out = pl.pallas_call(_double_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                         interpret=False)(x)
    np.testing.assert_array_equal(np.asarray(out), x * 2 + 1)
    # Code that sizes its launch by the SM count, as persistent kernels do.
    self.assertEqual(jax.devices()[0].core_count, 132)


class TpuGatedTest(unittest.TestCase):
  """Written like JAX's TPU tests: skips unless on a TPU v5+; sizes its
  blocks from ``pltpu.get_tpu_info()`` at trace time."""
  __test__ = False

  def setUp(self):
    if not jtu.test_device_matches(["tpu"]) or not jtu.is_device_tpu_at_least(5):
      self.skipTest("TPU v5+ only")

  def test_kernel(self):
    info = pltpu.get_tpu_info()
    rows, lanes = info.num_sublanes, info.num_lanes
    x = np.arange(4 * rows * lanes, dtype=np.int32).reshape(4 * rows, lanes)
    out = pl.pallas_call(
        _double_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
        in_specs=[pl.BlockSpec((rows, lanes), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((rows, lanes), lambda i: (i, 0)), interpret=False)(x)
    np.testing.assert_array_equal(np.asarray(out), x * 2 + 1)


def _run(case_cls):
  result = unittest.TestResult()
  unittest.defaultTestLoader.loadTestsFromTestCase(case_cls).run(result)
  return result


def test_gated_tests_skip_without_the_persona_and_run_with_it():
  for case in (GpuGatedTest, TpuGatedTest):
    r = _run(case)
    assert len(r.skipped) == 1 and not r.failures and not r.errors, (r.failures, r.errors)
  with pallas_np.emulate_device("h100"):
    r = _run(GpuGatedTest)
    assert (r.testsRun, r.skipped, r.failures, r.errors) == (1, [], [], []), (r.failures, r.errors)
    assert len(_run(TpuGatedTest).skipped) == 1
  with pallas_np.emulate_device("tpu-v5e"):
    r = _run(TpuGatedTest)
    assert (r.testsRun, r.skipped, r.failures, r.errors) == (1, [], [], []), (r.failures, r.errors)
    assert len(_run(GpuGatedTest).skipped) == 1


@pytest.mark.parametrize("name,cuda,cc9,cc10,sm90a,kind,sms", [
    ("h100", True, True, False, True, "NVIDIA H100 80GB HBM3", 132),
    ("b200", True, True, True, False, "NVIDIA B200", 148),
])
def test_gpu_gates(name, cuda, cc9, cc10, sm90a, kind, sms):
  with pallas_np.emulate_device(name) as spec:
    assert spec.name == name and current_device() is spec
    assert jtu.device_under_test() == "gpu"
    assert jtu.test_device_matches(["cuda"]) is cuda and not jtu.test_device_matches(["tpu"])
    assert not jtu.test_device_matches(["rocm"]) and not jtu.test_device_matches(["cpu"])
    assert jtu.is_cuda_compute_capability_at_least("9.0") is cc9
    assert jtu.is_cuda_compute_capability_at_least("10.0") is cc10
    assert jtu.is_cuda_compute_capability_equal("9.0") is sm90a
    assert jax.devices()[0].device_kind == kind and jax.devices()[0].core_count == sms

    class Arch(jtu.CudaArchSpecificTest, unittest.TestCase):
      def test_sm90a(self):
        self.skip_unless_sm90a()

      def test_tcgen05(self):
        self.skip_unless_tcgen05()
    r = _run(Arch)
    assert len(r.skipped) == 1 and not r.failures and not r.errors, (r.failures, r.errors)
    assert ("sm90a" in r.skipped[0][1]) is (not sm90a)


@pytest.mark.parametrize("name,version,variant,chip,cores", [
    ("tpu-v4", 4, "", "v4", 2), ("tpu-v5e", 5, "e", "v5e", 1), ("tpu-v5p", 5, "p", "v5p", 2),
    ("tpu-v6e", 6, "e", "v6e", 1), ("tpu-v7x", 7, "x", "7x", 1)])
def test_tpu_gates(name, version, variant, chip, cores):
  with pallas_np.emulate_device(name):
    assert jtu.device_under_test() == "tpu" and jtu.test_device_matches(["tpu"])
    assert not jtu.test_device_matches(["gpu"])
    assert jtu.get_tpu_version() == version
    assert jtu.is_device_tpu(version, variant) and jtu.is_device_tpu_at_least(version)
    assert not jtu.is_device_tpu_at_least(version + 1)
    info = pltpu.get_tpu_info()
    assert str(info.chip_version.value).endswith(chip) and info.num_cores == cores
    assert jax.devices()[0].num_cores == cores
    assert jc.interpret_mode_config.value.num_cores == cores


def _tpu_info_or_error():
  """What pltpu.get_tpu_info() answers outside a persona: an error on a
  CPU, or the chip an earlier test assumed (pallas_np.assume_tpu_chip)."""
  try:
    return repr(pltpu.get_tpu_info())
  except ValueError as e:
    return type(e)


def test_leaving_restores_jax():
  before = _snapshot()
  tpu_info_before = _tpu_info_or_error()
  with pallas_np.emulate_device("tpu-v5p"):
    with pallas_np.emulate_device("h100"):  # nested
      assert _snapshot() != before
    assert jtu.device_under_test() == "tpu"
  assert _snapshot() == before
  assert jtu.device_under_test() == "cpu" and jax.devices()[0].device_kind == "cpu"
  assert not hasattr(jax.devices()[0], "core_count")
  # The chip info is what it was (cached chip info cleared): an error on a CPU.
  assert _tpu_info_or_error() == tpu_info_before
  with pytest.raises(ValueError, match="interpret"):  # no persona: interpret=False is the device's
    pl.pallas_call(_double_kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                   interpret=False)(jnp.ones(8))
  # The process-wide setter, and an error inside the scope, restore too.
  pallas_np.set_emulated_device("b200")
  assert jtu.is_cuda_compute_capability_at_least("10.0")
  pallas_np.unset_emulated_device()
  with pytest.raises(KeyError):
    with pallas_np.emulate_device("tpu-v6e"):
      raise KeyError("inside")
  assert _snapshot() == before and current_device() is None


def test_persona_options_and_names():
  with pallas_np.emulate_device("h100", detect_races=True):
    params = jc.interpret_mode_config.value
    assert params.loop_watchdog_s == WATCHDOG_S and params.detect_races
  with pytest.raises(ValueError, match="unknown device persona"):
    pallas_np.emulate_device("h9000")
  with pallas_np.emulate_device("cpu"):  # numpy mode and the watchdog, no gates changed
    assert jtu.device_under_test() == "cpu"
    assert jc.interpret_mode_config.value.loop_watchdog_s == WATCHDOG_S


def test_lowering_text_skips_under_the_persona():
  x = jnp.arange(8.0)
  f = jax.jit(lambda x: pl.pallas_call(_double_kernel, out_shape=x)(x))
  with pallas_np.emulate_device("h100"):
    with pytest.raises(unittest.SkipTest, match="cannot be emulated"):
      f.lower(x).as_text()
    # Code around no kernel lowers as usual.
    assert "stablehlo" in jax.jit(lambda x: x + 1).lower(x).as_text()
  assert "stablehlo" in jax.jit(lambda x: x + 1).lower(x).as_text()


def test_environment_variable(monkeypatch):
  monkeypatch.setenv("PALLAS_NP_DEVICE", "tpu-v6e")
  from pallas_np.persona import from_environment
  try:
    assert from_environment().name == "tpu-v6e"
    assert jtu.is_device_tpu(6, "e")
  finally:
    pallas_np.unset_emulated_device()
  assert jtu.device_under_test() == "cpu"


GATED_FILE = '''
from jax._src import test_util as jtu
import jax, numpy as np
from jax.experimental import pallas as pl

class T(jtu.JaxTestCase):
  def setUp(self):
    super().setUp()
    if not jtu.is_cuda_compute_capability_at_least("9.0"):
      self.skipTest("sm90 only")

  def test_add(self):
    def k(x_ref, o_ref):
      o_ref[...] = x_ref[...] + 1
    x = np.arange(128, dtype=np.float32)
    out = pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    np.testing.assert_array_equal(np.asarray(out), x + 1)
'''


def test_pytest_option(tmp_path):
  import os
  import subprocess
  import sys
  (tmp_path / "test_gated.py").write_text(GATED_FILE)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
  from tests.helpers import concurrently

  def run(opt):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           *opt, str(tmp_path / "test_gated.py")], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300).stdout
  plain, h100 = concurrently(lambda: run([]), lambda: run(["--pallas-device=h100"]))
  outs = {False: plain, True: h100}
  assert "1 skipped" in outs[False], outs[False]
  assert "1 passed" in outs[True], outs[True]


def test_jax_interpreter_state_answered():
  """get_races() of JAX's GPU interpreter answers from pallas_np (which ran
  the kernels); JAX-interpreter-only options skip with the reason."""
  gpu_interpret = pytest.importorskip(
      "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
  params_mod = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params")
  original = gpu_interpret.get_races
  with pallas_np.emulate_device("cpu", detect_races=True):
    assert gpu_interpret.get_races().races_found is False
    with pytest.raises(unittest.SkipTest, match="skip_floating_point_ops"):
      params_mod.InterpretGPUParams(skip_floating_point_ops=True)
    params_mod.InterpretGPUParams(detect_races=True)  # other options build as usual
  with pallas_np.emulate_device("cpu", detect_races=False):
    with pytest.raises(pallas_np.UnsupportedError, match="pallas-numpy-races"):
      gpu_interpret.get_races()
  assert gpu_interpret.get_races is original
  params_mod.InterpretGPUParams(skip_floating_point_ops=True)
  tpu_interpret = pytest.importorskip("jax._src.pallas.mosaic.interpret.interpret_pallas_call")
  if hasattr(tpu_interpret, "races"):  # the TPU interpreter keeps it as a module attribute
    before = tpu_interpret.races
    with pallas_np.emulate_device("tpu-v5e", detect_races=True):
      assert tpu_interpret.races.races_found is False
    with pallas_np.emulate_device("tpu-v5e"):
      with pytest.raises(pallas_np.UnsupportedError):
        tpu_interpret.races.races_found  # noqa: B018
    assert tpu_interpret.races is before
