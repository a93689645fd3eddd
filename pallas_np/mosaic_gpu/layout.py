"""Layout and register-allocation hints: values are the same in every
layout, so ``layout_cast`` is the identity and the rest do nothing."""
from __future__ import annotations

from jax import lax

from pallas_np import _compat as jc
from pallas_np import races, registry
from pallas_np.mosaic_gpu import operands

if jc.mgpu_core is not None and hasattr(jc.mgpu_core, "layout_cast_p"):
  registry.register_numpy(jc.mgpu_core.layout_cast_p, lambda x: x, batch=registry.IDENTITY,
                          data_movement=True)


def _no_op(e):
  return lambda *args: []


for _name in ("set_max_registers_p",):
  if jc.mgpu_primitive(_name) is not None:
    registry.register(jc.mgpu_primitive(_name), foldable=False, batch=registry.unbatched(
        "a register-allocation hint: nothing to batch"))(_no_op)


# plgpu.load / plgpu.store: a ref read/write with an explicit register layout.
@registry.register(jc.mgpu_primitive("load_p"), batch=registry.unbatched(
    "plgpu.load: rare; runs lane by lane"), foldable=False)
def _load(e):
  get, _ = operands.ref_accessor(e, 0, e.params["tree"], 1)

  def load(*args):
    view, idx = get(args)
    races.note(view, idx, "read")
    return operands.read(view, idx)
  return load


if jc.mgpu_primitive("store_p") is not None:
  @registry.register(jc.mgpu_primitive("store_p"), batch=registry.unbatched(
      "plgpu.store: rare; runs lane by lane"), foldable=False)
  def _store(e):
    return operands.store_rule(e)


# plgpu.sum/max/min/prod: lax's reductions with a register-level hint
# (accumulator_ilp) that does not change the value: lax's rules compute them.
def _like_lax(lax_prim):
  def compile_reduction(e):
    return registry.lookup(lax_prim).compile(e)
  return compile_reduction


for _name, _lax_prim in (("reduce_sum_p", lax.reduce_sum_p), ("reduce_max_p", lax.reduce_max_p),
                         ("reduce_min_p", lax.reduce_min_p), ("reduce_prod_p", lax.reduce_prod_p)):
  if jc.mgpu_primitive(_name) is not None:
    registry.register(jc.mgpu_primitive(_name), batch=registry.unbatched(
        "plgpu reductions: rare; run lane by lane"))(_like_lax(_lax_prim))

if jc.mgpu_primitive("print_layout_p") is not None:
  # Prints the register layout of a value on a GPU; here there is none.
  registry.register(jc.mgpu_primitive("print_layout_p"), foldable=False, batch=registry.unbatched(
      "a debugging print of the layout: nothing to batch"))(_no_op)
