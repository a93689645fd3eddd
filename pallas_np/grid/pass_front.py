"""The per-call floor of small vectorized grids: a warm call whose whole
grid is one batched call of the kernel (``SlabRunner.one_pass``) goes from
the operands to that call without the layers that chose it.

A static grid without scalar prefetch asks the same questions on every call
(``GridVectorizer.choose``, the runner for its choice, the layout, the
buffer recipe) and gets the same answers: ``OnePassFront`` holds them,
found after a call that took that path, and checks on each call, by
identity, that they are still the vectorizer's (a cleared choice, a
replaced runner, a changed ``vectorize.LANES_LAST`` or a different
operand count send the call back to the full path, which rebuilds them).
The steps it runs are the full path's, on the same objects: the same
buffers (``BufferSetup.preps``), the same ``run_one_pass``, the same
results (padding cut by ``BufferSetup.results``); so the same bits. A run
that raises is handled as the full path handles it (``_run_vectorized``:
the sequential loop reruns the call, the failure recorded), and the front
is dropped.
"""
from __future__ import annotations

import math

from pallas_np import debugging
from pallas_np.grid import vectorize


class OnePassFront:
  """``GridRun.run`` of one kernel plan's one-pass vectorized grid (see the
  module doc); ``__call__`` returns the outputs, or None where the full
  path must run the call."""
  __slots__ = ("gv", "grid", "chosen", "entry", "lanes_last", "n_args", "in_preps",
               "out_preps", "runner", "total", "padded")

  def __init__(self, gv, grid, chosen, entry, n_args, in_preps, out_preps, padded):
    self.gv = gv
    self.grid = grid
    self.chosen = chosen
    self.entry = entry
    self.lanes_last = entry[2]
    self.n_args = n_args
    self.in_preps = in_preps
    self.out_preps = out_preps
    self.runner = entry[1]
    self.total = math.prod(grid)
    self.padded = padded

  @classmethod
  def of(cls, kp):
    """The front of ``kp``'s last run where that run was one batched pass
    of a static grid on buffers whose layout the pass never looks at (with
    scalar prefetch: a ``PrefetchPassFront``), else None."""
    gv = kp.vectorizer
    grid = kp.static_grid
    if gv is None or grid is None or gv.reason is not None or gv._partly_read:
      return None
    if kp.num_index:
      return PrefetchPassFront.of(kp)
    chosen = gv._chosen.get(grid)
    entry = _one_pass_entry(gv, chosen)
    if entry is None:
      return None
    index_preps, in_preps, out_preps = kp.setup.preps()
    if index_preps:
      return None
    padded = any(geo.needs_padding for geo in kp.blocks[kp.num_inputs:])
    return cls(gv, grid, chosen, entry, kp.num_inputs, tuple(in_preps), tuple(out_preps),
               padded)

  def __call__(self, kp, args):
    """``_run_vectorized``'s ``(outputs, failure)`` for this call, or None
    where the front no longer holds (the full path runs the call)."""
    gv = self.gv
    if (len(args) != self.n_args or kp.vectorizer is not gv or gv.reason is not None
        or gv._chosen.get(self.grid) is not self.chosen
        or gv.runners.get(id(self.chosen)) is not self.entry
        or vectorize.LANES_LAST is not self.lanes_last):
      gv.front = None
      return None
    return _one_pass(kp, self.runner, self, args, 0, [])


class PrefetchPassFront:
  """``OnePassFront`` for a static grid whose index maps read scalar
  prefetch: the choice depends on the prefetch values, so it and its runner
  are looked up on each call as the full path does (``GridVectorizer.choose``,
  cached per values); only the layers around them are skipped. A call whose
  choice has no one-pass runner yet goes to the full path (which builds it)."""
  __slots__ = ("gv", "grid", "n_args", "index_preps", "in_preps", "out_preps", "total",
               "padded")

  def __init__(self, gv, grid, n_args, index_preps, in_preps, out_preps, padded):
    self.gv = gv
    self.grid = grid
    self.n_args = n_args
    self.index_preps = index_preps
    self.in_preps = in_preps
    self.out_preps = out_preps
    self.total = math.prod(grid)
    self.padded = padded

  @classmethod
  def of(cls, kp):
    index_preps, in_preps, out_preps = kp.setup.preps()
    padded = any(geo.needs_padding for geo in kp.blocks[kp.num_inputs:])
    return cls(kp.vectorizer, kp.static_grid, kp.num_index + kp.num_inputs, tuple(index_preps),
               tuple(in_preps), tuple(out_preps), padded)

  def __call__(self, kp, args):
    """As ``OnePassFront.__call__``."""
    gv = self.gv
    if len(args) != self.n_args or kp.vectorizer is not gv or gv.reason is not None:
      gv.front = None
      return None
    n = len(self.index_preps)
    try:
      index_ops = [prep(a) for prep, a in zip(self.index_preps, args)]
      entry = _one_pass_entry(gv, gv.choose(self.grid, index_ops))
    except Exception as e:  # noqa: BLE001 - as the full path's failures
      return _failed(gv, e)
    if entry is None:
      return None
    return _one_pass(kp, entry[1], self, args, n, index_ops)


def _one_pass_entry(gv, chosen):
  """The vectorizer's runner entry of ``chosen`` where it is a one-pass
  runner for the current lane layout, else None."""
  entry = gv.runners.get(id(chosen)) if chosen is not None else None
  if (entry is None or entry[0] is not chosen or isinstance(entry[1], str)
      or entry[2] is not vectorize.LANES_LAST or not entry[1].one_pass()):
    return None
  return entry


def _failed(gv, e):
  """As ``_run_vectorized``: a pass that cannot batch goes to the
  sequential loop; any other failure reruns the call sequentially and is
  compared there. The front is dropped either way."""
  gv.last_failure, gv.front = e, None
  return (None, None) if isinstance(e, vectorize.NotBatchable) else (None, e)


def _one_pass(kp, runner, front, args, n, index_ops):
  """The full path's buffers, one batched pass and results, for a front
  (``args[n:]`` the kernel's inputs after ``n`` scalar-prefetch operands)."""
  gv = front.gv
  progress = debugging.progress_bar(kp.name, front.total, kp.params)
  try:
    in_bufs = [prep(x) for prep, x in zip(front.in_preps, args[n:])]
    out_bufs = [prep(args, index_ops + in_bufs) for prep in front.out_preps]
    runner.run_one_pass(index_ops, in_bufs + out_bufs, progress)
  except Exception as e:  # noqa: BLE001 - as the full path's failures
    return _failed(gv, e)
  finally:
    if progress is not None:
      progress.close()
  gv.last_layout, gv.last_axes = "lanes-first", runner.axes
  kp.last_mode = "vectorized"
  return (kp.setup.results(out_bufs) if front.padded else out_bufs), None
