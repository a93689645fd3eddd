"""No float primitive's numpy-mode rule calls a NumPy ufunc whose float loop
NumPy picks by CPU: the transcendental ufuncs have AVX2 and AVX-512 variants
(``numpy.lib.introspect.opt_func_info`` lists them), so their bits can
change from one machine to the next, while XLA's (its own formulas, or the C
library functions it calls) do not. A rule that called one would be
bit-exact on the machine its claim was measured on and not on another (as
asin, atan2, cbrt, cosh, pow and tan were on an AVX-512 machine). Watched
with ``sys.monitoring`` (every call made while the kernel runs, Python 3.12+).
The companion check with NumPy's dispatch switched off is
tests/test_xla_math.py::test_bits_do_not_depend_on_numpys_simd_dispatch."""
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_np import conformance

# NumPy's transcendental ufuncs (every one with CPU-dispatched float loops in
# NumPy 2.x; arithmetic, comparisons, rounding and sqrt are correctly rounded
# on every path).
TRANSCENDENTAL = ["arccos", "arccosh", "arcsin", "arcsinh", "arctan", "arctan2", "arctanh",
                  "cbrt", "cos", "cosh", "exp", "exp2", "expm1", "log", "log10", "log1p",
                  "log2", "logaddexp", "logaddexp2", "power", "float_power", "sin", "sinh",
                  "tan", "tanh", "hypot"]
_WATCHED = {id(getattr(np, n)): n for n in TRANSCENDENTAL}
_TOOL = 3  # a sys.monitoring tool id (0-5); 3 is unassigned by CPython


def _numpy_transcendentals_called(fn, *args):
  """The TRANSCENDENTAL ufuncs (and their methods) called while ``fn(*args)``
  runs."""
  mon = sys.monitoring
  seen = set()

  def on_call(code, offset, callable_, arg0):
    owner = getattr(callable_, "__self__", callable_)  # np.add.reduce -> np.add
    if getattr(callable_, "__objclass__", None) is np.ufunc:  # ufunc.reduce(np.add, ...)
      owner = arg0
    name = _WATCHED.get(id(owner))
    if name is not None:
      seen.add(name)

  mon.use_tool_id(_TOOL, "pallas_np dispatch audit")
  try:
    mon.register_callback(_TOOL, mon.events.CALL, on_call)
    mon.set_events(_TOOL, mon.events.CALL)
    fn(*args)
  finally:
    mon.set_events(_TOOL, 0)
    mon.register_callback(_TOOL, mon.events.CALL, None)
    mon.free_tool_id(_TOOL)
  return seen


@pytest.mark.skipif(not hasattr(sys, "monitoring"),
                    reason="needs sys.monitoring (Python >= 3.12; CI's 3.13 leg runs it)")
@pytest.mark.parametrize("name", sorted(conformance.DOMAINS))
def test_no_cpu_dispatched_numpy_ufunc(name):
  f = conformance.function(name)
  for dt in (np.float32, ml_dtypes.bfloat16, np.float16):
    rng = np.random.default_rng(0)
    dom = conformance.DOMAINS[name]
    doms = dom if isinstance(dom[0], tuple) else (dom,)
    args = [conformance._sample(lo, hi, 256, dt, rng) for lo, hi in doms]

    def kernel(*refs):
      refs[-1][...] = f(*[r[...] for r in refs[:-1]])
    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((256,), dt), interpret="numpy")
    np.asarray(call(*args))  # traced and compiled: only the run is watched
    called = _numpy_transcendentals_called(lambda: np.asarray(call(*args)))
    assert not called, (name, np.dtype(dt).name, sorted(called))


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="needs sys.monitoring (Python >= 3.12)")
def test_the_watch_sees_a_ufunc_call():
  x = np.ones(4, np.float32)
  assert _numpy_transcendentals_called(lambda: np.sin(x)) == {"sin"}
  assert _numpy_transcendentals_called(lambda: np.logaddexp.accumulate(x)) == {"logaddexp"}
  assert _numpy_transcendentals_called(lambda: np.add(x, x)) == set()
