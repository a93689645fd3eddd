"""Per-shape answers for reading a transposed dot operand in place
(``blas_calls.transposed_ok``, ``dots._transposed_word``): an OpenBLAS may
give the copy's bits for ``TRANS`` at one shape and not at another (this
VM's: (128, 128, 128) passes, (4, 128, 64) fails), so each dot site of a
loop reads its own status word, filled in from its shape's answer, in a
loop built here and in one loaded from the disk cache by its pre-key (the
sites' keys are in its record).

?gemm is replaced in the status array by a wrapper that records each call's
shape and flags and copies a transposed operand into C order before calling
the real routine (the NumPy rule's copy, so the bits are off's by
construction on any CPU); with one site's answer forced to 1 and the
other's to 0, and then the other way round, only the site answered 1 may
pass ``TRANS``. The tests fail if a loop ignores its sites' answers (one
process-wide word, or none) or if a loaded loop loses them."""
import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from pallas_np import native
from pallas_np.native import blas_calls, build_steps
from tests.native_elig_util import OFF, SYNC, bits, copying_gemm

needs_blas = pytest.mark.skipif(blas_calls.found() is None,
                                reason="NumPy's BLAS is not an OpenBLAS found here")

A = ("s", 8, 32, 16, False, True)  # q @ k.T of (8, 32) and a (16, 32) block
B = ("s", 12, 32, 24, False, True)  # q2 @ k2.T of (12, 32) and a (24, 32) block


def _two_sites(q_ref, k_ref, q2_ref, k2_ref, o_ref, o2_ref):
  def body(j, accs):
    s1 = lax.dot_general(q_ref[...], k_ref[pl.ds(j * 16, 16), pl.ds(4, 32)],
                         (((1,), (1,)), ((), ())))
    s2 = lax.dot_general(q2_ref[...], k2_ref[pl.ds(j * 24, 24), pl.ds(4, 32)],
                         (((1,), (1,)), ((), ())))
    return accs[0] + s1, accs[1] + s2
  o_ref[...], o2_ref[...] = lax.fori_loop(
      0, 2, body, (jnp.zeros((8, 16), jnp.float32), jnp.zeros((12, 24), jnp.float32)))


def _make(params):
  return pl.pallas_call(_two_sites, out_shape=(jax.ShapeDtypeStruct((8, 16), jnp.float32),
                                               jax.ShapeDtypeStruct((12, 24), jnp.float32)),
                        interpret=params)


def _args():
  rng = np.random.default_rng(5)
  scale = np.exp2(rng.integers(-10, 10, (1, 32)))
  return tuple(jnp.asarray(a, jnp.float32) for a in (
      rng.standard_normal((8, 32)) * scale, rng.standard_normal((32, 40)),
      rng.standard_normal((12, 32)) * scale, rng.standard_normal((48, 40))))


class _recorded_sgemm:
  """The status array's sgemm replaced by a ctypes wrapper: each call's
  (m, n, k, transA, transB) appended to ``calls``; a ``TRANS`` operand
  copied into C order and passed ``NO_TRANS`` to NumPy's own sgemm (the
  NumPy rule's bits, whatever this CPU's kernels do with ``TRANS``)."""

  def __init__(self):
    self.calls = []

  def __enter__(self):
    blas_calls.status()
    real = blas_calls.ctypes_routines()["sgemm"]
    gemm = copying_gemm(real, np.float32, self.calls)
    self._fn = ctypes.CFUNCTYPE(None, *real.argtypes)(gemm)
    slot = blas_calls.SLOT + blas_calls.NAMES.index("sgemm")
    self._slot, self._was = slot, int(blas_calls._status[0][slot])
    blas_calls._status[0][slot] = ctypes.cast(self._fn, ctypes.c_void_p).value
    return self

  def __exit__(self, *exc):
    blas_calls._status[0][self._slot] = self._was


def _run_forced(a_answer, b_answer):
  """The kernel compiled (a new plan: its loop's status array made now),
  with A's answer ``a_answer`` and B's ``b_answer``: its outputs and the
  (m, n, k) -> set of transB flags its sgemm calls passed."""
  pallas_np.clear_caches()
  with blas_calls.forced_transposed(a_answer, A), blas_calls.forced_transposed(b_answer, B), \
      _recorded_sgemm() as rec:
    before = native.stats()["native_calls"]
    got = _make(SYNC)(*_args())
    jax.block_until_ready(got)
    assert native.stats()["native_calls"] > before, "the compiled loop did not run"
  flags = {}
  for m, n, k, ta, tb in rec.calls:
    assert ta == blas_calls.NO_TRANS
    flags.setdefault((m, n, k), set()).add(tb)
  return got, flags


def _check(a_answer, b_answer):
  want = _make(OFF)(*_args())
  got, flags = _run_forced(a_answer, b_answer)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(bits(g), bits(w))
  trans = {1: {blas_calls.TRANS}, 0: {blas_calls.NO_TRANS}}
  assert flags == {(8, 16, 32): trans[a_answer], (12, 24, 32): trans[b_answer]}, flags


@needs_blas
@pytest.mark.parametrize("answers", [(1, 0), (0, 1)])
def test_each_dot_site_reads_in_place_only_where_its_shape_passed(answers):
  _check(*answers)


@needs_blas
def test_a_loop_loaded_by_its_prekey_keeps_its_sites_answers(own_cache):
  """Built and recorded here, then loaded from disk by its pre-key (no
  source generated: ``tier_records.Recorded``): the record holds the two
  sites' keys, and the loaded loop reads each site's own answer."""
  pallas_np.clear_caches()
  with blas_calls.forced_transposed(0):
    _make(SYNC)(*_args())  # (built, recorded)
  assert build_steps.prekeys, "no pre-key recorded"
  (record,) = [r for r in build_steps.prekeys.values() if "kinds" in r]
  assert [tuple(k) for k in record["transposed"]] == [A, B]
  for answers in ((1, 0), (0, 1)):
    build_steps.prekeys.clear()  # (only what is on disk: as a second process)
    build_steps.loaded.clear()
    hits = native.stats()["disk_hits"]
    _check(*answers)
    assert native.stats()["disk_hits"] == hits + 1
