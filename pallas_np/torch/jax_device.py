"""``device='jax'`` for torchax-style scripts (opt-in: import this module).

torchax examples create inputs with ``torch.randn(8, device='jax')``. Under
pallas_np everything runs on the CPU, so importing this module names torch's
PrivateUse1 backend ``'jax'`` and registers factory kernels for it that
allocate on the CPU: ``torch.randn/zeros/ones/full/arange/empty(...,
device='jax')`` return ordinary CPU tensors. ``tensor(..., device='jax')`` and
``.to('jax')`` (copies to the device) are not supported. Importing fails if
another library already owns the PrivateUse1 backend.
"""
from __future__ import annotations

import types

import torch

_OWNER = "pallas_np.torch.jax_device"


def _install():
  current = torch._C._get_privateuse1_backend_name()
  existing = getattr(torch, "jax", None)
  if getattr(existing, "__owner__", None) == _OWNER:
    return
  if current not in ("privateuseone", "jax") or existing is not None:
    raise ImportError(
        f"{_OWNER}: torch's PrivateUse1 backend is already used ('{current}'); "
        "cannot provide device='jax'")
  module = types.ModuleType("torch.jax")
  module.__owner__ = _OWNER
  module.is_available = lambda: True
  module.current_device = lambda: 0
  module.device_count = lambda: 1
  module._is_in_bad_fork = lambda: False
  module.manual_seed_all = lambda seed: None
  # Registers the device module plus Python hooks and a device guard, so
  # torch's accelerator queries (torch.compile makes them) keep working.
  # torch-internal, not in every torch version: imported only when the device is registered.
  from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
  _setup_privateuseone_for_python_backend(
      rename="jax" if current == "privateuseone" else None, backend_module=module)

  lib = torch.library.Library("aten", "IMPL")

  def empty_memory_format(size, *, dtype=None, layout=None, device=None, pin_memory=None,
                          memory_format=None):
    return torch.empty(size, dtype=dtype, layout=layout, device="cpu",
                       memory_format=memory_format)

  def empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return torch.empty_strided(size, stride, dtype=dtype, layout=layout, device="cpu")

  lib.impl("empty.memory_format", empty_memory_format, "PrivateUse1")
  lib.impl("empty_strided", empty_strided, "PrivateUse1")
  module._library = lib  # keep the registrations alive


_install()
