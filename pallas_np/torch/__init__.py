"""PyTorch front-end: run Pallas kernels on CPU torch tensors in numpy mode.

* ``make_kernel_from_pallas(jax_fn, output_shape_dtype_fn)``: torch_xla's
  adapter, on CPU tensors (zero-copy in and out where NumPy can share memory).
* ``flash_attention`` / ``paged_attention``: the JAX TPU kernels as
  ``torch.library`` custom ops (``torch.ops.pallas_np.*``), with fake
  implementations for ``torch.compile`` and autograd for flash attention.
* ``torch_pallas_call(kernel, out_shape=..., ...)``: Pallas kernels whose body
  is written with torch ops on refs (torch ops are mapped onto jax.numpy/lax
  while the kernel is traced; see ``pallas_np.torch.torch_ops``).
"""
try:
  import torch as _torch  # noqa: F401
except ImportError as _err:  # pragma: no cover - exercised only without torch
  raise ImportError(
      "pallas_np.torch needs PyTorch, which is not installed. Install the extra: "
      "pip install 'pallas-np[torch]'") from _err

from pallas_np.torch.convert import (to_numpy, to_torch, torch_dtype_to_numpy,
                                     numpy_dtype_to_torch)
from pallas_np.torch.kernels import make_kernel_from_pallas
from pallas_np.torch.attention import flash_attention, paged_attention
from pallas_np.torch.ops_table import UnsupportedTorchOpError, covered_torch_ops
from pallas_np.torch.pallas_call import torch_pallas_call
from pallas_np.torch import interop

__all__ = ["make_kernel_from_pallas", "flash_attention", "paged_attention",
           "torch_pallas_call", "interop", "to_numpy", "to_torch",
           "torch_dtype_to_numpy", "numpy_dtype_to_torch",
           "UnsupportedTorchOpError", "covered_torch_ops"]
