"""``pl.debug_check`` (``checkify.check`` with ``debug=True``) inside kernels.

As the Mosaic GPU and Mosaic TPU lowerings do: with
``jax_pallas_enable_debug_checks`` off (read when the kernel is compiled,
as they read it when lowering) the check is dropped; on, a failing check
stops the kernel (on a device, a device-side assert) with the check's
message. A ``checkify.check`` that was not functionalized (``debug=False``)
is refused, as the lowerings refuse it."""
from __future__ import annotations

import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry


@registry.register(jc.check_p, foldable=False, batch=registry.unbatched(
    "a failing check stops the kernel at its grid point"))
def _check(e):
  if not e.params["debug"]:
    raise e.unsupported("checkify.check that is not a debug check: Pallas's lowerings "
                        "(\"Non-debug checks are not supported\") need it functionalized "
                        "with jax.experimental.checkify, or use pl.debug_check")
  if not jc.debug_checks_enabled():
    return lambda *args: []
  err_tree = e.params["err_tree"]
  source = e.source

  def check(*args):
    failed, message = jc.failed_check_message(err_tree, args)
    if np.any(failed):
      raise jc.CheckFailedError(
          f"pallas_np: debug check failed at {source}: {message} (on the device: a "
          "device-side assert, the kernel fails)")
    return []
  return check
