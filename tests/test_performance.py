"""Plan-compilation and boundary optimisations keep results exact: inlined
call bodies, copy-free reads of read-only inputs, zero-copy eager results,
single-threaded small GEMMs."""
import functools

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_np
from pallas_np import api, blas
from tests.helpers import run_both


@jax.custom_jvp
def _softplus(x):
  return jnp.logaddexp(x, 0.0)


_softplus.defjvp(lambda p, t: (_softplus(p[0]), t[0] * jax.nn.sigmoid(p[0])))


@jax.jit
def _inner(x):
  return jnp.floor_divide(x, 3.0) + _softplus(x)


def inlined_kernel(x_ref, o_ref):
  o_ref[...] = _inner(x_ref[...]) * 2.0


def test_call_bodies_are_inlined():
  x = jnp.linspace(-4.0, 4.0, 64, dtype=jnp.float32).reshape(8, 8)

  def make(interp):
    return pl.pallas_call(inlined_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=interp)
  run_both(make, x)
  plan = [entry[1] for entry in api._plan_cache.values()][-1]
  prims = {e.primitive.name for e in plan.kernel.jaxpr.eqns}
  assert "pjit" in prims or "jit" in prims  # the kernel jaxpr has the calls ...
  # ... but the generated code has no sub-plan call: every line is a rule of
  # a leaf primitive (the inner eqns were emitted in place).
  from pallas_np.compiler import sourcemap
  lines = sourcemap.lookup(plan.kernel.filename)
  names = {e.primitive.name for e in lines if e is not None}
  assert not names & {"pjit", "jit", "custom_jvp_call"}, names


def test_reads_of_read_only_inputs_and_the_callers_arrays():
  # x is read twice around a write to the output; the caller's writeable
  # NumPy array stays writeable and unchanged.
  def kernel(x_ref, o_ref):
    a = x_ref[...]
    o_ref[...] = a + 1.0
    o_ref[...] += x_ref[...] * a

  x = np.arange(16, dtype=np.float32).reshape(4, 4)
  before = x.copy()
  out = pallas_np.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
  np.testing.assert_array_equal(np.asarray(out), before + 1.0 + before * before)
  assert x.flags.writeable
  np.testing.assert_array_equal(x, before)


def test_value_read_before_the_ref_is_overwritten():
  # An input the kernel writes (a private copy): the value read first keeps the
  # old contents (the read copies, since that buffer is writeable).
  def kernel(x_ref, o_ref):
    old = x_ref[...]
    x_ref[...] = old * 10.0
    o_ref[...] = old + x_ref[...]

  x = jnp.arange(8.0, dtype=jnp.float32)

  def make(interp):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=interp)
  got = run_both(make, x)
  np.testing.assert_array_equal(np.asarray(got), np.arange(8.0) * 11.0)


def test_eager_results_do_not_alias_inputs():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  x = np.ones((4, 4), np.float32)
  out = pallas_np.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
  assert isinstance(out, jax.Array)
  x[...] = 5.0  # the caller mutates its array afterwards
  np.testing.assert_array_equal(np.asarray(out), np.ones((4, 4), np.float32))


def test_eager_call_traces_the_jitted_pallas_call_directly(monkeypatch):
  """pl.pallas_call returns a jitted function; the eager path traces it as
  interpret=True's first call does, not under a second jit level."""
  from pallas_np import _compat as jc
  traced = []
  orig = jc.jit_trace

  def recording(fn, args):
    out = orig(fn, args)
    traced.append(out.jaxpr)
    return out
  monkeypatch.setattr(jc, "jit_trace", recording)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0

  x = np.arange(8, dtype=np.float32)
  out = pallas_np.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
  np.testing.assert_array_equal(np.asarray(out), x + 1.0)
  assert [e.primitive.name for e in traced[0].eqns] == ["pallas_call"]
  # A jitted function's body directly (no jit eqn around it); any other
  # callable under jax.jit, with the same jaxpr as before.
  inner = jax.jit(lambda v: v * 2.0)
  assert [e.primitive.name for e in jc.jit_trace(inner, (x,)).jaxpr.eqns] == ["mul"]
  plain = jc.jit_trace(lambda v: inner(v) + 1.0, (x,)).jaxpr
  assert [e.primitive.name for e in plain.eqns] == [
      e.primitive.name for e in jax.jit(lambda v: inner(v) + 1.0).trace(x).jaxpr.eqns]


@pytest.mark.parametrize("shape", [(128, 256), (100, 200)])  # (100, 200): padded edge blocks
def test_eager_results_reach_jax_without_a_copy(monkeypatch, shape):
  """Output buffers over ``memory.TEMPLATE_MAX_BYTES`` (smaller ones are
  template copies: XLA's copy of those costs less than the aligned
  allocation, PERF_LOG 103) are allocated 64-byte aligned, which XLA's CPU
  client needs to alias them: the jax.Array is the buffer the kernel wrote."""
  from pallas_np import memory
  made = []
  orig = memory.aligned_empty

  def recording(shape, dtype):
    buf = orig(shape, dtype)
    made.append(buf)
    return buf
  monkeypatch.setattr(memory, "aligned_empty", recording)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0

  x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  out = pallas_np.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(shape, x.dtype),
                              grid=(pl.cdiv(shape[0], 64), pl.cdiv(shape[1], 128)),
                              in_specs=[pl.BlockSpec((64, 128), lambda i, j: (i, j))],
                              out_specs=pl.BlockSpec((64, 128), lambda i, j: (i, j)))(x)
  np.testing.assert_array_equal(np.asarray(out), x * 2.0)
  assert out.unsafe_buffer_pointer() in [b.ctypes.data for b in made]


def test_small_gemm_on_one_blas_thread_matches_matmul():
  rng = np.random.default_rng(0)
  a = rng.standard_normal((64, 32)).astype(np.float32)
  b = rng.standard_normal((32, 48)).astype(np.float32)
  small = blas.matmul_for(64 * 32 * 48)
  np.testing.assert_array_equal(small(a, b), np.matmul(a, b))
  big = blas.matmul_for(blas.MULTITHREAD_MACS)
  np.testing.assert_array_equal(big(a, b), np.matmul(a, b))


def test_kernel_run_sets_blas_threads_once(monkeypatch):
  """A kernel's small GEMMs run on one BLAS thread set once for the run; a
  big GEMM inside the run gets the caller's count back; the caller's count
  is restored when the (outermost) run ends, also after an error."""
  assert blas._set is not None, "NumPy's OpenBLAS was not found"
  seen = []
  real_matmul = np.matmul

  def spy(a, b, out=None):
    seen.append((blas._get(), blas._runs))
    return real_matmul(a, b, out=out)
  monkeypatch.setattr(blas.np, "matmul", spy)
  monkeypatch.setattr(blas, "_warmed", [True])  # (the warm-up: test_blas_warm.py)
  before = blas._get()
  blas._set(2)
  try:
    a = np.ones((8, 8), np.float32)
    small, big = blas.matmul_for(512), blas.matmul_for(blas.MULTITHREAD_MACS)
    with blas.kernel_run():
      assert blas._get() == 1
      with blas.kernel_run():  # nested (a kernel inside a whole-program run)
        small(a, a)
        big(a, a)
        small(a, a)
      assert blas._get() == 1
    assert blas._get() == 2
    assert seen == [(1, 2), (2, 2), (1, 2)]
    with pytest.raises(ZeroDivisionError), blas.kernel_run():
      1 / 0
    assert blas._get() == 2 and blas._runs == 0

    def kernel(x_ref, y_ref, o_ref):  # through a real kernel
      o_ref[...] = x_ref[...] @ y_ref[...]
    seen.clear()
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    out = pallas_np.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 8), jnp.float32))(x, x)
    np.testing.assert_array_equal(np.asarray(out), real_matmul(x, x))
    assert seen == [(1, 1)] and blas._get() == 2  # inside the kernel's run
  finally:
    blas._set(before)


# Malloc tuning (on the first plan, opt-in, not at import): tests/test_env_switches.py
# ::test_malloc_is_left_alone_unless_asked.


def test_equal_ref_accesses_share_one_compiled_indexer():
  """Accesses with the same transforms, literal indices, ref shape and dtype
  share one RefAccess (DMA-heavy kernels repeat a few hundreds of times);
  any difference gives another one, and results stay exact."""
  from pallas_np.state.indexing import RefAccess

  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    a = x_ref[pl.ds(i * 4, 4)]
    b = x_ref[pl.ds(i * 4, 4)]
    c = x_ref[pl.ds(1, 4)]
    d = x_ref[pl.ds(2, 4)]
    o_ref[pl.ds(i * 4, 4)] = a + 2 * b + 3 * c + 4 * d
  x = jnp.arange(8.0)
  call = lambda interp: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                                       grid=(2,), interpret=interp)
  jaxpr = jax.make_jaxpr(call("numpy"))(x)
  kj = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call").params["jaxpr"]
  gets = [e for e in kj.eqns if e.primitive.name == "get"]
  assert len(gets) == 4
  accesses = [RefAccess.shared(e.params["tree"], e.invars[1:], e.invars[0].aval.shape,
                               clamp=False, ref_dtype=e.invars[0].aval.dtype) for e in gets]
  assert accesses[0] is accesses[1]  # same dynamic pl.ds
  assert len({id(a) for a in accesses}) == 3  # pl.ds(1, 4) and pl.ds(2, 4) differ
  other = RefAccess.shared(gets[0].params["tree"], gets[0].invars[1:], (16,), clamp=False,
                           ref_dtype=gets[0].invars[0].aval.dtype)
  assert other is not accesses[0]  # another ref shape
  run_both(call, x)


# -- first calls run the plan's lines without compiling them ---------------------
def _kernel_plans(kp):
  """The sequential and batched plans a KernelPlan has built."""
  # (a compiled native body's BodyPlan wraps the sequential plan: native/bodies.py)
  plans = [getattr(kp._kernel, "plan", kp._kernel)] if kp._kernel is not None else []
  if kp.vectorizer is not None:
    plans += [p for p in kp.vectorizer._kernels.values() if hasattr(p, "fn")]
  return plans


_FIRST_CALL_CASES = {
    "one grid point": lambda K: K.case_bitonic(8, 128, 8),
    "batched, fused concatenates": lambda K: K.case_bitonic(64, 256, 8),
    "batched softmax": lambda K: K.case_softmax(64, 128, 8),
    "fori_loop, causal": lambda K: K.case_gpu_attention(1, 1, 128, 32, 64, 64),
    "scalar prefetch": lambda K: K.case_paged_attention(2, 2, 32, 8, 2, 8),
}


@pytest.mark.parametrize("which", sorted(_FIRST_CALL_CASES))
def test_first_call_runs_lines_then_later_calls_compile(which):
  """A first call runs its plans' lines as data (no compile()); the next
  call compiles them. Both give the same bits, and the reference's values."""
  from benchmarks import kernels as K
  case = _FIRST_CALL_CASES[which](K)
  fn = case.make(pallas_np.InterpretParams())
  first = np.asarray(fn(*case.args))
  kp = [entry[1] for entry in api._plan_cache.values()][-1]
  plans = _kernel_plans(kp)
  assert plans and all(p._compiled is None for p in plans)
  second = np.asarray(fn(*case.args))
  assert all(p.fn is p._compiled is not None for p in _kernel_plans(kp))
  np.testing.assert_array_equal(first, second)
  np.testing.assert_allclose(second, np.asarray(case.reference(*case.args)),
                             rtol=max(case.tol, 1e-6), atol=max(case.tol, 1e-6))


def test_many_grid_steps_compile_during_the_first_call(monkeypatch):
  from pallas_np.compiler import plan as evaluator
  monkeypatch.setattr(evaluator, "FIRST_CALLS", 3)
  x = np.arange(64.0, dtype=np.float32).reshape(8, 8)
  out = pallas_np.pallas_call(
      lambda x_ref, o_ref: o_ref.__setitem__(..., jnp.sin(x_ref[...]) * 2.0),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(8,),
      in_specs=[pl.BlockSpec((1, 8), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((1, 8), lambda i: (i, 0)),
      interpret=pallas_np.InterpretParams(vectorize=False))(x)
  np.testing.assert_allclose(np.asarray(out), np.sin(x) * 2.0, rtol=1e-6)
  kp = [entry[1] for entry in api._plan_cache.values()][-1]
  plan = getattr(kp._kernel, "plan", kp._kernel)  # (a native body's BodyPlan: native/bodies.py)
  assert plan._calls == 3 and plan.fn is plan._compiled is not None


def _oob_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[pl.ds(pl.program_id(0) * 4 + 5, 4)]  # OOB: past the end


@pytest.mark.parametrize("first_calls", [8, 0])
def test_errors_name_the_line_whether_lines_run_or_compiled(monkeypatch, first_calls):
  from pallas_np.compiler import plan as evaluator
  monkeypatch.setattr(evaluator, "FIRST_CALLS", first_calls)
  x = jnp.arange(8.0)
  call = pallas_np.pallas_call(_oob_kernel, out_shape=jax.ShapeDtypeStruct((4,), x.dtype),
                               grid=(1,), in_specs=[pl.BlockSpec((8,), lambda i: (0,))],
                               out_specs=pl.BlockSpec((4,), lambda i: (0,)))
  with pytest.raises(IndexError) as info:
    call(x)
  err = info.value
  assert isinstance(err, pallas_np.KernelError) and err.primitive == "get"
  import inspect
  lines, start = inspect.getsourcelines(_oob_kernel)
  assert f"test_performance.py:{start + 1}" in err.source
  kp = [entry[1] for entry in api._plan_cache.values()][-1]
  assert (kp._kernel._compiled is None) == (first_calls > 0)


@pytest.mark.parametrize("first_calls", [10 ** 6, 0])
def test_index_map_errors_name_the_operand_whether_run_or_compiled(monkeypatch, first_calls):
  from pallas_np.compiler import plan as evaluator
  from jax.experimental.pallas import tpu as pltpu
  monkeypatch.setattr(evaluator, "FIRST_CALLS", first_calls)
  gs = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(2,),
      in_specs=[pl.BlockSpec((4,), lambda i, s: (s[i + 1],))],  # s[2]: out of bounds
      out_specs=pl.BlockSpec((4,), lambda i, s: (i,)))
  call = pallas_np.pallas_call(
      lambda s_ref, x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
      out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), grid_spec=gs,
      interpret=pallas_np.InterpretParams(vectorize=False))
  with pytest.raises(IndexError, match=r"at grid point \(1,\) in the index map of args\[1\]"):
    call(jnp.array([0, 1], jnp.int32), jnp.arange(8.0))
  kp = [entry[1] for entry in api._plan_cache.values()][-1]
  assert (kp.index_maps[0]._compiled is None) == (first_calls > 0)


def _in_place_lines(plan) -> int:
  return sum(getattr(f, "__qualname__", "").startswith("_ufunc_into.")
             for f in plan._text[4].values())


def _into_ref_lines(plan) -> int:
  return sum(getattr(f, "__qualname__", "").startswith("_into_ref.")
             for f in plan._text[4].values())


@pytest.mark.parametrize("vectorize", [False, True])
def test_ufuncs_write_into_dying_operands(monkeypatch, vectorize):
  """Softmax's ``exp(x - m)`` and ``e / s`` write into the array the line
  before allocated (``Emitter.in_place``), sequential and batched: the same
  bits as with fresh results, and interpret=True's values."""
  from pallas_np.compiler import passes
  x = jnp.asarray(np.random.default_rng(3).standard_normal((32, 64)), jnp.float32)

  def softmax(x_ref, o_ref):
    v = x_ref[...]
    e = jnp.exp(v - jnp.max(v, axis=-1, keepdims=True))
    o_ref[...] = e / jnp.sum(e, axis=-1, keepdims=True)

  def make(interp):
    return pl.pallas_call(softmax, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(4,), in_specs=[pl.BlockSpec((8, 64), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((8, 64), lambda i: (i, 0)), interpret=interp)

  interp = pallas_np.InterpretParams(vectorize=vectorize)
  pallas_np.clear_caches()
  got = np.asarray(make(interp)(x))
  kp = [entry[1] for entry in api._plan_cache.values()][-1]
  assert [_in_place_lines(p) for p in _kernel_plans(kp)] == [2]
  # ... and the buffer they share is the output block itself (into_refs).
  assert [_into_ref_lines(p) for p in _kernel_plans(kp)] == [1]
  np.testing.assert_allclose(got, jax.nn.softmax(x, axis=-1), rtol=1e-5, atol=1e-6)
  pallas_np.clear_caches()
  monkeypatch.setattr(passes, "in_place", lambda em, returned: None)
  monkeypatch.setattr(passes, "into_refs", lambda em, returned: None)
  fresh = np.asarray(make(interp)(x))
  kp = [entry[1] for entry in api._plan_cache.values()][-1]
  assert [_in_place_lines(p) for p in _kernel_plans(kp)] == [0]
  assert [_into_ref_lines(p) for p in _kernel_plans(kp)] == [0]
  np.testing.assert_array_equal(got, fresh)


def test_no_write_into_an_operand_a_live_view_still_reads():
  """``y`` dies at ``y * 2``, but ``z``, a reshape (view) of it, is read
  later: the product must not overwrite ``y``."""
  x = jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32).reshape(8, 8)

  def kernel(x_ref, o_ref, p_ref):
    y = jnp.exp(x_ref[...])
    z = y.reshape(64)
    o_ref[...] = y * 2.0
    p_ref[...] = z.reshape(8, 8) + 1.0

  def make(interp):
    return pl.pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),) * 2,
                          interpret=interp)
  pallas_np.clear_caches()
  run_both(make, x)


def _blocked_call(kernel, interp, n_out=1):
  """``kernel`` over (32, 64) in (8, 64) blocks, grid (4,), n_out outputs."""
  spec = pl.BlockSpec((8, 64), lambda i: (i, 0))
  shape = jax.ShapeDtypeStruct((32, 64), jnp.float32)
  return pl.pallas_call(kernel, out_shape=(shape,) * n_out, grid=(4,), in_specs=[spec],
                        out_specs=(spec,) * n_out, interpret=interp)


@pytest.mark.parametrize("vectorize", [False, True])
def test_no_value_computed_in_a_ref_read_before_the_store(vectorize):
  """``y`` would be computed in ``o_ref``'s block (``Emitter.into_refs``),
  but ``o_ref`` is read between ``y``'s allocation and its store: that read
  must see the first store, so only the first store is rewritten."""
  x = jnp.asarray(np.random.default_rng(4).standard_normal((32, 64)), jnp.float32)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
    y = x_ref[...] * 2.0
    z = o_ref[...]
    o_ref[...] = y + z

  pallas_np.clear_caches()
  (got,) = _blocked_call(kernel, pallas_np.InterpretParams(vectorize=vectorize))(x)
  kp = [entry[1] for entry in api._plan_cache.values()][-1]
  assert [_into_ref_lines(p) for p in _kernel_plans(kp)] == [1]
  (want,) = _blocked_call(kernel, True)(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_allclose(np.asarray(got), 3.0 * np.asarray(x) + 1.0, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("vectorize", [False, True])
def test_no_value_computed_in_a_ref_while_still_alive(vectorize):
  """``y`` is stored to ``o_ref`` and read again after ``o_ref`` changed:
  it must keep its own buffer. ``y * 3`` dies at its store: computed in
  ``p_ref``'s block."""
  x = jnp.asarray(np.random.default_rng(5).standard_normal((32, 64)), jnp.float32)

  def kernel(x_ref, o_ref, p_ref):
    y = jnp.exp(x_ref[...])
    o_ref[...] = y
    o_ref[0:1, :] = jnp.zeros((1, 64), jnp.float32)
    p_ref[...] = y * 3.0

  pallas_np.clear_caches()
  got = _blocked_call(kernel, pallas_np.InterpretParams(vectorize=vectorize), 2)(x)
  kp = [entry[1] for entry in api._plan_cache.values()][-1]
  assert [_into_ref_lines(p) for p in _kernel_plans(kp)] == [1]
  want = _blocked_call(kernel, True, 2)(x)
  for g, w in zip(got, want):  # (NumPy's and XLA's exp differ in the last bit)
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(got[1]), 3.0 * np.exp(np.asarray(x)), rtol=1e-6)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_dot_computed_in_the_output_block(transpose_rhs):
  """A 2-D dot stored whole is computed in the output block (``with_out``),
  also with a transposed operand; the values are interpret=True's."""
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
  y_in = y.T if transpose_rhs else y

  def kernel(x_ref, y_ref, o_ref):
    if transpose_rhs:
      o_ref[...] = lax.dot_general(x_ref[...], y_ref[...], (((1,), (1,)), ((), ())))
    else:
      o_ref[...] = x_ref[...] @ y_ref[...]

  def make(interp):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((64, 64), jnp.float32), grid=(2, 2),
        in_specs=[pl.BlockSpec((32, 32), lambda i, j: (i, 0)),
                  pl.BlockSpec((32, 32),
                               (lambda i, j: (j, 0)) if transpose_rhs else (lambda i, j: (0, j)))],
        out_specs=pl.BlockSpec((32, 32), lambda i, j: (i, j)), interpret=interp)

  pallas_np.clear_caches()
  got = make(pallas_np.InterpretParams(vectorize=False))(x, y_in)
  kp = [entry[1] for entry in api._plan_cache.values()][-1]
  assert [_into_ref_lines(p) for p in _kernel_plans(kp)] == [1]
  np.testing.assert_allclose(np.asarray(got), np.asarray(make(True)(x, y_in)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ np.asarray(y), rtol=1e-4, atol=1e-4)
