"""The oracle selector: mixed-group probability, pick rule, true pass rates and probe count."""

import dataclasses

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


def _state(params, selector=None, step=0):
  """A TrainState holding only what the probe reads: the policy, the step, the selector."""
  return train.TrainState(params=params, opt_state=None, rng=None,
                          step=jnp.asarray(step, jnp.int32),
                          policy_version=jnp.zeros((), jnp.int32), selector=selector, replay=None)


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
  state = _state(params)
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
  state = _state(params)
  _, stats = train.oracle_choose(state, pool, jax.random.key(3), 2, graphdef=graphdef, cfg=cfg)
  k_cand, _ = jax.random.split(jax.random.key(3))
  cand = np.asarray(jax.random.choice(k_cand, 40, (10,), replace=False))
  assert float(stats["ledger/probe_tokens"]) == float(
      np.sum(np.asarray(pool.prompt_lens)[cand]) + np.sum(np.asarray(pool.answer_lens)[cand]))


def test_probe_is_the_oracle_on_factor_times_n_candidates():
  """selection.mode="probe": the same candidates, pass rates and picks as the oracle with
  probe_factor x n candidates (what the benchmark measured as X with oracle_candidates)."""
  pool = _pool(np.random.default_rng(2), 40)
  graphdef, params = init_params(CFG, 0)
  state = _state(params)

  def choose(**sel):
    cfg = train.StepConfig(
        prompts_per_step=3, group_size=4, advantage="grpo", num_updates=1, num_minibatches=1,
        loss=LossConfig(), sampling=SamplingParams(max_new_tokens=4),
        selection=selection.SelectionConfig(**sel))
    return train.oracle_choose(state, pool, jax.random.key(5), 3, graphdef=graphdef, cfg=cfg)

  ids, stats = choose(mode="probe", probe_factor=4)
  want_ids, want = choose(mode="oracle", oracle_candidates=12)
  np.testing.assert_array_equal(ids, want_ids)
  assert float(stats["ledger/probe_tokens"]) == float(want["ledger/probe_tokens"])
  _, whole = choose(mode="oracle", oracle_candidates=0)
  assert float(stats["ledger/probe_tokens"]) < float(whole["ledger/probe_tokens"])
  _, capped = choose(mode="probe", probe_factor=100)  # more than the pool: the whole pool
  assert float(capped["ledger/probe_tokens"]) == float(whole["ledger/probe_tokens"])
  with pytest.raises(ValueError, match="probe_factor=0"):
    selection.SelectionConfig(mode="probe", probe_factor=0)


def test_oracle_needs_an_exact_match_task():
  with pytest.raises(ValueError, match="exact-match task"):
    train.StepConfig(prompts_per_step=2, group_size=4, advantage="grpo", num_updates=1,
                     num_minibatches=1, loss=LossConfig(),
                     sampling=SamplingParams(max_new_tokens=4),
                     selection=selection.SelectionConfig(mode="oracle"),
                     verifier=Verifier("final_answer", (5,)))
  with pytest.raises(ValueError, match="mode='probe' needs an exact-match task"):
    train.StepConfig(prompts_per_step=2, group_size=4, advantage="grpo", num_updates=1,
                     num_minibatches=1, loss=LossConfig(),
                     sampling=SamplingParams(max_new_tokens=4),
                     selection=selection.SelectionConfig(mode="probe"),
                     verifier=Verifier("final_answer", (5,)))
  with pytest.raises(ValueError, match="oracle_candidates"):
    selection.SelectionConfig(mode="oracle", oracle_candidates=-1)


@pytest.mark.parametrize("step", [20, 21])
def test_shadow_probe_sums_true_mixed_chances_of_the_excluded_prompts(step):
  """History mode: prompts 0-3 all-correct at their last visit (excluded), 4-5 all-wrong
  (down-weighted), the rest unvisited; the probe's sums against per-prompt reference pass
  rates. Off its schedule (step 21, every 10) it probes nothing."""
  rng = np.random.default_rng(2)
  pool = _pool(rng, 12)
  graphdef, params = init_params(CFG, 0)
  sc = selection.SelectionConfig(mode="history", history_cooldown=100, shadow_probe=12,
                                 shadow_every=10)
  cfg = train.StepConfig(
      prompts_per_step=3, group_size=4, advantage="grpo", num_updates=1, num_minibatches=1,
      loss=LossConfig(), sampling=SamplingParams(max_new_tokens=4), selection=sc,
      verifier=Verifier("exact_match"))
  sel = selection.SelectorState.init(12)
  sel = selection.update(sel, sc, jnp.arange(6), jnp.asarray([[1.] * 4] * 4 + [[0.] * 4] * 2),
                         step=15)
  state = _state(params, selector=sel, step=step)
  stats = train.shadow_probe(state, pool, jax.random.key(4), graphdef=graphdef, cfg=cfg)
  p = np.asarray([_reference_pass_rate(
      graphdef, params, np.asarray(pool.prompts[i, 5 - int(pool.prompt_lens[i]):]),
      np.asarray(pool.answers[i, :int(pool.answer_lens[i])]), 1.0) for i in range(12)])
  mixed = 1 - p ** 4 - (1 - p) ** 4
  if step % 10:
    assert all(float(v) == 0.0 for v in stats.values())
    return
  assert float(stats["select/shadow_probed"]) == 12
  assert float(stats["select/shadow_excluded"]) == 4 and float(stats["select/shadow_down"]) == 2
  np.testing.assert_allclose(float(stats["select/shadow_excluded_mixed_sum"]), mixed[:4].sum(),
                             rtol=2e-3, atol=1e-6)
  np.testing.assert_allclose(float(stats["select/shadow_down_mixed_sum"]), mixed[4:6].sum(),
                             rtol=2e-3, atol=1e-6)
  np.testing.assert_allclose(float(stats["select/shadow_mixed_sum"]), mixed.sum(), rtol=2e-3)
  assert float(stats["ledger/shadow_probe_tokens"]) == float(
      np.sum(pool.prompt_lens) + np.sum(pool.answer_lens))


def test_shadow_probe_sees_the_skip_rules_own_keep_draws():
  """Skip mode: the excluded count equals the prompts selection.choose's weights dropped with
  the same key (streaks 0-3 over a 40-prompt pool, every one probed)."""
  pool = _pool(np.random.default_rng(3), 40)
  graphdef, params = init_params(CFG, 0)
  sc = selection.SelectionConfig(mode="skip", skip_keep_base=0.5, shadow_probe=40)
  cfg = train.StepConfig(
      prompts_per_step=2, group_size=4, advantage="grpo", num_updates=1, num_minibatches=1,
      loss=LossConfig(), sampling=SamplingParams(max_new_tokens=4), selection=sc,
      verifier=Verifier("exact_match"))
  sel = selection.SelectorState.init(40).replace(
      zero_var_streak=jnp.asarray(np.arange(40) % 4, jnp.int32))
  state = _state(params, selector=sel)
  key = jax.random.key(7)
  stats = train.shadow_probe(state, pool, key, graphdef=graphdef, cfg=cfg)
  w = np.asarray(selection.weights(sel, sc, 0, jax.random.split(key)[0]))
  assert float(stats["select/shadow_excluded"]) == float((w == 0).sum()) > 0
  assert float(stats["select/shadow_down"]) == 0


def test_shadow_probe_needs_history_or_skip_and_an_exact_match_task():
  with pytest.raises(ValueError, match="shadow_probe=8 with mode 'band'"):
    selection.SelectionConfig(mode="band", shadow_probe=8)
  with pytest.raises(ValueError, match="shadow_probe=8 needs an exact-match task"):
    train.StepConfig(prompts_per_step=2, group_size=4, advantage="grpo", num_updates=1,
                     num_minibatches=1, loss=LossConfig(),
                     sampling=SamplingParams(max_new_tokens=4),
                     selection=selection.SelectionConfig(mode="skip", shadow_probe=8),
                     verifier=Verifier("final_answer", (5,)))


def _with_references(pool, rng, n_refs=3, width=6):
  """The pool with random probe references: per prompt n_refs completions ending in EOS (3),
  the last one absent (length 0) for every other prompt."""
  n = pool.size
  refs = np.zeros((n, n_refs, width), np.int32)
  lens = rng.integers(2, width + 1, (n, n_refs)).astype(np.int32)
  lens[::2, -1] = 0
  for i in range(n):
    for r in range(n_refs):
      if lens[i, r]:
        refs[i, r, :lens[i, r] - 1] = rng.integers(4, CFG.vocab_size, lens[i, r] - 1)
        refs[i, r, lens[i, r] - 1] = 3
  return pool.replace(references=jnp.asarray(refs), reference_lens=jnp.asarray(lens))


def _reference_probs(pool, i, graphdef, params, temperature):
  """Prompt i's present references: (unpadded prompt, their lengths, their probabilities)."""
  prompt = np.asarray(pool.prompts[i, pool.prompts.shape[1] - int(pool.prompt_lens[i]):])
  lens = [int(n) for n in np.asarray(pool.reference_lens[i]) if n]
  probs = [_reference_pass_rate(graphdef, params, prompt, np.asarray(pool.references[i, r, :n]),
                                temperature) for r, n in enumerate(lens)]
  return prompt, lens, probs


def test_probe_references_sum_their_probabilities_and_count_their_tokens():
  """A task whose reward accepts several completions (TaskDef.probe_references): the pass
  rate is the sum of the references' probabilities, each from an unpadded forward in numpy;
  an absent reference adds nothing, and the probe counts prompt + reference per reference."""
  rng = np.random.default_rng(7)
  pool = _with_references(_pool(rng, 10), rng)
  graphdef, params = init_params(CFG, 0)
  state = _state(params)
  cfg = train.StepConfig(
      prompts_per_step=2, group_size=4, advantage="grpo", num_updates=1, num_minibatches=1,
      loss=LossConfig(), sampling=SamplingParams(max_new_tokens=6, temperature=0.8),
      selection=selection.SelectionConfig(mode="oracle", oracle_candidates=0),
      verifier=Verifier("final_answer", (5,)), probe_references=True)
  got = train.true_pass_rate(state, pool, jnp.arange(10), graphdef=graphdef, cfg=cfg)
  want, tokens = [], 0
  for i in range(10):
    prompt, lens, probs = _reference_probs(pool, i, graphdef, params, 0.8)
    want.append(sum(probs))
    tokens += sum(len(prompt) + n for n in lens)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-3, atol=1e-7)
  _, stats = train.oracle_choose(state, pool, jax.random.key(0), 2, graphdef=graphdef, cfg=cfg)
  assert float(stats["ledger/probe_tokens"]) == tokens


def test_expected_length_and_the_per_token_pick_match_numpy():
  """probe_score="mixed_per_token": each candidate's expected completion length is its
  references' lengths weighted by their probabilities (numpy, unpadded forwards), the answer's
  length on an exact-match task; the pick ranks mixed-group chance / that length."""
  rng = np.random.default_rng(8)
  pool = _with_references(_pool(rng, 10), rng)
  graphdef, params = init_params(CFG, 0)
  state = _state(params)
  cfg = train.StepConfig(
      prompts_per_step=3, group_size=4, advantage="grpo", num_updates=1, num_minibatches=1,
      loss=LossConfig(), sampling=SamplingParams(max_new_tokens=6),
      selection=selection.SelectionConfig(mode="probe", probe_factor=4,
                                          probe_score="mixed_per_token"),
      verifier=Verifier("final_answer", (5,)), probe_references=True)
  p, length = train.true_pass_rate(state, pool, jnp.arange(10), graphdef=graphdef, cfg=cfg,
                                   with_length=True)
  want_p, want_len = [], []
  for i in range(10):
    _, lens, probs = _reference_probs(pool, i, graphdef, params, 1.0)
    want_p.append(sum(probs))
    want_len.append(np.dot(probs, lens) / sum(probs))
  np.testing.assert_allclose(np.asarray(p), want_p, rtol=2e-3, atol=1e-7)
  np.testing.assert_allclose(np.asarray(length), want_len, rtol=2e-3)
  # The pick: mixed chance per token against numpy, on hand-set rates where it differs from
  # the plain rank (the likeliest mixed group is the longest).
  rates = np.asarray([0.5, 0.45, 0.3, 0.1, 0.9], np.float32)
  lens = np.asarray([200., 60., 50., 20., 40.], np.float32)
  cand = np.arange(20, 25, dtype=np.int32)
  got = selection.oracle_pick(jnp.asarray(rates), jnp.asarray(cand), 2, 8, jax.random.key(0),
                              jnp.asarray(lens))
  mixed = 1 - rates ** 8 - (1 - rates) ** 8
  assert sorted(np.asarray(got).tolist()) == sorted(cand[np.argsort(-mixed / lens)[:2]].tolist())
  assert 20 in np.asarray(selection.oracle_pick(jnp.asarray(rates), jnp.asarray(cand), 1, 8,
                                                jax.random.key(0)))
  ids, stats = train.oracle_choose(state, pool, jax.random.key(2), 3, graphdef=graphdef, cfg=cfg)
  k_cand, _ = jax.random.split(jax.random.key(2))
  cand = np.asarray(jax.random.choice(k_cand, 10, (10,), replace=False))
  score = (1 - np.asarray(want_p) ** 4 - (1 - np.asarray(want_p)) ** 4) / np.asarray(want_len)
  assert sorted(np.asarray(ids).tolist()) == sorted(cand[np.argsort(-score[cand])[:3]].tolist())
  np.testing.assert_allclose(float(stats["select/oracle_expected_len"]),
                             np.asarray(want_len)[np.asarray(ids)].mean(), rtol=2e-3)
  # Exact match: the answer's length.
  plain = _pool(np.random.default_rng(9), 6)
  _, length = train.true_pass_rate(state, plain, jnp.arange(6), graphdef=graphdef,
                                   cfg=dataclasses.replace(cfg, verifier=Verifier("exact_match"),
                                                           probe_references=False),
                                   with_length=True)
  np.testing.assert_array_equal(np.asarray(length), np.asarray(plain.answer_lens, np.float32))
  with pytest.raises(ValueError, match="probe_score='mixed_per_token' with mode 'band'"):
    selection.SelectionConfig(mode="band", probe_score="mixed_per_token")
  with pytest.raises(ValueError, match="probe_score='tokens'"):
    selection.SelectionConfig(mode="probe", probe_score="tokens")


def test_a_final_answer_task_is_probed_only_with_references():
  kw = dict(prompts_per_step=2, group_size=4, advantage="grpo", num_updates=1,
            num_minibatches=1, loss=LossConfig(), sampling=SamplingParams(max_new_tokens=4),
            verifier=Verifier("final_answer", (5,)))
  for sel in (selection.SelectionConfig(mode="probe"),
              selection.SelectionConfig(mode="history", shadow_probe=4)):
    with pytest.raises(ValueError, match="names none"):
      train.StepConfig(selection=sel, **kw)
    assert train.StepConfig(selection=sel, probe_references=True, **kw).probe_references
