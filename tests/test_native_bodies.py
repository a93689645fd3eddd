"""Whole kernel bodies compiled by the native tier (pallas_np/native/bodies.py,
docs/native_bodies.md): a kernel without loops, run with
``native_loops="sync"`` (its body compiled at the first run, kept without
the timing probe), gives the bits of ``"off"`` (the NumPy plan) and, within
float tolerance, interpret=True's; its errors are the NumPy plan's; a body
with a primitive the tier refuses runs its NumPy plan. Each test checks
that the compiled body ran (``bodies.stats()["native_calls"]``), or did not.
A numba build takes seconds: few kernels, several features each."""
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

import pallas_np
from pallas_np.native import bodies
from tests.native_elig_util import OFF, SYNC, bits

_rng = np.random.default_rng(41)


def _f32(*shape):
  return jnp.asarray(_rng.standard_normal(shape).astype(np.float32))


def _native_steps():
  return bodies.stats()["native_calls"]


def compiled_body_equals_numpy(make, *args, steps, rtol=1e-5, atol=1e-5):
  """``make(interpret)``: the compiled body ran ``steps`` grid steps (the
  first call builds it: its first step runs compiled too) and gives the
  NumPy plan's bits, twice, and interpret=True's values."""
  fn = make(SYNC)
  before = _native_steps()
  got = [np.asarray(fn(*args)) for _ in range(2)]
  ran = _native_steps() - before
  off = np.asarray(make(OFF)(*args))
  want = np.asarray(make(True)(*args))
  for g in got:
    np.testing.assert_array_equal(bits(g), bits(off))
  np.testing.assert_allclose(got[0], want, rtol=rtol, atol=atol)
  assert ran == 2 * steps, f"the compiled body ran {ran} grid steps, not {2 * steps}"
  return got[0]


def _norm_kernel(x_ref, w_ref, o_ref):
  """Elementwise ops, float sums in NumPy's order, max, rsqrt, a select."""
  x = x_ref[...]
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  y = (x - mean) * lax.rsqrt(var + 1e-5) * w_ref[...]
  o_ref[...] = jnp.where(y > 0, y, 0.1 * y) + jnp.max(x, axis=-1, keepdims=True)


def test_elementwise_and_reductions_one_point():
  x, w = _f32(8, 128), _f32(1, 128)
  make = lambda interp: pl.pallas_call(
      _norm_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interp)
  compiled_body_equals_numpy(make, x, w, steps=1)


def _rsqrt_kernel(x_ref, o_ref):
  x = x_ref[...]
  o_ref[...] = lax.rsqrt(x) * 2.0 + x


def test_rsqrt_edge_values():
  """rsqrt's emitter (the NumPy rule's reciprocal(sqrt(x))) on zeros of
  both signs, negatives, infinities, NaN, tiny and huge values."""
  specials = np.array([0.0, -0.0, -1.0, np.inf, -np.inf, np.nan, 1e-30, 3e38, 1.0, 2.0, 0.25,
                       1e-20], np.float32)
  x = np.abs(_rng.standard_normal((8, 128)).astype(np.float32)) * 100
  x.reshape(-1)[:specials.size] = specials
  x = jnp.asarray(x)
  make = lambda interp: pl.pallas_call(
      _rsqrt_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interp)
  compiled_body_equals_numpy(make, x, steps=1)


def _acc_kernel(x_ref, y_ref, n_ref, o_ref, acc_ref):
  """Program ids and counts (scalar arguments of the compiled body), an f32
  dot through NumPy's BLAS, an int32 dot, a scratch accumulator across
  grid steps, pl.when on both sides."""
  k = pl.program_id(2)

  @pl.when(k == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)
  ints = jnp.dot(n_ref[...], n_ref[...].T, preferred_element_type=jnp.int32)
  where = (pl.program_id(0) * 10 + pl.program_id(1)).astype(jnp.float32)

  @pl.when(k == pl.num_programs(2) - 1)
  def _():
    o_ref[...] = acc_ref[...] + ints.astype(jnp.float32) + where


def test_grid_with_program_ids_and_scratch_accumulator():
  n, b = 32, 16
  x, y = _f32(n, n), _f32(n, n)
  ints = jnp.asarray(_rng.integers(-50, 50, (n, b)), jnp.int32)

  def make(interp):
    return pl.pallas_call(
        _acc_kernel, out_shape=jax.ShapeDtypeStruct((n, n), jnp.float32), grid=(2, 2, 2),
        in_specs=[pl.BlockSpec((b, b), lambda i, j, k: (i, k)),
                  pl.BlockSpec((b, b), lambda i, j, k: (k, j)),
                  pl.BlockSpec((b, b), lambda i, j, k: (i, 0))],
        out_specs=pl.BlockSpec((b, b), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((b, b), jnp.float32)], interpret=interp)
  compiled_body_equals_numpy(make, x, y, ints, steps=8, rtol=1e-4, atol=1e-3)


def _masked_kernel(x_ref, o_ref, *, n):
  """A Triton-style body: lanes past the end masked off on load and store."""
  cols = jnp.arange(64)
  mask = cols < n
  x = plgpu.load(x_ref.at[cols], mask=mask, other=-1.0)
  plgpu.store(o_ref.at[cols], jnp.maximum(x, 0.0) * 2.0 + 1.0, mask=mask)


def test_masked_triton_style_body():
  n = 50
  x = _f32(n)
  make = lambda interp: pl.pallas_call(
      functools.partial(_masked_kernel, n=n), out_shape=jax.ShapeDtypeStruct((n,), x.dtype),
      interpret=interp)
  compiled_body_equals_numpy(make, x, steps=1)


def _gather_kernel(idx_ref, x_ref, o_ref):
  o_ref[...] = x_ref[pl.ds(idx_ref[0], 8), :] * 2.0


def _gather_call(interp):
  return pl.pallas_call(
      _gather_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(1,),
          in_specs=[pl.BlockSpec((32, 128), lambda i, idx: (0, 0))],
          out_specs=pl.BlockSpec((8, 128), lambda i, idx: (0, 0))),
      interpret=interp)


def test_out_of_bounds_raises_the_numpy_plans_error():
  x = _f32(32, 128)
  ok = jnp.asarray([8], jnp.int32)
  compiled_body_equals_numpy(_gather_call, ok, x, steps=1)  # (built, then:)
  bad = jnp.asarray([30], jnp.int32)
  before = _native_steps()
  with pytest.raises(IndexError) as native_error:
    _gather_call(SYNC)(bad, x)
  with pytest.raises(IndexError) as numpy_error:
    _gather_call(OFF)(bad, x)
  assert str(native_error.value) == str(numpy_error.value)
  assert _native_steps() == before  # (the failing step is not counted as run)


def _refused_kernel(x_ref, o_ref):
  o_ref[...] = jnp.sin(x_ref[...]) + 1.0  # (sin: native_refused)


def test_refused_body_runs_the_numpy_plan():
  x = _f32(8, 128)
  make = lambda interp: pl.pallas_call(
      _refused_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interp)
  before = bodies.stats()
  got = np.asarray(make(SYNC)(x))
  after = bodies.stats()
  np.testing.assert_array_equal(bits(got), bits(make(OFF)(x)))
  assert after["refused"] == before["refused"] + 1
  assert after["native_calls"] == before["native_calls"]


def test_bodies_never_wrapped_when_off_or_holding_a_loop():
  """Off, too few eqns (a loop and its load and store), a program id below
  the top level, a value wider than MAX_ELEMENTS: the plan itself, no
  wrapper (bodies holding loops: tests/test_native_body_loops.py)."""
  def loop_kernel(x_ref, o_ref):
    o_ref[...] = lax.fori_loop(0, 3, lambda i, v: v * 2.0, x_ref[...])

  def when_pid_kernel(x_ref, o_ref):
    o_ref[...] = lax.cond(x_ref[0, 0] > 0, lambda: x_ref[...] + pl.program_id(0),
                          lambda: x_ref[...])
  def double_kernel(x_ref, o_ref):  # (3 eqns: fewer than MIN_EQNS)
    o_ref[...] = x_ref[...] * 2.0

  def poly_kernel(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = x * x * 2.0 + 1.0

  def wide_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + jnp.zeros((bodies.MAX_ELEMENTS + 8, 128), jnp.float32).sum()
  x = _f32(8, 128)
  for kernel, params, wrapped in ((poly_kernel, SYNC, True), (poly_kernel, OFF, False),
                                  (double_kernel, SYNC, False),
                                  (loop_kernel, SYNC, False), (when_pid_kernel, SYNC, False),
                                  (wide_kernel, SYNC, False)):
    jaxpr = jax.make_jaxpr(lambda v: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype), grid=(1,),
        interpret=params)(v))(x)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    plan = object()
    got = bodies.wrap(plan, eqn.params["jaxpr"], params)
    assert isinstance(got, bodies.BodyPlan) if wrapped else got is plan, kernel.__name__


def test_a_body_slower_than_its_numpy_plan_is_dropped():
  """The probe's decision (timed in background mode only): a body whose
  compiled step is not faster hands the grid back to the NumPy plan."""
  x, w = _f32(8, 128), _f32(1, 128)
  jaxpr = jax.make_jaxpr(lambda a, b: pl.pallas_call(
      _norm_kernel, out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype), interpret=SYNC)(a, b))(x, w)
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
  numpy_calls = []
  plan = types.SimpleNamespace(fn=lambda ctx, *refs: numpy_calls.append(refs))
  body_plan = bodies.wrap(plan, eqn.params["jaxpr"], SYNC)
  want = np.asarray(pl.pallas_call(_norm_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                   interpret=OFF)(x, w))
  for _ in range(2):  # (built at the first step; then the step function)
    out = np.full(x.shape, np.nan, np.float32)
    body_plan.fn(None, np.asarray(x), np.asarray(w), out)
    np.testing.assert_array_equal(bits(out), bits(want))
  assert body_plan.fn.__name__ == "native_step" and not numpy_calls
  slower = bodies.stats()["slower"]
  body_plan.decide(body_plan.fn, [1e-6, 1e-3])  # (NumPy 1 us, native 1 ms)
  assert bodies.stats()["slower"] == slower + 1
  body_plan.fn(None, np.asarray(x), np.asarray(w), out)
  assert len(numpy_calls) == 1


def test_a_refused_body_hands_the_grid_its_plan():
  """After a refusal the grid calls the plan's own function (no wrapper)."""
  x = _f32(8, 128)
  fn = pl.pallas_call(_refused_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                      grid=(2,), in_specs=[pl.BlockSpec((4, 128), lambda i: (i, 0))],
                      out_specs=pl.BlockSpec((4, 128), lambda i: (i, 0)), interpret=SYNC)
  jaxpr = jax.make_jaxpr(fn)(x)
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
  calls = []
  plan = types.SimpleNamespace(fn=lambda ctx, *refs: calls.append(len(refs)))
  body_plan = bodies.wrap(plan, eqn.params["jaxpr"], SYNC)
  refs = (np.asarray(x)[:4], np.zeros((4, 128), np.float32))
  body_plan.fn(None, *refs)  # (refused at this first run)
  assert body_plan.fn is plan.fn and calls == [2]


def _dma_body_kernel(x_hbm, o_ref, buf, sem, sem_out):
  """A body without loops holding a local DMA and a semaphore (their NumPy
  rules called back with the run context: dma_calls), then elementwise ops."""
  copy = pltpu.make_async_copy(x_hbm.at[pl.ds(8, 8)], buf, sem)
  copy.start()
  pl.semaphore_signal(sem_out, 3)
  copy.wait()
  seen = pl.semaphore_read(sem_out)
  pl.semaphore_wait(sem_out, 3)
  o_ref[...] = jnp.exp(buf[...] * 0.5) + seen.astype(jnp.float32) - buf[...]


def test_body_with_dmas_and_semaphores_runs_its_call_sites():
  """Merging the DMA call sites with compiled bodies: a body holding a
  DMA runs its step function through its call-site runner, bound to the
  step's run context (``bodies.dma_run``); once, it called the compiled
  function with no call sites bound."""
  x = _f32(24, 128)

  def make(interp):
    return pl.pallas_call(
        _dma_body_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA,
                        pltpu.SemaphoreType.REGULAR],
        interpret=interp)
  fn = make(SYNC)
  before = _native_steps()
  got = [np.asarray(fn(x)) for _ in range(2)]
  assert _native_steps() - before == 2, "the compiled body did not run"
  off = np.asarray(make(OFF)(x))
  for g in got:
    np.testing.assert_array_equal(bits(g), bits(off))
  xs = np.asarray(x)[8:16]
  np.testing.assert_allclose(got[0], np.exp(xs * np.float32(0.5)) + 3 - xs, rtol=1e-6, atol=1e-6)


def _norm_body_jaxpr(params):
  x, w = _f32(8, 128), _f32(1, 128)
  jaxpr = jax.make_jaxpr(lambda a, b: pl.pallas_call(
      _norm_kernel, out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype), interpret=params)(a, b))(x, w)
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
  return eqn.params["jaxpr"]


def test_timing_a_body_reads_the_clock_at_one_step_in_sample_steps(monkeypatch):
  """While a body's NumPy plan is timed (background mode, before its
  build), one grid step in SAMPLE_STEPS is timed and stands for them all;
  the others call the plan's function with no clock read (timing every
  step cost 1-3% of a small kernel). While its build is under way the grid
  gets the plan's own function, with no wrapper."""
  background = pallas_np.InterpretParams(native_loops="background")
  reads = []

  def clock():
    reads.append(1)
    return len(reads) * 1e-6  # (each timed step: 1 us)
  monkeypatch.setattr(bodies.time, "perf_counter", clock)
  calls = []
  plan = types.SimpleNamespace(fn=lambda ctx, *refs: calls.append(ctx))
  body_plan = bodies.wrap(plan, _norm_body_jaxpr(background), background)
  body = body_plan.body
  body.prechecked = True  # (as after its first run, with no library found by its pre-key)
  body.phase = "new"
  body_plan.route()
  n = 4 * bodies.SAMPLE_STEPS
  for _ in range(n):
    body_plan.fn(types.SimpleNamespace(), None, None, None)
  assert len(calls) == n
  assert len(reads) == 2 * n // bodies.SAMPLE_STEPS, "a clock read at every step"
  assert body.spent == pytest.approx(n * 1e-6)  # (each timed step stands for SAMPLE_STEPS)
  assert body.runs == n // bodies.SAMPLE_STEPS  # (the runs the timed steps saw)
  body.phase = "building"  # (its build queued: the plan's own function)
  body_plan.route()
  assert body_plan.fn is plan.fn


def test_a_body_takes_its_buffers_as_scratch_arrays():
  """A compiled body's buffers are slices of scratch arrays the tier
  allocates once and passes at every step (no allocation per step); a
  loop's stay allocated at its entry (LLVM vectorizes passes over
  separate allocations). Steps on different blocks, one after the other,
  each give the NumPy plan's bits."""
  from pallas_np.native import codegen
  body, _ = bodies.body_jaxpr(_norm_body_jaxpr(SYNC))
  src = codegen.loop_source(bodies.BodyEqn(body), False, "nan")
  assert src.scratch and "np.empty" not in src.text, src.text
  jaxpr = jax.make_jaxpr(lambda a: lax.fori_loop(0, 3, lambda i, v: v * v * 2.0 + v, a))(
      jnp.zeros((8, 128), jnp.float32))
  (loop,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("while", "scan")]
  src = codegen.loop_source(loop, False, "nan")
  assert not src.scratch and "np.empty" in src.text
  w = _f32(1, 128)

  def make(interp):
    return pl.pallas_call(_norm_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                          interpret=interp)
  fn, off = make(SYNC), make(OFF)
  before = _native_steps()
  for x in (_f32(8, 128), _f32(8, 128) * 100, _f32(8, 128)):
    np.testing.assert_array_equal(bits(np.asarray(fn(x, w))), bits(np.asarray(off(x, w))))
  assert _native_steps() - before == 3
