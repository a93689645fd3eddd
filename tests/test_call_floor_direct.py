"""The per-call floor, round 4 (issue 41): a warm call of a one-point
kernel runs in one frame straight to jax.Arrays (``SinglePoint.direct``
through ``EagerPlan.direct``, ``_compat.exact_array_putter``), eager and
under ``jax.jit``; the eager-jit program memo finds a loop's repeated call
by identity (``_compat.install_jit_params_memo``).

Each test checks the path is taken (the code it replaces is not reached)
and compares bit for bit with interpret=True, or checks what the path must
keep: fresh outputs that alias nothing, the jax.Array properties of the old
hand-off, errors on every call, and the memo missing when anything it keys
on changes.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np import _compat as jc
from pallas_np import api, lru, whole_program
from pallas_np.errors import KernelError
from pallas_np.grid import KernelPlan, run_strategies, vectorize
from tests.helpers import assert_identical

rng = np.random.default_rng(414)
SDS = jax.ShapeDtypeStruct((8, 128), jnp.float32)


def _f32(*shape):
  return rng.standard_normal(shape).astype(np.float32)


def copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def affine_kernel(x_ref, y_ref, o_ref, acc_ref):  # two operands and a scratch buffer
  acc_ref[...] = x_ref[...] * 2.0
  o_ref[...] = acc_ref[...] + y_ref[...]


def _numpy_callables(kernel_call):
  """The numpy-mode ways of calling a kernel: pallas_np.pallas_call
  eagerly, pl.pallas_call(interpret="numpy") eagerly (JAX runs it through a
  jit: the routed path) and jax.jit of the former."""
  eager = kernel_call(pallas_np.InterpretParams())
  return {"eager": eager, "pl eager": kernel_call("numpy"), "jit": jax.jit(eager)}


def _copy_call(interpret):
  call = pl.pallas_call if interpret in (True, "numpy") else pallas_np.pallas_call
  return call(copy_kernel, SDS, interpret=interpret)


def _affine_call(interpret):
  call = pl.pallas_call if interpret in (True, "numpy") else pallas_np.pallas_call
  return call(affine_kernel, SDS, scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)],
              interpret=interpret)


@pytest.mark.parametrize("make", [_copy_call, _affine_call], ids=["one-operand", "general"])
@pytest.mark.parametrize("how", ["eager", "pl eager", "jit"])
def test_warm_calls_run_direct(monkeypatch, make, how):
  """After the first call, neither ``KernelPlan.run`` nor the strategy's
  ``run``: the direct function."""
  fn = _numpy_callables(make)[how]
  want_fn = make(True)
  args = [jnp.asarray(_f32(8, 128)) for _ in range(1 if make is _copy_call else 2)]
  assert_identical(fn(*args), want_fn(*args))
  runs = []
  orig, orig_single = KernelPlan.run, run_strategies.SinglePoint.run
  monkeypatch.setattr(KernelPlan, "run", lambda self, *a, **k: runs.append(1) or orig(self, *a, **k))
  monkeypatch.setattr(run_strategies.SinglePoint, "run",
                      lambda self, *a: runs.append(2) or orig_single(self, *a))
  for _ in range(3):
    args = [jnp.asarray(_f32(8, 128)) for _ in args]
    assert_identical(fn(*args), want_fn(*args))
    np_args = [np.asarray(a) for a in args]  # NumPy arguments take it too
    assert_identical(fn(*np_args), want_fn(*args))
  assert runs == []


def test_direct_outputs_fresh_and_alias_nothing():
  """Every call's output is a new buffer: never the caller's NumPy array
  (mutating it afterwards leaves the output alone), never an earlier
  output, never the plan's template."""
  for fn in _numpy_callables(_copy_call).values():
    x = _f32(8, 128)
    outs = []
    for _ in range(4):
      outs.append(fn(x))
    want = x.copy()
    x[...] = -1.0  # the caller writes its array after the calls
    ptrs = {o.unsafe_buffer_pointer() for o in outs}
    assert len(ptrs) == len(outs)
    assert x.ctypes.data not in ptrs
    for o in outs:
      np.testing.assert_array_equal(np.asarray(o), want)
    outs[0].delete()  # one output deleted: the others keep their data
    for o in outs[1:]:
      np.testing.assert_array_equal(np.asarray(o), want)


@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.bool_, ml_dtypes.bfloat16,
                                   np.uint16, np.complex64])
@pytest.mark.parametrize("weak", [False, True])
def test_putter_hands_out_what_np_to_jax_did(dtype, weak):
  put = jc.exact_array_putter((8, 128), dtype, weak)
  x = np.asarray(rng.integers(0, 2, (8, 128))).astype(dtype)
  got, want = put([x.copy()]), jc.np_to_jax(x.copy(), weak)
  assert type(got) is type(want)
  assert got.aval == want.aval and got.weak_type == want.weak_type == weak
  assert got.dtype == want.dtype == np.dtype(dtype)
  assert got.sharding == want.sharding and got.committed == want.committed
  np.testing.assert_array_equal(np.asarray(got), x)


def test_putter_declines_structured_dtypes():
  assert jc.exact_array_putter((4,), np.dtype([("a", np.int32), ("b", np.float32)])) is None
  assert jc.exact_array_putter((4,), np.dtype(object)) is None


def test_direct_outputs_match_interpret_properties():
  """dtype, weak type, committed-ness and sharding of a warm direct call's
  output are interpret=True's (and the first call's)."""
  x = jnp.asarray(_f32(8, 128))
  want = _copy_call(True)(x)
  for fn in _numpy_callables(_copy_call).values():
    first = fn(x)
    for got in (first, fn(x), fn(x)):
      assert got.aval == want.aval and got.weak_type == want.weak_type
      assert got.committed == want.committed
      assert got.sharding == want.sharding


def _lost_dma(interpret):
  def kernel(x_ref, o_ref, sem):
    pltpu.make_async_copy(x_ref, o_ref, sem).start()
  call = pl.pallas_call if interpret in (True, "numpy") else pallas_np.pallas_call
  return call(kernel, out_shape=SDS, in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
              out_specs=pl.BlockSpec(memory_space=pl.ANY),
              scratch_shapes=[pltpu.SemaphoreType.DMA(())], interpret=interpret)


def test_unfinished_dma_raises_on_every_warm_call():
  """The DMA check at the end of a run (dma.check_finished) is in the
  direct path: a DMA never waited on raises on every call."""
  x = jnp.ones((8, 128), jnp.float32)
  for fn in _numpy_callables(_lost_dma).values():
    for _ in range(3):
      with pytest.raises(Exception, match="still in flight"):
        jax.block_until_ready(fn(x))


def test_kernel_error_on_warm_jit_call_names_the_point():
  def kernel(i_ref, x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(i_ref[0], 8), :]

  def make(interpret):
    call = pl.pallas_call if interpret is True else pallas_np.pallas_call
    return call(kernel, SDS, in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec()],
                interpret=interpret)
  x = jnp.asarray(_f32(16, 128))
  ok, bad = jnp.asarray([8], jnp.int32), jnp.asarray([12], jnp.int32)
  want = make(True)(ok, x)
  for fn in (make(pallas_np.InterpretParams()), jax.jit(make(pallas_np.InterpretParams()))):
    for _ in range(3):
      assert_identical(fn(ok, x), want)
      with pytest.raises(KernelError, match=r"grid point \(\)") as info:
        fn(bad, x)
      assert isinstance(info.value.original, IndexError)


def test_routed_call_with_arguments_to_convert():
  """A routed jit call whose NumPy argument is not of the program's dtype
  (float64 without x64: the program takes float32) is converted, not run
  direct on the wrong dtype."""
  fn = jax.jit(_copy_call(pallas_np.InterpretParams()))
  x32 = jnp.asarray(_f32(8, 128))
  x64 = rng.standard_normal((8, 128))  # (not float32 values: rounded by the conversion)
  want_fn = _copy_call(True)
  for _ in range(3):
    assert_identical(fn(x32), want_fn(x32))
    assert_identical(fn(x64), want_fn(x64))


# -- the eager-jit memo found by identity ------------------------------------------
@pytest.fixture
def memo_lookups(monkeypatch):
  """The keys the eager-jit memo is asked for (``whole_program._jit_params_memo``)."""
  seen = []
  orig = lru.LRU.peek

  def peek(self, key, default=None):
    if self is whole_program._jit_params_memo:
      seen.append(key)
    return orig(self, key, default)
  monkeypatch.setattr(lru.LRU, "peek", peek)
  return seen


def test_memo_finds_repeated_calls_by_identity(memo_lookups):
  fn = jax.jit(_copy_call(pallas_np.InterpretParams()))
  x = jnp.asarray(_f32(8, 128))
  want = _copy_call(True)(x)
  fn(x)
  fn(x)
  memo_lookups.clear()
  for _ in range(3):
    assert_identical(fn(x), want)
  assert memo_lookups and all(type(k) is int for k in memo_lookups)  # never the hashed key


def test_memo_misses_when_what_it_keys_on_changes(memo_lookups):
  """Another shape, dtype, weak type, placement object or forced option
  between warm calls: the identity front misses, the hashed memo (or a
  new trace) answers, the result is right."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  def make(interpret, shape, dtype):
    call = pl.pallas_call if interpret is True else pallas_np.pallas_call
    return call(kernel, jax.ShapeDtypeStruct(shape, dtype), interpret=interpret)
  fns = {}

  def run(x):
    key = (x.shape, x.dtype)
    if key not in fns:
      fns[key] = make(True, x.shape, x.dtype)
    return fns[key](x)
  numpy_fn = jax.jit(lambda x: make(pallas_np.InterpretParams(), x.shape, x.dtype)(x))
  xs = [jnp.asarray(_f32(8, 128)), jnp.asarray(_f32(16, 128)),
        jnp.asarray(rng.integers(-9, 9, (8, 128)), jnp.int32),
        jax.device_put(jnp.asarray(_f32(8, 128)), jax.devices()[0]),  # committed
        jnp.asarray(_f32(8, 128))]
  for _ in range(2):
    for x in xs:
      for _ in range(2):
        assert_identical(numpy_fn(x), run(x))
  memo_lookups.clear()
  numpy_fn(xs[0])
  numpy_fn(xs[1])  # another shape: the identity front misses, the hashed key answers
  assert any(type(k) is tuple for k in memo_lookups)


def test_memo_misses_under_a_forced_option():
  """The trace context (a forced interpret mode among it) is part of the
  identity check: a kernel reading its uninitialised output gives NaNs,
  then zeros under the forced option, then NaNs again, warm calls each."""
  def kernel(x_ref, o_ref):
    o_ref[:4, :] = x_ref[:4, :]
  fn = jax.jit(pallas_np.pallas_call(kernel, SDS, interpret=pallas_np.InterpretParams()))
  x = jnp.asarray(_f32(8, 128))
  zero = pallas_np.InterpretParams(uninitialized="zero")
  for _ in range(3):
    assert np.isnan(np.asarray(fn(x))[4:]).all()
    with pallas_np.force_numpy_interpret(zero):
      assert (np.asarray(fn(x))[4:] == 0).all()
    assert np.isnan(np.asarray(fn(x))[4:]).all()


def test_memo_emptied_by_clear_caches():
  fn = jax.jit(_copy_call(pallas_np.InterpretParams()))
  x = jnp.asarray(_f32(8, 128))
  fn(x)
  fn(x)
  assert len(whole_program._jit_params_memo) > 0
  pallas_np.clear_caches()
  assert len(whole_program._jit_params_memo) == 0
  for _ in range(3):
    assert_identical(fn(x), _copy_call(True)(x))


# -- the eager call's identity front ---------------------------------------------
@pytest.fixture
def signatures(monkeypatch):
  """Every flat signature an eager ``pallas_np.pallas_call`` builds."""
  seen = []
  orig = api.flat_signature
  monkeypatch.setattr(api, "flat_signature", lambda args: seen.append(1) or orig(args))
  return seen


def test_eager_repeated_call_found_by_identity(signatures):
  fn, want_fn = _copy_call(pallas_np.InterpretParams()), _copy_call(True)
  x = jnp.asarray(_f32(8, 128))
  want = want_fn(x)
  fn(x)
  fn(x)
  signatures.clear()
  for _ in range(3):
    assert_identical(fn(x), want)
  assert signatures == []  # (the front: no signature built)
  out = fn(x)
  for _ in range(3):  # a loop feeding the output back: the putter's aval each time
    out = fn(out)
  assert_identical(out, want)
  assert len(signatures) <= 1  # (at most the first output's aval through the signature)


def test_eager_front_misses_when_the_arguments_change(signatures):
  """Shapes, dtypes, weak types and NumPy arguments between warm calls:
  each call gets its own kernel, bit for bit interpret=True's."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...].astype(o_ref.dtype) * 2 + 1
  fn = pallas_np.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32))
  want_fn = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32), interpret=True)
  weak = jax.lax.broadcast(jnp.asarray(3.0), (8, 128))
  assert weak.weak_type
  xs = [jnp.asarray(_f32(8, 128)), jnp.asarray(rng.integers(-9, 9, (8, 128)), jnp.int32),
        weak, _f32(8, 128), jnp.asarray(_f32(8, 128)).astype(jnp.bfloat16)]
  for _ in range(3):
    for x in xs:
      for _ in range(2):
        assert_identical(fn(x), want_fn(x))


def test_eager_front_emptied_by_clear_caches(signatures):
  fn = _copy_call(pallas_np.InterpretParams())
  x = jnp.asarray(_f32(8, 128))
  fn(x)
  fn(x)
  pallas_np.clear_caches()
  signatures.clear()
  assert_identical(fn(x), _copy_call(True)(x))
  assert signatures == [1]  # (the front was emptied: the call built its signature)


# -- grids whose batched pass is declined for the grid alone ------------------------
def _grid_copy(interpret, grid=(2,)):
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  call = pl.pallas_call if interpret is True else pallas_np.pallas_call
  return call(copy_kernel, jax.ShapeDtypeStruct((8 * grid[0], 128), jnp.float32), grid=grid,
              in_specs=[spec], out_specs=spec, interpret=interpret)


def test_declined_grid_goes_straight_to_the_loop(monkeypatch):
  """A two-point grid auto mode does not batch ("too few lanes"): from the
  second call on, the vectorizer is not asked again; same bits."""
  fn = _grid_copy(pallas_np.InterpretParams(native_loops="off"))
  x = jnp.asarray(_f32(16, 128))
  want = _grid_copy(True)(x)
  assert_identical(fn(x), want)
  asked = []
  orig = vectorize.run_vectorized
  monkeypatch.setattr(vectorize, "run_vectorized", lambda *a: asked.append(1) or orig(*a))
  for _ in range(3):
    assert_identical(fn(x), want)
  assert asked == []
  report = [r for r in pallas_np.grid_report() if r["grid"] == (2,)][-1]
  assert report["mode"] == "sequential" and "too few lanes" in report["why"]


def test_declined_grid_with_scalar_prefetch_asked_every_call(monkeypatch):
  """With scalar prefetch the index maps read its values: the answer is
  not the grid's alone, the vectorizer is asked on every call."""
  def kernel(s_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] + s_ref[0]

  def make(interpret):
    spec = pl.BlockSpec((8, 128), lambda i, s: (i, 0))
    call = pl.pallas_call if interpret is True else pallas_np.pallas_call
    return call(kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32),
                grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(2,),
                                                       in_specs=[spec], out_specs=spec),
                interpret=interpret)
  fn, want_fn = make(pallas_np.InterpretParams(native_loops="off")), make(True)
  s, x = jnp.asarray([3], jnp.int32), jnp.asarray(_f32(16, 128))
  assert_identical(fn(s, x), want_fn(s, x))
  asked = []
  orig = vectorize.run_vectorized
  monkeypatch.setattr(vectorize, "run_vectorized", lambda *a: asked.append(1) or orig(*a))
  for _ in range(2):
    assert_identical(fn(s, x), want_fn(s, x))
  assert asked == [1, 1]


def two_out_kernel(x_ref, y_ref, o_ref, p_ref, acc_ref):  # cut blocks, scratch, two outputs
  acc_ref[...] = x_ref[...] + y_ref[...]
  o_ref[...] = acc_ref[...] * 2.0
  p_ref[...] = acc_ref[...] - x_ref[...]


def _two_out(interpret):
  call = pl.pallas_call if interpret is True else pallas_np.pallas_call
  part = pl.BlockSpec((8, 128), lambda: (0, 0))  # (the first rows of a (16, 128) array)
  return call(two_out_kernel, (jax.ShapeDtypeStruct((16, 128), jnp.float32), SDS),
              in_specs=[part, pl.BlockSpec((8, 128), lambda: (0, 0))],
              out_specs=[part, pl.BlockSpec((8, 128), lambda: (0, 0))],
              scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)], interpret=interpret)


def test_direct_runner_written_out_for_any_operands(monkeypatch):
  """The direct function is generated for its operand, output, cut and
  scratch counts (``run_strategies._direct_source``): two inputs, two
  outputs, blocks cut from bigger arrays, scratch; the bits of the full
  path (``SinglePoint.run``: the output rows the kernel never writes hold
  the same fill) and of interpret=True where written; a wrong operand count
  raises ``run``'s TypeError."""
  runners = []
  real = KernelPlan.direct_runner
  monkeypatch.setattr(KernelPlan, "direct_runner",
                      lambda self, puts: runners.append(real(self, puts)) or runners[-1])
  x, y = jnp.asarray(_f32(16, 128)), jnp.asarray(_f32(8, 128))
  fn = _two_out(pallas_np.InterpretParams())
  got = [fn(x, y) for _ in range(3)]
  (runner,) = runners
  assert runner.__code__.co_filename.startswith("<pallas_np direct run")
  want = _two_out(True)(x, y)
  kp = runner.__globals__["kp"]
  full = kp.strategy.run(kp, [x, y])
  for o, p in got:
    np.testing.assert_array_equal(np.asarray(o).view(np.uint32), full[0].view(np.uint32))
    np.testing.assert_array_equal(np.asarray(p), full[1])
    np.testing.assert_array_equal(np.asarray(o)[:8], np.asarray(want[0])[:8])
    np.testing.assert_array_equal(np.asarray(p), np.asarray(want[1]))
  with pytest.raises(TypeError) as direct_error:
    runner([x])
  with pytest.raises(TypeError) as run_error:
    kp.strategy.run(kp, [x])
  assert str(direct_error.value) == str(run_error.value)
