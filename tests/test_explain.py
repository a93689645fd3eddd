"""pallas_np.explain: access maps (expected values written out by hand), the
text summary, pictures, the --explain runner, and progress via tqdm."""
import builtins
import functools
import os
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np import debugging
from pallas_np.explainer import render


# -- kernels ----------------------------------------------------------------------
def matmul_kernel(x_ref, y_ref, z_ref):
  z_ref[...] = x_ref[...] @ y_ref[...]


def quickstart_matmul(x, y):  # JAX's Pallas quickstart, interpret=True
  return pl.pallas_call(
      matmul_kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), x.dtype),
      grid=(2, 2),
      in_specs=[pl.BlockSpec((x.shape[0] // 2, x.shape[1]), lambda i, j: (i, 0)),
                pl.BlockSpec((y.shape[0], y.shape[1] // 2), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((x.shape[0] // 2, y.shape[1] // 2), lambda i, j: (i, j)),
      interpret=True)(x, y)


def acc_kernel(x_ref, y_ref, o_ref):
  @pl.when(pl.program_id(2) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[...] += x_ref[...] @ y_ref[...]


def acc_matmul(x, y):  # (2, 2, 3) grid, k last: the output block stays put along k
  return pl.pallas_call(
      acc_kernel, out_shape=jax.ShapeDtypeStruct((8, 8), jnp.float32), grid=(2, 2, 3),
      in_specs=[pl.BlockSpec((4, 2), lambda i, j, k: (i, k)),
                pl.BlockSpec((2, 4), lambda i, j, k: (k, j))],
      out_specs=pl.BlockSpec((4, 4), lambda i, j, k: (i, j)),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")))(x, y)


def scale_kernel(x_ref, o_ref):
  o_ref[...] = 2 * x_ref[...]


def ragged(x):  # (10, 7) in (4, 4) blocks: partial edge blocks on both dims
  spec = pl.BlockSpec((4, 4), lambda i, j: (i, j))
  return pl.pallas_call(scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(3, 2), in_specs=[spec], out_specs=spec)(x)


def wrong_out_map(x):  # the output index map forgets j
  return pl.pallas_call(
      scale_kernel, out_shape=jax.ShapeDtypeStruct((4, 4), jnp.float32), grid=(2, 2),
      in_specs=[pl.BlockSpec((2, 2), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((2, 2), lambda i, j: (i, 0)))(x)


def causal_kernel(q_ref, k_ref, o_ref):
  qi, ki = pl.program_id(0), pl.program_id(1)

  @pl.when(ki == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)

  @pl.when(ki <= qi)  # blocks above the diagonal: skipped
  def _():
    o_ref[...] += q_ref[...] * k_ref[...]


def causal(q, k):  # (3, 3) grid of (2, 4) blocks
  return pl.pallas_call(
      causal_kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(3, 3),
      in_specs=[pl.BlockSpec((2, 4), lambda i, j: (i, 0)),
                pl.BlockSpec((2, 4), lambda i, j: (j, 0))],
      out_specs=pl.BlockSpec((2, 4), lambda i, j: (i, 0)))(q, k)


def dma_kernel(x_hbm, o_ref, buf, sem):
  i = pl.program_id(0)
  copy = pltpu.make_async_copy(x_hbm.at[pl.ds(i * 2, 2)], buf, sem)
  copy.start()
  copy.wait()
  o_ref[...] = buf[...] + 1


def manual_dma(x):  # (8, 4) in HBM; step i copies rows 2i, 2i+1 itself
  return pl.pallas_call(
      dma_kernel, out_shape=jax.ShapeDtypeStruct((8, 4), x.dtype), grid=(4,),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((2, 4), lambda i: (i, 0)),
      scratch_shapes=[pltpu.VMEM((2, 4), x.dtype), pltpu.SemaphoreType.DMA])(x)


def ds_kernel(x_ref, o_ref):
  # dynamic pl.ds inside the body: only the first row of each block is read
  o_ref[pl.ds(pl.program_id(0) * 0, 1), :] = x_ref[pl.ds(pl.program_id(0) * 0, 1), :]


def first_rows(x):
  return pl.pallas_call(
      ds_kernel, out_shape=jax.ShapeDtypeStruct((4, 4), x.dtype), grid=(2,),
      in_specs=[pl.BlockSpec((2, 4), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((2, 4), lambda i: (i, 0)))(x)


def blocks(rows_cols_values):
  """Expand a per-block table into an element array: ``np.kron`` of the
  table with ones of the block shape."""
  table, block = rows_cols_values
  return np.kron(np.asarray(table), np.ones(block, np.int64)).astype(np.int64)


def arange(*shape):
  return jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)


# -- access maps ----------------------------------------------------------------
def test_quickstart_matmul_access_maps():
  x, y = arange(8, 4), arange(4, 8)
  ex = pallas_np.explain(quickstart_matmul, x, y)
  assert len(ex) == 1
  k = ex[0]
  assert k.name == "matmul_kernel" and k.grid == (2, 2) and k.num_steps == 4
  xo, yo, zo = k.operands
  assert [o.arg_name for o in k.operands] == ["x_ref", "y_ref", "z_ref"]
  # x's row blocks are used by both j steps: steps (0,0),(0,1) and (1,0),(1,1)
  np.testing.assert_array_equal(xo.block_visits, [[2], [2]])
  np.testing.assert_array_equal(xo.visits, np.full((8, 4), 2))
  np.testing.assert_array_equal(xo.first_step, blocks(([[0], [2]], (4, 4))))
  np.testing.assert_array_equal(yo.first_step, blocks(([[0, 1]], (4, 4))))
  np.testing.assert_array_equal(zo.first_step, blocks(([[0, 1], [2, 3]], (4, 4))))
  np.testing.assert_array_equal(zo.visits, np.ones((8, 8)))
  assert zo.written.all() and xo.read.all() and not xo.written.any()
  np.testing.assert_array_equal(k.step_points, [[0, 0], [0, 1], [1, 0], [1, 1]])
  # explain returns fn's result, computed correctly
  np.testing.assert_allclose(np.asarray(ex.result), np.asarray(x) @ np.asarray(y))


def test_accumulator_revisits_along_k():
  x, y = arange(8, 6), arange(6, 8)
  ex = pallas_np.explain(jax.jit(acc_matmul), x, y)
  k = ex[0]
  xo, yo, oo = k.operands
  np.testing.assert_array_equal(oo.block_visits, [[3, 3], [3, 3]])
  # step = 6 i + 3 j + k: output block (i, j) first seen at 6 i + 3 j
  np.testing.assert_array_equal(oo.first_step, blocks(([[0, 3], [6, 9]], (4, 4))))
  # x block (i, k) first at 6 i + k; each visited by both j
  np.testing.assert_array_equal(xo.first_step, blocks(([[0, 1, 2], [6, 7, 8]], (4, 2))))
  np.testing.assert_array_equal(xo.block_visits, np.full((2, 3), 2))
  assert [(o.label, axes) for o, axes in k.accumulators()] == [("o_ref (outputs)", (2,))]
  # the output block is copied once per (i, j), each input block at every step
  assert oo.copies == 4 and xo.copies == 12
  assert k.dimension_semantics == ("parallel", "parallel", "arbitrary")
  np.testing.assert_allclose(np.asarray(ex.result), np.asarray(x) @ np.asarray(y), rtol=1e-6)


def test_ragged_edges_padding():
  x = arange(10, 7)
  ex = pallas_np.explain(ragged, x)
  k = ex[0]
  xo, oo = k.operands
  assert xo.padded_shape == (12, 8) and xo.block_grid == (3, 2)
  assert xo.partial_dims() == ["dim 0: 10 = 2x4 + 2", "dim 1: 7 = 1x4 + 3"]
  pad = np.zeros((12, 8), bool)
  pad[10:, :] = True
  pad[:, 7:] = True
  np.testing.assert_array_equal(xo.padding, pad)
  np.testing.assert_array_equal(xo.block_visits, np.ones((3, 2)))
  np.testing.assert_array_equal(oo.first_step, blocks(([[0, 1], [2, 3], [4, 5]], (4, 4)))[:10, :7])
  assert oo.written.all()  # padding is sliced off: every real element written
  np.testing.assert_array_equal(np.asarray(ex.result), 2 * np.asarray(x))


def test_wrong_index_map_shows_unwritten_region():
  k = pallas_np.explain(wrong_out_map, arange(4, 4))[0]
  oo = k.operands[1]
  want = np.zeros((4, 4), bool)
  want[:, :2] = True  # only block column 0 is ever mapped
  np.testing.assert_array_equal(oo.written, want)
  np.testing.assert_array_equal(oo.visits, blocks(([[2, 0], [2, 0]], (2, 2))))
  text = str(k)
  assert "8 of 16 elements never written in [0:4, 2:4]" in text
  assert "visits/block 0..2" in text


def test_causal_skipping_is_recorded():
  q, kk = arange(6, 4), arange(6, 4)
  k = pallas_np.explain(causal, q, kk)[0]
  qo, ko, oo = k.operands
  # index maps: every k block is mapped by all 3 q rows
  np.testing.assert_array_equal(ko.block_visits, [[3], [3], [3]])
  # recorded: k block j is read by the q rows i >= j only
  np.testing.assert_array_equal(ko.recorded_visits, blocks(([[3], [2], [1]], (2, 4))))
  np.testing.assert_array_equal(ko.recorded_first_step, blocks(([[0], [4], [8]], (2, 4))))
  # steps (0,1), (0,2), (1,2) touch nothing
  assert k.skipped_steps() == 3
  np.testing.assert_array_equal(np.flatnonzero(k.ran & (k.step_accesses == 0)), [1, 2, 5])
  assert ko.uses_recorded() and not oo.uses_recorded()
  assert "skipped steps: 3 of 9" in str(k)


def test_manual_dma_recorded_per_step():
  x = arange(8, 4)
  k = pallas_np.explain(manual_dma, x)[0]
  xo, oo = k.operands
  assert xo.unblocked and xo.memory_space == "any"
  assert xo.read.all() and not xo.written.any()
  np.testing.assert_array_equal(xo.recorded_first_step, blocks(([[0], [1], [2], [3]], (2, 4))))
  np.testing.assert_array_equal(xo.recorded_visits, np.ones((8, 4)))
  assert "memory_space=any" in str(k) and "32 of 32 elements read" in str(k)
  names = [n for n, _, _ in k.scratch]
  assert names == ["buf", "sem"]
  np.testing.assert_array_equal(np.asarray(pallas_np.explain(manual_dma, x).result),
                                np.asarray(x) + 1)


def test_dynamic_ds_records_elements_not_blocks():
  k = pallas_np.explain(first_rows, arange(4, 4))[0]
  xo, oo = k.operands
  np.testing.assert_array_equal(xo.visits, np.ones((4, 4)))  # whole blocks mapped
  want = np.zeros((4, 4), bool)
  want[[0, 2]] = True  # the first row of each (2, 4) block
  np.testing.assert_array_equal(xo.read, want)
  np.testing.assert_array_equal(oo.written, want)


def test_same_array_twice_is_two_operands():
  x = arange(8, 8)
  k = pallas_np.explain(quickstart_matmul, x, x)[0]
  xo, yo, _ = k.operands
  np.testing.assert_array_equal(xo.recorded_first_step, blocks(([[0], [2]], (4, 8))))
  np.testing.assert_array_equal(yo.recorded_first_step, blocks(([[0, 1]], (8, 4))))


def test_summary_key_facts():
  text = str(pallas_np.explain(acc_matmul, arange(8, 6), arange(6, 8)))
  assert "kernel 'acc_kernel': grid (2, 2, 3) = 12 grid steps" in text
  assert "dimension_semantics ('parallel', 'parallel', 'arbitrary')" in text
  assert "in  x_ref (args[0])  float32[8, 6]  block (4, 2)  2x3 blocks  visits/block 2..2" in text
  assert "out o_ref (outputs)  float32[8, 8]  block (4, 4)  2x2 blocks  visits/block 3..3" in text
  # blocks: x 4x2x4 B + y 2x4x4 B in, 4x4x4 B out; copied: (12 x 32 + 12 x 32 + 4 x 64) B / 12
  assert "bytes per grid step: blocks 128 B (in 64 B, out 64 B); 85 B copied per step" in text
  assert "accumulator: o_ref (outputs) keeps its block across consecutive steps along grid axis 2" \
      in text
  ragged_text = str(pallas_np.explain(ragged, arange(10, 7)))
  assert "partial edge blocks: x_ref (args[0]) dim 0: 10 = 2x4 + 2; dim 1: 7 = 1x4 + 3 " \
         "(26 padding elements)" in ragged_text
  assert "accumulators: none" in ragged_text
  assert str(pallas_np.explain(lambda: 1)) == "pallas_np.explain: no pallas_call ran"


def test_explain_leaves_the_normal_path_alone():
  assert pallas_np.InterpretParams().records_accesses is False
  assert pallas_np.InterpretParams(detect_races=True).records_accesses is True
  x = arange(8, 4)
  pallas_np.explain(quickstart_matmul, x, arange(4, 8))
  # after explain, calls run without a recorder (nothing is left forced)
  from pallas_np import _compat as jc
  assert jc.interpret_mode_config.value is None


def test_revisit_after_leaving_block_warns():
  def bad(x):  # output block alternates 0, 1, 0, 1: revisits are not consecutive
    return pl.pallas_call(
        scale_kernel, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32), grid=(4,),
        in_specs=[pl.BlockSpec((2,), lambda i: (0,))],
        out_specs=pl.BlockSpec((2,), lambda i: (i % 2,)))(x)
  k = pallas_np.explain(bad, jnp.ones(4))[0]
  np.testing.assert_array_equal(k.operands[1].block_visits, [2, 2])
  assert k.operands[1].revisits(k.grid) == ((), 2)
  assert "2 block(s) revisited after the grid moved to another block" in str(k)


# -- pictures -------------------------------------------------------------------
def test_png_and_svg(tmp_path):
  pytest.importorskip("matplotlib")  # the viz extra
  ex = pallas_np.explain(quickstart_matmul, arange(8, 4), arange(4, 8))
  png = tmp_path / "k.png"
  svg = tmp_path / "k.svg"
  ex[0].save(str(png))
  ex[0].save(str(svg), color="visits", source="recorded", view="last2")
  data = png.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
  text = svg.read_text()
  assert "<svg" in text and len(text) > 10_000
  assert ex[0]._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "<svg" in ex[0]._repr_svg_()
  with pytest.raises(ValueError, match="color"):
    ex[0].figure(color="rainbow")


def test_pictures_of_every_kind(tmp_path):
  pytest.importorskip("matplotlib")  # the viz extra
  cases = [(ragged, (arange(10, 7),)), (causal, (arange(6, 4), arange(6, 4))),
           (manual_dma, (arange(8, 4),)), (wrong_out_map, (arange(4, 4),)),
           (acc_matmul, (arange(8, 6), arange(6, 8)))]
  for fn, args in cases:
    paths = pallas_np.explain(fn, *args).save_all(str(tmp_path / fn.__name__))
    assert len(paths) == 1 and open(paths[0], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_figure_does_not_touch_pyplot_state():
  matplotlib = pytest.importorskip("matplotlib")  # the viz extra
  backend = matplotlib.get_backend()
  ex = pallas_np.explain(ragged, arange(10, 7))
  fig = ex[0].figure()
  assert len(fig.axes) >= 3  # 2 operands + grid (+ colorbar)
  assert matplotlib.get_backend() == backend
  assert "matplotlib.pyplot" not in sys.modules or not sys.modules["matplotlib.pyplot"].get_fignums()


def test_missing_matplotlib_names_the_extra(monkeypatch):
  ex = pallas_np.explain(ragged, arange(10, 7))
  real_import = builtins.__import__

  def no_matplotlib(name, *args, **kwargs):
    if name == "matplotlib" or name.startswith("matplotlib."):
      raise ImportError("No module named 'matplotlib'")
    return real_import(name, *args, **kwargs)
  monkeypatch.setattr(builtins, "__import__", no_matplotlib)
  with pytest.raises(ImportError, match=r"pallas-np\[viz\]"):
    ex[0].save("never.png")
  assert "x_ref" in str(ex[0])  # the summary needs no matplotlib


# -- python -m pallas_np --explain ----------------------------------------------
def test_cli_explain_writes_pngs(tmp_path, capsys):
  pytest.importorskip("matplotlib")  # the viz extra
  script = tmp_path / "prog.py"
  script.write_text(textwrap.dedent("""
      import jax, jax.numpy as jnp
      from jax.experimental import pallas as pl
      def k(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1
      f = pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct((8, 8), jnp.float32), grid=(2,),
                         in_specs=[pl.BlockSpec((4, 8), lambda i: (i, 0))],
                         out_specs=pl.BlockSpec((4, 8), lambda i: (i, 0)), interpret=False)
      for _ in range(3):  # one picture per kernel, not per run
        print(float(f(jnp.ones((8, 8))).sum()))
  """))
  from pallas_np.__main__ import main
  argv = sys.argv[:]
  try:
    main(["--explain", str(tmp_path / "out"), str(script)])
  finally:
    sys.argv = argv
    pallas_np.unset_numpy_interpret()
  out = capsys.readouterr()
  assert out.out.split() == ["128.0"] * 3  # interpret=False ran on CPU: numpy mode
  files = sorted(os.listdir(tmp_path / "out"))
  assert files == ["00_k.png", "summary.txt"]
  assert (tmp_path / "out" / "00_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "kernel 'k': grid (2,)" in (tmp_path / "out" / "summary.txt").read_text()


# -- progress in notebooks --------------------------------------------------------
def test_progress_uses_tqdm_auto_when_installed(monkeypatch, capsys):
  made = []

  class FakeTqdm:
    def __init__(self, total, desc, **kwargs):
      self.total, self.desc, self.n, self.closed = total, desc, 0, False
      made.append(self)

    def update(self, k):
      self.n += k

    def close(self):
      self.closed = True
  fake = types.ModuleType("tqdm.auto")
  fake.tqdm = FakeTqdm
  monkeypatch.setitem(sys.modules, "tqdm", types.ModuleType("tqdm"))
  monkeypatch.setitem(sys.modules, "tqdm.auto", fake)
  monkeypatch.setattr(debugging, "PROGRESS_AFTER_S", 0.0)
  call = pallas_np.pallas_call(
      scale_kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), grid=(16,),
      in_specs=[pl.BlockSpec((1,), lambda i: (i,))],
      out_specs=pl.BlockSpec((1,), lambda i: (i,)),
      interpret=pallas_np.InterpretParams(vectorize=False))
  call(jnp.ones(16))
  assert len(made) == 1 and made[0].desc == "pallas_np scale_kernel"
  assert made[0].total == 16 and made[0].n == 16 and made[0].closed
  assert capsys.readouterr().err == ""  # no stderr line next to the widget
