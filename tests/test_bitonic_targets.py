"""benchmarks/bitonic_sort.py says whether each headline target is met
(first call >= 10x faster than interpret=True on every size; warm within 3x)."""
from benchmarks.bitonic_sort import target_lines


def test_targets_met():
  cold, warm = target_lines([12.0, 30.5], [0.2, 0.5, 1.0])
  assert cold.endswith("(target >= 10x on every size): met") and "12.0x-30.5x" in cold
  assert warm.endswith("ratio >= 0.33): met") and "ratio 0.50" in warm


def test_targets_not_met():
  cold, warm = target_lines([9.9, 30.5], [0.3])  # one size under 10x; warm 0.30 < 0.33
  assert cold.endswith(": NOT MET") and warm.endswith(": NOT MET")
