"""Layout and register-allocation hints: values are the same in every
layout, so ``layout_cast`` is the identity and the rest do nothing."""
from __future__ import annotations

from pallas_np import _compat as jc
from pallas_np import registry

if jc.mgpu_core is not None and hasattr(jc.mgpu_core, "layout_cast_p"):
  registry.register_numpy(jc.mgpu_core.layout_cast_p, lambda x: x, batch=registry.IDENTITY,
                          data_movement=True)


def _no_op(e):
  return lambda *args: []


for _name in ("set_max_registers_p",):
  if jc.mgpu_primitive(_name) is not None:
    registry.register(jc.mgpu_primitive(_name), foldable=False, batch=registry.unbatched(
        "a register-allocation hint: nothing to batch"))(_no_op)
