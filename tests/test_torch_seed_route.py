"""docs/torch.md's replacement for seed 000's torchax route: the seed's own
definition of ``torch_pallas_call`` (``interop.torch_view(pl.pallas_call(
interop.jax_view(kernel), ...))``) with ``pallas_np.torch.interop`` in place of
``torchax.interop`` (torchax does not import on torch >= 2.13), on plain CPU
tensors, against torch's own result."""
import jax
import pytest
from jax.experimental import pallas as pl

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (pip install 'pallas-np[torch]'); "
    "CI installs it, so these tests run there")

from pallas_np.torch import interop  # noqa: E402  (instead of: from torchax import interop)


def torch_pallas_call(kernel, *args, **kwargs):  # the seed's definition, verbatim
  kernel_as_jax = interop.jax_view(kernel)
  orig_pallas_callable = pl.pallas_call(
      kernel_as_jax,
      *args,
      **kwargs,
  )
  return interop.torch_view(orig_pallas_callable)


def add_vectors_kernel(x_ref, y_ref, o_ref):
  x, y = x_ref[...], y_ref[...]
  o_ref[...] = torch.add(x, y)


def test_seed_000_torch_pallas_call_definition_with_pallas_np_interop():
  g = torch.Generator().manual_seed(0)
  x, y = torch.randn(8, generator=g), torch.randn(8, generator=g)
  result = torch_pallas_call(
      add_vectors_kernel,
      out_shape=jax.ShapeDtypeStruct(x.shape, interop.jax_view(x.dtype)),
      interpret="numpy")(x, y)
  assert isinstance(result, torch.Tensor) and result.dtype == torch.float32
  torch.testing.assert_close(result, x + y, rtol=0, atol=0)
