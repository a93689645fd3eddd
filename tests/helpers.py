"""Differential-testing helpers: run one kernel both ways and compare."""
import contextlib
import logging

import jax
import numpy as np

import pallas_np
from tests.conftest import assert_same

# ``pallas_np.pallas_call`` with the kernel body traced with its jit calls
# inlined even where that unrolls loops (pallas_np.tracing): make_calls that
# accept it (``make_call.inlined``) run it too, and it must reproduce numpy
# mode's traced-through-jit result bit for bit.
INLINED = pallas_np.InterpretParams(inline_jit=True, check_avals=True)


def is_inlined(interpret) -> bool:
  return isinstance(interpret, pallas_np.InterpretParams) and interpret.inline_jit is True


def assert_identical(got, want):
  got_leaves = jax.tree_util.tree_leaves(got)
  want_leaves = jax.tree_util.tree_leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for g, w in zip(got_leaves, want_leaves):
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype, (g.dtype, w.dtype)
    if g.dtype.kind not in "biu":  # ml_dtypes floats: NaN == NaN via float64
      g, w = g.astype(np.float64), w.astype(np.float64)
    np.testing.assert_array_equal(g, w)


def run_both(make_call, *args, rtol=1e-5, atol=1e-5):
  """``make_call(interpret)`` returns the pallas_call'd function; run it with
  interpret="numpy" and interpret=True and compare every output leaf (and
  with ``INLINED`` where ``make_call.inlined``)."""
  got = make_call("numpy")(*args)
  want = make_call(True)(*args)
  got_leaves = jax.tree_util.tree_leaves(got)
  want_leaves = jax.tree_util.tree_leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for g, w in zip(got_leaves, want_leaves):
    assert_same(g, w, rtol=rtol, atol=atol)
  if getattr(make_call, "inlined", False):
    assert_identical(make_call(INLINED)(*args), got)
  return got


class CompileLog(logging.Handler):
  """Collects JAX's "Compiling ..." log lines (use with jax.log_compiles())."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.messages = []

  def emit(self, record):
    msg = record.getMessage()
    if "ompil" in msg and "tracing" not in msg:
      self.messages.append(msg)


_compile_events: list = []
_listener_installed = False


@contextlib.contextmanager
def assert_no_xla_compiles():
  """The body must compile nothing with XLA: checked with jax.log_compiles()
  and JAX's compile-event listener, plus a positive control that the same
  counters do see a compilation."""
  import jax.numpy as jnp
  global _listener_installed
  if not _listener_installed:
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: _compile_events.append(name)
        if "backend_compile" in name else None)
    _listener_installed = True
  _compile_events.clear()
  handler = CompileLog()
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles():
      yield
      assert _compile_events == [] and handler.messages == [], (
          _compile_events, handler.messages)
      jax.jit(lambda a: a * 7 + 3)(jnp.float32(1.5)).block_until_ready()
      assert _compile_events and handler.messages, "positive control saw no compile"
  finally:
    logger.removeHandler(handler)


def count_xla_compiles(fn) -> int:
  """How many XLA compilations ``fn()`` triggers (JAX's compile log)."""
  handler = CompileLog()
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles():
      jax.block_until_ready(fn())
  finally:
    logger.removeHandler(handler)
  return len(handler.messages)


def concurrently(*calls):
  """The results of the zero-argument ``calls``, run on threads at once: for
  tests that start several independent child processes (each mostly one
  core while this process waits), so two children share CI's two cores
  instead of taking turns. An exception of any call is raised here."""
  from concurrent.futures import ThreadPoolExecutor
  with ThreadPoolExecutor(len(calls)) as pool:
    futures = [pool.submit(c) for c in calls]
    return [f.result() for f in futures]
