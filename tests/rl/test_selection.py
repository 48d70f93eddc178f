"""Prompt selection: selector updates, weights per mode, exploration floor, skip probability."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.rl import selection
from rlx.rl.selection import SelectionConfig, SelectorState


def test_update_ema_visits_streaks():
  cfg = SelectionConfig(ema=0.5)
  sel = SelectorState.init(5)
  ids = jnp.asarray([1, 3])
  sel = selection.update(sel, cfg, ids, jnp.asarray([[1., 1, 1, 1], [0, 1, 0, 0]]), step=3)
  np.testing.assert_allclose(sel.pass_rate, [.5, 1.0, .5, .25, .5])  # first visit: the rate
  sel = selection.update(sel, cfg, ids, jnp.asarray([[1., 0, 0, 0], [0, 0, 0, 0]]), step=4)
  np.testing.assert_allclose(sel.pass_rate, [.5, .625, .5, .125, .5])  # .5*old + .5*new
  np.testing.assert_array_equal(sel.visits, [0, 2, 0, 2, 0])
  np.testing.assert_array_equal(sel.zero_var_streak, [0, 0, 0, 1, 0])  # [1,0,0,0] has variance
  np.testing.assert_array_equal(sel.last_all_correct, [0, 0, 0, 0, 0])
  np.testing.assert_array_equal(sel.last_visit_step, [-10**6, 4, -10**6, 4, -10**6])


def test_band_weights_and_exploration_floor():
  cfg = SelectionConfig(mode="band", floor=0.1)
  sel = SelectorState.init(4).replace(pass_rate=jnp.asarray([0.0, 0.5, 1.0, 0.25]),
                                      visits=jnp.ones(4, jnp.int32))
  w = selection.weights(sel, cfg, 0, jax.random.key(0))
  np.testing.assert_allclose(w, [0.1, 1.0, 0.1, 0.1 + 0.9 * 0.75])
  # Frequencies follow the weights (solved / impossible prompts still come up: the floor).
  counts = np.zeros(4)
  for k in range(400):
    counts[np.asarray(selection.choose(sel, cfg, jax.random.key(k), 4, 1, 0))] += 1
  np.testing.assert_allclose(counts / 400, np.asarray(w) / np.asarray(w).sum(), atol=0.06)
  assert counts[0] > 0 and counts[2] > 0


def test_history_drops_all_correct_prompts_until_cooldown():
  cfg = SelectionConfig(mode="history", history_cooldown=10)
  sel = SelectorState.init(3)
  sel = selection.update(sel, cfg, jnp.asarray([0, 1]), jnp.asarray([[1., 1], [1, 0]]), step=5)
  np.testing.assert_array_equal(selection.weights(sel, cfg, 6, None), [0, 1, 1])
  np.testing.assert_array_equal(selection.weights(sel, cfg, 15, None), [1, 1, 1])
  for k in range(30):
    ids = np.asarray(selection.choose(sel, cfg, jax.random.key(k), 3, 2, 6))
    assert 0 not in ids and len(set(ids)) == 2


def _history_weights_numpy(visits, cooldown, wrong_weight, num_prompts, step):
  """SRPO-style history weights from a list of (step, prompt id, rewards) visits, in numpy."""
  w = np.ones(num_prompts)
  last = {}
  for s, i, r in visits:
    last[i] = (s, np.asarray(r))
  for i, (s, r) in last.items():
    if np.all(r >= 1) and step - s < cooldown:
      w[i] = 0.0
    elif np.all(r <= 0):
      w[i] = wrong_weight
  return w


def test_history_weights_match_a_numpy_version_over_random_visits():
  cfg = SelectionConfig(mode="history", history_cooldown=7, history_wrong_weight=0.3)
  rng = np.random.default_rng(0)
  n, sel, visits = 12, SelectorState.init(12), []
  for step in range(20):
    ids = rng.choice(n, 3, replace=False)
    # Groups of 4 drawn from a few pass rates: all-correct, all-wrong and mixed all occur.
    rewards = (rng.random((3, 4)) < rng.choice([0.0, 0.5, 1.0], (3, 1))).astype(np.float32)
    sel = selection.update(sel, cfg, jnp.asarray(ids), jnp.asarray(rewards), step=step)
    visits += [(step, int(i), r) for i, r in zip(ids, rewards)]
    np.testing.assert_allclose(selection.weights(sel, cfg, step + 1, None),
                               _history_weights_numpy(visits, 7, 0.3, n, step + 1))
  final = np.asarray(selection.weights(sel, cfg, 20, None), np.float64)
  assert {0.0, 0.3, 1.0} <= set(np.round(final, 6).tolist())


def test_skip_keep_probability_decays_with_zero_variance_streak():
  cfg = SelectionConfig(mode="skip", skip_keep_base=0.5)
  sel = SelectorState.init(4000).replace(
      zero_var_streak=jnp.repeat(jnp.asarray([0, 1, 2, 3]), 1000))
  w = np.asarray(selection.weights(sel, cfg, 0, jax.random.key(0))).reshape(4, 1000)
  np.testing.assert_allclose(w.mean(1), [1.0, 0.5, 0.25, 0.125], atol=0.04)
  # A visit with variance resets the streak: the prompt is back to certain selection.
  sel = selection.update(sel, cfg, jnp.asarray([3999]), jnp.asarray([[1., 0]]), step=1)
  assert int(sel.zero_var_streak[3999]) == 0


def test_choose_returns_distinct_ids_even_if_all_are_skipped():
  cfg = SelectionConfig(mode="history", history_cooldown=100)
  sel = SelectorState.init(6).replace(last_all_correct=jnp.ones(6, bool),
                                      last_visit_step=jnp.zeros(6, jnp.int32))
  ids = np.asarray(selection.choose(sel, cfg, jax.random.key(0), 6, 4, 1))
  assert len(set(ids)) == 4


def test_uniform_choice_matches_plain_grpo_draw():
  key = jax.random.key(5)
  ids = selection.choose(SelectorState.init(50), SelectionConfig(), key, 50, 8, 0)
  np.testing.assert_array_equal(ids, jax.random.choice(key, 50, (8,), replace=False))


def test_dynamic_filter_order_and_histogram():
  r = jnp.asarray([[1., 1], [0, 1], [0, 0], [1, 0]])
  np.testing.assert_array_equal(selection.dynamic_filter_order(r), [1, 3, 0, 2])
  sel = SelectorState.init(5).replace(pass_rate=jnp.asarray([0.05, 0.3, 0.5, 0.95, 1.0]),
                                      visits=jnp.ones(5, jnp.int32))
  np.testing.assert_array_equal(selection.pass_rate_histogram(sel, jnp.arange(5)),
                                [1, 1, 1, 0, 2])


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "greedy"}, "selection mode 'greedy'"),
    ({"ema": 0.0}, "ema=0.0"),
    ({"skip_keep_base": 0.0}, "skip_keep_base=0.0"),
    ({"history_wrong_weight": 0.0}, "history_wrong_weight=0.0"),
])
def test_bad_selection_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SelectionConfig(**kwargs)


def test_unvisited_prompts_take_their_difficulty_buckets_rate():
  # Two buckets (e.g. 2-digit and 5-digit problems); visits to some prompts of each teach the
  # selector about the unvisited ones, so band mode stops favouring solved / hopeless buckets.
  cfg = SelectionConfig(mode="band", floor=0.0, group_ema=0.5)
  sel = SelectorState.init(6, prompt_group=[0, 0, 0, 1, 1, 1], num_groups=2)
  np.testing.assert_allclose(sel.estimate(), [0.5] * 6)
  sel = selection.update(sel, cfg, jnp.asarray([0, 3]), jnp.asarray([[1., 1], [0., 0]]), step=1)
  np.testing.assert_allclose(sel.group_rate, [0.75, 0.25])  # .5 * .5 + .5 * rate
  np.testing.assert_allclose(sel.estimate(), [1.0, 0.75, 0.75, 0.0, 0.25, 0.25])
  w = np.asarray(selection.weights(sel, cfg, 2, None))
  np.testing.assert_allclose(w, 4 * np.asarray(sel.estimate()) * (1 - np.asarray(sel.estimate())))


def test_spread_bucket_score_tracks_each_buckets_mean_group_variance():
  cfg = SelectionConfig(mode="band", floor=0.1, group_ema=0.5, bucket_score="spread")
  sel = SelectorState.init(6, prompt_group=[0, 0, 0, 1, 1, 1], num_groups=2, spread=True)
  np.testing.assert_allclose(sel.group_pq, [0.25, 0.25])
  # Bucket 0: groups [1,0,1,1] (unbiased variance 0.25) and [1,1,1,1] (0): mean 0.125.
  # Bucket 1: [0,0,1,1] (variance 1/3).
  sel = selection.update(sel, cfg, jnp.asarray([0, 1, 3]),
                         jnp.asarray([[1., 0, 1, 1], [1., 1, 1, 1], [0., 0, 1, 1]]), step=1)
  np.testing.assert_allclose(sel.group_pq, [0.5 * 0.25 + 0.5 * 0.125,
                                            0.5 * 0.25 + 0.5 / 3], rtol=1e-6)
  np.testing.assert_allclose(sel.group_rate, [0.5 * 0.5 + 0.5 * 0.875, 0.5], rtol=1e-6)
  w = np.asarray(selection.weights(sel, cfg, 2, None))
  p = np.asarray(sel.estimate())
  own = 0.1 + 0.9 * 4 * p * (1 - p)  # visited prompts: their own history, as in "mean"
  bucket = 0.1 + 0.9 * 4 * np.asarray(sel.group_pq)[[0, 0, 0, 1, 1, 1]]
  np.testing.assert_allclose(w, np.where([1, 1, 0, 1, 0, 0], own, bucket), rtol=1e-6)
  # Groups of unequal size (adaptive budgets): the variance over the sampled members only.
  sel2 = SelectorState.init(6, prompt_group=[0, 0, 0, 1, 1, 1], num_groups=2, spread=True)
  sel2 = selection.update(sel2, cfg, jnp.asarray([3]), jnp.asarray([[0., 1, 0, 0]]), step=1,
                          valid_PxG=jnp.asarray([[True, True, False, False]]))
  np.testing.assert_allclose(sel2.group_pq, [0.25, 0.5 * 0.25 + 0.5 * 0.5], rtol=1e-6)


def test_mean_bucket_score_keeps_no_spread_state():
  assert SelectorState.init(4, num_groups=2).group_pq is None
  with pytest.raises(ValueError, match="bucket_score='median'"):
    SelectionConfig(bucket_score="median")
