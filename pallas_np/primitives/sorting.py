"""sort, top_k and the total-order comparisons the sort comparator uses.

XLA orders floats totally: -NaN < -inf < ... < -0.0 < 0.0 < ... < inf < NaN.
``lax.sort``'s comparator first maps -0.0 to 0.0 and every NaN to +NaN, so
zeros compare equal (a stable sort keeps their input order) and NaNs go last.
``top_k`` compares with the raw total order (0.0 ranks above -0.0, +NaN above
+inf). Both are reproduced with integer sort keys and NumPy's stable sorts.
"""
from __future__ import annotations

import numpy as np

from jax import lax

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import np_dtype, is_low_precision_float


def total_order_key(x):
  """Signed integers ordered like XLA's TOTALORDER comparison of ``x``."""
  x = np.asarray(x)
  dt = x.dtype
  if dt.kind not in "fV" and not is_low_precision_float(dt):
    return x
  sdt = np.dtype(f"int{dt.itemsize * 8}")
  bits = np.ascontiguousarray(x).view(sdt)
  # Negative floats: flip magnitude bits so larger magnitude sorts lower.
  return np.where(bits < 0, bits ^ np.array(np.iinfo(sdt).max, sdt), bits)


def _canonical_for_sort(x):
  """lax.sort's key canonicalisation: -0.0 -> 0.0, any NaN -> +NaN."""
  x = np.asarray(x)
  if x.dtype.kind == "f" or is_low_precision_float(x.dtype):
    x = np.where(x == 0, np.zeros((), x.dtype), x)
    x = np.where(np.isnan(x), np.array(np.nan, x.dtype), x)
  return x


def _sort_keys(x):
  """Keys (most significant last, as np.lexsort wants) for one sort operand."""
  x = np.asarray(x)
  if x.dtype.kind == "c":
    return [total_order_key(_canonical_for_sort(np.imag(x))),
            total_order_key(_canonical_for_sort(np.real(x)))]
  if x.dtype == np.bool_:
    return [x.astype(np.int8)]
  return [total_order_key(_canonical_for_sort(x))]


@registry.register(lax.sort_p, batch=registry.unbatched("sorts along an axis: run lane by lane"))
def _sort(e):
  dim = int(e.params["dimension"])
  num_keys = int(e.params["num_keys"])

  def sort(*operands):
    moved = [np.moveaxis(np.asarray(o), dim, -1) for o in operands]
    keys = []
    for k in reversed(range(num_keys)):
      keys.extend(_sort_keys(moved[k]))
    # np.lexsort is stable: equal keys keep their order (XLA's is_stable).
    order = np.lexsort(keys, axis=-1) if moved[0].ndim else np.zeros((), np.intp)
    return [np.moveaxis(np.take_along_axis(m, order, axis=-1), -1, dim)
            for m in moved]
  return sort


@registry.register(lax.top_k_p, batch=registry.unbatched("run lane by lane"))
def _top_k(e):
  k = int(e.params["k"])
  axis = int(e.params.get("axis", -1))
  ndim = len(e.in_avals[0].shape)
  axis = axis % ndim if ndim else 0
  idx_dt = np_dtype(e.out_avals[1].dtype)

  def top_k(x):
    x = np.moveaxis(np.asarray(x), axis, -1)
    key = total_order_key(x)
    # Descending and stable (ties: lower index first): sort ~key ascending.
    order = np.argsort(~key, axis=-1, kind="stable")[..., :k]
    vals = np.take_along_axis(x, order, axis=-1)
    return [np.moveaxis(vals, -1, axis), np.moveaxis(order.astype(idx_dt), -1, axis)]
  return top_k


def _total_order_compare(ufunc):
  def compile_rule(e):
    def compare(x, y):
      return ufunc(total_order_key(x), total_order_key(y))
    return compare
  return compile_rule


for _name, _ufunc in [("eq_to_p", np.equal), ("lt_to_p", np.less), ("le_to_p", np.less_equal)]:
  _p = getattr(jc.lax_internal, _name, None)
  if _p is not None:
    registry.register(_p, batch=registry.ELEMENTWISE)(_total_order_compare(_ufunc))
