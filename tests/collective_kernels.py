"""Collective kernels built from remote DMAs, in the style of JAX's
"Distributed computing in Pallas for TPUs" tutorial: a ring all-reduce with a
double-buffered HBM scratch and capacity semaphores, a ring reduce-scatter
and a ring all-gather collective matmul (all-gather-matmul, as in public
serving libraries). Used by tests/multi_device_kernels.py (against jax.lax
collectives and TPU interpret mode) and benchmarks/collectives.py.

Every builder takes the number of devices ``n`` on mesh axis ``"x"`` and an
``interpret`` value; ``broken`` selects a deliberately wrong variant:
``"barrier"`` (one barrier signal missing), ``"count"`` (a capacity wait for
2 signals where 1 comes), ``"neighbour"`` (the last device sends to device 1
instead of 0), ``"no_handshake"`` (no capacity semaphore: a device may
overwrite its neighbour's buffer while the neighbour still reads it — a race
that ``detect_races=True`` reports). ``send_to_device_zero`` is the simplest
race-detection case."""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

DeviceIdType = getattr(pl, "DeviceIdType", None) or pltpu.DeviceIdType
MESH = DeviceIdType.MESH
ANY = pl.ANY
VMEM = pltpu.VMEM


def _neighbours(n, broken):
  me = jax.lax.axis_index("x")
  right = jax.lax.rem(me + 1, n)
  if broken == "neighbour":
    right = jnp.where(me == n - 1, 1 % n, right)
  left = jax.lax.rem(me - 1 + n, n)
  return me, left, right


def local_barrier(left, right, broken=None, double_barrier=True):
  """The tutorial's handshake: both neighbours have entered the kernel. The
  second barrier on a run_scoped semaphore keeps a neighbour that already
  re-entered the kernel (next call, same collective_id) from counting twice."""
  barrier = pltpu.get_barrier_semaphore()
  pl.semaphore_signal(barrier, 1, device_id=(left,), device_id_type=MESH)
  if broken != "barrier":
    pl.semaphore_signal(barrier, 1, device_id=(right,), device_id_type=MESH)
  pl.semaphore_wait(barrier, 2)
  if double_barrier:
    @functools.partial(pl.run_scoped, second_barrier=pltpu.SemaphoreType.REGULAR)
    def _(second_barrier):
      for neighbour in (left, right):
        pl.semaphore_signal(second_barrier, 1, device_id=(neighbour,), device_id_type=MESH)
      pl.semaphore_wait(second_barrier, 2)


def _ring_send(src, dst, send_sem, recv_sem, capacity_sem, left, right, broken):
  """Tell the left neighbour our receiving slot is free, wait until the right
  one says the same, then start the copy into its receiving slot."""
  if broken != "no_handshake":
    pl.semaphore_signal(capacity_sem, 1, device_id=(left,), device_id_type=MESH)
    pl.semaphore_wait(capacity_sem, 2 if broken == "count" else 1)
  copy = pltpu.make_async_remote_copy(src_ref=src, dst_ref=dst, send_sem=send_sem,
                                      recv_sem=recv_sem, device_id=(right,),
                                      device_id_type=MESH)
  copy.start()
  return copy


# -- all-reduce (the tutorial's ring, grid=(n,)) --------------------------------------
def all_reduce_kernel(x_ref, o_ref, hbm_scratch, copy_sem, recv_sem, send_sem, capacity_sem,
                      receive_scratch, *, n, broken):
  step = pl.program_id(0)
  working = jax.lax.rem(step, 2)
  receiving = 1 - working
  me, left, right = _neighbours(n, broken)

  @pl.when(step == 0)
  def _():
    local_barrier(left, right, broken)
    o_ref[...] = jnp.zeros_like(o_ref)
    receive_scratch[...] = jnp.zeros_like(receive_scratch)
    first = pltpu.make_async_remote_copy(src_ref=x_ref, dst_ref=hbm_scratch.at[working],
                                         send_sem=send_sem, recv_sem=recv_sem,
                                         device_id=(right,), device_id_type=MESH)
    first.start()
    first.wait()

  local = pltpu.make_async_copy(hbm_scratch.at[working], receive_scratch, copy_sem)
  local.start()
  remote = _ring_send(hbm_scratch.at[working], hbm_scratch.at[receiving], send_sem, recv_sem,
                      capacity_sem, left, right, broken)
  local.wait()
  o_ref[...] += receive_scratch[...]
  remote.wait_send()
  remote.wait_recv()


def all_reduce(x, n, interpret="numpy", broken=None, detect_races=False):
  spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=0, in_specs=[pl.BlockSpec(memory_space=VMEM)],
      out_specs=[pl.BlockSpec(memory_space=VMEM), pl.BlockSpec(memory_space=ANY)],
      grid=(n,),
      scratch_shapes=[pltpu.SemaphoreType.DMA] * 3 + [pltpu.SemaphoreType.REGULAR,
                                                       VMEM(x.shape, x.dtype)])
  out, _ = pl.pallas_call(
      functools.partial(all_reduce_kernel, n=n, broken=broken),
      out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((2, *x.shape), x.dtype)),  # the HBM double buffer
      grid_spec=spec, interpret=_interpret(interpret, detect_races),
      compiler_params=pltpu.CompilerParams(collective_id=0))(x)
  return out


# -- reduce-scatter (ring, grid=(n - 1,)) ----------------------------------------------
def reduce_scatter_kernel(x_ref, o_ref, hbm_scratch, copy_sem, recv_sem, send_sem,
                          capacity_sem, stage, *, n, broken):
  """Device d ends with block d of the sum. At step s it sends the partial
  sum of block (d - s - 1) % n to the right and receives block
  (d - s - 2) % n from the left, adding its own rows before passing it on."""
  step = pl.program_id(0)
  working = jax.lax.rem(step, 2)
  receiving = 1 - working
  me, left, right = _neighbours(n, broken)
  rows = o_ref.shape[0]

  def block(c):
    return pl.ds(pl.multiple_of(c * rows, rows), rows)

  @pl.when(step == 0)
  def _():
    local_barrier(left, right, broken)
    stage[...] = x_ref[block(jax.lax.rem(me - 1 + n, n)), :]
    first = pltpu.make_async_copy(stage, hbm_scratch.at[working], copy_sem)
    first.start()
    first.wait()

  remote = _ring_send(hbm_scratch.at[working], hbm_scratch.at[receiving], send_sem, recv_sem,
                      capacity_sem, left, right, broken)
  remote.wait()
  got = pltpu.make_async_copy(hbm_scratch.at[receiving], stage, copy_sem)
  got.start()
  got.wait()
  stage[...] += x_ref[block(jax.lax.rem(me - step - 2 + 2 * n, n)), :]

  @pl.when(step < n - 2)
  def _():
    back = pltpu.make_async_copy(stage, hbm_scratch.at[receiving], copy_sem)
    back.start()
    back.wait()

  @pl.when(step == n - 2)
  def _():
    o_ref[...] = stage[...]


def reduce_scatter(x, n, interpret="numpy", broken=None, detect_races=False):
  rows = x.shape[0] // n
  block_shape = (rows, *x.shape[1:])
  spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=0, in_specs=[pl.BlockSpec(memory_space=VMEM)],
      out_specs=[pl.BlockSpec(memory_space=VMEM), pl.BlockSpec(memory_space=ANY)],
      grid=(n - 1,),
      scratch_shapes=[pltpu.SemaphoreType.DMA] * 3 + [pltpu.SemaphoreType.REGULAR,
                                                       VMEM(block_shape, x.dtype)])
  out, _ = pl.pallas_call(
      functools.partial(reduce_scatter_kernel, n=n, broken=broken),
      out_shape=(jax.ShapeDtypeStruct(block_shape, x.dtype),
                 jax.ShapeDtypeStruct((2, *block_shape), x.dtype)),
      grid_spec=spec, interpret=_interpret(interpret, detect_races),
      compiler_params=pltpu.CompilerParams(collective_id=0))(x)
  return out


# -- all-gather matmul (collective matmul, grid=(n,)) ----------------------------------
def all_gather_matmul_kernel(x_ref, y_ref, o_ref, x_hbm, copy_sem, recv_sem, send_sem,
                             capacity_sem, x_stage, *, n, broken):
  """out = all_gather(x) @ y: at step s multiply the shard of device
  (d - s) % n while it travels on to the right neighbour."""
  step = pl.program_id(0)
  working = jax.lax.rem(step, 2)
  receiving = 1 - working
  me, left, right = _neighbours(n, broken)
  rows = x_ref.shape[0]

  @pl.when(step == 0)
  def _():
    local_barrier(left, right, broken, double_barrier=False)
    first = pltpu.make_async_copy(x_ref, x_hbm.at[working], copy_sem)
    first.start()
    first.wait()

  remote = pltpu.make_async_remote_copy(src_ref=x_hbm.at[working], dst_ref=x_hbm.at[receiving],
                                        send_sem=send_sem, recv_sem=recv_sem,
                                        device_id=(right,), device_id_type=MESH)

  @pl.when(step < n - 1)
  def _():
    _ring_send(x_hbm.at[working], x_hbm.at[receiving], send_sem, recv_sem, capacity_sem,
               left, right, broken)

  local = pltpu.make_async_copy(x_hbm.at[working], x_stage, copy_sem)
  local.start()
  local.wait()
  src = jax.lax.rem(me - step + n, n)
  o_ref[pl.ds(pl.multiple_of(src * rows, rows), rows), :] = jnp.dot(
      x_stage[...], y_ref[...], preferred_element_type=jnp.float32).astype(o_ref.dtype)

  @pl.when(step < n - 1)
  def _():
    remote.wait()


def all_gather_matmul(x, y, n, interpret="numpy", broken=None, detect_races=False):
  spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=0,
      in_specs=[pl.BlockSpec(memory_space=VMEM), pl.BlockSpec(memory_space=VMEM)],
      out_specs=[pl.BlockSpec(memory_space=VMEM), pl.BlockSpec(memory_space=ANY)],
      grid=(n,),
      scratch_shapes=[pltpu.SemaphoreType.DMA] * 3 + [pltpu.SemaphoreType.REGULAR,
                                                       VMEM(x.shape, x.dtype)])
  out, _ = pl.pallas_call(
      functools.partial(all_gather_matmul_kernel, n=n, broken=broken),
      out_shape=(jax.ShapeDtypeStruct((n * x.shape[0], y.shape[1]), x.dtype),
                 jax.ShapeDtypeStruct((2, *x.shape), x.dtype)),
      grid_spec=spec, interpret=_interpret(interpret, detect_races),
      compiler_params=pltpu.CompilerParams(collective_id=0))(x, y)
  return out


# -- every device writes into device 0's output (race detection) ------------------------
def send_to_device_zero_kernel(x_ref, o_ref, send_sem, recv_sem, token_sem, *, n, mode):
  """``mode``: "same_slot" (devices 1.. all write rows [0, r) of device 0: a
  race), "own_slot" (device d writes the rows of slot d: disjoint),
  "ordered" (the same slot, one device at a time: device 0 hands a token to
  device k once device k - 1's rows have landed; the last one wins)."""
  me = jax.lax.axis_index("x")
  rows = x_ref.shape[0]
  slot = me if mode == "own_slot" else 0
  copy = pltpu.make_async_remote_copy(
      src_ref=x_ref, dst_ref=o_ref.at[pl.ds(pl.multiple_of(slot * rows, rows), rows)],
      send_sem=send_sem, recv_sem=recv_sem, device_id=(0,), device_id_type=MESH)

  @pl.when(me > 0)
  def _():
    if mode == "ordered":
      pl.semaphore_wait(token_sem, 1)
    copy.start()
    copy.wait_send()

  @pl.when(me == 0)
  def _():
    for k in range(1, n):
      if mode == "ordered":
        pl.semaphore_signal(token_sem, 1, device_id=(k,), device_id_type=MESH)
      copy.wait_recv()


def send_to_device_zero(x, n, mode, interpret="numpy", detect_races=True):
  spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=0, in_specs=[pl.BlockSpec(memory_space=VMEM)],
      out_specs=pl.BlockSpec(memory_space=ANY),
      scratch_shapes=[pltpu.SemaphoreType.DMA] * 2 + [pltpu.SemaphoreType.REGULAR])
  return pl.pallas_call(
      functools.partial(send_to_device_zero_kernel, n=n, mode=mode),
      out_shape=jax.ShapeDtypeStruct((n * x.shape[0], *x.shape[1:]), x.dtype),
      grid_spec=spec, interpret=_interpret(interpret, detect_races))(x)


def _interpret(interpret, detect_races):
  if detect_races and interpret == "numpy":
    import pallas_np
    return pallas_np.InterpretParams(detect_races=True)
  return interpret
