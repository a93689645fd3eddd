"""``pl.debug_print`` / ``jax.debug.print`` / ``jax.debug.callback`` inside
kernels. The grid runs in order, so prints come out in grid order; each line
is prefixed with the kernel and grid point so interleaved output stays
readable (``[kernel (i, j)] text``)."""
from __future__ import annotations

import sys

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry


_IN_GRID_ORDER = registry.unbatched("prints/calls back in grid order: the grid runs sequentially")


def _prefix(ctx) -> str:
  point = tuple(int(i) for i in ctx.grid_point)
  return f"[{ctx.kernel_name} {point}] " if point else f"[{ctx.kernel_name}] "


if jc.debug_print_p is not None:
  @registry.register(jc.debug_print_p, needs_ctx=True, foldable=False, batch=_IN_GRID_ORDER)
  def _debug_print(e):
    p = e.params
    fmt, in_tree, static_args = p["fmt"], p["in_tree"], p["static_args"]
    printoptions = dict(p["np_printoptions"])
    placeholders = p["has_placeholders"]

    def debug_print(ctx, *dyn):
      args, kwargs = jc.merge_callback_args(in_tree, dyn, static_args)
      if placeholders:
        with np.printoptions(**printoptions):
          msg = fmt.format(*args, **kwargs)
      else:
        msg = " ".join((fmt, *(str(a) for a in args)))
      prefix = _prefix(ctx)
      sys.stdout.write("".join(prefix + line + "\n" for line in msg.split("\n")))
      return ()
    return debug_print


@registry.register(jc.debug_callback_p, needs_ctx=True, foldable=False, batch=_IN_GRID_ORDER)
def _debug_callback(e):
  callback = e.params["callback"]

  def debug_callback(ctx, *args):
    callback(*args)
    return ()
  return debug_callback
