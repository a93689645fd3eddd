"""The caller's share (pallas_np/native/cost_rule.py, ``CALLER_SHARE``):
every step the native tier takes on the caller's own time waits until the
caller's seconds in the loop's kernel runs cover it over the share, and
each step is priced at what it costs the caller (a build's own part, lite's
process start, a lite build's neighbour's share), so that over any first N
calls the tier costs at most that share more than ``native_loops="off"``
(issue 41). The rest of the cost rule: tests/test_native_tier_speed.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from pallas_np.native import cost_rule, lite_cache, scheduler
from tests.native_elig_util import made_loops
from tests.test_native_tier_speed import BACKGROUND, _call, _lite_machine, _salt


@pytest.fixture(autouse=True)
def _no_set_up_price(monkeypatch):
  """Each test prices the steps it is about; the others cost nothing: the
  one-off set-up, lite's process start, the looks at it while it starts
  and a lite build's neighbour's share (set again where a test is about
  one of them)."""
  monkeypatch.setattr(cost_rule, "SETUP_PRICE", 0.0)
  monkeypatch.setattr(cost_rule, "PRESTART_PRICE", 0.0)
  monkeypatch.setattr(cost_rule, "STARTING_RECHECK", 0.0)
  monkeypatch.setattr(scheduler, "NEIGHBOUR_SHARE", 0.0)


def _share_machine(monkeypatch, modulus):
  """``_lite_machine`` with pricing at once and lite's build priced at ~0:
  the loops made (in order) and each submitted loop's (spent, called)."""
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(lite_cache, "PRICE", 1e-6)
  at_submit = []
  loops = made_loops(monkeypatch)
  builds, x = _lite_machine(monkeypatch, 0.5, modulus)
  submit = scheduler.submit_build
  monkeypatch.setattr(scheduler, "submit_build", lambda loop: at_submit.append(
      (loop.spent, loop.called)) or submit(loop))
  return builds, x, loops, at_submit


def test_a_builds_caller_part_waits_for_its_share_of_the_callers_seconds(monkeypatch):
  """The caller's own part of a build (``scheduler.CALLER_PRICE``: the
  source's generation, the job, the load, under the caller's GIL) is paid
  only once the caller's seconds in the loop's kernel runs (``called``:
  each run from its start to the loop's last run in it, at least the
  loop's own ``spent``) cover it over ``cost_rule.CALLER_SHARE``: over any first
  N calls the tier then costs the caller at most that share more than
  ``"off"`` (issue 41). Priced here at ~25 kernel runs (a first loop of
  the same kernel, never built, measures a run)."""
  builds, x, loops, at_submit = _share_machine(monkeypatch, 79)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", 1e9)
  f = _call(_salt(), BACKGROUND, x)
  for _ in range(20):
    f(x)
  (first,) = loops
  assert not builds.loops and first.phase == "priced"
  assert first.called >= first.spent > 0  # (a kernel run holds its loop's run)
  price = 25 * (first.called / first.runs) * cost_rule.CALLER_SHARE
  monkeypatch.setattr(scheduler, "CALLER_PRICE", price)
  g = _call(_salt(), BACKGROUND, x)
  for _ in range(1000):
    g(x)
    if builds.loops:
      break
  loop = loops[-1]
  assert builds.loops == [loop], ("never built", loop.called, loop.due, loop.runs)
  assert at_submit[0][1] >= price / cost_rule.CALLER_SHARE
  assert loop.runs > 5  # (not at the first runs: HOT_RUNS alone would allow it at 3)


def _prologue_kernel(salt):
  """A small loop after a costly prologue (a kernel whose loop is a small
  part of its run)."""
  def kernel(x_ref, w_ref, o_ref):
    w = w_ref[...]
    for _ in range(8):
      w = jnp.tanh(w @ w)
    x = x_ref[...] + (w[0, 0] > 2).astype(x_ref.dtype)
    o_ref[...] = lax.fori_loop(0, 2, lambda i, x: jnp.where(x % 2 == 0, x // 2, 3 * x + salt), x)
  return kernel


def test_the_callers_share_counts_the_kernels_seconds_not_only_the_loops(monkeypatch):
  """``called`` counts a kernel run from its start (``RunContext.t0``), so a
  loop that is a small part of its kernel comes due by the kernel's
  seconds: its build is submitted before the loop's own NumPy seconds
  (``spent``) alone would reach the share."""
  builds, x, loops, at_submit = _share_machine(monkeypatch, 83)
  w = jnp.asarray(np.random.default_rng(0).standard_normal((128, 128)) * 0.01, jnp.float32)

  def call(salt):
    return pl.pallas_call(_prologue_kernel(salt), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=BACKGROUND)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", 1e9)
  f = call(_salt())
  for _ in range(10):
    f(x, w)
  loop = next(v for v in loops if v.runs)
  assert loop.called > 3 * loop.spent, (loop.called, loop.spent)  # (the prologue counts)
  threshold = 10 * loop.called / loop.runs  # (~10 kernel runs, ~<3 runs of the loop's own)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", threshold * cost_rule.CALLER_SHARE)
  g = call(_salt())
  for _ in range(200):
    g(x, w)
    if builds.loops:
      break
  assert builds.loops, "never built"
  spent, called = at_submit[0]
  assert called >= threshold > spent


def test_a_build_waiting_for_lites_process_looks_again_after_its_recheck(monkeypatch):
  """While lite's compile process starts (~0.07 s), a loop whose build is
  due looks at it again only once the caller spent ``STARTING_RECHECK``
  more (a look at every run cost ~1 us each over hundreds of runs), and
  its build is queued at the first look after the process is ready."""
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", 0.0)
  monkeypatch.setattr(cost_rule, "STARTING_RECHECK", 1e9)
  monkeypatch.setattr(scheduler.lite_compiler, "starting", True)
  steps = []
  real = cost_rule.CostRule._step
  monkeypatch.setattr(cost_rule.CostRule, "_step",
                      lambda self, a: steps.append(self) or real(self, a))
  builds, x = _lite_machine(monkeypatch, 0.5, 59)
  f = _call(_salt(), BACKGROUND, x)
  for _ in range(cost_rule.HOT_RUNS + 5):
    f(x)
  looks = len(steps)
  assert not builds.loops and looks <= 2, looks  # (priced, then one look while starting)
  loop = steps[-1]  # (this test's loop: the steps' own, not another test's still in memory)
  assert set(steps) == {loop} and loop.phase == "priced" and loop.due > 1e8
  scheduler.lite_compiler.starting = False
  loop.due = 0.0  # (the recheck's seconds spent)
  f(x)
  assert builds.loops == [loop]


def test_a_lite_build_on_an_idle_core_prices_in_its_neighbours_share(monkeypatch):
  """A lite build on an idle core still slows the caller's calls a little
  (``scheduler.NEIGHBOUR_SHARE`` of its seconds, measured from lite's
  process start): its caller part counts that share of ``lite_cache.PRICE``,
  so a build priced at 1000 s is not due after a few runs, where the same
  build with no neighbour's share is (test_native_tier_speed.py's
  ``test_a_lite_build_is_priced_at_the_callers_own_part``)."""
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 0.0)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", 1e-6)
  monkeypatch.setattr(lite_cache, "PRICE", 1000.0)
  monkeypatch.setattr(scheduler.lite_compiler, "starting", False)
  for share, queued in ((0.02, 0), (0.0, 1)):
    monkeypatch.setattr(scheduler, "NEIGHBOUR_SHARE", share)
    builds, x = _lite_machine(monkeypatch, 0.5, 73 + queued)
    f = _call(_salt(), BACKGROUND, x)
    for _ in range(cost_rule.HOT_RUNS + 1):
      f(x)
    assert len(builds.loops) == queued, (share, builds.loops)


def test_a_kernel_called_less_than_the_lookup_price_pays_no_step(monkeypatch):
  """Until the caller's seconds in a loop's kernel runs reach
  ``LOOKUP_PRICE`` (by default ``START_LEAD`` before a first lite build is
  due, ~0.5 s), the tier only times the loop's runs: the loop is not priced
  (lite's availability not looked up, ~0.5 ms once per process) and lite's
  process is not started (``PRESTART_PRICE`` 0 here). Priced after 30 ms of
  the loop's NumPy path and started after ~0.17 s of calls, both landed in
  the first 10-20 calls of a 10 ms kernel (PERF_LOG 163)."""
  assert cost_rule.LOOKUP_PRICE > 0.3  # (the default)
  monkeypatch.setattr(scheduler.lite_compiler, "proc", None)
  loops = made_loops(monkeypatch)
  builds, x = _lite_machine(monkeypatch, 0.5, 89)
  f = _call(_salt(), BACKGROUND, x)
  f(x)
  (loop,) = loops
  for _ in range(100000):  # (~0.2 s of the kernel's calls: the old rule's pricing and start)
    if loop.called >= 0.2:
      break
    f(x)
  assert loop.called >= 0.2, loop.called
  assert loop.phase == "new" and loop._lite is None, loop.phase
  assert not builds.prestarts and not builds.loops


def test_a_loop_is_priced_by_its_kernels_seconds_not_only_its_own(monkeypatch):
  """``LOOKUP_PRICE`` counts the caller's seconds in the loop's kernel
  runs (``called``): a loop that is a small part of its kernel is priced,
  and lite's process started, once the kernel's seconds reach it, with
  the loop's own NumPy seconds (``spent``) still below it."""
  monkeypatch.setattr(scheduler.lite_compiler, "proc", None)
  monkeypatch.setattr(scheduler, "CALLER_PRICE", 1e9)  # (never built here)
  loops = made_loops(monkeypatch)
  builds, x = _lite_machine(monkeypatch, 0.5, 97)
  w = jnp.asarray(np.random.default_rng(0).standard_normal((128, 128)) * 0.01, jnp.float32)
  f = pl.pallas_call(_prologue_kernel(_salt()), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                     interpret=BACKGROUND)
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", 1e9)
  for _ in range(10):
    f(x, w)
  loop = next(v for v in loops if v.runs)
  assert loop.phase == "new" and loop.called > 3 * loop.spent, (loop.called, loop.spent)
  threshold = loop.called + 5 * loop.called / loop.runs  # (~5 kernel runs on)
  monkeypatch.setattr(cost_rule, "LOOKUP_PRICE", threshold)
  loop.due = threshold  # (its next look, set at its first run)
  for _ in range(100):
    f(x, w)
    if loop.phase != "new":
      break
  assert loop.phase == "priced" and loop.spent < threshold <= loop.called
  assert builds.prestarts == [scheduler.lite_compiler] and not builds.loops
