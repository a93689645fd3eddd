"""16 DMAs of 4 int32 rows through `x_hbm.bitcast(jnp.int32)` of a 32 MiB bf16 HBM ref
(the DeepSeek-V4 csa_gather pattern): warm numpy-mode call time. Run from the repo root:
`PYTHONPATH=$PWD python benchmarks/bitcast_dma.py`."""
import time, jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import pallas_np
i32 = jnp.int32
ROWS = 131072  # bf16 (131072, 128): 32 MiB
def kernel(idx_ref, x_hbm, o_hbm, buf, sem):
  x32, o32 = x_hbm.bitcast(i32), o_hbm.bitcast(i32)
  def body(k, c):
    pltpu.make_async_copy(x32.at[pl.ds(idx_ref[k], 4)], buf, sem).start()
    pltpu.make_async_copy(x32.at[pl.ds(idx_ref[k], 4)], buf, sem).wait()
    pltpu.sync_copy(buf, o32.at[pl.ds(k * 4, 4)])
    return c
  jax.lax.fori_loop(0, 16, body, 0)
x = jnp.zeros((ROWS, 128), jnp.bfloat16)
idx = jnp.arange(16, dtype=i32) * 1000
f = jax.jit(lambda idx, x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128, 128), jnp.bfloat16),
    grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pl.ANY), scratch_shapes=[pltpu.VMEM((4, 128), i32), pltpu.SemaphoreType.DMA]),
    interpret="numpy")(idx, x))
jax.block_until_ready(f(idx, x))
ts = []

for _ in range(3):
  t = time.perf_counter(); jax.block_until_ready(f(idx, x)); ts.append(time.perf_counter() - t)
print(f"warm call: {min(ts)*1e3:.1f} ms (16 DMAs of 4 int32 rows through a bitcast of a 32 MiB bf16 HBM ref)")
