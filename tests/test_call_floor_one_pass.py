"""The per-call floor of small vectorized grids (issue 41): a warm call of a
static grid whose whole pass is one batched kernel call goes straight to
that call (``grid.pass_front.OnePassFront``), skipping the layers that
chose it.

Each test checks the path is taken (``_run_vectorized`` is not reached) and
compares bit for bit with interpret=True, or checks that the front steps
aside when what it memoised changes (the vectorizer's choice or runner,
the layout switch, a failing pass, a kernel it does not apply to).
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np.errors import FallbackError
from pallas_np.grid import pass_front, run_strategies, vectorize
from tests.helpers import assert_identical

rng = np.random.default_rng(4141)


def softmax_kernel(x_ref, o_ref):
  x = x_ref[...].astype(jnp.float32)
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  o_ref[...] = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(o_ref.dtype)


def mul_max_kernel(x_ref, y_ref, o_ref):  # (no a*b+c: XLA may fuse that into an FMA)
  o_ref[...] = jnp.maximum(x_ref[...] * y_ref[...], y_ref[...]).astype(o_ref.dtype)


def gather_kernel(idx_ref, x_ref, o_ref):
  o_ref[...] = x_ref[...] * 2.0


def _softmax(interpret, rows=32):
  call = pl.pallas_call if interpret is True else pallas_np.pallas_call
  spec = pl.BlockSpec((8, 256), lambda i: (i, 0))
  return call(softmax_kernel, jax.ShapeDtypeStruct((rows, 256), jnp.bfloat16),
              grid=(rows // 8,), in_specs=[spec], out_specs=spec, interpret=interpret)


def _ragged(interpret):  # padded inputs and output: 100x70 in 32x32 blocks
  call = pl.pallas_call if interpret is True else pallas_np.pallas_call
  spec = pl.BlockSpec((32, 32), lambda i, j: (i, j))
  return call(mul_max_kernel, jax.ShapeDtypeStruct((100, 70), jnp.float32), grid=(4, 3),
              in_specs=[spec, spec], out_specs=spec, interpret=interpret)


def _bf16(*shape):
  return jnp.asarray(rng.standard_normal(shape).astype(ml_dtypes.bfloat16))


def _f32(*shape):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


@pytest.fixture(autouse=True)
def _fresh_plans():
  """Each test builds its plans (and so its fronts) anew."""
  pallas_np.clear_caches()
  yield
  pallas_np.clear_caches()


def _front_of(monkeypatch):
  """Records every OnePassFront built from now on."""
  built = []
  orig = pass_front.OnePassFront.of.__func__

  def of(cls, kp):
    front = orig(cls, kp)
    built.append((kp, front))
    return front
  monkeypatch.setattr(pass_front.OnePassFront, "of", classmethod(of))
  return built


def _count_full_path(monkeypatch):
  calls = []
  orig = run_strategies._run_vectorized
  monkeypatch.setattr(run_strategies, "_run_vectorized",
                      lambda kp, args: calls.append(1) or orig(kp, args))
  return calls


@pytest.mark.parametrize("make, args", [
    (_softmax, lambda: (_bf16(32, 256),)),
    (_ragged, lambda: (_f32(100, 70), _f32(100, 70))),
], ids=["softmax_bf16", "ragged_padded"])
def test_warm_one_pass_calls_skip_the_full_path(monkeypatch, make, args):
  built = _front_of(monkeypatch)
  fn, want_fn = make(pallas_np.InterpretParams()), make(True)
  a = args()
  assert_identical(fn(*a), want_fn(*a))
  assert built and isinstance(built[-1][1], pass_front.OnePassFront)
  kp = built[-1][0]
  assert kp.vectorizer.front is built[-1][1]
  full = _count_full_path(monkeypatch)
  for _ in range(3):
    a = args()
    assert_identical(fn(*a), want_fn(*a))
  assert full == []  # every warm call through the front
  assert kp.last_mode == "vectorized"


def test_routed_jit_calls_take_the_front(monkeypatch):
  """``jax.jit`` of a numpy-mode call (the routed whole-program path) runs
  the same kernel plan: its warm calls take the front too."""
  built = _front_of(monkeypatch)
  fn, want_fn = jax.jit(_softmax(pallas_np.InterpretParams())), _softmax(True)
  x = _bf16(32, 256)
  assert_identical(fn(x), want_fn(x))
  assert built and isinstance(built[-1][1], pass_front.OnePassFront)
  full = _count_full_path(monkeypatch)
  for _ in range(3):
    x = _bf16(32, 256)
    assert_identical(fn(x), want_fn(x))
  assert full == []


def test_front_steps_aside_when_the_choice_or_runner_changes(monkeypatch):
  built = _front_of(monkeypatch)
  fn, want_fn = _softmax(pallas_np.InterpretParams()), _softmax(True)
  x = _bf16(32, 256)
  assert_identical(fn(x), want_fn(x))
  kp, front = built[-1]
  gv = kp.vectorizer
  full = _count_full_path(monkeypatch)
  gv._chosen.clear()  # (what a pass that found communicating lanes does)
  gv.runners.clear()
  assert_identical(fn(x), want_fn(x))
  assert full == [1]  # the full path ran, rebuilt the choice and a new front
  assert gv.front and gv.front is not front
  assert_identical(fn(x), want_fn(x))
  assert full == [1]


def test_front_steps_aside_when_the_layout_switch_changes(monkeypatch):
  built = _front_of(monkeypatch)
  fn, want_fn = _softmax(pallas_np.InterpretParams()), _softmax(True)
  x = _bf16(32, 256)
  fn(x)
  kp, front = built[-1]
  full = _count_full_path(monkeypatch)
  monkeypatch.setattr(vectorize, "LANES_LAST", not kp.vectorizer.lanes_last)
  assert_identical(fn(x), want_fn(x))
  assert full == [1]
  assert kp.vectorizer.front is not front


@pytest.mark.parametrize("use_front", [True, False])
def test_a_failing_pass_is_handled_as_by_the_full_path(monkeypatch, use_front):
  """The pass raising where the sequential loop does not: the front hands
  the failure to the full path's fallback (a FallbackError: the pass has a
  bug), exactly as without the front; the front is dropped and the next
  call runs."""
  built = _front_of(monkeypatch)
  fn, want_fn = _softmax(pallas_np.InterpretParams()), _softmax(True)
  x = _bf16(32, 256)
  fn(x)
  kp, front = built[-1]
  if not use_front:
    kp.vectorizer.front = False
  runner = front.runner
  orig = type(runner).run_one_pass
  failed = []

  def run_one_pass(self, *a):
    if not failed:
      failed.append(1)
      raise RuntimeError("boom")
    return orig(self, *a)
  monkeypatch.setattr(type(runner), "run_one_pass", run_one_pass)
  full = _count_full_path(monkeypatch)
  with pytest.raises(FallbackError, match="boom"):
    fn(x)
  assert failed == [1] and full == ([] if use_front else [1])
  assert kp.vectorizer.front is not front
  assert isinstance(kp.vectorizer.last_failure, RuntimeError)
  assert_identical(fn(x), want_fn(x))


def test_kernel_errors_stay_the_full_paths():
  """A kernel error on a warm call is reported as without the front."""
  def oob_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  spec = pl.BlockSpec((8, 128), lambda i: (i + 1, 0))  # the last step reads past the end
  fn = pallas_np.pallas_call(oob_kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32),
                             grid=(4,), in_specs=[spec], out_specs=spec,
                             interpret=pallas_np.InterpretParams())
  x = _f32(32, 128)
  errors = []
  for _ in range(3):
    try:
      fn(x)
    except Exception as e:  # noqa: BLE001 - the same error each time
      errors.append((type(e), str(e)))
  assert len(errors) == 3 and errors[0] == errors[1] == errors[2]


def test_new_shapes_and_dtypes_get_their_own_plan():
  """A call with another shape or dtype never reuses a front built for
  another plan: each result matches interpret=True."""
  fn = pallas_np.pallas_call(mul_max_kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32),
                             grid=(4,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))] * 2,
                             out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                             interpret=pallas_np.InterpretParams())
  want = pl.pallas_call(mul_max_kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32),
                        grid=(4,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))] * 2,
                        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), interpret=True)
  for _ in range(2):
    a, b = _f32(32, 128), _f32(32, 128)
    assert_identical(fn(a, b), want(a, b))
  for a, b in [(_f32(64, 128), _f32(64, 128)),  # (the grid reads the first 32 rows)
               (jnp.asarray(rng.integers(-50, 50, (32, 128)), jnp.int32),
                jnp.asarray(rng.integers(-50, 50, (32, 128)), jnp.int32))]:
    for _ in range(2):
      assert_identical(fn(a, b), want(a, b))


def test_scalar_prefetch_grids_look_their_choice_up_per_call(monkeypatch):
  """A grid whose index maps read scalar prefetch: the pass depends on the
  values, so the front (``PrefetchPassFront``) looks the choice up on each
  call; values it has no runner for go to the full path, which builds one."""
  built = _front_of(monkeypatch)
  x = _f32(16, 128)

  def make(interp):
    call = pl.pallas_call if interp is True else pallas_np.pallas_call
    return call(gather_kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                grid_spec=pltpu.PrefetchScalarGridSpec(
                    num_scalar_prefetch=1, grid=(8,),
                    in_specs=[pl.BlockSpec((1, 128), lambda i, idx: (idx[i], 0))],
                    out_specs=pl.BlockSpec((1, 128), lambda i, idx: (i, 0))),
                interpret=interp)
  fn, want = make(pallas_np.InterpretParams()), make(True)
  idx1 = jnp.asarray(rng.integers(0, 16, 8), jnp.int32)
  idx2 = jnp.asarray((np.asarray(idx1) + 3) % 16, jnp.int32)
  assert_identical(fn(idx1, x), want(idx1, x))
  assert isinstance(built[-1][1], pass_front.PrefetchPassFront)
  full = _count_full_path(monkeypatch)
  assert_identical(fn(idx1, x), want(idx1, x))
  assert full == []
  assert_identical(fn(idx2, x), want(idx2, x))  # new values: their runner built
  assert full == [1]
  for idx in (idx2, idx1, idx2):
    assert_identical(fn(idx, x), want(idx, x))
  assert full == [1]
  bad = jnp.asarray([0, 1, 2, 3, 4, 5, 6, 99], jnp.int32)  # a block past the end
  with pytest.raises(Exception) as front_err:
    fn(bad, x)
  kp = built[-1][0]
  kp.vectorizer.front = False
  with pytest.raises(Exception) as full_err:
    fn(bad, x)
  assert (type(front_err.value), str(front_err.value)) == (type(full_err.value),
                                                            str(full_err.value))
