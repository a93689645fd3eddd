"""Pallas GPU (Triton) primitives, never imported by pallas_np itself.

JAX's Triton primitives module imports the Triton dialect (a few tenths of
a second) and only Triton kernels need it; such a kernel exists only once
user code imported it (``jax.experimental.pallas.triton``). So
``triton_primitives`` names its primitives without importing it: each
attribute is a ``LazyPrimitive``, a registry key that ``pallas_np.registry``
turns into the primitive itself when the module is imported
(``families.on_first_use``). A name this JAX does not have resolves to
nothing, and its rule is dropped."""
from __future__ import annotations

import sys

MODULE = "jax._src.pallas.triton.primitives"


class LazyPrimitive:
  """Primitive ``name`` of JAX module ``module``, named before it is imported."""
  __slots__ = ("module", "name")

  def __init__(self, module: str, name: str):
    self.module, self.name = module, name

  def resolve(self):
    """The primitive, if its module is imported and has it; else None."""
    mod = sys.modules.get(self.module)
    return getattr(mod, self.name, None) if mod is not None else None

  def __repr__(self):
    return f"LazyPrimitive({self.module}.{self.name})"


class LazyPrimitives:
  """A JAX module's primitives as ``LazyPrimitive`` attributes."""

  def __init__(self, module: str):
    self.module = module

  def __getattr__(self, name):
    if name.startswith("__"):
      raise AttributeError(name)
    return LazyPrimitive(self.module, name)


triton_primitives = LazyPrimitives(MODULE)
