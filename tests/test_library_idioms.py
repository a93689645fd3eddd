"""Constructs of public kernel libraries' kernels (tokamax, tpu-inference),
each reproduced by a small kernel or call of our own (CI has no mirror of
the libraries): what the hardware / XLA does, against a reference written
from the semantics or JAX's own interpreters."""
import numpy as np
import pytest


# -- an indexed gather of rows through a width-changing ref bitcast --------------------
# DeepSeek-V4 csa_gather (tpu-inference): ``pl.Indirect`` block specs gather
# rows of ``cache_u8.bitcast(jnp.int32)`` by a token index array: the index
# array sits on the second-minor dim, the one the bitcast packs along.
@pytest.mark.parametrize("dtype,to", [(np.uint8, np.int32), (np.int32, np.int8),
                                      (np.uint16, np.uint32), (np.uint32, np.uint16)])
def test_a_gather_along_the_packed_dim_of_a_bitcast_lens(dtype, to):
  """Reads and writes of ``lens[rows]`` (rows with duplicates and rows of
  one packed group) against the whole ref converted and indexed
  (``lens.tpu_bitcast``, checked against interpret=True in
  test_ref_transforms)."""
  from pallas_np.state import lens
  rng = np.random.RandomState(1)
  parent = rng.randint(0, 200, size=(64, 16)).astype(dtype)
  view_rows = lens.bitcast(parent.copy(), to).shape[0]
  rows = np.array([5, 4, view_rows - 1, 0, 5, 6, 7, 1], np.int32)
  for idx in [(rows,), (rows, slice(2, 9)), (rows, 3)]:
    want = lens.tpu_bitcast(parent, to)[idx]
    np.testing.assert_array_equal(lens.bitcast(parent.copy(), to)[idx], want)
    new = rng.randint(0, 100, size=want.shape).astype(want.dtype)
    got_parent = parent.copy()
    lens.bitcast(got_parent, to)[idx] = new
    whole = lens.tpu_bitcast(parent, to)
    whole[idx] = new  # NumPy: the last of duplicate rows wins
    np.testing.assert_array_equal(got_parent, lens.tpu_bitcast(whole, dtype))


def test_a_gather_along_the_packed_dim_converts_only_the_gathered_groups(monkeypatch):
  """The csa_gather slow path: a gather of 16 rows of a 4096-row bitcast
  converted the whole ref on every DMA (minutes per test)."""
  from pallas_np.state import lens
  sizes = []
  real = lens.tpu_bitcast

  def recording(x, dtype):
    sizes.append(x.size)
    return real(x, dtype)
  monkeypatch.setattr(lens, "tpu_bitcast", recording)
  parent = np.arange(4 * 4096 * 8, dtype=np.int64).astype(np.uint8).reshape(4 * 4096, 8)
  rows = np.arange(0, 4096, 256, dtype=np.int32)
  got = lens.bitcast(parent, np.int32)[rows]
  assert max(sizes) <= 16 * 4 * 8, max(sizes)
  want = parent.reshape(4096, 4, 8).astype(np.uint32)
  want = want[:, 0] | want[:, 1] << 8 | want[:, 2] << 16 | want[:, 3] << 24  # little-endian bytes
  np.testing.assert_array_equal(got.view(np.uint32), want[rows])
