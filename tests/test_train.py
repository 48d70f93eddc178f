"""The pure training step: log-prob agreement, multi-device equivalence, compile-once."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import sharding as shd
from rlx import train
from rlx.data.tasks import PromptPool, exact_match_reward
from rlx.model import ModelConfig, init_params
from rlx.rl.loss import LossConfig
from rlx.sampler import dense
from rlx.sampler.sampling import SamplingParams

CFG = ModelConfig(vocab_size=19, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64)


def make_pool(n=24, p=8, a=4, seed=0):
  rng = np.random.default_rng(seed)
  lens = rng.integers(3, p + 1, n).astype(np.int32)
  prompts = np.zeros((n, p), np.int32)
  for i, l in enumerate(lens):
    prompts[i, p - l:] = rng.integers(4, CFG.vocab_size, l)
    prompts[i, p - l] = 2
  # The answer is "stop at once" (EOS first): a random model earns reward ~1/V of the time,
  # so the steps below have a learning signal.
  answers = np.zeros((n, a), np.int32)
  answers[:, 0] = 3
  return PromptPool(prompts=prompts, prompt_lens=lens, answers=answers,
                    answer_lens=np.ones(n, np.int32), difficulty=np.ones(n, np.int32))


def step_config(**kw):
  base = dict(prompts_per_step=4, group_size=8, advantage="grpo", num_updates=2,
              num_minibatches=2, loss=LossConfig(),
              sampling=SamplingParams(max_new_tokens=5, temperature=1.0))
  base.update(kw)
  return train.StepConfig(**base)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_equal_sampler_behaviour_logprobs(temperature):
  g, params = init_params(CFG, 0)
  pool = make_pool()
  sp = SamplingParams(max_new_tokens=6, temperature=temperature)
  keys = jax.random.split(jax.random.key(0), pool.size)
  ro = dense.generate(g, params, jnp.asarray(pool.prompts), jnp.asarray(pool.prompt_lens),
                      keys, params_cfg=sp)
  lp, mask = train.completion_logprobs(g, params, pool.prompts, pool.prompt_lens, ro.tokens,
                                       ro.lengths, temperature)
  mask = np.asarray(mask)
  assert mask.sum() > pool.size  # several tokens per sequence were compared
  diff = np.abs(np.asarray(lp) - np.asarray(ro.logprobs))[mask]
  assert diff.max() <= 1e-5, diff.max()


def _run_steps(mesh, n_steps=2, fused=True):
  g, params = init_params(CFG, 0)
  cfg = step_config()
  tx = train.make_optimizer(1e-2, 10)
  state = train.init_state(params, tx, 0, mesh)
  fns = train.make_step_fns(g, cfg, tx, mesh, jax.eval_shape(lambda: state))
  pool = jax.device_put(make_pool(), fns.pool_sharding)
  history = []
  for _ in range(n_steps):
    if fused:
      state, m = fns.train_step(state, pool)
    else:
      state, batch = fns.rollout(state, pool)
      state, m = fns.update(state, batch)
    history.append(jax.device_get(m))
  return state, history, fns


def test_multi_device_matches_one_device_and_compiles_once():
  devices = jax.devices()
  assert len(devices) == 8, "tests/conftest.py sets 8 fake CPU devices"
  ref_state, ref_hist, _ = _run_steps(shd.make_mesh(1, 1, devices=devices[:1]), 3)
  assert any(h["reward/mean"] > 0 for h in ref_hist)  # the steps had a learning signal
  for data, fsdp in ((8, 1), (4, 2)):
    mesh = shd.make_mesh(data, fsdp)
    state, hist, fns = _run_steps(mesh, 3)
    for a, b in zip(jax.tree.leaves(ref_state.params), jax.tree.leaves(state.params)):
      np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
    for h, r in zip(hist, ref_hist):
      for k in ("reward/mean", "loss/policy", "grad_norm", "ledger/tokens_generated"):
        np.testing.assert_allclose(h[k], r[k], rtol=1e-3, atol=1e-5, err_msg=k)
    assert fns.train_step._cache_size() == 1  # no recompilation from step 2 on
  # FSDP really shards the parameters.
  spec = state.params["layer_0"]["mlp"]["up_proj"].sharding.spec
  assert spec[0] == "fsdp"


def test_split_halves_equal_fused_step():
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  fused, hf, _ = _run_steps(mesh, 2, fused=True)
  split, hs, fns = _run_steps(mesh, 2, fused=False)
  for a, b in zip(jax.tree.leaves(fused.params), jax.tree.leaves(split.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert fns.rollout._cache_size() == 1 and fns.update._cache_size() == 1


def test_update_improves_the_objective_on_its_batch():
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  g, params = init_params(CFG, 0)
  cfg = step_config(num_updates=1, num_minibatches=1)
  tx = train.make_optimizer(3e-3, 10, grad_clip=0.0)
  roll = jax.jit(functools.partial(train.rollout, graphdef=g, cfg=cfg))
  for seed in range(20):  # the first rollout with a learning signal
    state = train.init_state(params, tx, seed, mesh)
    state, ro = roll(state, make_pool())
    batch = ro.batch
    if float(jnp.abs(batch.advantages).sum()) > 0:
      break
  assert float(jnp.abs(batch.advantages).sum()) > 0

  def objective(p):
    lp, m = train.completion_logprobs(g, p, batch.prompts, batch.prompt_lens,
                                      batch.completions, batch.lengths, 1.0)
    return float((jnp.where(m, lp, 0).sum(1) * batch.advantages).sum())

  before = objective(state.params)
  new_state, metrics = jax.jit(functools.partial(train.update, graphdef=g, cfg=cfg, tx=tx))(
      state, ro)
  assert objective(new_state.params) > before
  assert int(new_state.step) == 1 and int(new_state.policy_version) == 1
  # Rewards are the verifier's: exact match of answer + EOS.
  np.testing.assert_array_equal(
      batch.rewards, exact_match_reward(batch.completions, make_pool().answers[
          np.asarray(batch.prompt_ids)], np.ones(32, np.int32)))
  np.testing.assert_array_equal(batch.rewards, np.asarray(batch.completions[:, 0]) == 3)


def _steps_with(mesh, n_steps, *, selector, **cfg_kw):
  from rlx.rl.replay import ReplayConfig  # noqa: F401  (used via cfg_kw)
  g, params = init_params(CFG, 0)
  cfg = step_config(**cfg_kw)
  tx = train.make_optimizer(1e-2, 10)
  pool = make_pool(40)
  state = train.init_state(params, tx, 0, mesh, num_prompts=40 if selector else None,
                           replay=cfg.replay, prompt_width=8, max_new_tokens=5,
                           selector_spread=cfg.selection.bucket_score == "spread")
  fns = train.make_step_fns(g, cfg, tx, mesh, jax.eval_shape(lambda: state))
  pool = jax.device_put(pool, fns.pool_sharding)
  hist = []
  for _ in range(n_steps):
    state, m = fns.train_step(state, pool)
    hist.append(jax.device_get(m))
  return state, hist


def test_uniform_selection_without_replay_equals_the_plain_grpo_step():
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  plain, hp = _steps_with(mesh, 3, selector=False)
  tracked, ht = _steps_with(mesh, 3, selector=True)
  for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(tracked.params)):
    np.testing.assert_array_equal(a, b)
  assert [h["reward/mean"] for h in hp] == [h["reward/mean"] for h in ht]
  assert int(tracked.selector.visits.sum()) == 3 * 4  # the selector still learned pass rates


def test_replay_selection_and_length_control_shard_like_one_device():
  from rlx.rl.length import LengthConfig
  from rlx.rl.replay import ReplayConfig
  from rlx.rl.selection import SelectionConfig
  kw = dict(selection=SelectionConfig(mode="band", dynamic_filter=True, bucket_score="spread"),
            replay=ReplayConfig(capacity=64, num_samples=16, max_staleness=8),
            length=LengthConfig(overlong_shaping=True, overlong_buffer=2))
  one, h1 = _steps_with(shd.make_mesh(1, 1, devices=jax.devices()[:1]), 4, selector=True, **kw)
  assert h1[-1]["replay/rows"] > 0 and h1[-1]["ledger/tokens_replayed"] > 0
  assert h1[-1]["ledger/tokens_generated"] >= h1[-1]["ledger/tokens_discarded"] > 0
  eight, h8 = _steps_with(shd.make_mesh(4, 2), 4, selector=True, **kw)
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(eight.params)):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
  np.testing.assert_array_equal(one.replay.prompt_ids, eight.replay.prompt_ids)
  assert eight.replay.prompt_ids.sharding.spec[0] == ("data", "fsdp")
  np.testing.assert_allclose(one.selector.group_pq, eight.selector.group_pq, rtol=1e-6)
  assert float(one.selector.group_pq[0]) != 0.25  # the spread score learned from the groups
