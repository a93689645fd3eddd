"""``plgpu.inline_mgpu``: Mosaic GPU IR written by hand inside a kernel.

Its body builds MLIR; there is nothing to run here. The only uses the
interpreter can honour are PTX fences (``plgpu``'s ``inline_ptx`` of a
``fence.*`` instruction, as ``dynamic_scheduling_loop`` emits around its
cluster-cancel buffers): they order a thread's memory accesses between the
generic and asynchronous proxies, and here every access is visible in
program order already (copies land at their barrier waits), so they change
nothing a kernel can observe. Anything else raises ``UnsupportedError``
naming the function and the kernel line."""
from __future__ import annotations

import inspect

from pallas_np import _compat as jc
from pallas_np import registry


def _ptx_of(fn) -> str | None:
  """The PTX an ``inline_ptx(asm)`` body inserts, or None."""
  if not getattr(fn, "__qualname__", "").startswith("inline_ptx."):
    return None
  try:
    asm = inspect.getclosurevars(fn).nonlocals.get("asm")
  except (TypeError, ValueError):  # pragma: no cover - not a Python function
    return None
  return asm if isinstance(asm, str) else None


def is_fence(fn) -> bool:
  asm = _ptx_of(fn)
  if asm is None:
    return False
  lines = [ln.strip() for ln in asm.strip().split(";") if ln.strip()]
  return bool(lines) and all(ln.startswith("fence.") for ln in lines)


if jc.mgpu_primitive("inline_mgpu_p") is not None:
  @registry.register(jc.mgpu_primitive("inline_mgpu_p"), foldable=False,
                     batch=registry.unbatched("a fence: nothing to batch"))
  def _inline_mgpu(e):
    fn = e.params["mgpu_fn"]
    if not is_fence(fn) or e.params.get("flat_ret_ty"):
      name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
      asm = _ptx_of(fn)
      raise e.unsupported(f"inline_mgpu ({name}" + (f": PTX {asm.strip()!r}" if asm else "")
                          + "): only PTX fences can be interpreted")
    return lambda *args: []
