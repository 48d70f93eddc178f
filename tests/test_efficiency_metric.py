"""The tokens-to-target rule and bootstrap ratio of experiments/efficiency.py."""

import math

import numpy as np

from rlx.experiments import efficiency


def curve(accs, tokens_per_eval=1000):
  return [(5 * i, tokens_per_eval * i, a) for i, a in enumerate(accs)]


def test_an_early_transient_above_the_target_does_not_count():
  # Jumps above 0.70 at the first two evaluations, falls back, then climbs for good.
  c = curve([0.44, 0.71, 0.72, 0.60, 0.62, 0.69, 0.71, 0.70, 0.73, 0.75])
  assert efficiency.tokens_to_target(c, 0.70) == 6000
  # A dip within the margin after reaching it is noise; the next one below it is not.
  assert efficiency.tokens_to_target(curve([0.5, 0.70, 0.68, 0.72]), 0.70) == 1000
  assert math.isinf(efficiency.tokens_to_target(curve([0.5, 0.70, 0.66, 0.72]), 0.70))
  assert efficiency.tokens_to_target(curve([0.5, 0.70, 0.66, 0.72, 0.71]), 0.70) == 3000


def test_the_last_evaluation_alone_or_never_is_censored():
  assert math.isinf(efficiency.tokens_to_target(curve([0.4, 0.5, 0.8]), 0.7))
  assert math.isinf(efficiency.tokens_to_target(curve([0.4, 0.5, 0.6]), 0.7))


def test_bootstrap_ratio_is_the_ratio_of_medians_with_an_interval_around_it():
  point, (lo, hi) = efficiency.bootstrap_ratio([100, 110, 90, 105], [50, 55, 60, 52])
  assert point == np.median([100, 110, 90, 105]) / np.median([50, 55, 60, 52])
  assert lo <= point <= hi
