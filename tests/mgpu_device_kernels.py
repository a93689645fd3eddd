"""Mosaic GPU (plgpu) kernels across devices, for tests/test_mosaic_gpu_devices.py
and benchmarks/mosaic_gpu_collectives.py: run in a subprocess with N host
devices (``python tests/mgpu_device_kernels.py CASE``; XLA_FLAGS must be set
before JAX starts). Not collected by pytest (no test_ prefix).

JAX's GPU interpret mode cannot run any of these (it raises
``NotImplementedError`` on semaphores), so the references are jax.lax
collectives and NumPy references written from the semantics (said per case).
JAX's kernels ask the GPU for its SM count at trace time: stubbed (2 SMs)."""
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas.ops.gpu import all_gather_mgpu, reduce_scatter_mgpu
from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu, hopper_matmul_mgpu
from jax.sharding import PartitionSpec as P

import pallas_np

N = jax.device_count()
MESH = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
NUM_SMS = 2


class _Device:
  # One SM for the collective matmul: with several, its semaphore counts
  # signals from any block, so a block with no tile to send (2 SMs, 1 tile
  # here) can signal step s+1 before another block's step-s data landed and
  # the receiver reads it unwritten (NaN). A race of the kernel at such
  # shapes (any interleaving we run is one a GPU may run); the
  # cross-block get_global case is ring_remote_copy below.
  core_count = 1


class _JaxWithDevice:
  """``jax`` for the collective matmul module, but ``jax.devices()[0]``
  answers a GPU's SM count."""

  def __getattr__(self, name):
    return getattr(jax, name)

  @staticmethod
  def devices(*args):
    return [_Device()]


collective_matmul_mgpu.jax = _JaxWithDevice()


def shmap(f, in_specs=P("x"), out_specs=P("x")):
  return jax.jit(jax.shard_map(f, mesh=MESH, in_specs=in_specs, out_specs=out_specs,
                               check_vma=False))


def data(shape, dtype, seed):
  # NumPy's generator, not jax.random: each jax.random call of a new shape or
  # dtype is an XLA compile (~5 s of a case's ~12).
  rng = np.random.default_rng(seed)
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.asarray(rng.integers(-1000, 1000, shape).astype(jnp.dtype(dtype)))
  return jnp.asarray(rng.standard_normal(shape, np.float32).astype(jnp.dtype(dtype)))


def check(name, ok, detail=""):
  print(("ok " if ok else "FAILED ") + name + ("" if ok else f": {detail}"), flush=True)


# -- JAX's kernels -------------------------------------------------------------
# One jitted function per configuration: warm calls reuse its executable.
@functools.lru_cache(maxsize=None)
def _all_gather(dim):
  return shmap(functools.partial(all_gather_mgpu.all_gather, axis_name="x",
                                 gather_dimension=dim, num_blocks=NUM_SMS))


def all_gather(x, dim=0):
  return _all_gather(dim)(x)


@functools.lru_cache(maxsize=None)
def _reduce_scatter(dim, reduction):
  return shmap(functools.partial(reduce_scatter_mgpu.reduce_scatter, axis_name="x",
                                 scatter_dimension=dim, reduction=reduction,
                                 num_blocks=NUM_SMS))


def reduce_scatter(x, dim=0, reduction="add"):
  return _reduce_scatter(dim, reduction)(x)


CONFIG = hopper_matmul_mgpu.TuningConfig(tile_m=64, tile_n=64, tile_k=64,
                                         max_concurrent_steps=2)


@functools.lru_cache(maxsize=None)
def _collective_matmul(dtype):
  return shmap(functools.partial(collective_matmul_mgpu.all_gather_lhs_matmul, axis_name="x",
                                 config=CONFIG, dtype=dtype),
               in_specs=(P("x", None), P(None, "x")), out_specs=P(None, "x"))


def collective_matmul(a, b, dtype):
  return _collective_matmul(jnp.dtype(dtype))(a, b)


def np_reduce(shards, op, dtype):
  """Device order, each partial result rounded to the dtype (multimem.ld_reduce)."""
  fn = {"add": np.add, "min": np.minimum, "max": np.maximum, "and": np.bitwise_and,
        "or": np.bitwise_or, "xor": np.bitwise_xor}[op]
  acc = shards[0]
  for s in shards[1:]:
    acc = fn(acc, s).astype(dtype)
  return acc


def case_ops():
  with pallas_np.force_numpy_interpret():
    for dtype, dim in ((jnp.float32, 0), (jnp.bfloat16, 1), (jnp.int32, 0)):
      x = data((N * 8, 256), dtype, 0)
      ref = shmap(lambda v, d=dim: lax.all_gather(v, "x", axis=d, tiled=True))(x)
      out = all_gather(x, dim)
      check(f"all_gather {jnp.dtype(dtype).name} dim {dim} vs lax.all_gather",
            np.array_equal(np.asarray(out), np.asarray(ref)))
    x = data((N * N * 8, 128), jnp.float32, 1)
    ref = shmap(lambda v: lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True))(x)
    out = reduce_scatter(x)
    check("reduce_scatter f32 add vs lax.psum_scatter",
          np.allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-5),
          np.abs(np.asarray(out) - np.asarray(ref)).max())
    ref = shmap(lambda v: lax.psum(v, "x"))(x)
    out = reduce_scatter(x, None)
    check("all-reduce (scatter_dimension=None) f32 add vs lax.psum",
          np.allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-5))
    # In the kernel's dtype, device order: a NumPy reference of multimem.ld_reduce.
    xb = data((N * 16, N * 128), jnp.bfloat16, 2)
    out = np.asarray(reduce_scatter(xb, 1))
    shards = np.asarray(xb).reshape(N, 16, N, 128)
    ref = np.concatenate([np_reduce([shards[d, :, j] for d in range(N)], "add", jnp.bfloat16)
                          for j in range(N)])
    check("reduce_scatter bf16 add dim 1 vs NumPy (bf16, device order)",
          np.array_equal(out.astype(np.float32), ref.astype(np.float32)))
    xi = data((N * N * 8, 128), jnp.int32, 3)
    shards = np.asarray(xi).reshape(N, N, 8, 128)
    for op in ("add", "min", "max", "and", "or", "xor"):
      out = np.asarray(reduce_scatter(xi, 0, op))
      ref = np.concatenate([np_reduce([shards[d, j] for d in range(N)], op, np.int32)
                            for j in range(N)])
      check(f"reduce_scatter int32 {op} vs NumPy", np.array_equal(out, ref))
    for dtype in (jnp.float16, jnp.bfloat16):
      m_shard, k, n_shard = 64, 128, 128
      a = data((N * m_shard, k), dtype, 4)
      b = data((k, N * n_shard), dtype, 5)
      out = np.asarray(collective_matmul(a, b, dtype), np.float32)
      ref = np.asarray(shmap(lambda u, v: lax.all_gather(u, "x", axis=0, tiled=True) @ v,
                             in_specs=(P("x", None), P(None, "x")),
                             out_specs=P(None, "x"))(a.astype(jnp.float32),
                                                     b.astype(jnp.float32)))
      err = np.abs(out - ref).max() / np.abs(ref).max()
      check(f"collective_matmul {jnp.dtype(dtype).name} vs lax.all_gather + matmul",
            err < 2e-2, err)


# -- constructs (NumPy references written from the semantics) -------------------
def ring_remote_copy(x, id_style="dict"):
  """Every block sends its half of x to the right neighbour's output through
  SMEM and a remote TMA store, then signals a pl.get_global semaphore there;
  each device waits for both of its left neighbour's blocks."""
  rows = x.shape[0] // 2

  def body(x_ref, o_ref, scratch_ref, smem, bar):
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    me = lax.axis_index("x")
    b = lax.axis_index("b")
    right = lax.rem(me + 1, N)
    dev = {"x": right} if id_style == "dict" else right
    part = pl.ds(b * rows, rows)
    plgpu.copy_gmem_to_smem(x_ref.at[part], smem, bar)
    plgpu.barrier_wait(bar)
    plgpu.copy_smem_to_gmem(smem, plgpu.remote_ref(scratch_ref, dev).at[part])
    plgpu.wait_smem_to_gmem(0)
    pl.semaphore_signal(sem, device_id=dev)
    pl.semaphore_wait(sem, NUM_SMS, decrement=False)
    o_ref[part] = scratch_ref[part] * 2
  out, _ = plgpu.kernel(body, out_type=[jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2,
                        grid=(NUM_SMS,), grid_names=("b",),
                        scratch_types=[plgpu.SMEM((rows, x.shape[1]), x.dtype),
                                       plgpu.Barrier()])(x)
  return out


def multimem_gather(x):
  """Each device multimem-stores its shard into slot ``me`` of every device's
  output; a multicast signal per device, then a decrementing wait."""
  rows = x.shape[0]

  def body(x_ref, o_ref, done):
    me = lax.axis_index("x")
    plgpu.multimem_store(x_ref[...], o_ref.at[pl.ds(me * rows, rows)], "x")
    plgpu.semaphore_signal_multicast(done, 2, collective_axes="x")
    pl.semaphore_wait(done, 2 * N)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((N * rows, x.shape[1]), x.dtype),
                      scratch_types=[plgpu.SemaphoreType.REGULAR])(x)


def multimem_reduce(x, op):
  def body(x_ref, o_ref, done):
    o_ref[...] = plgpu.layout_cast(
        plgpu.multimem_load_reduce(x_ref, collective_axes="x", reduction_op=op),
        plgpu.Layout.WG_STRIDED(x_ref.shape, vec_size=1))
    plgpu.semaphore_signal_multicast(done, collective_axes="x")
    pl.semaphore_wait(done, N)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                      scratch_types=[plgpu.SemaphoreType.REGULAR])(x)


def parallel_signals(x):
  """plgpu.semaphore_signal_parallel to both neighbours (scoped semaphores:
  per block, the same block on the peer), plgpu.semaphore_signal/wait (JAX
  0.12's with a memory scope; pl's on 0.10) and pl.semaphore_read."""
  signal = getattr(plgpu, "semaphore_signal", pl.semaphore_signal)
  wait = getattr(plgpu, "semaphore_wait", pl.semaphore_wait)

  def body(x_ref, o_ref, sem_a, sem_b, sem_c):
    me = lax.axis_index("x")
    right, left = lax.rem(me + 1, N), lax.rem(me + N - 1, N)
    plgpu.semaphore_signal_parallel(
        plgpu.SemaphoreSignal(sem_a, device_id={"x": right}, inc=2),
        plgpu.SemaphoreSignal(sem_b, device_id={"x": left}, inc=3))
    signal(sem_c, 4, device_id={"x": right})
    pl.semaphore_wait(sem_a, 2, decrement=False)
    pl.semaphore_wait(sem_b, 3, decrement=False)
    wait(sem_c, 4, decrement=False)
    got = pl.semaphore_read(sem_a) * 100 + pl.semaphore_read(sem_b) * 10 + \
        pl.semaphore_read(sem_c)
    o_ref[...] = x_ref[...] + got.astype(x_ref.dtype)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                      grid=(NUM_SMS,), grid_names=("b",),
                      scratch_types=[plgpu.SemaphoreType.REGULAR] * 3)(x)


def remote_load_store(x):
  """Plain stores and loads through plgpu.remote_ref (an indexed ref made
  remote, and a remote ref indexed), ordered by get_global semaphores."""
  rows = x.shape[0] // 2

  def body(x_ref, o_ref, p_ref):
    sent = pl.get_global(plgpu.SemaphoreType.REGULAR)
    me = lax.axis_index("x")
    right = lax.rem(me + 1, N)
    plgpu.remote_ref(o_ref.at[pl.ds(0, rows)], {"x": right})[...] = x_ref[pl.ds(0, rows)]
    plgpu.remote_ref(o_ref, {"x": right}).at[pl.ds(rows, rows)][...] = x_ref[pl.ds(rows, rows)]
    pl.semaphore_signal(sent, device_id={"x": right})
    pl.semaphore_wait(sent, 1)
    p_ref[...] = plgpu.remote_ref(x_ref, {"x": right})[...] * 3  # read the right one's input
  return tuple(plgpu.kernel(body, out_type=[jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2)(x))


def remote_atomics(x):
  """plgpu.atomic_add into the right neighbour's output after a "zeroed"
  handshake; each device's output ends as its left neighbour's input."""
  def body(x_ref, o_ref):
    ready = pl.get_global(plgpu.SemaphoreType.REGULAR)
    done = pl.get_global(plgpu.SemaphoreType.REGULAR)
    me = lax.axis_index("x")
    right, left = lax.rem(me + 1, N), lax.rem(me + N - 1, N)
    o_ref[...] = jnp.zeros_like(o_ref)
    pl.semaphore_signal(ready, device_id={"x": left})
    pl.semaphore_wait(ready, 1)
    plgpu.atomic_add(plgpu.remote_ref(o_ref, {"x": right}), x_ref[...])
    pl.semaphore_signal(done, device_id={"x": right})
    pl.semaphore_wait(done, 1)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def case_constructs():
  with pallas_np.force_numpy_interpret():
    x = data((N * 16, 128), jnp.float32, 0)
    want = np.roll(np.asarray(x).reshape(N, 16, 128), 1, 0).reshape(N * 16, 128) * 2
    for style in ("dict", "scalar"):
      out = shmap(functools.partial(ring_remote_copy, id_style=style))(x)
      check(f"remote_ref TMA store + get_global semaphore ({style} device id) vs NumPy",
            np.array_equal(np.asarray(out), want))
    out, peek = shmap(remote_load_store, out_specs=(P("x"), P("x")))(x)
    xs = np.asarray(x).reshape(N, 16, 128)
    check("stores and loads through remote_ref vs NumPy",
          np.array_equal(np.asarray(out), np.roll(xs, 1, 0).reshape(N * 16, 128)) and
          np.array_equal(np.asarray(peek), np.roll(xs, -1, 0).reshape(N * 16, 128) * 3))
    xi = data((N * 8, 128), jnp.int32, 6)
    out = shmap(remote_atomics)(xi)
    check("atomic_add through remote_ref vs NumPy",
          np.array_equal(np.asarray(out),
                         np.roll(np.asarray(xi).reshape(N, 8, 128), 1, 0).reshape(N * 8, 128)))
    out = shmap(parallel_signals)(x)
    check("semaphore_signal_parallel + plgpu.semaphore_signal/wait + semaphore_read vs NumPy",
          np.array_equal(np.asarray(out), np.asarray(x) + 234))
    out = shmap(multimem_gather, out_specs=P("x"))(x)
    want = np.tile(np.asarray(x), (N, 1))
    check("multimem_store + semaphore_signal_multicast vs NumPy",
          np.array_equal(np.asarray(out), want))
    for dtype, ops in ((jnp.float32, ("add",)), (jnp.bfloat16, ("add", "min", "max")),
                       (jnp.int32, ("add", "min", "max", "and", "or", "xor"))):
      xr = data((N * 8, 128), dtype, 1)
      shards = np.asarray(xr).reshape(N, 8, 128)
      for op in ops:
        out = np.asarray(shmap(functools.partial(multimem_reduce, op=op))(xr))
        ref = np.tile(np_reduce(list(shards), op, shards.dtype), (N, 1))
        check(f"multimem_load_reduce {jnp.dtype(dtype).name} {op} vs NumPy",
              np.array_equal(out.astype(np.float64), ref.astype(np.float64)))


# -- broken kernels raise, never hang ----------------------------------------------
def never_signalled(x):
  def body(x_ref, o_ref, sem):
    me = lax.axis_index("x")
    @pl.when(me == 0)
    def _():
      pl.semaphore_signal(sem, device_id={"x": 1 % N})
    pl.semaphore_wait(sem, 1)  # device 1 gets its signal; the others wait forever
    o_ref[...] = x_ref[...]
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                      scratch_types=[plgpu.SemaphoreType.REGULAR])(x)


def case_broken():
  x = data((N * 8, 128), jnp.float32, 0)
  with pallas_np.force_numpy_interpret():
    try:
      shmap(never_signalled)(x).block_until_ready()
      print("FAILED no error for a wait that is never signalled")
    except Exception as e:  # noqa: BLE001
      msg = str(e)
      line = "mgpu_device_kernels.py" in msg and "semaphore_wait" in msg
      print("raised deadlock" if "deadlock" in msg else "FAILED other error: " + msg[:2000])
      if "-v" in sys.argv:
        print(msg)
      check("the deadlock names the kernel line and the devices",
            line and "device 0" in msg and "block ()" in msg, msg[:3000])
    out = shmap(multimem_gather)(x)
    check("multimem_store after errors", np.array_equal(np.asarray(out),
                                                         np.tile(np.asarray(x), (N, 1))))


if __name__ == "__main__":
  {"ops": case_ops, "constructs": case_constructs, "broken": case_broken}[sys.argv[1]]()
  print("done")
