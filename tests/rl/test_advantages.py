"""Group advantages against hand-computed numpy values."""

import numpy as np
import pytest

from rlx.rl.advantages import group_advantages

REWARDS = np.array([1.0, 0.0, 0.0, 1.0,   # group 0: mean .5
                    0.0, 0.0, 0.0, 0.0,   # group 1: zero variance
                    1.0, 0.0, 0.0, 0.0],  # group 2: mean .25
                   np.float32)


def test_grpo_matches_hand_values():
  adv, zero = group_advantages(REWARDS, 4, "grpo", eps=0.0 + 1e-6)
  # group 0: centered +-.5, unbiased std = sqrt(4 * .25 / 3) = .57735
  g0 = 0.5 / np.sqrt(1.0 / 3.0)
  # group 2: centered .75, -.25 x3; unbiased std = sqrt((.5625 + 3 * .0625) / 3) = .5
  expected = [g0, -g0, -g0, g0, 0, 0, 0, 0, 0.75 / 0.5, -0.5, -0.5, -0.5]
  np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(zero, [False, True, False])


def test_dr_grpo_is_centered_only():
  adv, _ = group_advantages(REWARDS, 4, "dr_grpo")
  expected = [.5, -.5, -.5, .5, 0, 0, 0, 0, .75, -.25, -.25, -.25]
  np.testing.assert_allclose(adv, expected, atol=1e-6)


def test_rloo_leave_one_out_baseline():
  adv, _ = group_advantages(REWARDS, 4, "rloo")
  # r_i - mean of the other three
  expected = [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 0, 0, 0, 0,
              1 - 0, 0 - 1 / 3, 0 - 1 / 3, 0 - 1 / 3]
  np.testing.assert_allclose(adv, expected, atol=1e-6)


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_group_size_one_is_rejected(mode):
  with pytest.raises(ValueError, match=r"group_size=1.*must be >= 2"):
    group_advantages(np.ones(4, np.float32), 1, mode)


def test_unknown_mode():
  with pytest.raises(ValueError, match=r"advantage mode 'ppo'; expected one of"):
    group_advantages(REWARDS, 4, "ppo")


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("group_size", [3, 5, 7, 16])
@pytest.mark.parametrize("value", [0.1, 0.9, 2.2, 1 / 3])
def test_equal_non_dyadic_rewards_have_exactly_zero_advantage(mode, group_size, value):
  # f32 mean of G copies of 2.2 is off by an ulp; that rounding must not become a signal.
  rewards = np.concatenate([np.full((group_size,), value, np.float32),
                            np.arange(group_size, dtype=np.float32) * value])
  adv, zero = group_advantages(rewards, group_size, mode)
  np.testing.assert_array_equal(np.asarray(adv)[:group_size], 0.0)
  np.testing.assert_array_equal(zero, [True, False])
  assert np.all(np.asarray(adv)[group_size:] != 0) or group_size % 2 == 1  # odd G: median is 0
