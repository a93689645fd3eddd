"""SparseCore vector-lane primitives (``jax.experimental.pallas.tpu_sc``):
masked cumulative scans, the masked key/value sort, ``scan_count``,
``pack`` / ``unpack`` of half-width elements and (JAX 0.10) ``plsc.bitcast``.

There is no JAX oracle (no interpreter of JAX runs them); the semantics are
the ones the Mosaic ops of their lowerings (``tpu.scan``, ``tpu.sort``,
``tpu.scan_count``, ``tpu.pack_subelements`` / ``unpack_subelements``,
``vector.bitcast``) define in their docs, written out in each rule's
docstring and in docs/tpu.md. All act along the minormost axis.
"""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import np_dtype
from pallas_np.primitives.tpu import minor_viewer

scp = jc.sc_primitives
_PURE = registry.unbatched("rare (SparseCore vector ops): run lane by lane")


def _rows(x):
  """``x`` as rows along its minormost axis (a view where possible)."""
  x = np.asarray(x)
  return x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)


def masked_scan(op, x, mask):
  """``tpu.scan`` with a mask: lane i gets ``op`` folded over the valid
  lanes up to and including i; lanes before the first valid one pass their
  own ``x`` through (cummax's docstring); an invalid lane after it holds
  the running value of the valid lanes before it."""
  x = np.asarray(x)
  out = np.array(x, copy=True)
  for row_out, row_x, row_m in zip(_rows(out), _rows(x), _rows(np.asarray(mask, bool))):
    valid = row_x[row_m]
    if not valid.size:
      continue
    running = op.accumulate(valid, dtype=x.dtype)
    seen = np.cumsum(row_m)  # valid lanes up to and including each lane
    row_out[seen > 0] = running[seen[seen > 0] - 1]
  return out


def _sort_order(keys, descending):
  """Stable order of ``keys``; duplicates keep their input order in both
  directions (``tpu.sort``)."""
  if not descending:
    return np.argsort(keys, kind="stable")
  if keys.dtype.kind in "iu":
    return np.argsort(-keys.astype(np.int64), kind="stable")
  return np.argsort(-keys, kind="stable")


def masked_sort(keys, values, mask, descending):
  """``tpu.sort``: a stable sort of the valid (key, value) pairs by key,
  then the masked-out pairs in their input order; the output mask marks the
  first ``count(mask)`` lanes (the valid outputs)."""
  keys, values = np.asarray(keys), np.asarray(values)
  mask = np.asarray(mask, bool)
  valid_keys, valid_values = keys[mask], values[mask]
  order = _sort_order(valid_keys, descending)
  out_keys = np.concatenate([valid_keys[order], keys[~mask]])
  out_values = np.concatenate([valid_values[order], values[~mask]])
  out_mask = np.arange(keys.size) < valid_keys.size
  return out_keys, out_values, out_mask


def scan_count(x, mask):
  """``tpu.scan_count``: lane i of the counts holds how many valid lanes
  j <= i hold a value equal to x[i] (1 for an invalid lane); the second
  output marks the valid lanes holding the last occurrence of their value.
  Equality is that of the element type (floats: -0.0 == 0.0, NaN never
  equal, so a NaN lane counts 1 and is its own last occurrence)."""
  x = np.asarray(x)
  mask = np.asarray(mask, bool)
  counts = np.ones(x.shape, np.int32)
  last = np.zeros(x.shape, bool)
  for row_c, row_l, row_x, row_m in zip(_rows(counts), _rows(last), _rows(x), _rows(mask)):
    same = (row_x[:, None] == row_x[None, :]) & row_m[:, None] & row_m[None, :]
    same |= np.diag(row_m)  # a valid NaN equals itself for its own count
    row_c[row_m] = np.tril(same).sum(axis=1)[row_m]
    row_l[:] = row_m & ~np.triu(same, 1).any(axis=1)
  return counts, last


def pack(a, b, fmt: str, dst):
  """``tpu.pack_subelements``: a and b converted to the half-width ``dst``
  (as ``astype``: floats round to nearest even, integers wrap — the
  conversion plsc.pack's docstring points to), then laid out
  ``interleaved`` (a0, b0, a1, b1, ...) or ``compressed`` (a then b, shaped
  (n, 2): [[a0, a1], [b0, b1]] for n = 2, as ``PackFormat`` documents)."""
  a = np.asarray(a).astype(dst)
  b = np.asarray(b).astype(dst)
  if fmt == "interleaved":
    return np.stack([a, b], axis=-1).reshape(2 * a.size)
  return np.concatenate([a, b]).reshape(a.size, 2)


def unpack(ab, fmt: str, dst):
  """The inverse of ``pack``: the two halves, widened to ``dst`` (exact)."""
  ab = np.asarray(ab)
  if fmt == "interleaved":
    a, b = ab[0::2], ab[1::2]
  else:
    flat = ab.reshape(-1)
    a, b = flat[:flat.size // 2], flat[flat.size // 2:]
  return [a.astype(dst), b.astype(dst)]


def _format_name(fmt) -> str:
  return str(getattr(fmt, "value", fmt))


if scp is not None and getattr(scp, "masked_cumsum_p", None) is not None:
  for _prim, _op in ((scp.masked_cumsum_p, np.add), (scp.masked_cummax_p, np.maximum),
                     (scp.masked_cummin_p, np.minimum)):
    registry.register_impl(_prim, batch=_PURE)(
        lambda x, mask, _op=_op: masked_scan(_op, x, mask))

  @registry.register(scp.masked_sort_p, batch=_PURE)
  def _masked_sort(e):
    """``plsc.sort_key_val(keys, values, mask=, descending=)``."""
    descending = bool(e.params["descending"])
    has_mask = len(e.eqn.invars) == 3

    def sort(keys, values, *maybe_mask):
      mask = maybe_mask[0] if has_mask else np.ones(np.shape(keys), bool)
      out = masked_sort(keys, values, mask, descending)
      return list(out) if has_mask else list(out[:2])
    return sort

  @registry.register(scp.scan_count_p, batch=_PURE)
  def _scan_count(e):
    """``plsc.scan_count(x, mask=)``: (counts, last-occurrence mask)."""
    return lambda x, mask: list(scan_count(x, mask))

  @registry.register(scp.pack_p, batch=_PURE)
  def _pack(e):
    """``plsc.pack(a, b, format=, preferred_element_type=)``."""
    fmt, dst = _format_name(e.params["format"]), np_dtype(e.out_avals[0].dtype)
    return lambda a, b: pack(a, b, fmt, dst)

  @registry.register(scp.unpack_p, batch=_PURE)
  def _unpack(e):
    """``plsc.unpack(ab, format=, preferred_element_type=)``."""
    fmt, dst = _format_name(e.params["format"]), np_dtype(e.out_avals[0].dtype)
    return lambda ab: unpack(ab, fmt, dst)

if scp is not None and getattr(scp, "bitcast_p", None) is not None:
  @registry.register(scp.bitcast_p, batch=_PURE)
  def _sc_bitcast(e):
    """JAX 0.10's ``plsc.bitcast``: ``vector.bitcast`` of the minormost dim,
    i.e. ``ndarray.view`` (JAX 0.12's is ``pltpu.bitcast(dim=-1)``)."""
    dst = np_dtype(e.params["dtype"])
    return minor_viewer(len(e.in_avals[0].shape), -1, dst)
