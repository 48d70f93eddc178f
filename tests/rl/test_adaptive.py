"""Adaptive rollout budgets (rlx.rl.adaptive): groups of unequal size in the advantages, the
loss, the selector and the ledger against hand-computed numpy; a group extended in a second
round equals the same group sampled at once; the config's errors."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx
from rlx import configs
from rlx import sharding as shd
from rlx import train
from rlx.model import init_params
from rlx.rl import adaptive
from rlx.rl.advantages import group_advantages
from rlx.rl.loss import LossConfig, policy_loss
from rlx.rl.replay import ReplayConfig
from rlx.rl.selection import SelectionConfig, SelectorState, update as selector_update
from rlx.sampler.sampling import SamplingParams

from test_train import CFG, make_pool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _numpy_advantages(r, v, g, mode, eps=1e-6):
  out = np.zeros_like(r)
  for i in range(len(r) // g):
    rows = [i * g + j for j in range(g) if v[i * g + j]]
    x = r[rows].astype(np.float64)
    k = len(x)
    if np.all(x == x[0]):
      continue
    c = x - x.mean()
    if mode == "grpo":
      a = c / (np.sqrt((c ** 2).sum() / (k - 1)) + eps)
    elif mode == "dr_grpo":
      a = c
    else:  # rloo: r_i - mean of the others
      a = np.array([x[j] - np.delete(x, j).mean() for j in range(k)])
    out[rows] = a
  return out


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_unequal_group_advantages_equal_numpy(mode):
  rng = np.random.default_rng(0)
  g, g0, n = 6, 2, 7
  r = rng.integers(0, 2, n * g).astype(np.float32) + rng.normal(0, 0.3, n * g).astype(
      np.float32) * (rng.random(n * g) < 0.5)
  r[:g] = 1.0  # an extended zero-variance group
  r[g:g + g0] = 0.0  # a not-extended zero-variance group (its unsampled rows differ)
  extended = np.array([0, 2, 3, 5])
  v = np.asarray(adaptive.valid_rows(jnp.asarray(extended), n, g0, g))
  assert v.sum() == n * g0 + len(extended) * (g - g0)
  adv, zero_var = group_advantages(jnp.asarray(r), g, mode, valid=jnp.asarray(v))
  np.testing.assert_allclose(adv, _numpy_advantages(r, v, g, mode), rtol=1e-5, atol=1e-6)
  assert not np.asarray(adv)[~v].any()  # unsampled rows carry nothing
  assert bool(zero_var[0]) and bool(zero_var[1]) and not np.asarray(zero_var[2:]).all()


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_all_rows_valid_is_the_equal_group_path(mode):
  r = jnp.asarray(np.random.default_rng(1).integers(0, 2, 32), jnp.float32)
  a, z = group_advantages(r, 8, mode)
  b, zb = group_advantages(r, 8, mode, valid=jnp.ones((32,), bool))
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(z, zb)


def test_priorities_by_hand():
  r = jnp.asarray([[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]],
                  jnp.float32)
  # Laplace p = (s + 1) / 6: p (1 - p) = 5/36, 8/36, 9/36, 5/36, 8/36.
  np.testing.assert_allclose(adaptive.priority(r, "uncertain"),
                             np.array([5, 8, 9, 5, 8]) / 36, rtol=1e-6)
  key = jax.random.key(0)
  pick = lambda mode, k: sorted(np.asarray(adaptive.choose_extended(
      r, adaptive.AdaptiveConfig(first=4, extend_groups=k, priority=mode), key)).tolist())
  assert pick("uncertain", 1) == [2]
  assert pick("uncertain", 3) == [1, 2, 4]
  assert pick("unsolved", 1) == [0]  # AR3PO: the group with nothing right first
  assert pick("unsolved", 4) == [0, 1, 2, 4]


def test_merge_rounds_places_round_two_after_round_one():
  n, g0, g2 = 3, 2, 3
  first = jnp.arange(n * g0) + 100
  second = jnp.arange(2 * g2) + 200
  out = np.asarray(adaptive.merge_rounds(first, second, jnp.asarray([2, 0]), n))
  np.testing.assert_array_equal(out.reshape(n, g0 + g2), [[100, 101, 203, 204, 205],
                                                          [102, 103, 0, 0, 0],
                                                          [104, 105, 200, 201, 202]])


def test_selector_counts_sampled_rows_only():
  sel = SelectorState.init(4)
  r = jnp.asarray([[1, 0, 0, 0], [1, 1, 0, 0]], jnp.float32)
  v = jnp.asarray([[True, True, False, False], [True, True, True, True]])
  out = selector_update(sel, SelectionConfig(), jnp.asarray([0, 1]), r, 0, v)
  np.testing.assert_allclose(out.pass_rate[:2], [0.5, 0.5])
  assert not bool(out.last_all_correct[0])
  sel2 = selector_update(sel, SelectionConfig(), jnp.asarray([0]),
                         jnp.asarray([[1, 1, 0, 0]], jnp.float32), 0,
                         jnp.asarray([[True, True, False, False]]))
  assert bool(sel2.last_all_correct[0]) and int(sel2.zero_var_streak[0]) == 1


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_loss_on_unequal_groups_equals_numpy(aggregation):
  rng = np.random.default_rng(2)
  b, t = 6, 5
  lengths = np.array([3, 5, 0, 2, 0, 4])  # rows 2 and 4 unsampled
  valid = lengths > 0
  mask = np.arange(t)[None] < lengths[:, None]
  logp = rng.normal(-1, 0.3, (b, t)).astype(np.float32)
  old = logp + rng.normal(0, 0.1, (b, t)).astype(np.float32)
  mu = old + rng.normal(0, 0.1, (b, t)).astype(np.float32)
  adv = np.where(valid, rng.normal(0, 1, b), 0).astype(np.float32)
  cfg = LossConfig(aggregation=aggregation)
  loss, _ = policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(mu), jnp.asarray(adv),
                        jnp.asarray(mask), cfg, norm_rows=int(valid.sum()))
  ratio = np.exp(logp - old)
  pg = np.maximum(-ratio * adv[:, None], -np.clip(ratio, 0.8, 1.28) * adv[:, None])
  per_tok = np.minimum(np.exp(old - mu), 2.0) * pg * mask
  rows = valid.sum()  # the loss averages over the 4 sampled rows, not the 6 slots
  if aggregation == "seq_mean_token_mean":
    want = sum(per_tok[i].sum() / mask[i].sum() for i in range(b) if valid[i]) / rows
  else:
    want = per_tok.sum() / (rows * t)
  np.testing.assert_allclose(loss, want, rtol=1e-5)


def _tiny(**kw):
  g, params = init_params(CFG, 0)
  base = dict(prompts_per_step=4, group_size=6, advantage="grpo", num_updates=1,
              num_minibatches=1, loss=LossConfig(),
              sampling=SamplingParams(max_new_tokens=5, temperature=1.0),
              adaptive=adaptive.AdaptiveConfig(first=2, extend_groups=2))
  base.update(kw)
  return g, params, train.StepConfig(**base)


@pytest.mark.parametrize("impl", ["dense", "paged"])
def test_an_extended_group_equals_the_group_sampled_at_once(impl):
  g, params, cfg = _tiny(sampler_impl=impl)
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  tx = train.make_optimizer(1e-2, 10)
  state = train.init_state(params, tx, 3, mesh)
  pool = make_pool()
  rng0 = state.rng
  _, ro, rewards = jax.jit(lambda s, p: train.generate(s, p, graphdef=g, cfg=cfg))(state, pool)
  n, gs, g0 = 4, 6, 2
  valid = np.asarray(ro.valid).reshape(n, gs)
  extended = np.flatnonzero(valid.all(axis=1))
  assert len(extended) == 2 and valid[:, :g0].all()
  # The keys generate draws from (see train._generate_adaptive).
  _, _, k_sample = jax.random.split(jax.random.wrap_key_data(rng0), 3)
  group_keys = jax.random.split(jax.random.split(k_sample)[0], n)
  b = ro.batch
  # Every group sampled at once with all G members, in one call.
  keys = adaptive.row_keys(group_keys, range(gs)).reshape(-1)
  once = jax.jit(lambda p, l, k: train.sample(g, params, p, l, k, cfg, None, group_size=gs))(
      b.prompts, b.prompt_lens, keys)
  for i in range(n):
    rows = slice(i * gs, (i + 1) * gs)
    k = gs if i in extended else g0  # a group not extended: its first G0 members
    np.testing.assert_array_equal(b.completions[rows][:k], once.tokens[rows][:k])
    np.testing.assert_array_equal(b.lengths[rows][:k], once.lengths[rows][:k])
    np.testing.assert_allclose(b.behaviour_logp[rows][:k], once.logprobs[rows][:k], atol=1e-5)
    assert not np.asarray(b.lengths[rows][k:]).any()  # unsampled: no tokens
  ids = np.asarray(b.prompt_ids)
  want = cfg.verifier(b.completions, jnp.asarray(pool.answers[ids]),
                      jnp.asarray(pool.answer_lens[ids]))
  np.testing.assert_array_equal(np.asarray(rewards)[valid.reshape(-1)],
                                np.asarray(want)[valid.reshape(-1)])


def _ledger_sums(hist, sequences=None):
  for m in hist:
    parts = (m["ledger/tokens_trained"] - m["ledger/tokens_replayed"] +
             m["ledger/tokens_zero_adv"] + m["ledger/tokens_discarded"])
    np.testing.assert_allclose(parts, m["ledger/tokens_generated"], rtol=1e-6)
    if sequences is not None:
      assert m["ledger/sequences"] == sequences


def test_adaptive_steps_train_and_the_ledger_accounts_for_every_token():
  g, params, cfg = _tiny(replay=ReplayConfig(capacity=48, num_samples=8, max_staleness=8))
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  tx = train.make_optimizer(1e-2, 10)
  state = train.init_state(params, tx, 0, mesh, num_prompts=24, replay=cfg.replay,
                           prompt_width=8, max_new_tokens=5)
  fns = train.make_step_fns(g, cfg, tx, mesh, jax.eval_shape(lambda: state))
  pool = jax.device_put(make_pool(), fns.pool_sharding)
  hist = []
  for _ in range(3):
    state, ro = fns.rollout(state, pool)
    gen = float(jnp.where(ro.valid, ro.batch.lengths, 0).sum())
    shape = train.update_shape(ro, cfg)
    state, m = fns.update(state, ro, **shape)
    m = jax.device_get(m)
    assert m["ledger/tokens_generated"] == gen
    assert m["adaptive/round2_tokens"] <= gen
    assert m["guard/signal_rows_left_out"] == 0
    hist.append(m)
  _ledger_sums(hist, sequences=4 * 2 + 2 * 4)
  assert int(state.selector.visits.sum()) == 3 * 4
  assert int(state.replay.valid.sum()) > 0
  assert np.asarray(state.replay.lengths)[np.asarray(state.replay.valid)].min() > 0


def test_ledger_sums_for_the_plain_step_with_dynamic_filtering():
  from test_train import _steps_with
  kw = dict(selection=SelectionConfig(mode="band", dynamic_filter=True),
            replay=ReplayConfig(capacity=64, num_samples=16, max_staleness=8))
  _, hist = _steps_with(shd.make_mesh(1, 1, devices=jax.devices()[:1]), 3, selector=True,
                        **kw)
  _ledger_sums(hist)
  assert any(m["ledger/tokens_discarded"] > 0 for m in hist)


ARITH = os.path.join(REPO, "experiments", "arith.py")


@pytest.mark.parametrize("overrides,match", [
    ({"adaptive.first": 8, "adaptive.extend_groups": 2}, "adaptive.first=8 with rl.group_size=8"),
    ({"adaptive.first": 1, "adaptive.extend_groups": 1}, "adaptive.first=1"),
    ({"adaptive.first": 4}, "adaptive.extend_groups=0"),
    ({"adaptive.first": 4, "adaptive.extend_groups": 99}, "adaptive.extend_groups=99 >"),
    ({"adaptive.first": 4, "adaptive.extend_groups": 2, "adaptive.priority": "random"},
     "adaptive.priority='random'"),
    ({"adaptive.first": 4, "adaptive.extend_groups": 2, "selection.dynamic_filter": True},
     "dynamic_filter"),
    ({"adaptive.first": 4, "adaptive.extend_groups": 2, "pipeline.mode": "overlap",
      "fused_step": False}, "overlap"),
])
def test_bad_adaptive_configs_are_one_error(overrides, match):
  base = {"rl.group_size": 8, "rl.prompts_per_step": 8}
  config = configs.with_overrides(rlx.load_config(ARITH, "runlocal"), {**base, **overrides})
  with pytest.raises(configs.ConfigError, match=match):
    configs.resolve(config)


def test_a_good_adaptive_config_resolves():
  config = configs.with_overrides(rlx.load_config(ARITH, "runlocal"), {
      "rl.group_size": 8, "rl.prompts_per_step": 8, "adaptive.first": 4,
      "adaptive.extend_groups": 2})
  spec = configs.resolve(config)
  assert spec.adaptive == adaptive.AdaptiveConfig(first=4, extend_groups=2)
  assert spec.adaptive.sequences(8, 8) == 8 * 4 + 2 * 4


def test_adaptive_steps_shard_like_one_device():
  """Both rounds and the unequal-group scoring on a 4 x 2 mesh equal one device."""
  def run(mesh):
    g, params, cfg = _tiny(prompts_per_step=8, group_size=4,
                           adaptive=adaptive.AdaptiveConfig(first=2, extend_groups=4))
    tx = train.make_optimizer(1e-2, 10)
    state = train.init_state(params, tx, 0, mesh, num_prompts=24)
    fns = train.make_step_fns(g, cfg, tx, mesh, jax.eval_shape(lambda: state))
    pool = jax.device_put(make_pool(), fns.pool_sharding)
    hist = []
    for _ in range(2):
      state, m = fns.train_step(state, pool)
      hist.append(jax.device_get(m))
    return state, hist
  one, h1 = run(shd.make_mesh(1, 1, devices=jax.devices()[:1]))
  eight, h8 = run(shd.make_mesh(4, 2))
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(eight.params)):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
  for m1, m8 in zip(h1, h8):
    assert m1["ledger/tokens_generated"] == m8["ledger/tokens_generated"]
    assert m1["ledger/sequences"] == 8 * 2 + 4 * 2


def test_tie_breaking_never_reorders_distinct_priorities():
  g0 = 32  # adjacent p (1 - p) values near p = 1/2 differ by 1 / 34^2 < 1e-3
  solved = jnp.asarray([16, 15, 17, 14, 0, 32])
  r = (jnp.arange(g0)[None, :] < solved[:, None]).astype(jnp.float32)
  cfg = adaptive.AdaptiveConfig(first=g0, extend_groups=1)
  keys = jax.random.split(jax.random.key(0), 500)
  ext = jax.vmap(lambda k: adaptive.choose_extended(r, cfg, k))(keys)
  # 16 of 32 right is the most uncertain whatever the noise (1e-3 noise reorders ~1.6% of draws)
  assert (np.asarray(ext[:, 0]) == 0).all()
