"""DAPO length control: soft overlong punishment against the paper's formula by hand, and
overlong filtering inside the training step's scoring half."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import sharding as shd
from rlx import train
from rlx.model import ModelConfig, init_params
from rlx.rl.length import LengthConfig, length_weight, overlong_penalty
from rlx.rl.loss import LossConfig
from rlx.sampler.sampling import SamplingParams


def test_soft_overlong_punishment_by_hand():
  # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then a ramp to -1 at 10; a response
  # cut at L_max without a stop token is longer than L_max: -1.
  lengths = jnp.array([3, 6, 7, 9, 10, 10])
  truncated = jnp.array([False, False, False, False, False, True])
  pen = overlong_penalty(lengths, truncated, 10, LengthConfig(overlong_buffer=4,
                                                              overlong_penalty=0.5))
  np.testing.assert_allclose(pen, 0.5 * np.array([0, 0, -0.25, -0.75, -1.0, -1.0]))


@pytest.mark.parametrize("kwargs,match", [
    (dict(overlong_buffer=0), "overlong_buffer=0"),
    (dict(overlong_penalty=-1.0), "overlong_penalty=-1.0"),
    (dict(length_mode="before"), "length_mode='before'"),
    (dict(length_warmup_steps=-1), "length_warmup_steps=-1"),
    (dict(length_warmup_steps=2.5), "length_warmup_steps=2.5"),
    (dict(guard_margin=2.0), "guard_margin=2.0"),
    (dict(guard_margin=-0.1), "guard_margin=-0.1"),
    (dict(guard_steps=0), "guard_steps=0"),
    (dict(guard_decay=1.0), "guard_decay=1.0"),
])
def test_bad_length_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    LengthConfig(**kwargs)


def _score(length_cfg, step=0, length_guard=None):
  """Scores one hand-made group of 4: two correct, one of them cut at max length."""
  cfg = train.StepConfig(prompts_per_step=1, group_size=4, advantage="grpo", num_updates=1,
                         num_minibatches=1, loss=LossConfig(),
                         sampling=SamplingParams(max_new_tokens=8), length=length_cfg)
  mcfg = ModelConfig(vocab_size=11, num_layers=1, d_model=8, num_heads=2, num_kv_heads=1,
                     head_dim=4, mlp_dim=16)
  _, params = init_params(mcfg, 0)
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  state = train.init_state(params, train.make_optimizer(1e-3, 1), 0, mesh)
  b = 4
  batch = train.Batch(
      prompts=jnp.ones((b, 3), jnp.int32), prompt_lens=jnp.full((b,), 3, jnp.int32),
      completions=jnp.ones((b, 8), jnp.int32), behaviour_logp=jnp.zeros((b, 8)),
      lengths=jnp.array([2, 7, 8, 3], jnp.int32),
      truncated=jnp.array([False, False, True, False]),
      rewards=jnp.zeros((b,)), advantages=jnp.zeros((b,)),
      prompt_ids=jnp.zeros((b,), jnp.int32), difficulty=jnp.ones((b,), jnp.int32),
      policy_version=jnp.zeros((b,), jnp.int32))
  correct = jnp.array([1.0, 1.0, 1.0, 0.0])
  state = state.replace(step=jnp.asarray(step, jnp.int32), length_guard=length_guard)
  state, scored = train.score(state, train.Rollouts(batch, {}), correct, cfg=cfg)
  return scored.batch if length_guard is None else (scored.batch, state.length_guard)


def _grpo(r):
  r = np.asarray(r, np.float64)
  return (r - r.mean()) / (r.std(ddof=1) + 1e-6)  # GRPO, unbiased group std


def test_scoring_applies_shaping_to_advantages_and_filtering_to_truncated_rows():
  plain = _score(LengthConfig())
  np.testing.assert_allclose(plain.advantages, _grpo([1, 1, 1, 0]), rtol=1e-4, atol=1e-5)
  # Shaping, L_max 8, L_cache 4: lengths 2, 7, 8 (cut), 3 -> penalties 0, -0.75, -1, 0.
  shaped = _score(LengthConfig(overlong_shaping=True, overlong_buffer=4))
  np.testing.assert_allclose(shaped.advantages, _grpo([1, 0.25, 0, 0]), rtol=1e-4, atol=1e-5)
  # The task reward is kept for logging; only the advantage sees the shaping.
  np.testing.assert_array_equal(shaped.rewards, [1, 1, 1, 0])
  # Filtering: the cut response contributes nothing to the loss.
  filtered = _score(LengthConfig(overlong_filter=True))
  expected = _grpo([1, 1, 1, 0])
  expected[2] = 0.0
  np.testing.assert_allclose(filtered.advantages, expected, rtol=1e-4, atol=1e-5)


def test_group_length_reward_matches_a_hand_computed_table():
  from rlx.rl.length import group_length_reward
  # Group 0 (G=4): lengths 10, 20, 30, 50 -> lambda = .5 - (L - 10) / 40 = .5, .25, 0, -.5.
  # Group 1: all length 7 -> lambda 0 for everyone.
  # Group 2: lengths as group 0, all wrong -> no length term (it would only rank wrong answers).
  lengths = jnp.array([10, 20, 30, 50, 7, 7, 7, 7, 10, 20, 30, 50])
  correct = jnp.array([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
  got = group_length_reward(lengths, correct, 4)
  # correct: lambda; wrong: min(0, lambda) (never rewarded for being short)
  np.testing.assert_allclose(got, [0.5, 0.0, 0.0, -0.5, 0, 0, 0, 0, 0, 0, 0, 0], atol=1e-7)


def test_length_reward_enters_the_advantages_through_score():
  plain = _score(LengthConfig())
  shaped = _score(LengthConfig(length_reward=0.4, length_mode="reward"))
  # lengths 2, 7, 8, 3 (one group of 4); correct 1, 1, 1, 0 -> lambda .5, -.1/.6*... by hand:
  lam = 0.5 - (np.array([2, 7, 8, 3]) - 2) / 6
  bonus = np.where([1, 1, 1, 0], lam, np.minimum(lam, 0))
  r = np.array([1.0, 1.0, 1.0, 0.0]) + 0.4 * bonus
  np.testing.assert_allclose(shaped.advantages, _grpo(r), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(shaped.rewards, plain.rewards)  # the task reward is kept


def test_length_term_after_normalisation_is_bounded_by_its_weight():
  # The default: the task advantage keeps GRPO's normalisation and the length term, centred on
  # its group, is added after it (lengths 2, 7, 8, 3; correct 1, 1, 1, 0; weight 0.4).
  shaped = _score(LengthConfig(length_reward=0.4))
  lam = 0.5 - (np.array([2, 7, 8, 3]) - 2) / 6
  term = 0.4 * np.where([1, 1, 1, 0], lam, np.minimum(lam, 0))
  np.testing.assert_allclose(shaped.advantages, _grpo([1, 1, 1, 0]) + term - term.mean(),
                             rtol=1e-5, atol=1e-6)


def test_all_correct_group_push_is_full_strength_as_a_reward_and_bounded_as_an_advantage():
  from rlx.rl import advantages, length
  lengths = jnp.array([10, 20, 30, 50])
  correct = jnp.ones((4,))
  for w in (0.05, 0.5):
    term = w * length.group_length_reward(lengths, correct, 4)
    as_reward, _ = advantages.group_advantages(correct + term, 4, "grpo")
    as_adv = length.centred_length_advantage(term, 4)
    # As a reward, std normalisation gives the same unit-size push at any weight ...
    np.testing.assert_allclose(as_reward, _grpo(np.array([0.5, 0.25, 0, -0.5])), rtol=1e-4)
    # ... after normalisation it is w * (lambda - mean lambda): |push| <= w.
    np.testing.assert_allclose(as_adv, w * (np.array([0.5, 0.25, 0, -0.5]) - 0.0625),
                               rtol=1e-5)
  # Rows not sampled (adaptive budgets) get no term and do not count in the mean.
  got = length.centred_length_advantage(jnp.array([1.0, 0.0, 3.0, 9.0]), 4,
                                        jnp.array([True, True, True, False]))
  np.testing.assert_allclose(got, [1 - 4 / 3, -4 / 3, 3 - 4 / 3, 0.0], rtol=1e-6)


def test_relative_scale_by_hand_and_its_push_fades_as_lengths_converge():
  from rlx.rl.length import group_length_reward
  # Group 0: lengths 10, 20, 30, 50 (midrange sum 60) -> (60 - 2 L) / 60 = 2/3, 1/3, 0, -2/3;
  # the wrong ones keep min(0, lambda). Group 1: concise answers 100, 102, 104, 105 (sum 205)
  # -> (205 - 2 L) / 205: a push of ~1/40 where "range" still gives the full +-0.5.
  lengths = jnp.array([10, 20, 30, 50, 100, 102, 104, 105])
  correct = jnp.array([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
  got = group_length_reward(lengths, correct, 4, scale="relative")
  want = [2 / 3, 0.0, 0.0, -2 / 3] + [(205 - 2 * l) / 205 for l in (100, 102, 104, 105)]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  rng = group_length_reward(lengths, correct, 4, scale="range")
  np.testing.assert_allclose(rng[4:], [0.5, 0.1, -0.3, -0.5], rtol=1e-6)
  # Same ordering as Kimi's range scale within every group.
  for a in (got, rng):
    assert list(np.argsort(-np.asarray(a[4:]))) == [0, 1, 2, 3]
  with pytest.raises(ValueError, match="length_scale='median'"):
    LengthConfig(length_scale="median")


def test_relative_scale_reaches_the_advantages_through_score():
  shaped = _score(LengthConfig(length_reward=0.4, length_scale="relative"))
  # lengths 2, 7, 8, 3; correct 1, 1, 1, 0; lo + hi = 10 -> lambda .6, -.4, -.6, (.4 -> 0).
  term = 0.4 * np.array([0.6, -0.4, -0.6, 0.0])
  np.testing.assert_allclose(shaped.advantages, _grpo([1, 1, 1, 0]) + term - term.mean(),
                             rtol=1e-5, atol=1e-6)


def test_length_warmup_ramps_the_weight_by_hand():
  cfg = LengthConfig(length_reward=0.4, length_warmup_steps=4)
  np.testing.assert_allclose([float(length_weight(cfg, s)) for s in range(6)],
                             [0.1, 0.2, 0.3, 0.4, 0.4, 0.4], rtol=1e-6)
  assert float(length_weight(LengthConfig(length_reward=0.4), 0)) == pytest.approx(0.4)


def test_length_warmup_reaches_the_advantages_through_score():
  # Step 1 of a 4-step warm-up: weight 0.4 x 2/4 = 0.2 (the relative table above).
  shaped = _score(LengthConfig(length_reward=0.4, length_scale="relative",
                               length_warmup_steps=4), step=1)
  term = 0.2 * np.array([0.6, -0.4, -0.6, 0.0])
  np.testing.assert_allclose(shaped.advantages, _grpo([1, 1, 1, 0]) + term - term.mean(),
                             rtol=1e-5, atol=1e-6)
  full = _score(LengthConfig(length_reward=0.4, length_scale="relative",
                             length_warmup_steps=4), step=9)
  term = 0.4 * np.array([0.6, -0.4, -0.6, 0.0])
  np.testing.assert_allclose(full.advantages, _grpo([1, 1, 1, 0]) + term - term.mean(),
                             rtol=1e-5, atol=1e-6)


def _guard_reference(levels, margin, steps, decay, history):
  """The length guard in plain numpy, one step at a time: (row multipliers per step, avg)."""
  levels = sorted(set(levels))
  ref_sum = dict.fromkeys(levels, 0.0)
  ref_rows = dict.fromkeys(levels, 0.0)
  avg = dict.fromkeys(levels, 0.0)
  out = []
  for step, (diff, correct) in enumerate(history):
    rows = {l: sum(1 for d in diff if d == l) for l in levels}
    hits = {l: sum(1 for d, c in zip(diff, correct) if d == l and c > 0) for l in levels}
    if step < steps:
      for l in levels:
        ref_sum[l] += hits[l]
        ref_rows[l] += rows[l]
      out.append([0.0] * len(diff))
      continue
    ref = {l: ref_sum[l] / max(ref_rows[l], 1) for l in levels}
    for l in levels:
      start = ref[l] if step == steps else avg[l]
      avg[l] = decay * start + (1 - decay) * hits[l] / rows[l] if rows[l] else start
    m = {l: (min(max((avg[l] - ref[l] + margin) / margin, 0.0), 1.0) if ref_rows[l] else 1.0)
         for l in levels}
    out.append([m.get(d, 1.0) for d in diff])
  return out, avg


def test_length_guard_equals_a_numpy_reference():
  from rlx.rl.length import LengthGuard, guard_update
  rng = np.random.default_rng(0)
  cfg = LengthConfig(length_reward=0.5, guard_margin=0.2, guard_steps=3, guard_decay=0.7)
  levels = [1, 2, 5, 9]  # 9 never appears in calibration: never guarded
  # Level 5 is solved during calibration and then fails: its term must fade and go off.
  history = []
  for step in range(12):
    diff = rng.choice([1, 2, 5] if step < 3 else [1, 2, 5, 9], size=8)
    p = {1: 0.9, 2: 0.5, 5: 1.0 if step < 3 else 0.3, 9: 0.5}
    history.append((diff.tolist(), [float(rng.random() < p[d]) for d in diff]))
  want, want_avg = _guard_reference(levels, 0.2, 3, 0.7, history)
  guard = LengthGuard.init(levels)
  for step, (diff, correct) in enumerate(history):
    guard, m, stats = guard_update(guard, cfg, jnp.int32(step), jnp.array(diff, jnp.int32),
                                   jnp.array(correct))
    np.testing.assert_allclose(m, want[step], rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
    for i, level in enumerate(levels):  # each level's multiplier is logged
      if level in diff:
        assert float(stats[f"length/guard_m{i}"]) == pytest.approx(want[step][diff.index(level)])
  np.testing.assert_allclose(guard.avg, [want_avg[l] for l in levels], rtol=1e-5, atol=1e-6)
  assert want[-1][history[-1][0].index(5)] == 0.0  # the failing level ends with no term


def test_length_guard_turns_the_term_off_through_score_where_a_level_lost_accuracy():
  from rlx.rl.length import LengthGuard
  cfg = LengthConfig(length_reward=0.4, guard_margin=0.25, guard_steps=2)
  term = 0.4 * (0.5 - (np.array([2, 7, 8, 3]) - 2) / 6)
  term = np.where([1, 1, 1, 0], term, np.minimum(term, 0))
  plain = _grpo([1, 1, 1, 0])

  def scored(guard, step):
    return _score(cfg, step=step, length_guard=guard)

  # Calibrating (step < guard_steps): no length term, the level's rows are counted.
  batch, guard = scored(LengthGuard.init([1]), 0)
  np.testing.assert_allclose(batch.advantages, plain, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose([guard.ref_sum[0], guard.ref_rows[0]], [3, 4])
  # The level at its reference (3 of 4): the full term.
  batch, guard = scored(guard.replace(ref_sum=jnp.array([3.0]), ref_rows=jnp.array([4.0])), 2)
  np.testing.assert_allclose(guard.avg, [0.75], rtol=1e-6)
  np.testing.assert_allclose(batch.advantages, plain + term - term.mean(), rtol=1e-5,
                             atol=1e-6)
  # The level a full margin under its reference (1.0 measured, 0.75 now): no term.
  batch, _ = scored(guard.replace(ref_sum=jnp.array([4.0]), avg=jnp.array([0.75])), 5)
  np.testing.assert_allclose(batch.advantages, plain, rtol=1e-5, atol=1e-6)
