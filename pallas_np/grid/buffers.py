"""How one run of a ``KernelPlan`` turns the caller's operands into its
buffers, and its output buffers back into results: the one place for
padding, private copies of written inputs, output allocation and
``input_output_aliases`` (every run strategy of ``kernel_plan`` gets its
buffers here, so they all see the same aliasing).

An aliased input whose ref is the HBM buffer itself (memory space ANY, HBM,
GMEM, or any block of a GPU kernel) and its output are *one* buffer, as on
the hardware and in JAX's TPU interpret mode: a kernel may update it through
the input ref and never touch the output ref (``shared_aliases``). That
buffer is a private copy: the caller's array never changes.
"""
from __future__ import annotations

import functools

import numpy as np

from pallas_np import _compat as jc
from pallas_np import memory, races
from pallas_np.errors import UnsupportedError


class BufferSetup:
  """The buffer recipe of one plan (built once, used by every run)."""
  __slots__ = ("blocks", "num_index", "num_inputs", "out_for_in", "written", "params",
               "shared", "_preps")

  def __init__(self, blocks, block_mappings, *, num_index, num_inputs, out_for_in, written,
               params, compiler_params):
    self.blocks = blocks
    self.num_index = num_index
    self.num_inputs = num_inputs
    self.out_for_in = out_for_in
    self.params = params
    # output -> operand position of the aliased pairs that are one buffer
    self.shared = shared_aliases(blocks, block_mappings, out_for_in, num_index, num_inputs,
                                 compiler_params)
    # operands the run writes: the kernel's written inputs and shared ones
    self.written = written | frozenset(self.shared.values())
    self._preps = None  # built on the first run

  def buffers(self, args):
    """(scalar-prefetch operands, input and output buffers, output buffers)
    of one run on ``args`` (scalar prefetch then inputs): every buffer
    fresh, or a read-only view of the caller's array."""
    index_preps, in_preps, out_preps = self.preps()
    num_index = self.num_index
    index_ops = [prep(a) for prep, a in zip(index_preps, args)]
    in_bufs = [prep(x) for prep, x in zip(in_preps, args[num_index:])]
    out_bufs = [prep(args, index_ops + in_bufs) for prep in out_preps]
    return index_ops, in_bufs + out_bufs, out_bufs

  def preps(self):
    """Per scalar-prefetch operand and input, a function of the caller's
    array giving the run's buffer: a private copy where the kernel writes
    it (the caller's array is not ours to mutate), a padded copy where the
    shape is not a multiple of the block, else a read-only view (refs read
    from it without copying). Per output, a function of all operands and
    their buffers giving its buffer: the aliased input's own buffer where
    the pair is one buffer (``shared``; that input's buffer is then a
    private copy), else a copy of the aliased input, or uninitialised
    memory. The caller's arrays are never written."""
    if self._preps is not None:
      return self._preps
    params, shared, written = self.params, self.shared, self.written
    index_preps = [_private_copy if i in written else np.asarray
                   for i in range(self.num_index)]
    in_preps = []
    for i, geo in enumerate(self.blocks[:self.num_inputs]):
      writes = self.num_index + i in written
      if geo.needs_padding:
        pad = functools.partial(_padded, geo, params, not writes,
                                memory.allocator(geo.padded_shape, geo.dtype, params),
                                geo.unpadded_index())
      elif writes:
        pad = _private_copy
      else:  # (a builtin dtype needs no low-precision read: host_array)
        plain = isinstance(geo.dtype, np.dtype) and geo.dtype.isbuiltin == 1
        pad = _read_only_builtin if plain else _read_only
      in_preps.append(pad)
    out_preps = []
    for o, geo in enumerate(self.blocks[self.num_inputs:]):
      if o in shared:
        out_preps.append(_SharedBuffer(shared[o]))
      elif o in self.out_for_in:
        out_preps.append(functools.partial(_aliased_output, self.out_for_in[o], geo, params))
      else:
        out_preps.append(_Fresh(memory.allocator(geo.padded_shape, geo.dtype, params)))
    self._preps = (index_preps, in_preps, out_preps)
    return self._preps

  def results(self, out_bufs):
    """The outputs of a run: its output buffers with the padding cut off."""
    results = []
    for buf, geo in zip(out_bufs, self.blocks[self.num_inputs:]):
      if geo.needs_padding:
        view = buf[geo.unpadded_index()]
        if view.nbytes <= memory.TEMPLATE_MAX_BYTES:  # (as memory.allocator)
          buf = view.copy()
        else:
          buf = memory.aligned_empty(view.shape, view.dtype)
          buf[...] = view
      results.append(buf)
    return results


class _Fresh:
  """An output buffer of uninitialised memory (the operands are ignored)."""
  __slots__ = ("fresh",)

  def __init__(self, fresh):
    self.fresh = fresh

  def __call__(self, operands, buffers):
    return self.fresh()


class _SharedBuffer:
  """An aliased output that is its input's buffer (``shared_aliases``):
  the run's private copy of the input, at operand position ``source``."""
  __slots__ = ("source",)

  def __init__(self, source):
    self.source = source

  def __call__(self, operands, buffers):
    return buffers[self.source]


def _private_copy(x) -> np.ndarray:
  return np.array(x)


def _read_only(x) -> np.ndarray:
  """A read-only view of ``x`` (refs read from it without copying)."""
  x = jc.host_array(x) if type(x) is jc.ArrayImpl else np.asarray(x)
  if x.flags.writeable:
    x = x.view()
    x.flags.writeable = False
  return x


def _read_only_builtin(x) -> np.ndarray:
  """``_read_only`` of an operand whose block dtype is a NumPy builtin:
  NumPy reads a jax.Array of it through the buffer protocol (read-only)."""
  x = np.asarray(x)
  if x.flags.writeable:
    x = x.view()
    x.flags.writeable = False
  return x


def _padded(geo, params, read_only, fresh, unpadded, x) -> np.ndarray:
  """A padded copy of ``x`` (uninitialised padding), read-only unless the
  kernel writes it; ``fresh``: the allocator of the padded buffer,
  ``unpadded``: the index of ``x`` in it."""
  x = jc.host_array(x) if type(x) is jc.ArrayImpl else np.asarray(x)
  buf = fresh()
  if buf.dtype == x.dtype:
    buf[unpadded] = x
  else:  # (another dtype than the block's: as BlockGeometry.pad does)
    buf = geo.pad(x, params)
  if read_only:
    buf = buf.view()
    buf.flags.writeable = False
  return buf


def _aliased_output(source, geo, params, operands, buffers) -> np.ndarray:
  """A fresh buffer holding the aliased input (``input_output_aliases``)."""
  src = np.asarray(operands[source])
  return geo.pad(src, params) if geo.needs_padding else np.array(src)


# Memory spaces whose ref is the array itself in HBM/GMEM (no VMEM/SMEM copy
# of a block): an aliased input and its output there are one buffer.
_BUFFER_SPACES = frozenset({"any", "hbm", "gmem"})


def shared_aliases(blocks, block_mappings, out_for_in, num_index, num_inputs,
                   compiler_params) -> dict:
  """Output -> operand position of each aliased pair that is one buffer.

  On a TPU (and in JAX's TPU interpret mode) ``input_output_aliases`` makes
  the input and the output one HBM buffer: a kernel may update it through
  its *input* ref (a DMA or a store into an ANY/HBM ref) and ignore the
  output ref. Blocked VMEM/SMEM refs are copies of a block (writes to an
  input block are never written back), so those pairs stay apart, as in
  both interpret modes. On a GPU every ref points into global memory: every
  aliased pair is one buffer."""
  gpu = races.is_gpu(compiler_params)
  shared = {}
  for o, pos in out_for_in.items():
    i = pos - num_index
    if not 0 <= i < num_inputs:
      continue  # a scalar prefetch operand (SMEM): a copy
    space = jc.memory_space_of(block_mappings[i].transformed_block_aval)
    if not gpu and str(getattr(space, "value", space)).lower() not in _BUFFER_SPACES:
      continue
    src, dst = blocks[i], blocks[num_inputs + o]
    if (src.padded_shape, src.pad_low) != (dst.padded_shape, dst.pad_low):
      raise UnsupportedError(
          f"pallas_np: {src.origin} is aliased to {dst.origin}, one buffer on the hardware, "
          "but their blocks pad the array differently; give both the same block shape")
    shared[o] = pos
  return shared
