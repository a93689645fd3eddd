"""Differential-testing helpers: run one kernel both ways and compare."""
import logging

import jax
import numpy as np

from tests.conftest import assert_same


def run_both(make_call, *args, rtol=1e-5, atol=1e-5):
  """``make_call(interpret)`` returns the pallas_call'd function; run it with
  interpret="numpy" and interpret=True and compare every output leaf."""
  got = make_call("numpy")(*args)
  want = make_call(True)(*args)
  got_leaves = jax.tree_util.tree_leaves(got)
  want_leaves = jax.tree_util.tree_leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for g, w in zip(got_leaves, want_leaves):
    assert_same(g, w, rtol=rtol, atol=atol)
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
