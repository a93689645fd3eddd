"""One buffer for eqn results whose lives do not overlap (pallas_np/native/
buffer_reuse.py, applied by ``codegen.finish``): the lives on hand-written
generated lines (aliases, addresses, loops a life crosses), and kernels
whose values live across a loop's iterations, compared bit for bit with
``native_loops="off"`` and within tolerance with interpret=True. The
structural checks fail without the change (every eqn had a buffer)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_np.native import buffer_reuse, codegen
from tests.native_elig_util import compiled_equals_numpy

F32 = np.dtype(np.float32)


def _temps(*names, n=64, dt=F32):
  return [(name, n, dt) for name in names]


def test_disjoint_lives_share_one_buffer():
  lines = ["    for _i in range(64):",
           "        v1[_i] = a0[_i]",
           "    for _i in range(64):",
           "        v2[_i] = v1[_i] * 2",
           "    for _i in range(64):",
           "        v3[_i] = v2[_i] + 1",
           "    for _i in range(64):",
           "        a0[_i] = v3[_i]"]
  new, kept = buffer_reuse.share(lines, _temps("v1", "v2", "v3"))
  assert [t[0] for t in kept] == ["v1", "v2"]  # v3 takes v1's buffer (v1 dead after line 3)
  assert new[5] == "        v1[_i] = v2[_i] + 1" and new[7] == "        a0[_i] = v1[_i]"


def test_one_loop_never_sees_one_buffer_twice():
  lines = ["    for _i in range(64):",
           "        v1[_i] = a0[_i]",
           "        v2[_i] = v1[_i] * 2",
           "    for _i in range(64):",
           "        a0[_i] = v2[_i]"]
  _, kept = buffer_reuse.share(lines, _temps("v1", "v2"))
  assert len(kept) == 2


def test_other_dtype_or_size_not_shared():
  lines = ["    v1[0] = a0[0]", "    a0[0] = v1[0]", "    v2[0] = a0[0]", "    a0[0] = v2[0]"]
  assert len(buffer_reuse.share(lines, [("v1", 64, F32), ("v2", 64, np.dtype(np.int32))])[1]) == 2
  assert len(buffer_reuse.share(lines, [("v1", 64, F32), ("v2", 32, F32)])[1]) == 2
  assert len(buffer_reuse.share(lines, _temps("v1", "v2"))[1]) == 1


def test_aliases_and_addresses_extend_a_life():
  """A view (``u = v.view``) or an address (``p = v.ctypes.data``) read
  later keeps the buffer alive until then; an element read does not."""
  lines = ["    p5 = np.int64(v1.ctypes.data)",
           "    u6 = v2.view(np.int32)",
           "    e7 = v3[0]",
           "    v4[0] = e7",
           "    _cblas_sgemm(_fp, p5, u6)",
           "    a0[0] = v4[0]"]
  lives = buffer_reuse._lives(lines, ["v1", "v2", "v3", "v4"])
  assert lives["v1"] == (0, 4) and lives["v2"] == (1, 4)
  assert lives["v3"] == (2, 2)


def test_a_life_crossing_a_loop_spans_the_loop():
  """Made before a loop and read in it: alive to the loop's end (read
  again in the next iteration); made in a loop and read after it: alive
  from the loop's start (a later iteration's earlier lines, or the lines
  before a ``break``, must not overwrite it)."""
  lines = ["    v1[0] = a0[0]",           # 0
           "    while True:",             # 1
           "        v2[0] = a0[1]",       # 2
           "        if v2[0] > 0: break",  # 3
           "        a0[2] = v1[0]",       # 4
           "        v3[0] = a0[3]",       # 5
           "        a0[4] = v3[0]",       # 6
           "        v4[0] = a0[5]",       # 7
           "    a0[6] = v4[0]"]           # 8
  lives = buffer_reuse._lives(lines, ["v1", "v2", "v3", "v4"])
  assert lives["v1"] == (0, 7)  # (to the loop's end, not line 4)
  assert lives["v3"] == (5, 6)
  assert lives["v4"] == (1, 8)  # (from the loop's start)
  _, kept = buffer_reuse.share(lines, _temps("v1", "v2", "v3", "v4"))
  # v1 overlaps everyone; v2 (2-3) and v3 (5-6) share; v4 overlaps both
  assert sorted(t[0] for t in kept) == ["v1", "v2", "v4"]


def _carried_values(x_ref, w_ref, o_ref):
  """A value made before the loop and read in every iteration (``base``),
  many elementwise temporaries in the iteration, a cond in it, a max and an
  exp (flash attention's shapes of work), and one made in the last
  iteration read after the loop (through the carry)."""
  base = jnp.exp(x_ref[...] * 0.5)

  def body(i, carry):
    acc, m = carry
    s = x_ref[...] * (i + 1).astype(jnp.float32) - base
    row = jnp.max(s, axis=1, keepdims=True)
    m2 = jnp.maximum(m, row)
    p = jnp.exp(s - m2)
    alpha = jnp.exp(m - m2)
    t = lax.cond(i % 2 == 0, lambda: p * 2.0 + base, lambda: p - base)
    acc = acc * alpha + t + jnp.dot(p, w_ref[...])
    return acc, m2
  acc, m = lax.fori_loop(0, 5, body, (jnp.zeros((16, 128), jnp.float32),
                                      jnp.full((16, 1), -jnp.inf, jnp.float32)))
  o_ref[...] = acc / (m + 1.0) + base


def _make(interp):
  return pl.pallas_call(_carried_values, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
                        interpret=interp)


def _args():
  rng = np.random.default_rng(3)
  return (jnp.asarray(rng.standard_normal((16, 128)), jnp.float32),
          jnp.asarray(rng.standard_normal((128, 128)) * 0.1, jnp.float32))


def test_shared_buffers_bit_exact():
  compiled_equals_numpy(_make, *_args(), rtol=1e-4, atol=1e-4)


def _source():
  closed = jax.make_jaxpr(_make(True))(*_args())
  eqn = next(e for e in closed.jaxpr.eqns if e.primitive.name == "pallas_call")
  loop = next(e for e in eqn.params["jaxpr"].eqns if e.primitive.name in ("while", "scan"))
  return codegen.loop_source(loop, False, "nan").text


def test_loop_allocates_fewer_buffers_than_eqn_results(monkeypatch):
  shared = _source()
  monkeypatch.setattr(buffer_reuse, "share", lambda lines, temps: (lines, temps))
  unshared = _source()
  buffers = [len(re.findall(r"^    v\d+ = np\.empty\(2048, np\.float32\)$", t, re.M))
             for t in (shared, unshared)]
  assert 0 < buffers[0] <= buffers[1] - 3, (buffers, shared)  # (9 -> 6: lazy operands have none)
  # the same lines, up to the buffers' names
  strip = lambda t: re.sub(r"\bv\d+\b", "v", "\n".join(
      l for l in t.splitlines() if "np.empty(" not in l))
  assert strip(shared) == strip(unshared)
