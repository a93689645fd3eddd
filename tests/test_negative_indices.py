"""Negative ref indices (issue 27, item 3).

A *static* negative index (``x_ref[:, -1]``: JAX keeps the literal -1 in the
jaxpr) counts from the end, as in NumPy and interpret=True. A *dynamic*
negative index or ``pl.ds`` start raises by default (on a TPU/GPU it
addresses memory before the ref), naming what interpret=True does; with
``bounds_check="clamp"`` we do exactly what interpret=True does (add the
axis size, then clamp). interpret=True is the oracle, on sequential and
vectorized grids."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

import pallas_np
from tests.conftest import assert_same

SEQ = pallas_np.InterpretParams(vectorize=False, num_threads=1, check_avals=True)
VEC = pallas_np.InterpretParams(vectorize=True, check_avals=True)
CLAMP_SEQ = pallas_np.InterpretParams(vectorize=False, num_threads=1, bounds_check="clamp",
                                      check_avals=True)
CLAMP_VEC = pallas_np.InterpretParams(vectorize=True, bounds_check="clamp", check_avals=True)
MODES = pytest.mark.parametrize("interp", [SEQ, VEC], ids=["seq", "vec"])


def _x(*shape):
  return jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape)


def _last_mode():
  return pallas_np.grid_report()[-1]["mode"]


# -- static negative indices: NumPy meaning -----------------------------------------
def _static_loads(x_ref, i_ref, o_ref):
  j = pl.program_id(0)
  o_ref[0, :, 0] = x_ref[:, -1]  # a column from the end
  o_ref[0, :, 1] = x_ref[..., -2]
  o_ref[0, 0:8, 2] = x_ref[-1]  # a row from the end
  o_ref[0, 0:4, 3] = x_ref[-2, pl.ds(j * 4, 4)]  # static -2 next to a dynamic slice
  o_ref[0, 0:2, 4] = x_ref[i_ref[...], -1]  # gather: index array and a static -1
  o_ref[0, 0:8, 5] = x_ref.at[-3][...]  # through a ref view
  o_ref[0, 2:4, 4] = x_ref[-2:, -3]
  o_ref[0, 8:16, 5] = jnp.zeros((8,), jnp.float32)
  o_ref[0, 8:16, 2:4] = jnp.zeros((8, 2), jnp.float32)
  o_ref[0, 4:16, 4] = jnp.zeros((12,), jnp.float32)


@MODES
def test_static_negative_loads(interp):
  x, idx = _x(16, 8), jnp.array([3, 9], jnp.int32)

  def make(interpret):
    return pl.pallas_call(
        _static_loads, jax.ShapeDtypeStruct((2, 16, 6), jnp.float32), grid=(2,),
        in_specs=[pl.BlockSpec((16, 8), lambda j: (0, 0)), pl.BlockSpec((2,), lambda j: (0,))],
        out_specs=pl.BlockSpec((1, 16, 6), lambda j: (j, 0, 0)), interpret=interpret)
  got = make(interp)(x, idx)
  assert _last_mode() == ("vectorized" if interp is VEC else "sequential")
  assert_same(got, make(True)(x, idx))
  xn = np.asarray(x)  # NumPy reference for a few of them
  np.testing.assert_array_equal(np.asarray(got)[0, :, 0], xn[:, -1])
  np.testing.assert_array_equal(np.asarray(got)[1, 0:4, 3], xn[-2, 4:8])
  np.testing.assert_array_equal(np.asarray(got)[0, 0:2, 4], xn[[3, 9], -1])


def _static_stores(x_ref, o_ref):
  o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[-1] = x_ref[0]  # last row
  o_ref[:, -1] = x_ref[:, 1] * 2  # last column
  o_ref[-2, pl.ds(pl.program_id(0), 2)] = jnp.full((2,), 7.0)
  o_ref[-3] += x_ref[2]  # addupdate


@MODES
def test_static_negative_stores(interp):
  x = _x(4, 6, 8)

  def make(interpret):
    spec = pl.BlockSpec((None, 6, 8), lambda j: (j, 0, 0))
    return pl.pallas_call(_static_stores, jax.ShapeDtypeStruct((4, 6, 8), jnp.float32),
                          grid=(4,), in_specs=[spec], out_specs=spec, interpret=interpret)
  got = make(interp)(x)
  assert _last_mode() == ("vectorized" if interp is VEC else "sequential")
  assert_same(got, make(True)(x))
  ref = np.zeros((4, 6, 8), np.float32)
  xn = np.asarray(x)
  for j in range(4):
    ref[j, -1] = xn[j, 0]
    ref[j, :, -1] = xn[j, :, 1] * 2
    ref[j, -2, j:j + 2] = 7.0
    ref[j, -3] += xn[j, 2]
  np.testing.assert_array_equal(np.asarray(got), ref)


def test_static_negative_index_in_masked_load_and_store():
  """Triton-style masked accesses with a static -1. interpret=True (JAX
  0.10) cannot run a masked load with an int index ('TypedInt' object has
  no attribute 'shape'): checked against NumPy."""
  def kernel(x_ref, o_ref):
    m = jnp.arange(8) < 6
    row = pltriton.load(x_ref.at[-1, pl.ds(0, 8)], mask=m, other=-1.0)
    o_ref[...] = jnp.zeros_like(o_ref)
    pltriton.store(o_ref.at[-2, pl.ds(0, 8)], row * 2, mask=m)

  x = _x(4, 8)
  make = lambda interp: pl.pallas_call(kernel, jax.ShapeDtypeStruct((4, 8), jnp.float32),
                                       interpret=interp)
  got = make("numpy")(x)
  ref = np.zeros((4, 8), np.float32)
  ref[-2, :6] = np.asarray(x)[-1, :6] * 2
  np.testing.assert_array_equal(np.asarray(got), ref)


def test_static_negative_index_in_dma():
  def kernel(x_hbm, o_ref, buf, sem):
    copy = pltpu.make_async_copy(x_hbm.at[-1], buf, sem)
    copy.start()
    copy.wait()
    o_ref[...] = buf[...]

  x = _x(3, 8, 128)
  make = lambda interp: pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA],
      interpret=interp)
  got = make("numpy")(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x)[-1])
  assert_same(got, make(pltpu.InterpretParams())(x))


# -- dynamic negative indices: raise, or interpret=True's meaning in clamp mode ---
def _dyn_scalar_load(s_ref, x_ref, o_ref):
  o_ref[...] = x_ref[s_ref[0]]


def _dyn_scalar_store(s_ref, x_ref, o_ref):
  o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[s_ref[0]] = x_ref[0] + 100.0


def _dyn_ds_load(s_ref, x_ref, o_ref):
  o_ref[0:2] = x_ref[pl.ds(s_ref[0], 2)]
  o_ref[2:] = jnp.zeros((2, 8), jnp.float32)


def _dyn_ds_store(s_ref, x_ref, o_ref):
  o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[pl.ds(s_ref[0], 2)] = x_ref[0:2] + 100.0


def _dyn_array_load(s_ref, x_ref, o_ref):
  o_ref[0:2] = x_ref[s_ref[...]]
  o_ref[2:] = jnp.zeros((2, 8), jnp.float32)


DYN = {"scalar_load": (_dyn_scalar_load, (8,)), "scalar_store": (_dyn_scalar_store, (4, 8)),
       "ds_load": (_dyn_ds_load, (4, 8)), "ds_store": (_dyn_ds_store, (4, 8)),
       "array_load": (_dyn_array_load, (4, 8))}


def _dyn_call(kernel, out_shape, interpret):
  gs = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(1,),
      in_specs=[pl.BlockSpec((4, 8), lambda i, s: (0, 0))],
      out_specs=pl.BlockSpec(out_shape, lambda i, s: (0,) * len(out_shape)))
  return pl.pallas_call(kernel, jax.ShapeDtypeStruct(out_shape, jnp.float32), grid_spec=gs,
                        interpret=interpret)


@pytest.mark.parametrize("name", sorted(DYN))
@pytest.mark.parametrize("value", [-1, -2, -4, -5, 6])
def test_dynamic_negative_index_raises_and_clamp_mode_is_interpret_true(name, value):
  kernel, out_shape = DYN[name]
  s = jnp.array([value, 1], jnp.int32)
  x = _x(4, 8)
  want = _dyn_call(kernel, out_shape, True)(s, x)
  in_bounds = 0 <= value and value + (2 if "ds" in name else 1) <= 4
  if not in_bounds:
    with pytest.raises(IndexError, match="out-of-bounds ref access") as info:
      _dyn_call(kernel, out_shape, SEQ)(s, x)
    msg = str(info.value)
    assert "bounds_check='clamp'" in msg
    if value < 0:
      assert "does not wrap dynamic negative indices" in msg
      assert "interpret=True would silently use" in msg
  assert_same(_dyn_call(kernel, out_shape, CLAMP_SEQ)(s, x), want)


def test_dynamic_negative_message_names_interpret_true_result():
  s, x = jnp.array([-1, 1], jnp.int32), _x(4, 8)
  with pytest.raises(IndexError, match=r"index -1 on axis 0 .*would silently use 3 instead"):
    _dyn_call(_dyn_scalar_load, (8,), "numpy")(s, x)
  with pytest.raises(IndexError, match=r"pl.ds\(start=-2, size=2\).*use start 2 instead"):
    _dyn_call(_dyn_ds_load, (4, 8), "numpy")(jnp.array([-2, 1], jnp.int32), x)
  with pytest.raises(IndexError, match=r"array index -1 on axis 0.*use 3 instead"):
    _dyn_call(_dyn_array_load, (4, 8), "numpy")(s, x)


def _prev_row(x_ref, o_ref):
  # BUG on purpose at program 0: row pid - 1 is -1 (interpret=True reads row 3).
  o_ref[...] = x_ref[pl.program_id(0) - 1][None] * 2.0


def _prev_row_store(x_ref, o_ref):
  # Each program writes row pid - 1 of its own output block.
  o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[0, pl.program_id(0) - 1] = x_ref[0] + 1.0


@pytest.mark.parametrize("vec", [False, True], ids=["seq", "vec"])
def test_program_id_based_negative_index(vec):
  """Dynamic negatives on a grid: raise at the grid point (sequential, and
  vectorized, whose failing pass is re-run point by point), clamp mode
  equals interpret=True in both runners."""
  x = _x(4, 8)
  raise_p = VEC if vec else SEQ
  clamp_p = CLAMP_VEC if vec else CLAMP_SEQ

  def load(interpret):
    return pl.pallas_call(_prev_row, jax.ShapeDtypeStruct((4, 8), jnp.float32), grid=(4,),
                          in_specs=[pl.BlockSpec((4, 8), lambda i: (0, 0))],
                          out_specs=pl.BlockSpec((1, 8), lambda i: (i, 0)),
                          interpret=interpret)

  def store(interpret):
    return pl.pallas_call(_prev_row_store, jax.ShapeDtypeStruct((4, 4, 8), jnp.float32),
                          grid=(4,), in_specs=[pl.BlockSpec((4, 8), lambda i: (0, 0))],
                          out_specs=pl.BlockSpec((1, 4, 8), lambda i: (i, 0, 0)),
                          interpret=interpret)
  for make in (load, store):
    with pytest.raises(pallas_np.KernelError, match="index -1 on axis") as info:
      make(raise_p)(x)
    assert info.value.program_ids == (0,)
    got = make(clamp_p)(x)
    assert_same(got, make(True)(x))
    if vec:
      assert _last_mode() == "vectorized"
  # The reference, by hand: program 0 reads/writes row 3 (-1 + 4).
  got = np.asarray(load(CLAMP_SEQ)(x))
  np.testing.assert_array_equal(got[0], np.asarray(x)[3] * 2)
