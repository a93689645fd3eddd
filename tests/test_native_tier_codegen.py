"""The generated loop's form where it decides speed (docs/native.md, "The
generated code"), and the bits of the forms chosen for it.

The structural tests read ``codegen.loop_source``'s text (no compile): each
names a form that kept LLVM from vectorizing a loop, or made numba compile
a slow helper, and fails if the generator writes it again. The
differential tests compile (``native_loops="sync"``) and compare with the
NumPy path (``"off"``) bit for bit, and with ``interpret=True``."""
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from benchmarks.small_kernels import bitonic_fori_kernel, collatz_kernel
from pallas_np.native import aot_worker, codegen
from tests.test_native_loops import three_ways


def _loop_source(kernel, out_shape, *args) -> str:
  """The generated source of ``kernel``'s first top-level loop."""
  call = pl.pallas_call(kernel, out_shape=out_shape, interpret=True)
  closed = jax.make_jaxpr(call)(*args)
  eqn = next(e for e in closed.jaxpr.eqns if e.primitive.name == "pallas_call")
  loop = next(e for e in eqn.params["jaxpr"].eqns if e.primitive.name in ("while", "scan"))
  return codegen.loop_source(loop, False, "nan").text


def _collatz_source():
  x = jnp.ones((2, 128), jnp.int32)
  return _loop_source(collatz_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def test_carries_and_operands_copied_by_plain_loops():
  """``x[:] = v`` made numba compile its broadcast error path (a formatted
  message, ~4 s of a compile process's first build), and
  ``np.ascontiguousarray(a).copy().reshape(n)`` three overloads per type."""
  text = _collatz_source()
  assert "[:] =" not in text, text
  assert "ascontiguousarray" not in text and ".reshape(" not in text, text


def test_bool_reduction_is_bitwise():
  """The while condition's ``any``: ``acc or v`` is a branch per element
  (not vectorized), ``acc | v`` is not."""
  text = _collatz_source()
  assert " or " not in text, text
  assert "acc" in text and "|" in text, text


def test_constant_divisor_is_one_truncating_op():
  """``x // 2`` and ``x % 2`` (jnp's floor ops are built on XLA's
  truncating div/rem): one ``_sdiv``/``_srem`` each, no guards for the
  divisors 0 and -1 and no floor corrections, which LLVM did not
  vectorize."""
  text = _collatz_source()
  assert "_srem(" in text and "_sdiv(" in text, text
  assert "== -1" not in text and "// " not in text and " % " not in text, text


def test_two_rolls_of_one_trace_stay_lazy():
  """Bitonic's two ``jnp.roll``s call one traced jitted function: its
  ``concatenate([x, x])`` is read by one ``dynamic_slice`` in each call
  and must not be built (a buffer twice the block's size) in either."""
  x = jnp.ones((8, 128), jnp.float32)
  text = _loop_source(bitonic_fori_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
  assert "np.empty(2048" not in text, text
  assert text.count("range(max(0, 128 - ") == 2, text  # (each roll's wrapped half)


def test_float_max_min_are_two_selects():
  """Float max/min were a chain of five branches (not vectorized); two
  selects on conditions combined bitwise keep NaN-first and -0 < +0."""
  x = jnp.ones((8, 128), jnp.float32)
  text = _loop_source(bitonic_fori_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
  minmax = [line for line in text.splitlines() if "-((-" in line or " != e" in line]
  assert minmax, text
  assert max(line.count(" if ") for line in minmax) == 2, minmax


def _shift_kernel(x_ref, y_ref, o_ref):
  def body(i, x):
    return lax.shift_left(x, y_ref[...]) + lax.shift_right_arithmetic(x, y_ref[...])
  o_ref[...] = lax.fori_loop(0, 2, body, x_ref[...])


def test_shift_range_test_is_bitwise():
  """A shift by an array of amounts tests each amount against the width:
  ``0 <= s < 32`` is two branches per element (short-circuit), ``(0 <= s) &
  (s < 32)`` none."""
  x = jnp.ones((2, 128), jnp.int32)
  text = _loop_source(_shift_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), x, x)
  assert "(0 <= " in text, text
  assert not re.search(r"0 <= \w+ <", text), text


def _divide_kernel(divisors, x_ref, o_ref):
  def body(i, x):
    for k, d in enumerate(divisors):
      o_ref[2 * k] = lax.div(x, jnp.asarray(d, x.dtype))
      o_ref[2 * k + 1] = lax.rem(x, jnp.asarray(d, x.dtype))
    return x + jnp.asarray(1, x.dtype)
  lax.fori_loop(0, 2, body, x_ref[...])


@pytest.mark.parametrize("dt,divisors", [(jnp.int32, (3, -3, 128, -7, 1, -1, 0)),
                                         (jnp.int8, (3, -3, 100, -128, -1, 0))])
def test_constant_divisors_bit_exact(dt, divisors):
  """Truncating division and remainder by constants of either sign, the
  type's minimum among the dividends and divisors, 1, -1 (INT_MIN / -1
  wraps) and 0 (x / 0 = -1, x % 0 = x): as the NumPy path and XLA."""
  info = np.iinfo(np.dtype(dt))
  v = np.arange(-64, 64, dtype=np.int64).reshape(1, 128).repeat(2, 0)
  v[0, :8] = [info.min, info.min + 1, info.max, info.max - 1, -1, 0, 1, -2]
  x = jnp.asarray(v.astype(np.dtype(dt)))
  out = jax.ShapeDtypeStruct((2 * len(divisors), *x.shape), dt)
  three_ways(lambda interp: pl.pallas_call(functools.partial(_divide_kernel, divisors),
                                           out_shape=out, interpret=interp), x)


def _minmax_kernel(x_ref, y_ref, o_ref):
  def body(i, c):
    x, y = c
    o_ref[0] = jnp.maximum(x, y)
    o_ref[1] = jnp.minimum(x, y)
    return y, x
  lax.fori_loop(0, 2, body, (x_ref[...], y_ref[...]))


def test_float_max_min_every_special_pair():
  """Every pair of NaN, -NaN, +-0, +-inf, +-1 in both orders: the first
  NaN operand, +0 > -0, as the NumPy path (bit for bit: zeros' signs)."""
  special = np.array([np.nan, -np.nan, 0.0, -0.0, np.inf, -np.inf, 1.0, -1.0], np.float32)
  a, b = np.meshgrid(special, special)
  x = jnp.asarray(np.resize(a.ravel(), (2, 128)))
  y = jnp.asarray(np.resize(b.ravel(), (2, 128)))
  out = jax.ShapeDtypeStruct((2, 2, 128), jnp.float32)
  three_ways(lambda interp: pl.pallas_call(_minmax_kernel, out_shape=out, interpret=interp),
             x, y)


def test_compile_process_warm_up_runs():
  """``aot_worker.warm_up`` (run by a background compile process before its
  first build; its errors are swallowed there, costing only time) compiles
  its loop: in a process of its own, as the compile process does."""
  code = ("import sys; sys.path.insert(0, sys.argv[1]); import aot_worker; "
          "aot_worker.warm_up()")
  res = subprocess.run([sys.executable, "-I", "-c", code, os.path.dirname(aot_worker.__file__)],
                       capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
