"""The per-call floor of the compiled float loops (issue 41): a loop
written in place into its own operand (``passes.in_place``: softmax's exp)
skips ``libm.call``'s general path (broadcast, contiguous copies, overlap
check). The path is checked taken, and its bits against XLA's (jax.jit)
and the general path's; operands it must not take stay on the general path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_np.primitives import libm, xla_math  # noqa: F401 (xla_math defines the loops)

rng = np.random.default_rng(4142)


def _x(n=4099):
  x = rng.standard_normal(n).astype(np.float32) * 10
  x[:4] = [0.0, -0.0, np.inf, -np.inf]
  return x


@pytest.mark.parametrize("name, f", [("xla_expf", jnp.exp), ("xla_logf", jnp.log),
                                     ("xla_tanhf", jnp.tanh), ("sinf", jnp.sin)])
def test_in_place_call_skips_the_general_path(monkeypatch, name, f):
  base = _x()
  general = libm.call(name, base.copy())  # (a fresh result: the general path)
  calls = []
  monkeypatch.setattr(libm.np, "broadcast_arrays",
                      lambda *a, **k: calls.append(1) or np.lib.stride_tricks.broadcast_arrays(*a, **k))
  same = base.copy()
  got = libm.call(name, same, out=same)
  assert got is same and calls == []
  want = np.asarray(jax.jit(f)(base))
  ok = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
  assert ok.all()
  np.testing.assert_array_equal(got.view(np.uint32), general.view(np.uint32))


@pytest.mark.parametrize("case", ["strided", "read_only", "float64", "empty"])
def test_operands_the_in_place_path_must_not_take(monkeypatch, case):
  base = _x(64)
  want = libm.call("xla_expf", base.copy())
  if case == "strided":  # not contiguous: the general path's contiguous copy
    buf = np.repeat(base, 2)
    view = buf[::2]
    got = libm.call("xla_expf", view, out=view)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(buf[::2].view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(buf[1::2], base)  # the elements between untouched
  elif case == "read_only":
    x = base.copy()
    x.flags.writeable = False
    with pytest.raises(ValueError):
      libm.call("xla_expf", x, out=x)  # (as before: NumPy refuses to write it)
  elif case == "float64":  # another dtype: converted, the result copied back
    x = base.astype(np.float64)
    got = libm.call("xla_expf", x, out=x)
    np.testing.assert_array_equal(got, want.astype(np.float64))
  else:
    x = np.empty(0, np.float32)
    assert libm.call("xla_expf", x, out=x) is x
