"""The dense reference sampler and the token-sampling helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.model import ModelConfig, apply, init_params
from rlx.sampler import dense
from rlx.sampler.sampling import SamplingParams, filter_logits, top_p_threshold

CFG = ModelConfig(vocab_size=23, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=48)
EOS = 3


def _prompts(b=6, p=7, seed=0):
  rng = np.random.default_rng(seed)
  lens = rng.integers(2, p + 1, b).astype(np.int32)
  prompts = np.zeros((b, p), np.int32)
  for i, l in enumerate(lens):
    prompts[i, p - l:] = rng.integers(4, CFG.vocab_size, l)
  return jnp.asarray(prompts), jnp.asarray(lens)


def _naive_greedy(g, params, prompts, lens, steps):
  """No cache: re-run the whole sequence each step and take the argmax (the oracle).

  Sequences are right-padded to a fixed width (causal attention: padding after a token
  cannot change its logits), so the forward compiles once.
  """
  width = prompts.shape[1] + steps
  forward = jax.jit(lambda t: apply(g, params, t, jnp.arange(width)[None])[0])
  out = []
  for i in range(prompts.shape[0]):
    seq = list(np.asarray(prompts[i, prompts.shape[1] - int(lens[i]):]))
    gen = []
    for _ in range(steps):
      padded = np.zeros((1, width), np.int32)
      padded[0, :len(seq)] = seq
      logits = forward(jnp.asarray(padded))
      tok = int(jnp.argmax(logits[0, len(seq) - 1]))
      gen.append(tok)
      seq.append(tok)
      if tok == EOS:
        break
    out.append(gen)
  return out


def test_greedy_matches_uncached_oracle():
  g, params = init_params(CFG, 0)
  prompts, lens = _prompts()
  sp = SamplingParams(max_new_tokens=6, temperature=0.0, eos_id=EOS)
  ro = dense.generate(g, params, prompts, lens, jax.random.split(jax.random.key(0), 6),
                      params_cfg=sp)
  oracle = _naive_greedy(g, params, prompts, lens, 6)
  for i, want in enumerate(oracle):
    n = int(ro.lengths[i])
    assert list(np.asarray(ro.tokens[i, :n])) == want
    assert bool(ro.truncated[i]) == (want[-1] != EOS)
    assert np.all(np.asarray(ro.tokens[i, n:]) == sp.pad_id)


def test_stops_at_eos_and_reports_lengths():
  g, params = init_params(CFG, 0)
  prompts, lens = _prompts()
  stop_ids = (7, 8, 9, 10)  # several stop tokens, so some sequences stop early
  sp = SamplingParams(max_new_tokens=5, temperature=1.0, eos_id=EOS, stop_ids=stop_ids)
  ro = dense.generate(g, params, prompts, lens, jax.random.split(jax.random.key(1), 6),
                      params_cfg=sp)
  toks = np.asarray(ro.tokens)
  assert (np.asarray(ro.lengths) < 5).any()
  for i in range(6):
    n = int(ro.lengths[i])
    stops = [k for k, t in enumerate(toks[i, :n]) if t in (EOS,) + stop_ids]
    if stops:
      assert stops == [n - 1] and not ro.truncated[i]
    else:
      assert n == 5 and ro.truncated[i]
    assert np.all(np.asarray(ro.logprobs[i, n:]) == 0)


def test_results_do_not_depend_on_batch_position():
  g, params = init_params(CFG, 0)
  prompts, lens = _prompts(b=8, seed=3)
  keys = jax.random.split(jax.random.key(7), 8)
  sp = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=10, top_p=0.9, eos_id=EOS)
  a = dense.generate(g, params, prompts, lens, keys, params_cfg=sp)
  perm = np.array([5, 2, 7, 0, 1, 6, 3, 4])
  b = dense.generate(g, params, prompts[perm], lens[perm], keys[perm], params_cfg=sp)
  np.testing.assert_array_equal(np.asarray(a.tokens)[perm], b.tokens)
  np.testing.assert_allclose(np.asarray(a.logprobs)[perm], b.logprobs, atol=1e-6)
  # Half the batch, alone: same draws again.
  c = dense.generate(g, params, prompts[:4], lens[:4], keys[:4], params_cfg=sp)
  np.testing.assert_array_equal(np.asarray(a.tokens)[:4], c.tokens)


def test_top_p_threshold_matches_sort_reference():
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 2, (64, 50)).astype(np.float32)
  probs = jax.nn.softmax(jnp.asarray(logits), -1)
  for top_p in (0.1, 0.5, 0.9, 0.99):
    tau = np.asarray(top_p_threshold(probs, top_p))
    p = np.asarray(probs)
    for row in range(64):
      order = np.sort(p[row])[::-1]
      k = int(np.searchsorted(np.cumsum(order), top_p - 1e-7) + 1)  # smallest nucleus
      kept = p[row] >= tau[row]
      assert kept.sum() == k, (top_p, row)


def test_filter_logits_top_k_and_top_p():
  logits = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]]))
  np.testing.assert_array_equal(np.isfinite(filter_logits(logits, 2, 1.0))[0],
                                [True, True, False, False, False])
  np.testing.assert_array_equal(np.isfinite(filter_logits(logits, 0, 0.8))[0],
                                [True, True, True, False, False])
  np.testing.assert_array_equal(np.isfinite(filter_logits(logits, 2, 0.6))[0],
                                [True, False, False, False, False])


def test_sampling_frequencies_follow_the_policy():
  logits = jnp.log(jnp.asarray([0.6, 0.3, 0.1]))[None].repeat(4000, 0)
  from rlx.sampler.sampling import sample_tokens
  keys = jax.random.split(jax.random.key(0), 4000)
  tok, logp = sample_tokens(logits, keys, SamplingParams(max_new_tokens=1))
  freq = np.bincount(np.asarray(tok), minlength=3) / 4000
  np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.03)
  np.testing.assert_allclose(np.exp(np.asarray(logp)), np.array([0.6, 0.3, 0.1])[np.asarray(tok)],
                             rtol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ({"max_new_tokens": 4, "temperature": -1.0}, "temperature=-1.0"),
    ({"max_new_tokens": 4, "top_p": 0.0}, "top_p=0.0"),
    ({"max_new_tokens": 4, "top_k": -2}, "top_k=-2"),
])
def test_bad_sampling_params(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**kwargs)
