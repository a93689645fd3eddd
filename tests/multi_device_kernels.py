"""Multi-device kernels for tests/test_multi_device.py, run in a subprocess
with N host devices (``python tests/multi_device_kernels.py CASE``).

Not collected by pytest (no test_ prefix): XLA_FLAGS must be set before JAX
starts, so each case runs in a fresh interpreter with a hard timeout."""
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import pallas_np  # noqa: F401  (installs interpret="numpy")
from tests import collective_kernels as ck

if __name__ == "__main__" and sys.argv[1:2] == ["distributed"]:  # before any JAX call
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{sys.argv[3]}", num_processes=2,
                             process_id=int(sys.argv[2]), initialization_timeout=60)

DeviceIdType = getattr(pl, "DeviceIdType", None) or pltpu.DeviceIdType
N = jax.device_count()
MESH = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
ANY = pl.ANY


def shmap(f, in_specs=P("x"), out_specs=P("x"), mesh=MESH):
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                               check_vma=False))


# -- the "distributed TPU kernels" tutorial's right permute -----------------------
def right_permute_kernel(input_ref, output_ref, send_sem, recv_sem, *, shift=1, to=None):
  my_id = jax.lax.axis_index("x")
  target = jax.lax.rem(my_id + shift, N) if to is None else to(my_id)
  copy = pltpu.make_async_remote_copy(
      src_ref=input_ref, dst_ref=output_ref, send_sem=send_sem, recv_sem=recv_sem,
      device_id=(target,), device_id_type=DeviceIdType.MESH)
  copy.start()
  copy.wait()


def right_permute(x, interpret="numpy", **kw):
  spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=0, in_specs=[pl.BlockSpec(memory_space=ANY)],
      out_specs=pl.BlockSpec(memory_space=ANY),
      scratch_shapes=[pltpu.SemaphoreType.DMA] * 2)
  return pl.pallas_call(functools.partial(right_permute_kernel, **kw),
                        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid_spec=spec, interpret=interpret)(x)


# -- the tutorial's ring all-gather (barrier handshake, LOGICAL device ids) -------
def all_gather_kernel(input_ref, output_ref, local_copy_sem, send_sem, recv_sems,
                      *, skip_barrier_signal=False, wait_count=2):
  outer_step = pl.program_id(0)
  my_id = jax.lax.axis_index("x")
  right = jax.lax.rem(my_id + 1, N)
  left = jax.lax.rem(my_id - 1 + N, N)
  copy_slot = jax.lax.rem(my_id - outer_step + N, N)

  @pl.when(outer_step == 0)
  def _():
    # Handshake with both neighbours so nobody writes into a kernel that
    # has not started (the tutorial's barrier).
    barrier = pltpu.get_barrier_semaphore()
    pl.semaphore_signal(barrier, device_id=left, device_id_type=DeviceIdType.LOGICAL)
    if not skip_barrier_signal:
      pl.semaphore_signal(barrier, device_id=right, device_id_type=DeviceIdType.LOGICAL)
    pl.semaphore_wait(barrier, wait_count)
    local = pltpu.make_async_copy(input_ref, output_ref.at[my_id], local_copy_sem)
    local.start()
    local.wait()

  copy = pltpu.make_async_remote_copy(
      src_ref=output_ref.at[copy_slot], dst_ref=output_ref.at[copy_slot],
      send_sem=send_sem, recv_sem=recv_sems.at[outer_step],
      device_id=(right,), device_id_type=DeviceIdType.MESH)
  copy.start()
  copy.wait()


def all_gather(x, interpret="numpy", **kw):
  spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=0, in_specs=[pl.BlockSpec(memory_space=ANY)],
      out_specs=pl.BlockSpec(memory_space=ANY),
      scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA,
                      pltpu.SemaphoreType.DMA((N - 1,))],
      grid=(N - 1,))
  return pl.pallas_call(functools.partial(all_gather_kernel, **kw),
                        out_shape=jax.ShapeDtypeStruct((N, *x.shape), x.dtype),
                        grid_spec=spec, interpret=interpret,
                        compiler_params=pltpu.CompilerParams(collective_id=0))(x)


def data(rows=8):
  return jnp.arange(N * rows * 128, dtype=jnp.float32).reshape(N * rows, 128)


def check(got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and np.array_equal(got, want), (what, got, want)
  print("ok", what)


def case_correct():
  x = data()
  perm = [(i, (i + 1) % N) for i in range(N)]
  want = shmap(lambda v: jax.lax.ppermute(v, "x", perm))(x)
  check(shmap(right_permute)(x), want, "right_permute vs ppermute")
  # a left shift by N - 1 (MESH ids), twice: sessions of one plan in a row
  for _ in range(2):
    check(shmap(functools.partial(right_permute, shift=N - 1))(x),
          shmap(lambda v: jax.lax.ppermute(v, "x", [(i, (i - 1) % N) for i in range(N)]))(x),
          "left_permute vs ppermute")
  # one kernel twice in one program: two sessions, one call id each
  check(shmap(lambda v: right_permute(right_permute(v)))(x),
        shmap(lambda v: jax.lax.ppermute(v, "x", [(i, (i + 2) % N) for i in range(N)]))(x),
        "right_permute twice in one program vs ppermute by 2")
  want_ag = shmap(lambda v: jax.lax.all_gather(v, "x"), out_specs=P(None))(x)
  got_ag = shmap(lambda v: all_gather(v)[None], out_specs=P("x"))(x)
  for d in range(N):
    check(got_ag[d], want_ag, f"tutorial all_gather on device {d} vs lax.all_gather")
  from jax.experimental.pallas.ops.tpu import all_gather as ag_mod
  with pallas_np.force_numpy_interpret():
    got = ag_mod.all_gather(x, mesh=MESH, axis_name="x")
  check(got, x, "pallas.ops.tpu.all_gather")
  # psum from the gathered shards (all-reduce built on the kernel)
  check(shmap(lambda v: all_gather(v).sum(0))(x),
        shmap(lambda v: jax.lax.psum(v, "x"))(x), "all_gather + sum vs psum")
  # 2-D mesh: MESH device-id tuples and axis_index per axis
  if N % 2 == 0 and N > 2:
    mesh2 = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, N // 2), ("a", "b"))

    def k2(x_ref, o_ref, send, recv):
      a, b = jax.lax.axis_index("a"), jax.lax.axis_index("b")
      copy = pltpu.make_async_remote_copy(
          x_ref, o_ref, send, recv, device_id=(a, jax.lax.rem(b + 1, N // 2)),
          device_id_type=DeviceIdType.MESH)
      copy.start()
      copy.wait()

    def f2(v):
      spec = pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=0, in_specs=[pl.BlockSpec(memory_space=ANY)],
          out_specs=pl.BlockSpec(memory_space=ANY),
          scratch_shapes=[pltpu.SemaphoreType.DMA] * 2)
      return pl.pallas_call(k2, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
                            grid_spec=spec, interpret="numpy")(v)
    m = N // 2
    got = shmap(f2, in_specs=P(("a", "b")), out_specs=P(("a", "b")), mesh=mesh2)(x)
    want = shmap(lambda v: jax.lax.ppermute(v, "b", [(i, (i + 1) % m) for i in range(m)]),
                 in_specs=P(("a", "b")), out_specs=P(("a", "b")), mesh=mesh2)(x)
    check(got, want, "2-D mesh permute along b vs ppermute")
  case_collectives()


def case_oracle():
  """The same kernels under TPU interpret mode (JAX's own CPU simulation)."""
  x = data()
  tpu = pltpu.InterpretParams()
  check(shmap(right_permute)(x), shmap(functools.partial(right_permute, interpret=tpu))(x),
        "right_permute vs TPU interpret mode")
  check(shmap(lambda v: all_gather(v)[None])(x),
        shmap(lambda v: all_gather(v, interpret=tpu)[None])(x),
        "all_gather vs TPU interpret mode")
  case_collectives_oracle()


def case_threads():
  """Two Python threads call the same compiled kernel on the same mesh at the
  same time, each with its own data: every call must meet its own peers
  (pairing by run count would mix the two calls' shards)."""
  import threading
  perm = [(i, (i + 1) % N) for i in range(N)]
  # one kernel (one plan) in two programs: the second scales its input
  fs = [shmap(right_permute), shmap(lambda v: right_permute(v * 2.0))]
  ref = shmap(lambda v: jax.lax.ppermute(v, "x", perm))
  inputs = [data() + 10000.0 * t for t in range(2)]
  wants = [np.asarray(ref(v * (1.0 + t))) for t, v in enumerate(inputs)]
  for f, v in zip(fs, inputs):
    f(v).block_until_ready()  # compile outside the threads
  from pallas_np import devices
  entered, enter = [], devices.enter

  def recording_enter(placement, targets):
    entered.append((placement.call, placement.coords))
    return enter(placement, targets)
  devices.enter = recording_enter
  errors, start = [], threading.Barrier(2)

  def worker(t):
    try:
      start.wait(timeout=60)
      for _ in range(ROUNDS):
        got = np.asarray(fs[t](inputs[t]))
        assert np.array_equal(got, wants[t]), f"thread {t}: a call met another call's devices"
    except BaseException as e:  # noqa: BLE001 (reported below)
      errors.append(e)
  threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
  for th in threads:
    th.start()
  for th in threads:
    th.join(timeout=120)
  assert not any(th.is_alive() for th in threads), "a thread hung"
  assert not errors, errors[0]
  devices.enter = enter
  by_call = {}
  for call, coords in entered:
    by_call.setdefault(call, []).append(coords)
  assert None not in by_call and len(by_call) == 2 * ROUNDS, sorted(by_call, key=str)[:4]
  assert all(sorted(c) == [(d,) for d in range(N)] for c in by_call.values())
  print("ok two threads, one compiled kernel, paired by call")


ROUNDS = 25


def int_data(shape, seed):
  """Small integers as float32: ring sums in any order are exact."""
  return jnp.asarray(np.random.default_rng(seed).integers(-8, 8, shape), jnp.float32)


def collectives(interpret="numpy", broken=None, cols=256, **kw):
  """(name, f, args): the three ring collectives under shard_map."""
  rows = 8
  x = int_data((N * rows, 128), 0)           # shard (rows, 128) per device
  xs = int_data((N * N * rows, 128), 1)      # shard (N * rows, 128) per device
  y = int_data((128, cols), 2)               # replicated
  ar = shmap(lambda v: ck.all_reduce(v, N, interpret, broken, **kw))
  rs = shmap(lambda v: ck.reduce_scatter(v, N, interpret, broken, **kw))
  agm = shmap(lambda v, w: ck.all_gather_matmul(v, w, N, interpret, broken, **kw),
              in_specs=(P("x"), P(None)), out_specs=P("x"))
  return [("all_reduce", ar, (x,)), ("reduce_scatter", rs, (xs,)),
          ("all_gather_matmul", agm, (x, y))]


def lax_collectives():
  ar = shmap(lambda v: jax.lax.psum(v, "x"))
  rs = shmap(lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True))
  agm = shmap(lambda v, w: jax.lax.all_gather(v, "x", tiled=True) @ w,
              in_specs=(P("x"), P(None)), out_specs=P("x"))
  return {"all_reduce": (ar, "psum"), "reduce_scatter": (rs, "psum_scatter"),
          "all_gather_matmul": (agm, "all_gather + matmul")}


def case_collectives():
  ref = lax_collectives()
  for name, f, args in collectives():
    lax_f, lax_name = ref[name]
    want = lax_f(*args)
    for _ in range(2):  # a second call: fresh sessions, same plan
      check(f(*args), want, f"{name} vs lax.{lax_name}")


def case_collectives_oracle():
  tpu = pltpu.InterpretParams()
  for (name, f, args), (_, g, _) in zip(collectives(cols=128), collectives(tpu, cols=128)):
    check(f(*args), g(*args), f"{name} vs TPU interpret mode")


def case_collectives_broken():
  here = "collective_kernels.py"
  for broken, needles in [("barrier", ("deadlock across devices", "semaphore_wait at", here,
                                       "grid point (0,)")),
                          ("count", ("deadlock across devices", "reach 2", here)),
                          ("neighbour", ("deadlock across devices", here, "device 0 (x=0)"))]:
    for name, f, args in collectives(broken=broken):
      expect_error(lambda: f(*args), *needles)
  ref = lax_collectives()
  for name, f, args in collectives():
    check(f(*args), ref[name][0](*args), f"{name} after errors")


def case_races():
  """detect_races=True across devices: unordered remote writes to the same
  elements are reported; disjoint or semaphore-ordered ones are not."""
  import warnings
  warnings.simplefilter("ignore")  # "no parallel grid axis": the check here is across devices
  x = int_data((N * 8, 128), 3)
  f = {mode: shmap(functools.partial(lambda v, mode: ck.send_to_device_zero(v, N, mode),
                                     mode=mode)) for mode in ("same_slot", "own_slot", "ordered")}
  expect_error(lambda: f["same_slot"](x), "data race across devices",
               "send_to_device_zero_kernel", "on device 0 (x=0)", "collective_kernels.py")
  got = np.asarray(f["own_slot"](x))[8:N * 8]  # device 0's output: devices 1.. rows
  check(got, x[8:], "own_slot: disjoint remote writes, no race reported")
  got = np.asarray(f["ordered"](x))[:8]
  check(got, x[(N - 1) * 8:], "ordered: the writes are ordered by semaphores, no race reported")
  ref = lax_collectives()
  for name, g, args in collectives(detect_races=True):
    check(g(*args), ref[name][0](*args), f"{name} with detect_races: no race reported")
  for name, g, args in collectives(broken="no_handshake", detect_races=True):
    expect_error(lambda: g(*args), "data race across devices", "collective_kernels.py")


def offset_kernel(x_ref, o_ref):
  """axis_index alone (expert parallelism): no peers, no session."""
  o_ref[...] = x_ref[...] + (jax.lax.axis_index("x") * 1000).astype(x_ref.dtype)


def offset(v):
  return pl.pallas_call(offset_kernel, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
                        interpret="numpy")(v)


def case_pmap():
  """The same kernels under jax.pmap, and an axis_index-only kernel."""
  x = data()
  want = shmap(lambda v: v + (jax.lax.axis_index("x") * 1000).astype(v.dtype))(x)
  check(shmap(offset)(x), want, "axis_index-only kernel vs shard_map of jnp")
  xs = x.reshape(N, -1, 128)
  perm = [(i, (i + 1) % N) for i in range(N)]
  check(jax.pmap(right_permute, axis_name="x")(xs),
        jax.pmap(lambda v: jax.lax.ppermute(v, "x", perm), axis_name="x")(xs),
        "right_permute under pmap vs ppermute")
  check(jax.pmap(offset, axis_name="x")(xs), want.reshape(N, -1, 128),
        "axis_index-only kernel under pmap")


def case_distributed():
  """One of 2 processes under jax.distributed (argv: process id, port),
  N local devices each: an axis_index-only kernel runs over the global
  mesh; a remote-DMA kernel raises UnsupportedError at lowering."""
  from jax.sharding import NamedSharding
  n = jax.device_count()
  assert n == 2 * jax.local_device_count(), (n, jax.local_device_count())
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
  host = np.arange(n * 8 * 128, dtype=np.float32).reshape(n * 8, 128)
  x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("x")), lambda i: host[i])
  got = shmap(offset, mesh=mesh)(x)
  for shard in got.addressable_shards:
    rows = shard.index[0]
    want = host[rows] + 1000.0 * (rows.start // 8)
    check(shard.data, want, f"axis_index-only kernel across processes, rows {rows.start}")
  expect_error(lambda: shmap(right_permute, mesh=mesh)(x), "spans several processes",
               "jax.distributed")


def expect_error(fn, *needles):
  try:
    jax.block_until_ready(fn())
  except Exception as e:  # noqa: BLE001 (XLA wraps the callback's error)
    msg = str(e)
    for n in needles:
      assert n in msg, (n, msg)
    print("raised", needles[0])
    return
  raise AssertionError(f"no error; expected {needles}")


def case_broken():
  x = data()
  here = __file__.rsplit("/", 1)[-1]
  # a barrier nobody signals twice
  expect_error(lambda: shmap(lambda v: all_gather(v, skip_barrier_signal=True)[None])(x),
               "deadlock across devices", "semaphore_wait at", here, "grid point (0,)",
               "device 0 (x=0)")
  # waiting for more than is ever signalled
  expect_error(lambda: shmap(lambda v: all_gather(v, wait_count=3)[None])(x),
               "deadlock across devices", "reach 3")
  # wrong neighbour: the last device sends to device 1 instead of 0, so
  # device 0 waits forever while the others leave (needs N >= 3)
  expect_error(lambda: shmap(functools.partial(
      right_permute, to=lambda i: jnp.where(i == N - 1, 1, i + 1)))(x),
      "deadlock across devices", "DMA wait at", here, "has left the kernel")
  # a device id outside the mesh on the last device: its peers must not hang
  expect_error(lambda: shmap(functools.partial(right_permute, to=lambda i: i + 1))(x),
               "outside the mesh")
  case_collectives_broken()
  # after all of these, the shared state is clean: a correct kernel still runs
  perm = [(i, (i + 1) % N) for i in range(N)]
  check(shmap(right_permute)(x), shmap(lambda v: jax.lax.ppermute(v, "x", perm))(x),
        "right_permute after errors")


# -- a remote DMA "future": started in one kernel, waited on in later ones -------
def _future_start(x):
  def kernel(x_ref, aliased_x_ref, o_ref, send_sem, recv_sem):
    del aliased_x_ref
    me = jax.lax.axis_index("x")
    barrier = pltpu.get_barrier_semaphore()
    pl.semaphore_signal(barrier, device_id=(jax.lax.rem(me - 1 + N, N),),
                        device_id_type=DeviceIdType.MESH)
    pl.semaphore_wait(barrier, 1)
    pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem,
                                 device_id=(jax.lax.rem(me + 1, N),),
                                 device_id_type=DeviceIdType.MESH).start()
  return pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct.like(x), jax.ShapeDtypeStruct.like(x),
                 pltpu.SemaphoreType.DMA(()), pltpu.SemaphoreType.DMA(())),
      in_specs=[pl.BlockSpec(memory_space=ANY)],
      out_specs=(pl.BlockSpec(memory_space=ANY), pl.BlockSpec(memory_space=ANY),
                 pl.BlockSpec(memory_space=pltpu.SEMAPHORE),
                 pl.BlockSpec(memory_space=pltpu.SEMAPHORE)),
      input_output_aliases={0: 0},
      compiler_params=pltpu.CompilerParams(collective_id=0, has_side_effects=True),
      interpret="numpy")(x)


def _future_wait(x, out, sem):
  def kernel(x_ref, o_ref, sem, aliased_o_ref):
    del aliased_o_ref
    pltpu.make_async_copy(x_ref, o_ref, sem).wait()
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct.like(out),
      in_specs=[pl.BlockSpec(memory_space=ANY), pl.BlockSpec(memory_space=ANY),
                pl.BlockSpec(memory_space=pltpu.SEMAPHORE)],
      out_specs=pl.BlockSpec(memory_space=ANY), input_output_aliases={1: 0},
      interpret="numpy")(x, out, sem)


def case_futures():
  """Each step starts a remote copy to the right neighbour in one kernel and
  waits for its send and receive semaphores in two later kernels; the
  receiving device may finish its start kernel before its left neighbour's
  copy lands in its output."""
  x = data()
  steps = max(N - 1, 1)

  def body(_, x):
    x, out, send_sem, recv_sem = _future_start(x)
    x = _future_wait(x, x, send_sem)
    return _future_wait(x, out, recv_sem)
  got = shmap(lambda x: jax.lax.fori_loop(0, steps, body, x))(x)
  check(got, jnp.roll(x, steps * (x.shape[0] // N), axis=0), "remote DMA futures in a loop")
  print("done")


def case_semaphore_input():
  """A REGULAR semaphore returned by one kernel is signalled by every device
  in the next kernel, which takes it as an input (JAX's
  ``test_no_barrier_semaphore``); the input was read-only before."""
  def make(_):
    pass

  def kernel(x_ref, sem_ref, o_ref):
    for i in range(N):
      pl.semaphore_signal(sem_ref, device_id=(i,), device_id_type=DeviceIdType.MESH)
    pl.semaphore_wait(sem_ref, N)
    o_ref[...] = x_ref[...] + 1

  def body(x):
    sem = pl.pallas_call(make, in_specs=[], out_shape=pltpu.SemaphoreType.REGULAR(()),
                         out_specs=pl.BlockSpec(memory_space=pltpu.SEMAPHORE),
                         interpret="numpy")()
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM),
                  pl.BlockSpec(memory_space=pltpu.SEMAPHORE)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM), interpret="numpy")(x, sem)
  x = data()
  check(shmap(body)(x), x + 1, "a semaphore input signalled by every device")
  print("done")


if __name__ == "__main__":
  globals()["case_" + sys.argv[1]]()
  print("done")
