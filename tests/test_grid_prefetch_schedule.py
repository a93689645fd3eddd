"""The grid loop's steps of a grid whose index maps read scalar prefetch
(``KernelPlan._grid_schedule``): computed once per grid and prefetch
contents, keyed by the operands' bytes, not where the kernel writes a
prefetch operand; an index map out of bounds raises at its grid point at
every run. Results compared with a NumPy reference or interpret=True; the
structural checks fail without the change (every run evaluated the index
maps at every grid point)."""
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np.grid.kernel_plan import KernelPlan

SEQ = pallas_np.InterpretParams(vectorize=False, native_loops="off")
rng = np.random.default_rng(43)


def _gather_prefetched(idx_ref, x_ref, o_ref):
  o_ref[...] = x_ref[...] * 2.0 + pl.program_id(0).astype(jnp.float32) + idx_ref[0]


def _gather(interp, n=6):
  return pl.pallas_call(
      _gather_prefetched,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(n,),
          in_specs=[pl.BlockSpec((8, 128), lambda i, idx: (idx[i], 0))],
          out_specs=pl.BlockSpec((8, 128), lambda i, idx: (i, 0))),
      out_shape=jax.ShapeDtypeStruct((8 * n, 128), jnp.float32), interpret=interp)


def _want(idx, x):
  x = np.asarray(x).reshape(-1, 8, 128)
  return np.concatenate([x[j] * np.float32(2) + np.float32(i) + np.float32(idx[0])
                         for i, j in enumerate(np.asarray(idx))])


def _plans(name):
  gc.collect()  # (plans of earlier tests, dropped by clear_caches)
  return [o for o in gc.get_objects() if type(o) is KernelPlan and o.name == name]


def test_steps_kept_per_prefetch_contents():
  """Two tables called in turn: each run gathers its own table's blocks
  (steps keyed by the table's bytes), the steps of both kept."""
  pallas_np.clear_caches()
  x = jnp.asarray(rng.standard_normal((32, 128)), jnp.float32)
  tables = [jnp.asarray(t, jnp.int32) for t in ([3, 0, 2, 3, 1, 0], [1, 1, 0, 2, 3, 2])]
  fn = _gather(SEQ)
  for _ in range(2):
    for idx in tables:
      np.testing.assert_array_equal(np.asarray(fn(idx, x)), _want(idx, x))
  (kp,) = _plans("_gather_prefetched")
  keys = [k for k, v in kp._schedules.items() if v]  # noqa: SLF001
  assert len(keys) == 2 and {k[-1][-1] for k in keys} == {np.asarray(t).tobytes() for t in tables}
  np.testing.assert_array_equal(np.asarray(fn(tables[1], x)),
                                np.asarray(_gather(True)(tables[1], x)))


def test_index_map_out_of_bounds_raises_at_its_point_every_run():
  pallas_np.clear_caches()
  x = jnp.asarray(rng.standard_normal((32, 128)), jnp.float32)
  fn = _gather(SEQ)
  good = jnp.asarray([0, 1, 2, 3, 0, 1], jnp.int32)
  bad = jnp.asarray([0, 1, 9, 3, 0, 1], jnp.int32)
  np.testing.assert_array_equal(np.asarray(fn(good, x)), _want(good, x))
  for _ in range(2):
    with pytest.raises(Exception) as info:
      fn(bad, x)
    assert "grid point (2,)" in str(info.value)
  np.testing.assert_array_equal(np.asarray(fn(good, x)), _want(good, x))


def _rewriting(idx_ref, x_ref, o_ref):
  o_ref[...] = x_ref[...] + 1.0
  i = pl.program_id(0)

  @pl.when(i + 1 < 4)
  def _():
    idx_ref[i + 1] = (idx_ref[i + 1] + 1) % 4  # (read by the next point's index map)


def test_kernel_writing_its_prefetch_keeps_no_steps():
  """A kernel that writes its prefetch operand: each index map reads the
  values written at the earlier points (no steps kept)."""
  pallas_np.clear_caches()
  x = jnp.asarray(rng.standard_normal((32, 128)), jnp.float32)
  idx = jnp.asarray([0, 1, 2, 3], jnp.int32)

  def make(interp):
    return pl.pallas_call(
        _rewriting,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(4,),
            in_specs=[pl.BlockSpec((8, 128), lambda i, idx: (idx[i], 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i, idx: (i, 0))),
        out_shape=jax.ShapeDtypeStruct((32, 128), jnp.float32), interpret=interp)
  want = np.asarray(x).reshape(4, 8, 128)[[0, 2, 3, 0]].reshape(32, 128) + np.float32(1)
  for _ in range(2):
    np.testing.assert_array_equal(np.asarray(make(SEQ)(idx, x)), want)
  (kp,) = _plans("_rewriting")
  assert not any(kp._schedules.values())  # noqa: SLF001
