"""The run's closing lines: per-level accuracy change and the band's correct length."""

import math

from rlx import trainer


def test_every_level_and_the_band_length_before_and_after():
  before = {"eval/accuracy_d1": 1.0, "eval/accuracy_d3": 0.25, "eval/accuracy_d5": 0.969,
            "eval/band_correct_len_mean": 90.0}
  after = {"eval/accuracy_d1": 0.9, "eval/accuracy_d3": 0.945, "eval/accuracy_d5": 0.75,
           "eval/band_correct_len_mean": 63.0}
  lines = trainer._level_changes(before, after, (3,))
  assert lines == [
      "[rlx] per level: d1 100.0 -> 90.0% (-10.0), d3 25.0 -> 94.5% (+69.5), "
      "d5 96.9 -> 75.0% (-21.9)",
      "[rlx] correct band completions: 90.0 -> 63.0 tokens (-30.0%)"]
  # No correct band completion before (NaN): no length line.
  after["eval/band_correct_len_mean"] = math.nan
  assert len(trainer._level_changes(before, after, (3,))) == 1
