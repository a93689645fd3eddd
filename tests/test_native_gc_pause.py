"""The first-call garbage-collection pause (pallas_np/gc_pause.py): the
automatic collector is off while a kernel's first call traces and builds
its plans, back on afterwards, left off if the user turned it off, and
untouched with PALLAS_NP_GC_PAUSE=0. The kernel body records the
collector's state while JAX traces it (inside the first call)."""
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_np


def _call(seen):
  def kernel(x_ref, o_ref):
    seen.append(gc.isenabled())
    o_ref[...] = x_ref[...] + 1.0
  return pallas_np.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32))


def test_collector_paused_during_first_call_and_restored(monkeypatch):
  monkeypatch.delenv("PALLAS_NP_GC_PAUSE", raising=False)
  assert gc.isenabled()
  seen = []
  x = jnp.zeros((8, 128), jnp.float32)
  np.testing.assert_array_equal(np.asarray(_call(seen)(x)), 1.0)
  assert seen == [False]
  assert gc.isenabled()


def test_collector_disabled_by_the_user_stays_disabled(monkeypatch):
  monkeypatch.delenv("PALLAS_NP_GC_PAUSE", raising=False)
  gc.disable()
  try:
    seen = []
    _call(seen)(jnp.zeros((8, 128), jnp.float32))
    assert seen == [False]
    assert not gc.isenabled()
  finally:
    gc.enable()


def test_off_switch(monkeypatch):
  monkeypatch.setenv("PALLAS_NP_GC_PAUSE", "0")
  seen = []
  _call(seen)(jnp.zeros((8, 128), jnp.float32))
  assert seen == [True]
  assert gc.isenabled()


def test_restored_when_the_first_call_raises(monkeypatch):
  monkeypatch.delenv("PALLAS_NP_GC_PAUSE", raising=False)

  def kernel(x_ref, o_ref):
    raise ValueError("boom")
  with pytest.raises(ValueError, match="boom"):
    pallas_np.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32))(
        jnp.zeros((8, 128), jnp.float32))
  assert gc.isenabled()
