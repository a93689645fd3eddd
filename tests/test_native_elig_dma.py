"""TPU DMAs and semaphores inside a compiled loop (pallas_np/native/dma.py,
dma_calls.py): the compiled loop calls the NumPy rules back, so the same
bytes move at the same points, the semaphores count the same and the
errors are the same. Before, such a loop was refused ("dma_start: it needs
the run context") and kept its NumPy path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_np
from pallas_np import native
from pallas_np.native import codegen
from tests.native_elig_util import bits, made_loops

ROWS, STEPS = 8, 4


def _pipelined(x_hbm, o_ref, sem_out, buf, sem, acc):
  """Double buffering as library kernels do it: the first copy started
  before the loop, the next one started and the current one waited inside,
  a copy still in flight when the loop ends (waited after it); a
  semaphore signalled and read in the loop."""
  def copy(i, slot):
    return pltpu.make_async_copy(x_hbm.at[pl.ds(i * ROWS, ROWS)], buf.at[slot], sem.at[slot])

  copy(0, 0).start()
  acc[...] = jnp.zeros_like(acc)

  def body(i, carry):
    slot = i % 2
    copy(i + 1, 1 - slot).start()
    copy(i, slot).wait()
    pl.semaphore_signal(sem_out, i + 1)
    seen = pl.semaphore_read(sem_out)
    acc[...] = acc[...] * 0.5 + buf[slot] + seen.astype(jnp.float32)
    return carry + seen
  total = lax.fori_loop(0, STEPS, body, jnp.int32(0))
  copy(STEPS, STEPS % 2).wait()
  o_ref[...] = acc[...] + buf[STEPS % 2] + total.astype(jnp.float32)


def _make(interp, kernel=_pipelined, rows=(STEPS + 1) * ROWS):
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((ROWS, 128), jnp.float32),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
      scratch_shapes=[pltpu.SemaphoreType.REGULAR, pltpu.VMEM((2, ROWS, 128), jnp.float32),
                      pltpu.SemaphoreType.DMA((2,)), pltpu.VMEM((ROWS, 128), jnp.float32)],
      interpret=interp)


def _x(rows=(STEPS + 1) * ROWS):
  return jnp.asarray(np.random.default_rng(5).standard_normal((rows, 128)), jnp.float32)


def _params(mode, **kw):
  return pallas_np.InterpretParams(native_loops=mode, **kw)


def test_pipelined_dmas_and_semaphores_bit_exact():
  x = _x()
  before = native.stats()["native_calls"]
  got = _make(_params("sync"))(x)
  assert native.stats()["native_calls"] > before, "the compiled loop did not run"
  np.testing.assert_array_equal(bits(got), bits(_make(_params("off"))(x)))
  pallas_np.clear_caches()  # (a new plan: its loop's library found by its pre-key, with
  before = native.stats()["native_calls"]  # no source: the call sites generated at its first call)
  again = _make(_params("sync"))(x)
  assert native.stats()["native_calls"] > before
  np.testing.assert_array_equal(bits(again), bits(got))
  # The semantics in NumPy (JAX's TPU interpret mode has no semaphore_read on a CPU).
  xs = np.asarray(x).reshape(STEPS + 1, ROWS, 128)
  acc, sem, total = np.zeros((ROWS, 128), np.float32), 0, 0
  for i in range(STEPS):
    sem += i + 1
    acc = acc * np.float32(0.5) + xs[i] + np.float32(sem)
    total += sem
  np.testing.assert_array_equal(np.asarray(got), acc + xs[STEPS] + np.float32(total))


def _deadlock(x_hbm, o_ref, sem_out, buf, sem, acc):
  """The third iteration waits for a copy nobody started."""
  def body(i, carry):
    @pl.when(i != 2)
    def _():
      pltpu.make_async_copy(x_hbm.at[pl.ds(i * ROWS, ROWS)], buf.at[0], sem.at[0]).start()
    pltpu.make_async_copy(x_hbm.at[pl.ds(i * ROWS, ROWS)], buf.at[0], sem.at[0]).wait()
    o_ref[...] += buf[0]
    return carry
  o_ref[...] = jnp.zeros_like(o_ref)
  lax.fori_loop(0, STEPS, body, 0)


def _out_of_bounds(x_hbm, o_ref, sem_out, buf, sem, acc):
  """The last iteration copies rows past the end of ``x``."""
  def body(i, carry):
    cp = pltpu.make_async_copy(x_hbm.at[pl.ds(i * ROWS + 3, ROWS)], buf.at[0], sem.at[0])
    cp.start()
    cp.wait()
    o_ref[...] += buf[0]
    return carry
  o_ref[...] = jnp.zeros_like(o_ref)
  lax.fori_loop(0, STEPS, body, 0)


def _underflow(x_hbm, o_ref, sem_out, buf, sem, acc):
  """A semaphore waited for more than it was signalled, in the last iteration."""
  def body(i, carry):
    pl.semaphore_signal(sem_out, 1)
    pl.semaphore_wait(sem_out, jnp.where(i == STEPS - 1, 3, 1))
    o_ref[...] += jnp.float32(1)
    return carry
  o_ref[...] = jnp.zeros_like(o_ref)
  lax.fori_loop(0, STEPS, body, 0)


@pytest.mark.parametrize("kernel,error", [(_deadlock, RuntimeError),
                                          (_out_of_bounds, IndexError),
                                          (_underflow, RuntimeError)])
def test_errors_as_numpy(kernel, error):
  """A wait nothing can satisfy, a copy past the end of its source, a
  semaphore waited below zero: the NumPy rule's error (same type, same
  message), raised by the compiled loop."""
  x = _x(STEPS * ROWS)
  with pytest.raises(error) as want:
    _make(_params("off"), kernel, STEPS * ROWS)(x)
  compiled = native.stats()["compiled"]
  with pytest.raises(error) as got:
    _make(_params("sync"), kernel, STEPS * ROWS)(x)
  assert native.stats()["compiled"] > compiled, "the loop was not compiled"
  assert str(got.value) == str(want.value)


def _loop_eqn(make, x):
  closed = jax.make_jaxpr(make)(x)
  kernel = closed.jaxpr.eqns[0].params["jaxpr"]
  return next(e for e in kernel.eqns if e.primitive.name in ("while", "scan"))


def _remote_signal(x_hbm, o_ref, sem_out, buf, sem, acc):
  def body(i, carry):
    pl.semaphore_signal(sem_out, 1, device_id=0, device_id_type=pl.DeviceIdType.LOGICAL)
    return carry
  lax.fori_loop(0, STEPS, body, 0)
  o_ref[...] = jnp.zeros_like(o_ref)


def test_remote_signal_refused():
  """A signal to another device keeps the NumPy path, refused by name."""
  eqn = _loop_eqn(_make(_params("sync"), _remote_signal), _x())
  with pytest.raises(codegen.Refused, match="remote semaphore_signal"):
    codegen.loop_source(eqn, False, "nan")
  local = _loop_eqn(_make(_params("sync")), _x())  # (the local ones are compiled)
  assert "_pycall" in codegen.loop_source(local, False, "nan").text


def test_race_detection_keeps_numpy_path():
  """Under detect_races the loop runs on the NumPy path (its accesses are
  recorded there), with the same result as the compiled loop."""
  x = _x()
  before = native.stats()["native_calls"]
  raced = _make(_params("sync", detect_races=True, parallel_axes=()))(x)
  assert native.stats()["native_calls"] == before
  got = _make(_params("sync"))(x)
  assert native.stats()["native_calls"] > before
  np.testing.assert_array_equal(bits(got), bits(raced))


def test_a_loop_with_call_sites_is_priced_for_numba_and_starts_no_lite_process(monkeypatch):
  """lite refuses DMA and semaphore call sites (``NativeLoop._build_lite``):
  a loop or kernel body holding them is priced for numba's build when it
  is priced, so that no lite process is started and no source generated
  for a lite build that would be refused (before, the caller paid both,
  and its numba build came due only after the refusal)."""
  from pallas_np.native import cost_rule, dma_calls, lite_cache, scheduler
  monkeypatch.setenv(lite_cache.ENV, "auto")
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(cost_rule, "PRESTART_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "weight", lambda: scheduler.COMPILE_WEIGHT)  # (a core idle)
  monkeypatch.setattr(scheduler.lite_compiler, "proc", None)
  started, submitted = [], []
  monkeypatch.setattr(scheduler, "prestart", lambda which=None: started.append(which))
  monkeypatch.setattr(scheduler, "submit_build", submitted.append)
  made = made_loops(monkeypatch)
  salt = float(np.random.default_rng().integers(1, 1 << 20))  # (no library of it on disk)

  def kernel(x_hbm, o_ref, *scratch):
    _pipelined(x_hbm, o_ref, *scratch)
    o_ref[...] += salt
  x = _x()
  f = _make(_params("background"), kernel)
  want = _make(_params("off"), kernel)(x)
  for _ in range(3):
    np.testing.assert_array_equal(bits(f(x)), bits(want))
  priced = [loop for loop in made if loop.phase != "new"]
  assert priced and all(dma_calls.has_calls(loop.eqn) for loop in priced), made
  assert all(loop.lite is False and loop.price > lite_cache.PRICE for loop in priced), [(type(v).__name__, v.lite, v.price, v.phase, v.due, v.spent) for v in priced]
  assert scheduler.lite_compiler not in started and not submitted
