"""A dot operand needed transposed, read by ?gemm in place (pallas_np/native/
dots.py ``_in_place``): the NumPy rule copies such a ref block into C order
and calls ?gemm with ``NO_TRANS``; a compiled loop passes the ref block
itself with ``TRANS`` where the status array says ?gemm gives the copy's
bits that way for that dot site's shape (its word from
``blas_calls.TRANSPOSED`` on, set by ``transposed_ok``'s per-shape check),
else it makes the copy, as before. Every kernel is compared bit for bit
with ``native_loops="off"`` and within tolerance with interpret=True, with
the slot on and forced off; the structural tests read the generated source
(they fail without the change: the block was always gathered)."""
import ctypes
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from pallas_np import blas
from pallas_np.native import blas_calls
from pallas_np import native
from tests.native_elig_util import SYNC, compiled_equals_numpy, copying_gemm, loop_source_of
from pallas_np.native import codegen

needs_blas = pytest.mark.skipif(blas_calls.found() is None,
                                reason="NumPy's BLAS is not an OpenBLAS found here")


def _qk_contracting(q_ref, k_ref, v_ref, o_ref):
  """``q @ k.T`` as dot_general contracting both dims 1 (flash attention's
  form), k's block at a dynamic row offset of a wider ref; ``p @ v``."""
  def body(j, acc):
    k = k_ref[pl.ds(j * 16, 16), pl.ds(4, 32)]  # (16, 32) of a (64, 40) ref
    s = lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())))  # (8, 16)
    return acc + jnp.dot(jnp.exp(s * 0.1), v_ref[pl.ds(j * 16, 16), :])
  o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros(o_ref.shape, jnp.float32))


def _qk_transpose(q_ref, k_ref, v_ref, o_ref):
  """``q @ k.T`` through a ``transpose`` eqn (GPU decode attention's form)."""
  def body(j, acc):
    k = k_ref[pl.ds(j * 16, 16), pl.ds(4, 32)]
    s = jnp.dot(q_ref[...], k.T)
    return acc + jnp.dot(jnp.exp(s * 0.1), v_ref[pl.ds(j * 16, 16), :])
  o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros(o_ref.shape, jnp.float32))


def _qk_value(q_ref, k_ref, v_ref, o_ref):
  """``q @ k.T`` of a computed K block (TPU paged attention's form: the
  block rounded first, then ``pl.dot(q, k, trans_b=True)``), a value, not a
  ref block."""
  def body(j, acc):
    k = k_ref[pl.ds(j * 16, 16), pl.ds(4, 32)] * 0.5 + 1.0
    s = lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())))
    return acc + jnp.dot(jnp.exp(s * 0.1), v_ref[pl.ds(j * 16, 16), :])
  o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros(o_ref.shape, jnp.float32))


def _xt_w(x_ref, w_ref, o_ref):
  """The left operand transposed (``x.T @ w``: ?gemm's A with ``TRANS``)."""
  def body(j, acc):
    x = x_ref[pl.ds(j * 16, 16), :]  # (16, 8): x.T is (8, 16)
    return acc + jnp.dot(x.T, w_ref[pl.ds(j * 16, 16), :])
  o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros(o_ref.shape, jnp.float32))


def _attention_args(seed, k_cols=40):
  rng = np.random.default_rng(seed)
  scale = np.exp2(rng.integers(-8, 8, (1, 32)))
  q = rng.standard_normal((8, 32)) * scale
  return tuple(jnp.asarray(a, jnp.float32)
               for a in (q, rng.standard_normal((64, k_cols)), rng.standard_normal((64, 24))))


def _xt_args(seed):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((64, 8)), jnp.float32),
          jnp.asarray(rng.standard_normal((64, 24)), jnp.float32))


CASES = {
    "contracting_dims": (_qk_contracting, (8, 24), lambda s: _attention_args(s)),
    "transpose_eqn": (_qk_transpose, (8, 24), lambda s: _attention_args(s)),
    "lhs_transposed": (_xt_w, (8, 24), _xt_args),
    "value": (_qk_value, (8, 24), lambda s: _attention_args(s)),
}


def loop_of(make, *args):
  """The generated ``codegen.Source`` of the first loop in ``make``'s kernel."""
  closed = jax.make_jaxpr(make(True))(*args)
  eqn = next(e for e in closed.jaxpr.eqns if e.primitive.name == "pallas_call")
  loop = next(e for e in eqn.params["jaxpr"].eqns if e.primitive.name in ("while", "scan"))
  return codegen.loop_source(loop, False, "nan")


def _make(kernel, out_shape):
  def make(interp):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
                          interpret=interp)
  return make


@needs_blas
@pytest.mark.parametrize("name", sorted(CASES))
def test_transposed_operand_read_in_place_bit_exact(name):
  kernel, out_shape, args = CASES[name]
  make = _make(kernel, out_shape)
  compiled_equals_numpy(make, *args(1), rtol=1e-4, atol=1e-4)
  text = loop_source_of(make, *args(1))
  # the sgemm's transpose flag is a local set at run time: TRANS in place,
  # NO_TRANS on the gathered copy
  flags = re.findall(r"^\s+(tr\d+) = (\d+)$", text, re.M)
  assert sorted(v for _, v in flags) == [str(blas_calls.NO_TRANS), str(blas_calls.TRANS)], text
  sgemm = [l for l in text.splitlines() if "_cblas_sgemm(" in l]
  assert any(flags[0][0] in l for l in sgemm), sgemm
  assert re.search(rf"if _st\.shape\[0\] > {blas_calls.TRANSPOSED} and "
                   rf"_st\[{blas_calls.TRANSPOSED}\] == 1\b", text), text  # (its one site's word)


@needs_blas
@pytest.mark.parametrize("name", sorted(CASES))
def test_transposed_operand_copied_where_the_status_says_no(name):
  """With the status slot 0 (a BLAS whose ``TRANS`` sums in another order)
  the loop gathers the block as the NumPy rule copies it: the same bits.
  (New shapes: a loop compiled here takes the status array of its build.)"""
  kernel, out_shape, args = CASES[name]
  big = (lambda s: _attention_args(s, k_cols=48)) if name != "lhs_transposed" else (
      lambda s: (jnp.concatenate([_xt_args(s)[0]] * 2, 1)[:, :12], _xt_args(s)[1]))
  with blas_calls.forced_transposed(0):
    compiled_equals_numpy(_make(kernel, (12, 24) if name == "lhs_transposed" else out_shape),
                          *big(2), rtol=1e-4, atol=1e-4)


@needs_blas
@pytest.mark.parametrize("name", sorted(CASES))
def test_transposed_operand_in_place_where_the_status_says_yes(name):
  """The in-place path itself (slot forced to 1), on every CPU: where this
  OpenBLAS passes the check its bits are the copy's (the test above and
  ``compiled_equals_numpy``); where it fails, ``TRANS`` may sum in another
  order, so the result is compared within tolerance only, which still
  catches a wrong stride, offset or flag. (New shapes again: a loop takes
  the status array of its build.)"""
  kernel, out_shape, args = CASES[name]
  big = (lambda s: _attention_args(s, k_cols=56)) if name != "lhs_transposed" else (
      lambda s: (jnp.concatenate([_xt_args(s)[0]] * 2, 1)[:, :10], _xt_args(s)[1]))
  make = _make(kernel, (10, 24) if name == "lhs_transposed" else out_shape)
  sites = loop_of(make, *big(3)).transposed
  assert len(sites) == 1, sites
  was = blas_calls.transposed_ok(sites[0])  # (this CPU's answer for the site's shape)
  with blas_calls.forced_transposed(1):
    if was:
      compiled_equals_numpy(make, *big(3), rtol=1e-4, atol=1e-4)
    else:
      before = native.stats()["native_calls"]
      got = np.asarray(make(SYNC)(*big(3)))
      assert native.stats()["native_calls"] > before, "the compiled loop did not run"
      np.testing.assert_allclose(got, np.asarray(make(True)(*big(3))), rtol=1e-3, atol=1e-3)


def _copying(fns):
  """``fns`` with ?gemm's transposed operands copied into C order first and
  passed ``NO_TRANS``: what the NumPy rule does, so the copy's bits by
  construction, whatever this CPU's OpenBLAS kernels are."""
  out = dict(fns)
  for p, dt in (("s", np.float32), ("d", np.float64)):
    out[p + "gemm"] = copying_gemm(fns[p + "gemm"], dt)
  return out


def _perturbed(fns):
  """``fns`` with ?gemm one ulp off in its first element whenever an
  operand is passed transposed (a BLAS summing in another order there)."""
  out = dict(fns)
  for p, dt in (("s", np.float32), ("d", np.float64)):
    real = fns[p + "gemm"]

    def gemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, real=real, dt=dt):
      real(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
      if blas_calls.TRANS in (ta, tb):
        ctype = ctypes.c_float if dt == np.float32 else ctypes.c_double
        first = np.ctypeslib.as_array(ctypes.cast(c, ctypes.POINTER(ctype)), shape=(1,))
        first[0] = np.nextafter(first[0], dt(np.inf))
    out[p + "gemm"] = gemm
  return out


@needs_blas
def test_transposed_check_refuses_other_bits():
  """The check passes for a ?gemm whose transposed calls give the copy's
  bits (built here from this OpenBLAS: the transposed operand copied, then
  ``NO_TRANS``), and fails for one whose transposed calls round differently
  (then every loop copies). This OpenBLAS itself may pass or fail (its
  kernels depend on the CPU); ``transposed_ok`` answers as the check for
  each of its shapes."""
  fns = blas_calls.ctypes_routines()
  assert blas_calls._transposed_check(_copying(fns))
  assert not blas_calls._transposed_check(_perturbed(fns))
  assert not blas_calls._transposed_check(_perturbed(_copying(fns)))
  with blas.kernel_run():  # as ``transposed_ok`` runs it: one thread
    own = blas_calls._transposed_check(fns)
  assert own == all(blas_calls.transposed_ok((p, m, k, n, True, True))
                    for p, shapes in (("s", blas_calls._TRANSPOSED_SHAPES),
                                      ("d", blas_calls._TRANSPOSED_SHAPES[-3:]))
                    for m, k, n in shapes)
