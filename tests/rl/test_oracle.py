"""The oracle selector: mixed-group probability, pick rule, true pass rates and probe count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import train
from rlx.data.tasks import PromptPool, Verifier
from rlx.model import ModelConfig, init_params
from rlx.model import transformer
from rlx.rl import selection
from rlx.rl.loss import LossConfig
from rlx.sampler.sampling import SamplingParams

CFG = ModelConfig(vocab_size=17, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64)


def test_mixed_group_probability_and_pick_match_numpy():
  p = np.asarray([0.0, 0.02, 0.3, 0.5, 0.7, 0.99, 1.0], np.float32)
  for g in (2, 4, 8):
    want = 1 - p ** g - (1 - p) ** g
    np.testing.assert_allclose(selection.mixed_group_prob(jnp.asarray(p), g), want, atol=1e-6)
  cand = np.asarray([10, 11, 12, 13, 14, 15, 16], np.int32)
  got = selection.oracle_pick(jnp.asarray(p), jnp.asarray(cand), 3, 8, jax.random.key(0))
  order = np.argsort(-(1 - p ** 8 - (1 - p) ** 8), kind="stable")
  assert sorted(np.asarray(got).tolist()) == sorted(cand[order[:3]].tolist())


def _pool(rng, n, p_len=5, a_len=4):
  prompts = np.zeros((n, p_len), np.int32)
  answers = np.zeros((n, a_len), np.int32)
  plens = rng.integers(2, p_len + 1, n).astype(np.int32)
  alens = rng.integers(2, a_len + 1, n).astype(np.int32)
  for i in range(n):
    prompts[i, p_len - plens[i]:] = rng.integers(4, CFG.vocab_size, plens[i])
    answers[i, :alens[i] - 1] = rng.integers(4, CFG.vocab_size, alens[i] - 1)
    answers[i, alens[i] - 1] = 3  # EOS
  return PromptPool(prompts=jnp.asarray(prompts), prompt_lens=jnp.asarray(plens),
                    answers=jnp.asarray(answers), answer_lens=jnp.asarray(alens),
                    difficulty=jnp.zeros((n,), jnp.int32))


def _reference_pass_rate(graphdef, params, prompt, answer, temperature):
  """Product of next-token probabilities of the answer, one unpadded sequence at a time."""
  tokens = np.concatenate([prompt, answer])[None]
  pos = np.arange(tokens.shape[1])[None]
  logits, _ = transformer.apply(graphdef, params, jnp.asarray(tokens), jnp.asarray(pos))
  logp = jax.nn.log_softmax(np.asarray(logits, np.float64)[0] / temperature, axis=-1)
  total = sum(logp[len(prompt) - 1 + t, answer[t]] for t in range(len(answer)))
  return float(np.exp(total))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_oracle_choose_uses_true_pass_rates_and_counts_its_probes(temperature):
  rng = np.random.default_rng(0)
  pool = _pool(rng, 12)
  graphdef, params = init_params(CFG, 0)
  cfg = train.StepConfig(
      prompts_per_step=3, group_size=4, advantage="grpo", num_updates=1, num_minibatches=1,
      loss=LossConfig(), sampling=SamplingParams(max_new_tokens=4, temperature=temperature),
      selection=selection.SelectionConfig(mode="oracle", oracle_candidates=0),
      verifier=Verifier("exact_match"))
  state = train.TrainState(params=params, opt_state=None, rng=None, step=jnp.zeros((), jnp.int32),
                           policy_version=jnp.zeros((), jnp.int32), selector=None, replay=None)
  ids, stats = train.oracle_choose(state, pool, jax.random.key(1), 3, graphdef=graphdef,
                                   cfg=cfg)
  p = np.asarray([_reference_pass_rate(
      graphdef, params, np.asarray(pool.prompts[i, 5 - int(pool.prompt_lens[i]):]),
      np.asarray(pool.answers[i, :int(pool.answer_lens[i])]), temperature) for i in range(12)])
  score = 1 - p ** 4 - (1 - p) ** 4
  assert sorted(np.asarray(ids).tolist()) == sorted(np.argsort(-score)[:3].tolist())
  # Every candidate's prompt and answer tokens went through one forward: the probe count.
  assert float(stats["ledger/probe_tokens"]) == float(
      np.sum(pool.prompt_lens) + np.sum(pool.answer_lens))
  np.testing.assert_allclose(float(stats["select/oracle_pass_rate"]),
                             p[np.asarray(ids)].mean(), rtol=2e-3)
  np.testing.assert_allclose(float(stats["select/oracle_pool_mixed_prob"]), score.mean(), rtol=2e-3)


def test_oracle_candidates_are_a_uniform_subset_and_counted():
  pool = _pool(np.random.default_rng(1), 40)
  graphdef, params = init_params(CFG, 0)
  cfg = train.StepConfig(
      prompts_per_step=2, group_size=4, advantage="grpo", num_updates=1, num_minibatches=1,
      loss=LossConfig(), sampling=SamplingParams(max_new_tokens=4),
      selection=selection.SelectionConfig(mode="oracle", oracle_candidates=10))
  state = train.TrainState(params=params, opt_state=None, rng=None, step=jnp.zeros((), jnp.int32),
                           policy_version=jnp.zeros((), jnp.int32), selector=None, replay=None)
  _, stats = train.oracle_choose(state, pool, jax.random.key(3), 2, graphdef=graphdef, cfg=cfg)
  k_cand, _ = jax.random.split(jax.random.key(3))
  cand = np.asarray(jax.random.choice(k_cand, 40, (10,), replace=False))
  assert float(stats["ledger/probe_tokens"]) == float(
      np.sum(np.asarray(pool.prompt_lens)[cand]) + np.sum(np.asarray(pool.answer_lens)[cand]))


def test_oracle_needs_an_exact_match_task():
  with pytest.raises(ValueError, match="exact-match task"):
    train.StepConfig(prompts_per_step=2, group_size=4, advantage="grpo", num_updates=1,
                     num_minibatches=1, loss=LossConfig(),
                     sampling=SamplingParams(max_new_tokens=4),
                     selection=selection.SelectionConfig(mode="oracle"),
                     verifier=Verifier("final_answer", (5,)))
  with pytest.raises(ValueError, match="oracle_candidates"):
    selection.SelectionConfig(mode="oracle", oracle_candidates=-1)
