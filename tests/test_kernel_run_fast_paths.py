"""Fast paths inside one kernel run (issue 33): each against
interpret=True bit for bit, and checked to be the path taken.

* eager single-kernel runner (``EagerEntry.runner``): outputs straight from
  the kernel plan to jax.Arrays, several outputs, weak types;
* NumPy's error state set through its context variable (``fp_state``):
  silent inside a run, the caller's state restored after, also on errors
  and under other outer states;
* small buffers copied from a filled template (``memory.allocator``): fresh
  every call, never holding an earlier call's data;
* bfloat16/fp8 jax.Array inputs read straight from their buffer
  (``_compat.host_array``): every bit pattern (NaN payloads, subnormals,
  infinities) through unchanged;
* vectorized grids: block windows through ``np.ndarray`` (and
  non-contiguous operands through ``as_strided``), lanes that fill a box of
  block positions gathered and written back by reshape copies
  (``slab_runner._Box``), padded operands from a template allocator.
"""
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_np
from pallas_np import _compat as jc
from pallas_np import api, fp_state, memory
from pallas_np.errors import KernelError
from pallas_np.grid import slab_runner
from tests.helpers import assert_identical

rng = np.random.default_rng(333)


def _f32(*shape):
  return rng.standard_normal(shape).astype(np.float32)


def _both(kernel, out_shape, **kw):
  return (pallas_np.pallas_call(kernel, out_shape, **kw),
          pl.pallas_call(kernel, out_shape, interpret=True, **kw))


# -- the eager single-kernel runner -------------------------------------------------
def two_out_kernel(x_ref, y_ref, s_ref, d_ref):
  s_ref[...] = x_ref[...] + y_ref[...]
  d_ref[...] = (x_ref[...] - y_ref[...]).astype(d_ref.dtype)


def test_runner_two_outputs_fresh_and_identical(monkeypatch):
  outs = (jax.ShapeDtypeStruct((8, 128), jnp.float32),
          jax.ShapeDtypeStruct((8, 128), jnp.bfloat16))
  fn, want_fn = _both(two_out_kernel, outs)
  x, y = jnp.asarray(_f32(8, 128)), jnp.asarray(_f32(8, 128))
  first = fn(x, y)
  calls = []
  monkeypatch.setattr(api.EagerEntry, "call", lambda self, leaves: calls.append(1))
  got = [fn(x, y) for _ in range(3)]
  assert not calls  # warm calls ran the runner, not EagerEntry.call
  for g in [first, *got]:
    assert isinstance(g, tuple) and all(isinstance(o, jax.Array) for o in g)
    assert_identical(g, want_fn(x, y))
  ptrs = {o.unsafe_buffer_pointer() for g in [first, *got] for o in g}
  assert len(ptrs) == 8  # no output shares memory with another call's


def test_runner_keeps_the_signature_apart():
  """The runner is kept per flat signature: a float32 then an int32 call
  of one wrapper, back to back, each gets its own kernel."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[:8, :].astype(jnp.float32) * 2.0 + x_ref.shape[0]
  fn = pallas_np.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32))
  want = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32), interpret=True)
  xf = jnp.asarray(_f32(8, 128))
  xi = jnp.asarray(rng.integers(-50, 50, (8, 128)), jnp.int32)
  x16 = jnp.asarray(_f32(16, 128))
  for _ in range(2):
    for x in (xf, xi, np.asarray(xf), x16):
      assert_identical(fn(x), want(x))


# -- NumPy's error state --------------------------------------------------------------
def div_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] / y_ref[...]


def test_error_state_silent_inside_and_restored_after():
  fn, want_fn = _both(div_kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32))
  x = _f32(8, 128)
  y = np.zeros((8, 128), np.float32)  # x / 0: inf, 0 / 0: NaN
  x[0, 0] = 0.0
  before = np.geterr()
  for outer in ({"all": "raise"}, {"divide": "warn", "invalid": "ignore"}, {"all": "raise"}):
    with np.errstate(**outer), warnings.catch_warnings():
      warnings.simplefilter("error")
      state = np.geterr()
      assert_identical(fn(x, y), want_fn(x, y))
      assert np.geterr() == state  # the outer state is back after the run
  assert np.geterr() == before


def test_error_state_restored_after_a_kernel_error():
  def bad_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(pl.program_id(0) * 8, 8), :]
  fn = pallas_np.pallas_call(bad_kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                             grid=(3,), in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
                             out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)))
  before = np.geterr()
  with pytest.raises(KernelError):
    fn(_f32(8, 128))
  assert np.geterr() == before


def test_quiet_floats_follows_the_outer_state():
  """The quiet state is rebuilt from a changed outer state (its buffer
  size is the outer one's)."""
  old = np.getbufsize()
  try:
    for size in (8192, 16384, 8192):
      np.setbufsize(size)
      token = fp_state.quiet_floats()
      try:
        assert np.geterr() == {"divide": "ignore", "over": "ignore", "under": "ignore",
                               "invalid": "ignore"}
        assert np.getbufsize() == size
      finally:
        fp_state.restore_floats(token)
      assert np.geterr()["divide"] == "warn"
  finally:
    np.setbufsize(old)


# -- template-copied buffers ------------------------------------------------------------
def half_kernel(flag_ref, o_ref):
  """Writes the whole output when flag is 1, else only its top half: the
  rest must be the uninitialised value again, not an earlier call's data."""
  o_ref[: o_ref.shape[0] // 2, :] = jnp.full((o_ref.shape[0] // 2, o_ref.shape[1]), 7.0)

  @pl.when(flag_ref[0, 0] == 1)
  def _():
    o_ref[...] = jnp.full(o_ref.shape, 5.0)


@pytest.mark.parametrize("rows", [8, 256])  # 4 KiB (template) and 128 KiB (aligned) outputs
def test_fresh_buffers_never_hold_earlier_data(rows):
  fn, want_fn = _both(half_kernel, jax.ShapeDtypeStruct((rows, 128), jnp.float32))
  full, half = np.ones((1, 1), np.int32), np.zeros((1, 1), np.int32)
  for flag in (full, half, full, half):
    got = fn(flag)
    assert_identical(got, want_fn(flag))
    if flag is half:
      assert np.isnan(np.asarray(got)[rows // 2:]).all()


def test_template_allocator_copies():
  params = pallas_np.InterpretParams()
  fresh = memory.allocator((4, 8), np.float32, params)
  a, b = fresh(), fresh()
  assert a.flags.writeable and not np.shares_memory(a, b) and np.isnan(a).all()
  a[...] = 1.0
  assert np.isnan(fresh()).all()
  zero = memory.allocator((4, 8), np.int32, pallas_np.InterpretParams(uninitialized="zero"))
  assert (zero() == 0).all()


# -- low-precision jax.Array inputs -------------------------------------------------------
def copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn])
def test_low_precision_inputs_every_bit_pattern(dtype):
  nbits = np.dtype(dtype).itemsize * 8
  bits = np.arange(1 << nbits, dtype=np.uint16 if nbits == 16 else np.uint8)
  x = jnp.asarray(bits.reshape(-1, 128).view(dtype))  # NaN payloads, subnormals, infs
  fn, want_fn = _both(copy_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype))
  for _ in range(2):
    got = np.asarray(fn(x)).view(bits.dtype).ravel()
    np.testing.assert_array_equal(got, bits)
  np.testing.assert_array_equal(np.asarray(want_fn(x)).view(bits.dtype).ravel(), bits)
  host = jc.host_array(x)
  assert not host.flags.writeable and np.array_equal(host.view(bits.dtype).ravel(), bits)


def test_deleted_low_precision_input_raises_as_before():
  fn = pallas_np.pallas_call(copy_kernel, jax.ShapeDtypeStruct((8, 128), jnp.bfloat16))
  x = jnp.ones((8, 128), jnp.bfloat16)
  fn(x)
  x.delete()
  with pytest.raises(RuntimeError, match="deleted"):
    fn(x)


# -- vectorized grids ----------------------------------------------------------------------
def mean_kernel(x_ref, y_ref, o_ref):
  """(No multiply-add XLA could fuse: bit-identical to interpret=True.)"""
  o_ref[...] = (x_ref[...] + y_ref[...]) * 0.5


def rowsum_kernel(x_ref, o_ref):
  """Edge blocks read the padding: its NaN fill shows in the result."""
  o_ref[...] = jnp.broadcast_to(jnp.sum(x_ref[...], axis=1, keepdims=True), o_ref.shape)


def _grid_call(kernel, shape, block, n_in, index_map, interpret):
  grid = tuple(-(-n // b) for n, b in zip(shape, block))
  spec = pl.BlockSpec(block, index_map)
  return pl.pallas_call(kernel, jax.ShapeDtypeStruct(shape, jnp.float32), grid=grid,
                        in_specs=[spec] * n_in, out_specs=spec, interpret=interpret)


def _boxes_used():
  """How many lanes' gathers went through a box recipe, in every cached
  plan's runners."""
  n = 0
  for _, kp in api._plan_cache.values():
    gv = kp.vectorizer
    for runner in (gv.runners.values() if gv is not None else ()):
      if isinstance(runner[1], slab_runner.SlabRunner):
        n += sum(type(r) is slab_runner._Box for r in runner[1]._recipes.values())
  return n


@pytest.mark.parametrize("shape,block", [((100, 70), (32, 32)), ((64, 96), (16, 32))])
def test_box_lanes_ragged_2d(shape, block):
  pallas_np.clear_caches()
  x, y = _f32(*shape), _f32(*shape)
  numpy_fn = _grid_call(mean_kernel, shape, block, 2, lambda i, j: (i, j),
                        pallas_np.InterpretParams(vectorize=True))
  want_fn = _grid_call(mean_kernel, shape, block, 2, lambda i, j: (i, j), True)
  for _ in range(3):
    assert_identical(numpy_fn(x, y), want_fn(x, y))
  assert _boxes_used() >= 3  # both inputs' gathers and the output's write-back
  assert pallas_np.grid_report()[-1]["mode"] == "vectorized"


def test_box_lanes_3d_grid_and_padding_read():
  pallas_np.clear_caches()
  shape, block = (6, 40, 72), (2, 16, 32)
  x = _f32(*shape)
  numpy_fn = _grid_call(rowsum_kernel, shape, block, 1, lambda i, j, k: (i, j, k),
                        pallas_np.InterpretParams(vectorize=True))
  want_fn = _grid_call(rowsum_kernel, shape, block, 1, lambda i, j, k: (i, j, k), True)
  for _ in range(2):
    got = numpy_fn(x)
    assert_identical(got, want_fn(x))
  got = np.asarray(got)  # the edge blocks' sums over padded rows: NaN
  assert np.isnan(got[:, 32:, :]).all() and not np.isnan(got[:, :32, :]).any()
  assert _boxes_used() >= 2


def test_lanes_that_are_not_a_box_still_gather():
  """A transposing index map: the lanes' blocks are a box walked in
  another order, so the plain gather runs (and gives the same answer)."""
  pallas_np.clear_caches()
  shape, block = (96, 96), (32, 32)
  x, y = _f32(*shape), _f32(*shape)
  for imap in (lambda i, j: (j, i), lambda i, j: ((i + j) % 3, j)):
    numpy_fn = _grid_call(mean_kernel, shape, block, 2, imap,
                          pallas_np.InterpretParams(vectorize=True))
    want_fn = _grid_call(mean_kernel, shape, block, 2, imap, True)
    assert_identical(numpy_fn(x, y), want_fn(x, y))


def test_box_recipe_matches_the_gather():
  window = np.arange(5 * 4 * 3 * 2, dtype=np.float32).reshape(5, 4, 3, 2)
  ii, jj = np.meshgrid(np.arange(1, 4), np.arange(0, 3), indexing="ij")
  cols = [ii.ravel(), jj.ravel()]
  box = slab_runner._Box.of(window, cols)
  assert box is not False
  np.testing.assert_array_equal(window[box.index].reshape(box.lanes_shape),
                                window[tuple(cols)])
  assert slab_runner._Box.of(window, [cols[0][::-1], cols[1]]) is False  # another order
  assert slab_runner._Box.of(window, [cols[0][:-1], cols[1][:-1]]) is False  # not whole


def test_non_contiguous_operands():
  """NumPy inputs that are transposed views: their windows go through
  as_strided (np.ndarray needs a contiguous buffer)."""
  pallas_np.clear_caches()
  shape, block = (64, 128), (8, 128)
  xt, yt = _f32(*shape[::-1]).T, _f32(*shape[::-1]).T
  assert not xt.flags.c_contiguous
  numpy_fn = _grid_call(mean_kernel, shape, block, 2, lambda i, j: (i, j),
                        pallas_np.InterpretParams(vectorize=True))
  want_fn = _grid_call(mean_kernel, shape, block, 2, lambda i, j: (i, j), True)
  for _ in range(2):
    assert_identical(numpy_fn(xt, yt), want_fn(np.ascontiguousarray(xt),
                                               np.ascontiguousarray(yt)))


def test_jax_array_maker_hands_over_only_its_exact_arrays():
  """batched_device_put trusts the aval it is given: an array of another
  dtype or shape must not be labelled with it."""
  to_jax = jc.jax_array_maker((2, 3), np.float32)
  good = np.arange(6, dtype=np.float32).reshape(2, 3)
  out = to_jax(good)
  assert out.dtype == np.float32 and out.shape == (2, 3)
  np.testing.assert_array_equal(np.asarray(out), good)
  for other in (np.arange(6, dtype=np.int32).reshape(2, 3), np.zeros((3, 2), np.float32)):
    out = to_jax(other)
    assert out.dtype == other.dtype and out.shape == other.shape
    np.testing.assert_array_equal(np.asarray(out), other)
  weak = jc.jax_array_maker((2, 3), np.float32, weak_type=True)(good)
  assert weak.weak_type


def gather_kernel(idx_ref, x_ref, o_ref):
  o_ref[...] = x_ref[...] * 2.0


@pytest.mark.parametrize("grid_shape", ["prefetch", "unit_axis"])
def test_one_pass_runs(monkeypatch, grid_shape):
  """Vectorized grids that are one batched call: a scalar-prefetch row
  gather, and a grid whose second axis has one point (a sequential point
  (0,)); the one-pass path is taken and gives interpret=True's bits."""
  pallas_np.clear_caches()
  passes = []
  orig = slab_runner.SlabRunner.run_one_pass
  monkeypatch.setattr(slab_runner.SlabRunner, "run_one_pass",
                      lambda self, *a: passes.append(1) or orig(self, *a))
  if grid_shape == "prefetch":
    from jax.experimental.pallas import tpu as pltpu
    idx = jnp.asarray(rng.integers(0, 64, 24), jnp.int32)
    x = jnp.asarray(_f32(64, 256))
    args = (idx, x)

    def make(interpret):
      return pl.pallas_call(
          gather_kernel, jax.ShapeDtypeStruct((24, 256), jnp.float32),
          grid_spec=pltpu.PrefetchScalarGridSpec(
              num_scalar_prefetch=1, grid=(24,),
              in_specs=[pl.BlockSpec((1, 256), lambda i, idx: (idx[i], 0))],
              out_specs=pl.BlockSpec((1, 256), lambda i, idx: (i, 0))),
          interpret=interpret)
  else:
    x = jnp.asarray(_f32(32, 512)).astype(jnp.bfloat16)
    args = (x,)
    spec = pl.BlockSpec((8, 512), lambda i, j: (i, j))

    def make(interpret):
      return pl.pallas_call(
          lambda x_ref, o_ref: o_ref.__setitem__(
              ..., (x_ref[...].astype(jnp.float32) * 0.5).astype(o_ref.dtype)),
          jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4, 1), in_specs=[spec],
          out_specs=spec, interpret=interpret)
  numpy_fn, want_fn = make(pallas_np.InterpretParams()), make(True)
  for _ in range(3):
    got = numpy_fn(*args)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                  np.asarray(want_fn(*args)).view(np.uint8))
  assert len(passes) == 3
  assert pallas_np.grid_report()[-1]["mode"] == "vectorized"


# -- static ref accesses: the index built once (state.refs._static_index) ------------
def static_access_kernel(x_ref, o_ref, s_ref):
  s_ref[...] = x_ref[...]
  old = s_ref[...]  # a read of a written ref: its own copy ...
  s_ref[...] = old * 2.0  # ... unchanged by this store
  o_ref[...] = old - 1.0
  o_ref[0] = old[1] + s_ref[2]  # an int index: one dim fewer
  o_ref[1:3, ::2] = x_ref[4:6, 1::2] + s_ref[0:2, ::2]  # strided
  o_ref[7, 3:9] = x_ref[0, 0:6] * s_ref[5, 10:16]


def _kernel_globals_named(fn, args, interp):
  entry = api.eager_entry(fn.jax_callable, interp, args)
  kernel = entry.plan.kernel.kernel
  kernel = getattr(kernel, "plan", kernel)  # (a native body's BodyPlan wraps it: native/bodies.py)
  return {getattr(v, "__name__", None) for v in kernel.fn.__globals__.values()}


@pytest.mark.filterwarnings("ignore:pallas_np. detect_races=True")
@pytest.mark.parametrize("races", [False, True])
def test_static_ref_accesses_index_once_and_keep_copies(races):
  from jax.experimental.pallas import tpu as pltpu
  interp = pallas_np.InterpretParams(detect_races=races)
  kw = dict(scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)])
  out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  fn = pallas_np.pallas_call(static_access_kernel, out, interpret=interp, **kw)
  want_fn = pl.pallas_call(static_access_kernel, out, interpret=True, **kw)
  x = jnp.asarray(_f32(8, 128))
  for _ in range(3):
    assert_identical(fn(x), want_fn(x))
  names = _kernel_globals_named(fn, (x,), interp)
  if races:  # accesses are recorded: the general rule
    assert "get_static" not in names and "swap_static" not in names, names
  else:
    assert {"get_static", "swap_static"} <= names, names


# -- inputs of builtin dtypes read without host_array (grid.buffers) ----------------
def mixed_inputs_kernel(x_ref, b_ref, o_ref):
  o_ref[...] = x_ref[...] * 2.0 + b_ref[...].astype(jnp.float32)


@pytest.mark.parametrize("host", ["jax", "numpy"])
def test_builtin_dtype_inputs_read_only_and_identical(host):
  """A float32 block's operand is read by ``np.asarray`` alone (the buffer
  protocol), a bfloat16 one through ``host_array``: both read-only views,
  results as interpret=True's, the caller's NumPy array left writable and
  unchanged."""
  out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  fn, want_fn = _both(mixed_inputs_kernel, out)
  x = _f32(8, 128)
  b = rng.standard_normal((8, 128)).astype(ml_dtypes.bfloat16)
  args = (jnp.asarray(x), jnp.asarray(b)) if host == "jax" else (x.copy(), b)
  want = want_fn(jnp.asarray(x), jnp.asarray(b))
  for _ in range(3):
    assert_identical(fn(*args), want)
  from pallas_np.params import resolve
  kp = api.eager_entry(fn.jax_callable, resolve("numpy"), args).plan.kernel  # (the one run)
  in_preps = kp.setup.preps()[1]
  assert [p.__name__ for p in in_preps] == ["_read_only_builtin", "_read_only"]
  for prep, a in zip(in_preps, args):
    view = prep(a)
    assert not view.flags.writeable
    np.testing.assert_array_equal(view.astype(np.float64), np.asarray(a).astype(np.float64))
  assert kp.strategy.fresh_outputs is not None  # (one point: the output's allocator direct)
  outs = [fn(*args) for _ in range(2)]
  assert not np.shares_memory(np.asarray(outs[0]), np.asarray(outs[1]))
  if host == "numpy":
    assert args[0].flags.writeable
    np.testing.assert_array_equal(args[0], x)
