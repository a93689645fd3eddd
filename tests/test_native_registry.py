"""Every registered rule says what the native tier does with its primitive:
an emitter or an explicit ``registry.native_refused(why)`` (the ``native``
field of the rule, pallas_np/registry.py). A rule added without either
fails here, so the tier's coverage is decided per primitive, not by
omission."""
import importlib

import pytest

from pallas_np import native, registry  # noqa: F401 (attaches the emitters)
from pallas_np.native import codegen


def _import_families():
  for mod in ("jax.experimental.pallas.tpu", "jax.experimental.pallas.triton",
              "jax.experimental.pallas.mosaic_gpu"):
    try:
      importlib.import_module(mod)
    except ImportError:  # (not in every JAX version)
      pass


def test_every_rule_has_a_native_emitter_or_a_refusal():
  _import_families()
  prims = registry.registered_primitives()
  missing = sorted(n for n, p in prims.items() if registry.lookup(p).native is None)
  assert not missing, f"rules with neither a native emitter nor native_refused: {missing}"
  for name, p in prims.items():
    nat = registry.lookup(p).native
    assert callable(nat) or (isinstance(nat, registry.native_refused) and nat.why), name


def test_refused_primitive_raises_refused_with_the_reason():
  _import_families()
  prims = registry.registered_primitives()
  with pytest.raises(codegen.Refused, match="sin: its float formula is XLA's"):
    codegen.emitter(prims["sin"])
  assert codegen.emitter(prims["add"]) is registry.lookup(prims["add"]).native
