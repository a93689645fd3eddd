"""How the compiled DMA queue moves a popped copy's bytes
(pallas_np/native/dma_queue.py, ``_dq_move``): straight from source to
destination where their byte ranges are apart (one memcpy per contiguous
run, typed loads and stores per item where a stride is not the item size:
a broadcast source of stride 0, as JAX's quantized paged attention DMAs
its scales from), through a buffer where they overlap (the NumPy rule reads
the whole source before it writes).

The helpers are called here on rows built by hand, against NumPy's own
copy of the same windows (``np.copyto`` of a copy of the source: the
NumPy rule's ``Dma.read_and_write``); the kernel tests compare a compiled
loop against ``native_loops="off"`` and JAX's TPU interpret mode. Before,
there was no direct path (``_dq_direct``, ``_dq_span``: the helper tests
fail without it) and a strided item was a ``memcpy`` call each."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np.native import dma_queue
from tests.native_elig_util import bits

numba = pytest.importorskip("numba")


@pytest.fixture(scope="module")
def queue():
  """The queue's helpers, compiled by numba.njit from the header the
  generated loops carry."""
  from numba import types as nt
  from numba.extending import intrinsic
  import llvmlite.ir as lir
  scope = {"np": np, "_nt": nt, "_intrinsic": intrinsic, "_lir": lir, "_pycall": None}
  exec(compile(dma_queue.HEADER, "<dma_queue header>", "exec"), scope)  # noqa: S102
  return scope


def _row(src, sview, dst, dview, sem):
  """A queue row moving the window ``sview`` (a view into ``src``) to
  ``dview`` (into ``dst``), counting on the int64 cell ``sem``."""
  row = np.zeros(dma_queue.WIDTH, np.int64)
  pad = dma_queue.RANK - sview.ndim
  row[dma_queue.SEM] = sem.ctypes.data
  row[dma_queue.SRC] = sview.__array_interface__["data"][0]
  row[dma_queue.DST] = dview.__array_interface__["data"][0]
  row[dma_queue.ITEM] = sview.itemsize
  row[dma_queue.SHAPE:dma_queue.SHAPE + dma_queue.RANK] = (1,) * pad + sview.shape
  row[dma_queue.SSTR + pad:dma_queue.SSTR + dma_queue.RANK] = sview.strides
  row[dma_queue.DSTR + pad:dma_queue.DSTR + dma_queue.RANK] = dview.strides
  return row


def _numpy_move(sview, dview):
  np.copyto(dview, sview.copy())


def _v3(a):
  """(rows, 170) items of 3 bytes over the first 510 bytes of each row."""
  return a.view(np.uint8)[:, :510].view("V3")


CASES = {
    # (source array, source window, destination array, destination window)
    "contiguous pages": lambda x, y: (x[1, 2:6], y[0]),
    "broadcast source (stride 0)": lambda x, y: (
        np.broadcast_to(x[0, 0, :, :1], (16, 128)), y[1, 0]),
    "strided columns, int8": lambda x, y: (x.view(np.int8)[0, 1, :, ::3][:, :128],
                                           y.view(np.int8)[0, 0, :, :128]),
    "strided rows, int16": lambda x, y: (x.view(np.int16)[0, 0, ::2], y.view(np.int16)[1, 1, :8]),
    "float64 items": lambda x, y: (x.view(np.float64)[0, 3, :, 1:33], y.view(np.float64)[1, 2, :, :32]),
    "3-byte items, strided": lambda x, y: (_v3(x[0, 0])[:, ::2][:, :80], _v3(y[0, 1])[:, 10:90]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_move_apart_is_numpys_copy(queue, case):
  rng = np.random.default_rng(3)
  x = rng.integers(0, 2**32, (2, 8, 16, 128), dtype=np.uint32).view(np.float32)
  y = rng.standard_normal((2, 4, 16, 128)).astype(np.float32)
  sview, dview = CASES[case](x, y)
  want = y.copy()
  _numpy_move(sview, CASES[case](x, want)[1])
  sem = np.zeros(1, np.int64)
  row = _row(x, sview, y, dview, sem)
  slo, shi = queue["_dq_span"](row[dma_queue.SRC], row, dma_queue.SSTR)
  dlo, dhi = queue["_dq_span"](row[dma_queue.DST], row, dma_queue.DSTR)
  assert shi <= dlo or dhi <= slo, "the windows overlap"
  queue["_dq_move"](row)
  np.testing.assert_array_equal(y.view(np.uint8), want.view(np.uint8))
  assert sem[0] == sview.size * sview.itemsize


@pytest.mark.parametrize("shift", [1, -1, 3])
def test_move_overlapping_reads_whole_source_first(queue, shift):
  """One buffer, the window shifted by ``shift`` rows onto itself: the
  bytes must be the source's as it was before the copy."""
  rng = np.random.default_rng(4)
  buf = rng.standard_normal((24, 128)).astype(np.float32)
  sview = buf[8:16, ::2]
  dview = buf[8 + shift:16 + shift, ::2]
  want = buf.copy()
  _numpy_move(want[8:16, ::2], want[8 + shift:16 + shift, ::2])
  sem = np.zeros(1, np.int64)
  row = _row(buf, sview, buf, dview, sem)
  slo, shi = queue["_dq_span"](row[dma_queue.SRC], row, dma_queue.SSTR)
  dlo, dhi = queue["_dq_span"](row[dma_queue.DST], row, dma_queue.DSTR)
  assert not (shi <= dlo or dhi <= slo), "the windows should overlap"
  queue["_dq_move"](row)
  np.testing.assert_array_equal(buf.view(np.uint32), want.view(np.uint32))


# -- in a kernel -----------------------------------------------------------------
STEPS, P = 4, 16


def _scaled_pages(x_hbm, s_hbm, o_ref, xbuf, sbuf, sem):
  """Pages and their per-row scales DMAed in a loop (the quantized paged
  attention's pattern); the scales come broadcast along the lanes."""
  def body(i, carry):
    cx = pltpu.make_async_copy(x_hbm.at[i], xbuf, sem.at[0])
    cs = pltpu.make_async_copy(s_hbm.at[i], sbuf, sem.at[0])
    cx.start()
    cs.start()
    cx.wait()
    cs.wait()
    o_ref[...] += xbuf[...]  # (two adds, no product: XLA would fuse one into an FMA)
    o_ref[...] += sbuf[...]
    return carry
  o_ref[...] = jnp.zeros_like(o_ref)
  lax.fori_loop(0, STEPS, body, 0)


def _make(interp):
  call = pl.pallas_call(
      _scaled_pages, out_shape=jax.ShapeDtypeStruct((P, 128), jnp.float32),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
      scratch_shapes=[pltpu.VMEM((P, 128), jnp.float32), pltpu.VMEM((P, 128), jnp.float32),
                      pltpu.SemaphoreType.DMA((1,))],
      interpret=interp)
  # (under jit the broadcast is evaluated by the NumPy evaluator: a stride-0 view)
  return jax.jit(lambda x, s: call(x, jnp.broadcast_to(s, (STEPS, P, 128))))


def test_broadcast_source_in_a_compiled_loop(dma_callbacks):
  count = dma_callbacks
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((STEPS, P, 128)), jnp.float32)
  s = jnp.asarray(rng.standard_normal((STEPS, P, 1)), jnp.float32)
  with pallas_np.force_numpy_interpret(pallas_np.InterpretParams(native_loops="sync")):
    got = _make(None)(x, s)
  assert count[0] == 0, "the loop's DMAs called back"
  with pallas_np.force_numpy_interpret(pallas_np.InterpretParams(native_loops="off")):
    off = _make(None)(x, s)
  np.testing.assert_array_equal(bits(got), bits(off))
  tpu = _make(pltpu.InterpretParams())(x, s)
  np.testing.assert_array_equal(bits(got), bits(tpu))
