"""``plgpu.atomic_add``/``atomic_max``/... (``mgpu_atomic_store``): a
read-modify-write of a GMEM/SMEM ref. Warpgroups take turns
(``threads``), so applying the update in place is exactly atomic."""
from __future__ import annotations

import jax
import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.mosaic_gpu import operands

_OPS = {"add": np.add, "max": np.maximum, "min": np.minimum,
        "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}


@registry.register(jc.mgpu_primitive("atomic_store_p"), foldable=False,
                   batch=registry.unbatched("atomics update refs shared by all grid points"))
def _atomic_store(e):
  args_tree = e.params["args_tree"]
  n = len(e.eqn.invars)
  _, transforms, val_pos = jc.tree_unflatten(args_tree, list(range(n)))
  leaves, tree = jax.tree_util.tree_flatten(transforms)
  if leaves and leaves != list(range(1, 1 + len(leaves))):
    raise e.unsupported("atomic update with this operand layout")
  get, _ = operands.ref_accessor(e, 0, tree, 1)
  kind = getattr(e.params["atomic_type"], "value", e.params["atomic_type"])
  op = _OPS.get(str(kind))
  if op is None:
    raise e.unsupported(f"atomic {kind!r}")

  def atomic(*args):
    view, idx = get(args)
    view[idx] = op(view[idx], args[val_pos])
    return []
  return atomic
