"""The progress bar's clock: a tqdm bar appears only after the grid has run
PROGRESS_AFTER_S seconds, but its elapsed time and rate count from the
grid's start (tqdm's own clock would start when the bar shows)."""
import time

import pytest

import pallas_np
from pallas_np import debugging

ALREADY_RAN_S = 5.0


class ClockedTqdm:
  """tqdm's clock as tqdm keeps it: ``start_t`` and ``last_print_t`` from
  ``time.time()`` at construction; elapsed = now - start_t; the rate of the
  first update = its count / (now - last_print_t)."""

  def __init__(self, total, desc, **kwargs):
    self.total, self.desc, self.n = total, desc, 0
    self.start_t = self.last_print_t = time.time()
    self.rates = []

  def update(self, k):
    now = time.time()
    self.rates.append(k / (now - self.last_print_t))
    self.n += k
    self.last_print_t = now

  def close(self):
    pass


def _grid_that_already_ran(monkeypatch, tqdm_class):
  """A progress bar of a 100-point grid that started ALREADY_RAN_S ago and
  has done 50 points: its first draw creates the tqdm bar."""
  monkeypatch.setattr(debugging, "_tqdm", lambda: tqdm_class)
  monkeypatch.delenv("PALLAS_NP_PROGRESS", raising=False)
  bar = debugging.progress_bar("k", 100, pallas_np.InterpretParams())
  bar.start -= ALREADY_RAN_S
  bar.next = bar.start + debugging.PROGRESS_AFTER_S
  bar.tick(50)
  assert bar.tqdm_bar is not None
  return bar


def test_tqdm_clock_starts_with_the_grid(monkeypatch):
  bar = _grid_that_already_ran(monkeypatch, ClockedTqdm)
  elapsed = time.time() - bar.tqdm_bar.start_t
  assert ALREADY_RAN_S <= elapsed < ALREADY_RAN_S + 1.0  # was: ~0 (the bar's own start)
  (rate,) = bar.tqdm_bar.rates
  assert 50 / (ALREADY_RAN_S + 1.0) < rate <= 50 / ALREADY_RAN_S  # was: 50 / microseconds


def test_real_tqdm_reports_elapsed_and_rate_from_the_grids_start(monkeypatch):
  tqdm_auto = pytest.importorskip("tqdm.auto")
  bar = _grid_that_already_ran(monkeypatch, tqdm_auto.tqdm)
  stats = bar.tqdm_bar.format_dict
  assert ALREADY_RAN_S <= stats["elapsed"] < ALREADY_RAN_S + 1.0
  assert 50 / (ALREADY_RAN_S + 1.0) < stats["rate"] <= 50 / ALREADY_RAN_S
  bar.tick(100)
  bar.close()
  assert bar.tqdm_bar.n == 100
