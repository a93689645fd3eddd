"""Differential fuzzing of refs: scalar-prefetch operands aliased to outputs
(blocks written or not) and masked Triton loads/stores through ``.at[]``
views, numpy mode vs interpret=True (issue 27). Apart from ``fuzz_core``'s
op programs: these draw grids and aliases, not ops."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax.experimental import pallas as pl

from tests.fuzz_core import compare


@st.composite
def alias_prefetch_cases(draw):
  """(n_prefetch, alias input index, blocks, written-block mask, seed)."""
  n_prefetch = draw(st.integers(0, 2))
  alias_in = draw(st.integers(0, n_prefetch + 1))  # a prefetch operand or x / y
  blocks = draw(st.integers(1, 4))
  written = tuple(draw(st.booleans()) for _ in range(blocks))
  return n_prefetch, alias_in, blocks, written, draw(st.integers(0, 2 ** 31 - 1))


def run_alias_case(n_prefetch, alias_in, blocks, written, seed):
  """Numpy mode vs a NumPy reference and vs interpret=True (where it runs:
  JAX 0.12's fails when a prefetch operand is aliased); an aliased prefetch
  operand feeds an SMEM output of its shape. Returns an error string or None."""
  from jax.experimental.pallas import tpu as pltpu
  rng = np.random.default_rng(seed)
  pre = [jnp.asarray(rng.integers(-5, 5, 3), jnp.int32) for _ in range(n_prefetch)]
  x = jnp.asarray(rng.standard_normal((8 * blocks, 128)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((8 * blocks, 128)), jnp.float32)
  aliased_prefetch = alias_in < n_prefetch
  mask = jnp.asarray(written, jnp.int32)

  def kernel(*refs):
    s_refs, (m_ref, x_ref, y_ref), outs = (refs[:n_prefetch], refs[n_prefetch:n_prefetch + 3],
                                           refs[n_prefetch + 3:])
    i = pl.program_id(0)

    @pl.when(m_ref[i] != 0)
    def _():
      add = s_refs[0][0].astype(jnp.float32) if s_refs else 0.0
      outs[0][...] = x_ref[...] * 2.0 + y_ref[...] + add
    if aliased_prefetch:
      @pl.when(i == 0)
      def _():
        outs[1][0] = outs[1][0] + 1

  spec = pl.BlockSpec((8, 128), lambda i, *_: (i, 0))
  out_specs = [spec]
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
  if aliased_prefetch:
    out_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    out_shape.append(jax.ShapeDtypeStruct((3,), jnp.int32))
    aliases = {alias_in: 1}
  else:  # x or y (operand n_prefetch + 1 or + 2, after the block mask)
    aliases = {alias_in + 1: 0}
  gs = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=n_prefetch, grid=(blocks,),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), spec, spec], out_specs=out_specs)

  def call(interpret):
    return pl.pallas_call(kernel, out_shape, grid_spec=gs, input_output_aliases=aliases,
                          interpret=interpret)(*pre, mask, x, y)
  got = [np.asarray(g) for g in call("numpy")]
  # The NumPy reference, from the semantics: out0 starts from the aliased
  # input (NaN, interpret=True's fill, when none), written blocks get
  # x*2 + y + pre[0][0]; an aliased prefetch operand comes back with [0] += 1.
  xs, ys = np.asarray(x), np.asarray(y)
  out0 = {n_prefetch: xs, n_prefetch + 1: ys}.get(alias_in, np.full_like(xs, np.nan)).copy()
  add = np.float32(np.asarray(pre[0])[0]) if pre else np.float32(0)
  for b, w in enumerate(written):
    if w:
      rows = slice(8 * b, 8 * b + 8)
      out0[rows] = xs[rows] * np.float32(2) + ys[rows] + add
  oracles = [("reference", [out0])]
  if aliased_prefetch:
    out1 = np.asarray(pre[alias_in]).copy()
    out1[0] += 1
    oracles[0][1].append(out1)
  try:  # JAX 0.12's interpret=True fails on an aliased prefetch operand
    oracles.append(("interpret=True", [np.asarray(w) for w in call(True)]))
  except Exception:  # noqa: BLE001
    if not aliased_prefetch:
      raise
  for name, want in oracles:
    for k, (g, w) in enumerate(zip(got, want)):
      err = compare(g, w, "exact", xs)
      if err:
        return f"output {k} vs {name}: {err}"
  return None


@st.composite
def masked_view_cases(draw):
  """(rows, block, start, limit, store): a masked load (or store) through
  ``ref.at[pl.ds(start, block)]`` whose lanes at rows >= limit are off;
  the view may cross the end of the ref."""
  rows = draw(st.integers(1, 40))
  block = draw(st.integers(1, 16))
  start = draw(st.integers(0, rows - 1))
  limit = draw(st.integers(start, rows))
  return rows, block, start, limit, draw(st.booleans())


def run_masked_view_case(rows, block, start, limit, store):
  """Numpy mode vs a NumPy reference (interpret=True clamps such views and
  is wrong there). Returns an error string or None."""
  from jax.experimental.pallas import triton as pltriton
  x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + 1.0
  s = np.array([start, limit], np.int32)

  def kernel(s_ref, x_ref, o_ref):
    st_, lim = s_ref[0], s_ref[1]
    mask = ((st_ + jnp.arange(block)) < lim)[:, None]
    if store:
      o_ref[...] = jnp.zeros_like(o_ref)
      pltriton.store(o_ref.at[pl.ds(st_, block)].at[pl.ds(0, block)],
                     jnp.full((block, 3), -1.0, jnp.float32), mask=mask)
    else:
      o_ref[...] = pltriton.load(x_ref.at[pl.ds(st_, block)].at[pl.ds(0, block)],
                                 mask=mask, other=0.0)

  out_rows = rows if store else block
  got = np.asarray(pl.pallas_call(kernel, jax.ShapeDtypeStruct((out_rows, 3), jnp.float32),
                                  interpret="numpy")(s, x))
  n = max(0, min(limit, start + block) - start)
  if store:
    want = np.zeros((rows, 3), np.float32)
    want[start:start + n] = -1.0
  else:
    want = np.zeros((block, 3), np.float32)
    want[:n] = x[start:start + n]
  return compare(got, want, "exact", x)
