"""A warm cache's first calls (pallas_np.native.tier, bodies; issue 41, "never
slower than off at N = 20"): what a second process skips.

* A kernel body's probe (its compiled steps timed against the NumPy plan's,
  ``bodies.PROBE_CALLS`` grid steps) is recorded under the body's pre-key;
  the next process neither loads a body that was clearly slower (the NumPy
  plan from its first step, no ``dlopen``) nor probes one that was clearly
  faster (the compiled step from its first step). ``"sync"`` ignores both.
* A loop whose code reads no address from its status array (integer dots,
  Collatz: only its error sites are stored there) runs with a status array of
  zeros: loading it never runs ``blas_calls.status`` (BLAS's self-checks and
  libm's loops, ~5 ms of the caller's first call).

Deterministic: the probe's timings are handed to ``decide``; nothing is timed."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import pallas_np
from pallas_np import native
from pallas_np.native import (blas_calls, bodies, build_steps, codegen, cost_rule, disk_cache, tier,
                              tier_records)
from tests.native_elig_util import OFF, bits

_rng = np.random.default_rng(7)


def _norm_kernel(x_ref, w_ref, o_ref):
  x = x_ref[...]
  mean = jnp.mean(x, axis=-1, keepdims=True)
  o_ref[...] = (x - mean) * w_ref[...] + jnp.max(x, axis=-1, keepdims=True)


def _body_jaxpr(x, w):
  jaxpr = jax.make_jaxpr(lambda a, b: pl.pallas_call(
      _norm_kernel, out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype), interpret=OFF)(a, b))(x, w)
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
  return eqn.params["jaxpr"]


def _norm_case():
  """The "sync" and "background" params, a layer-norm body's operands, its
  jaxpr and the NumPy path's result (off)."""
  sync = pallas_np.InterpretParams(native_loops="sync", uninitialized="zero")
  background = pallas_np.InterpretParams(native_loops="background", uninitialized="zero")
  x = np.asarray(_rng.standard_normal((8, 128)), np.float32)
  w = np.asarray(_rng.standard_normal((1, 128)), np.float32)
  return (sync, background, x, w, _body_jaxpr(jnp.asarray(x), jnp.asarray(w)),
          np.asarray(_norm_kernel_off(x, w)))


def _plan(calls):
  """A stand-in NumPy plan: the off result written, its calls counted."""
  def fn(ctx, x, w, out):
    calls.append(1)
    out[...] = np.asarray(_norm_kernel_off(x, w))
  return types.SimpleNamespace(fn=fn)


def _norm_kernel_off(x, w):
  return pl.pallas_call(_norm_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        interpret=OFF)(x, w)


def _step(body_plan, x, w):
  out = np.full(x.shape, np.nan, np.float32)
  body_plan.fn(None, x, w, out)
  return out


@pytest.mark.parametrize("numpy_s,native_s,kept", [(1e-6, 1e-3, False), (1e-3, 1e-6, True)])
def test_a_clear_probe_is_reused_by_the_next_process(own_cache, numpy_s, native_s, kept):
  """The probe's decision goes with the body's pre-key record: the next
  plan (a second process: nothing in memory) runs the NumPy plan from its
  first step without loading a body recorded slower, and the compiled step
  from its first step (no probe) for one recorded faster; the bits are the
  NumPy plan's either way."""
  sync, background, x, w, jaxpr, want = _norm_case()
  calls = []
  built = bodies.wrap(_plan(calls), jaxpr, sync)  # (built and recorded under its pre-key)
  np.testing.assert_array_equal(bits(_step(built, x, w)), bits(want))
  assert not calls
  probing = bodies.wrap(_plan(calls), jaxpr, background)  # (found by its pre-key: probed)
  np.testing.assert_array_equal(bits(_step(probing, x, w)), bits(want))
  assert probing.fn.__name__ == "probe"
  build_steps.prekeys.clear()  # (only what is on disk: as a second process)
  probing.decide(probing.fixed, [numpy_s, native_s])
  assert native.wait(60)  # (recorded by the tier's thread)
  record = disk_cache.read_prekey(probing.body.prekey)
  assert record["probe"]["kept"] is kept
  build_steps.prekeys.clear()
  build_steps.loaded.clear()
  before, compiled = native.stats(), bodies.stats()["compiled"]
  calls.clear()
  second = bodies.wrap(_plan(calls), jaxpr, background)
  for _ in range(3):
    np.testing.assert_array_equal(bits(_step(second, x, w)), bits(want))
  after = native.stats()
  if kept:
    assert second.fn.__name__ == "native_step" and not calls  # (no probe: compiled throughout)
    assert after["disk_hits"] == before["disk_hits"] + 1
  else:
    assert second.body.native is None and len(calls) == 3  # (the NumPy plan throughout)
    assert after["dropped"] == before["dropped"] + 1
    assert after["disk_hits"] == before["disk_hits"]  # (not loaded)
    assert bodies.stats()["compiled"] == compiled
  # ("sync" is never timed: it loads and runs the body whatever was recorded)
  build_steps.prekeys.clear()
  build_steps.loaded.clear()
  calls.clear()
  again = bodies.wrap(_plan(calls), jaxpr, sync)
  np.testing.assert_array_equal(bits(_step(again, x, w)), bits(want))
  assert again.fn.__name__ == "native_step" and not calls


def test_an_unclear_probe_is_probed_again(own_cache):
  """A body kept narrowly (its recorded ratio between the tier's
  ``PROBE_KEEP_RATIO`` and ``PROBE_DROP_RATIO``, ``bodies.KEEP_RATIO``)
  decides nothing; one its probe did not keep is dropped, even near the
  ratio (a second probe could only find a 10% gain, and costs a warm
  process's first calls more)."""
  record = {"probe": {"kept": True, "numpy": 1.0, "native": 0.85}}
  assert tier_records.probe_decision(record) is None
  record["probe"].update(kept=False, native=0.92)
  assert tier_records.probe_decision(record) == "dropped"
  record["probe"].update(kept=False, native=1.5)
  assert tier_records.probe_decision(record) == "dropped"
  record["probe"].update(kept=True, native=0.5)
  assert tier_records.probe_decision(record) == "kept"


def test_unclear_probes_that_agree_twice_in_a_row_decide():
  """An unclear verdict (kept, between ``PROBE_KEEP_RATIO`` and
  ``PROBE_DROP_RATIO``) is probed again, but ``PROBE_AGREED`` probes in a
  row that decided alike are reused: a body at ~0.85 of its plan is not
  probed by every warm process; a probe deciding the other way starts the
  count again."""
  rec = {"key": "k"}
  first = tier_records.probe_record(rec, True, 1.0, 0.85)
  assert first["probe"]["agreed"] == 1 and tier_records.probe_decision(first) is None
  second = tier_records.probe_record(first, True, 1.0, 0.86)
  assert second["probe"]["agreed"] == 2 and tier_records.probe_decision(second) == "kept"
  assert second["key"] == "k" and "probe" not in rec  # (a new record; the old one unchanged)
  flipped = tier_records.probe_record(first, False, 1.0, 0.95)
  assert flipped["probe"]["agreed"] == 1 and tier_records.probe_decision(flipped) == "dropped"
  again = tier_records.probe_record(flipped, True, 1.0, 0.84)
  assert again["probe"]["agreed"] == 1 and tier_records.probe_decision(again) is None


def _collatz_kernel(x_ref, o_ref):
  def body(i, x):
    return jnp.where(x % 2 == 0, x // 2, 3 * x + 1)
  o_ref[...] = lax.fori_loop(0, 9, body, x_ref[...])


def _dot_kernel(x_ref, y_ref, o_ref):
  def body(i, acc):
    return acc + jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)
  o_ref[...] = lax.fori_loop(0, 3, body, jnp.zeros(o_ref.shape, jnp.float32))


def _loop_eqn(kernel, *args):
  """The one loop eqn of ``kernel``'s pallas_call (an (8, 128) output)."""
  jaxpr = jax.make_jaxpr(lambda *a: pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32 if len(a) == 2
                                             else jnp.int32), interpret=OFF)(*a))(*args)
  (call,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
  (loop,) = [e for e in call.params["jaxpr"].eqns if e.primitive.name in ("while", "scan")]
  return loop


def _loop_source(kernel, *args):
  return codegen.loop_source(_loop_eqn(kernel, *args), False, "nan")


def test_reads_status_tells_address_reads_from_error_stores():
  """A source whose code reads BLAS addresses from its status array needs
  ``blas_calls.status()``; one that only stores there (an error site, its
  index values) does not."""
  x = jnp.zeros((8, 128), jnp.int32)
  assert not tier_records.reads_status(_loop_source(_collatz_kernel, x).text)
  a, b = jnp.zeros((8, 64), jnp.float32), jnp.zeros((64, 128), jnp.float32)
  assert tier_records.reads_status(_loop_source(_dot_kernel, a, b).text)
  assert not tier_records.reads_status("def native_loop(_st, a0):\n    _st[0] = 3\n    _st[1] = np.int64(i)\n")
  assert tier_records.reads_status("def native_loop(_st, a0):\n    if _st[7] == 1:\n        pass\n")
  assert tier_records.reads_status("def native_loop(_st, a0):\n    f(_st)\n")


def test_a_warm_loop_without_address_reads_never_runs_the_blas_checks(own_cache, monkeypatch):
  """A loop loaded by its pre-key whose code reads no address (recorded
  with its library) runs with zeros for a status array: ``blas_calls.status``
  (BLAS's self-checks, libm's loops) is not called on the caller's path; the
  bits are off's."""
  sync = pallas_np.InterpretParams(native_loops="sync", uninitialized="zero")
  x = jnp.asarray(np.arange(1024).reshape(8, 128) % 91 + 1, jnp.int32)

  def make(params):
    return pl.pallas_call(_collatz_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=params)
  want = np.asarray(make(OFF)(x))
  np.testing.assert_array_equal(np.asarray(make(sync)(x)), want)  # (built, recorded)
  pallas_np.clear_caches()  # (a new plan, nothing in memory: as in a second process)
  build_steps.prekeys.clear()
  build_steps.loaded.clear()
  status_calls = []
  real = blas_calls.status
  monkeypatch.setattr(blas_calls, "status", lambda: status_calls.append(1) or real())
  before = native.stats()
  got = np.asarray(make(sync)(x))
  after = native.stats()
  np.testing.assert_array_equal(got, want)
  assert after["disk_hits"] == before["disk_hits"] + 1
  assert after["native_calls"] > before["native_calls"]
  assert not status_calls


def test_the_one_off_set_up_looks_addresses_up_only_for_loops_that_may_read_them(monkeypatch):
  """A process's first build does the one-off set-up in the caller; the BLAS
  and libm addresses (``blas_calls.status``: ~6 ms) only once a loop holding
  a float dot or a transcendental is built, not for Collatz."""
  monkeypatch.setattr(cost_rule, "set_up_done", [])
  monkeypatch.setattr(tier, "_addresses_set_up", [])
  status_calls = []
  real = blas_calls.status
  monkeypatch.setattr(blas_calls, "status",
                      lambda loops=True: status_calls.append(loops) or real(loops=loops))
  background = pallas_np.InterpretParams(native_loops="background")
  collatz = tier.NativeLoop(_loop_eqn(_collatz_kernel, jnp.zeros((8, 128), jnp.int32)),
                            background, lambda ctx, *a: None)
  collatz._one_off_set_up()
  assert cost_rule.set_up_done and not status_calls
  a, b = jnp.zeros((8, 64), jnp.float32), jnp.zeros((64, 128), jnp.float32)
  dot = tier.NativeLoop(_loop_eqn(_dot_kernel, a, b), background, lambda ctx, *a: None)
  dot._one_off_set_up()
  assert status_calls == [False]  # (a dot: BLAS's addresses, not libm's loops)
  dot._one_off_set_up()  # (once per process)
  assert status_calls == [False]
  x = jnp.zeros((8, 128), jnp.float32)
  exp = tier.NativeLoop(_loop_eqn(_exp_kernel, x, x), background, lambda ctx, *a: None)
  exp._one_off_set_up()
  assert status_calls == [False, True]  # (a transcendental: libm's loops too, once)
  dot._one_off_set_up()
  exp._one_off_set_up()
  assert status_calls == [False, True]


def _exp_kernel(x_ref, w_ref, o_ref):
  o_ref[...] = lax.fori_loop(0, 2, lambda i, a: jnp.exp(a * 0.5) + w_ref[...], x_ref[...])


def test_a_dot_loop_runs_without_libm_loops_and_a_transcendental_one_with_them():
  """``new_status``: a loop holding only dots gets BLAS's addresses and the
  transposed-operand words (libm's loop slots may be zero: loading them is
  ~3.6 ms of a warm process's first call); a loop holding exp gets libm's
  loop addresses, which its generated prologue checks are there."""
  background = pallas_np.InterpretParams(native_loops="background")
  a, b = jnp.zeros((8, 64), jnp.float32), jnp.zeros((64, 128), jnp.float32)
  dot = tier.NativeLoop(_loop_eqn(_dot_kernel, a, b), background, lambda ctx, *a: None)
  x = jnp.zeros((8, 128), jnp.float32)
  exp = tier.NativeLoop(_loop_eqn(_exp_kernel, x, x), background, lambda ctx, *a: None)
  full = blas_calls.status()
  libm_slots = [blas_calls.loop_slot(n) for n in blas_calls.LOOPS]
  assert all(full[k] != 0 for k in libm_slots)
  assert not dot._reads_libm() and exp._reads_libm()
  st = dot.new_status()
  blas_slots = slice(blas_calls.SLOT, blas_calls.SLOT + len(blas_calls.NAMES))
  np.testing.assert_array_equal(st[blas_slots], full[blas_slots])
  assert len(st) == len(full)  # (no dot site that may read in place: no site words)
  st = exp.new_status()
  assert all(st[k] == full[k] for k in libm_slots)


def test_a_body_far_slower_than_its_plan_is_dropped_after_two_steps_of_each(own_cache,
                                                                           monkeypatch):
  """The probe ends early (``bodies.DROP_EARLY``) where the compiled step's
  fastest took over 4x the NumPy plan's after two steps of each (a
  clock that gives the plan's steps 1 us and the compiled ones 1 ms), and
  its verdict is recorded once."""
  sync, background, x, w, jaxpr, want = _norm_case()
  calls = []
  bodies.wrap(_plan(calls), jaxpr, sync).fn(None, x, w, np.empty_like(want))  # (built)
  now = [0.0]

  def clock():
    now[0] += 1e-3  # (each read: 1 ms later)
    return now[0]
  plan = _plan(calls)
  numpy_fn = plan.fn

  def timed_numpy(ctx, *refs):
    now[0] -= 1e-3 - 1e-6  # (the plan's step: 1 us between its clock reads)
    return numpy_fn(ctx, *refs)
  plan.fn = timed_numpy
  records = []
  monkeypatch.setattr(tier.NativeLoop, "remember_probe",
                      lambda self, kept, a, b: records.append((kept, a, b)))
  monkeypatch.setattr(bodies.time, "perf_counter", clock)  # (the probe's, read at the swap)
  probing = bodies.wrap(plan, jaxpr, background)
  np.testing.assert_array_equal(bits(_step(probing, x, w)), bits(want))  # (loaded, compiled)
  assert probing.fn.__name__ == "probe"
  probe = probing.fn
  for _ in range(4):  # (plan, compiled, plan, compiled)
    np.testing.assert_array_equal(bits(_step(probing, x, w)), bits(want))
  assert probing.fn is plan.fn and probing.body.native is None
  assert len(records) == 1 and records[0][0] is False
  out = np.full(x.shape, np.nan, np.float32)
  probe(None, x, w, out)  # (a later step of a run that read ``fn`` before the verdict)
  np.testing.assert_array_equal(bits(out), bits(want))
  assert len(records) == 1


def test_a_verdict_is_written_in_the_caller_where_no_tier_thread_runs(own_cache, monkeypatch):
  """A warm process has no tier thread: the probe's verdict is written in
  the caller (a file, ~0.4 ms) rather than by a thread started for it
  (~0.8 ms of the caller's next call); where the thread runs, by it."""
  sync, background, x, w, jaxpr, _ = _norm_case()
  calls = []
  bodies.wrap(_plan(calls), jaxpr, sync).fn(None, x, w, np.empty((8, 128), np.float32))
  submitted = []
  monkeypatch.setattr(tier.scheduler, "submit", lambda loop, step: submitted.append(step))
  for running, kept in ((False, False), (True, True)):
    monkeypatch.setattr(tier.scheduler, "_thread", [object()] if running else [])
    build_steps.prekeys.clear()
    probing = bodies.wrap(_plan(calls), jaxpr, background)
    _step(probing, x, w)
    probing.body.remember_probe(kept, 1e-3, 1e-4 if kept else 1e-2)
    if running:
      assert len(submitted) == 1
      submitted.pop()()
    else:
      assert not submitted
    assert disk_cache.read_prekey(probing.body.prekey)["probe"]["kept"] is kept


# -- a kernel's first call pays none of the tier's once-per-process set-up --------------------
def test_the_cpu_id_reads_cpuinfo_and_runs_no_subprocess(monkeypatch):
  """``platform.processor()`` runs ``uname -p`` in a subprocess on Linux
  (2-5 ms of a first call): it is asked only where /proc/cpuinfo cannot be read."""
  import os
  if not os.path.exists("/proc/cpuinfo"):
    pytest.skip("no /proc/cpuinfo here: the id is platform.processor()'s")

  def no_subprocess():
    raise AssertionError("platform.processor() called")
  monkeypatch.setattr(disk_cache.platform, "processor", no_subprocess)
  first = disk_cache._cpu()
  assert first == disk_cache._cpu() and len(first) == 8


def test_an_empty_cache_answers_has_prekeys_without_its_directory(own_cache, monkeypatch):
  """A new machine's (or an empty cache's) first run learns there is no
  pre-key from one ``scandir`` of the cache root: this process's directory
  (its tag: /proc/cpuinfo, site-packages listed) is not computed, nor
  created."""
  def no_tag():
    raise AssertionError("the directory's tag computed")
  monkeypatch.setattr(disk_cache, "_cpu", no_tag)
  monkeypatch.setattr(disk_cache, "_numba_version", no_tag)
  assert not disk_cache.has_prekeys()
  assert list(own_cache.iterdir()) == []
  monkeypatch.undo()  # (a cache holding a pre-key: found through the directory)
  monkeypatch.setenv("PALLAS_NP_NATIVE_CACHE", str(own_cache))
  monkeypatch.setattr(disk_cache, "_dir", [])
  disk_cache.write_prekey("ab" * 20, {"refused": "a test"})
  assert disk_cache.has_prekeys()


def test_a_loop_asks_whether_lite_builds_it_when_priced_not_at_its_plan(monkeypatch):
  """``lite_cache.enabled()`` (llvmlite's dist-info listed, NumPy's structs
  probed, ~0.7 ms once per process) is read when the loop is first priced:
  building a plan, and a kernel's first call, do not pay it."""
  asked = []
  monkeypatch.setattr(tier.lite_cache, "enabled", lambda: asked.append(1) or True)
  x = jnp.zeros((8, 128), jnp.float32)

  def kernel(x_ref, o_ref):
    o_ref[...] = lax.fori_loop(0, 2, lambda i, a: a + 1.0, x_ref[...])
  closed = jax.make_jaxpr(lambda a: pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype), interpret=OFF)(a))(x)
  (call,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "pallas_call"]
  (loop,) = [e for e in call.params["jaxpr"].eqns if e.primitive.name in ("while", "scan")]
  nl = tier.NativeLoop(loop, pallas_np.InterpretParams(native_loops="background"), None)
  assert asked == []
  assert nl.lite and asked == [1]
  nl.lite = False  # (lite refused it: numba's build from now on)
  assert not nl.lite and asked == [1]
