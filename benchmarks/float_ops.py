"""Micro-benchmark of the float rules of issue "Faithful to the hardware, round 2": one pallas_call
per op on a (512, 1024) float32 block, numpy mode, best of 7 (ms); then the compiled float loops
alone (primitives/libm.py) against NumPy's ufuncs on 1M float32, in ns per element.

    PYTHONPATH=. python benchmarks/float_ops.py
"""
import time
import numpy as np, jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import pallas_np
rng = np.random.default_rng(0)
x = rng.uniform(-3, 3, (512, 1024)).astype(np.float32)
y = rng.uniform(0.5, 2, (512, 1024)).astype(np.float32)
OPS = {"exp": lambda a, b: jnp.exp(a), "log": lambda a, b: jnp.log(b), "sin": lambda a, b: jnp.sin(a),
       "cos": lambda a, b: jnp.cos(a), "tan": lambda a, b: jnp.tan(a), "tanh": lambda a, b: jnp.tanh(a),
       "pow": lambda a, b: lax.pow(b, a), "atan2": lambda a, b: jnp.arctan2(a, b),
       "sign": lambda a, b: jnp.sign(a), "clamp": lambda a, b: lax.clamp(-1.0, a, 1.0),
       "div_const": lambda a, b: a / 3.0, "softmax": lambda a, b: jax.nn.softmax(a, axis=-1)}
for name, f in OPS.items():
  def k(a_ref, b_ref, o_ref, f=f):
    o_ref[...] = f(a_ref[...], b_ref[...])
  call = pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret="numpy")
  call(x, y)
  ts = []
  for _ in range(7):
    t = time.perf_counter(); np.asarray(call(x, y)); ts.append(time.perf_counter() - t)
  print(f"{name:10s} {1e3 * min(ts):8.2f} ms", flush=True)

# Per element, 1M float32 (the compiled loops of primitives/libm.py against NumPy's ufuncs, best of
# 15, ns/element; "in place": out= the operand, as the compiler chains softmax's exp).
from pallas_np.primitives import libm, xla_math  # noqa: E402
v = rng.uniform(-3, 3, 1 << 20).astype(np.float32)
pos, out = np.abs(v) + np.float32(0.1), np.empty_like(v)


def per_element(f):
  f()
  ts = []
  for _ in range(15):
    t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
  return 1e9 * min(ts) / v.size


for name, ours, ref in [
    ("exp", lambda: xla_math.exp_f32(v, out=out), lambda: np.exp(v, out=out)),
    ("exp in place", lambda: xla_math.exp_f32(out, out=out), lambda: np.exp(out, out=out)),
    ("log", lambda: xla_math.log_f32(pos, out=out), lambda: np.log(pos, out=out)),
    ("tanh", lambda: xla_math.tanh_f32(v, out=out), lambda: np.tanh(v, out=out)),
    ("sin", lambda: libm.call("sinf", v, out=out), lambda: np.sin(v, out=out)),
    ("cos", lambda: libm.call("cosf", v, out=out), lambda: np.cos(v, out=out))]:
  if name == "exp in place":
    np.copyto(out, v)
  print(f"{name:12s} ours {per_element(ours):6.2f} ns/element   numpy {per_element(ref):6.2f}", flush=True)
