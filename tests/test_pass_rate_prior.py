"""experiments/benchmarks/pass_rate_prior.py: the logistic fit, the prefill features and the
scoring."""

import jax
import jax.numpy as jnp
import numpy as np

from rlx.experiments.benchmarks import pass_rate_prior as prior
from rlx.model import ModelConfig, init_params, transformer

CFG = ModelConfig(vocab_size=23, num_layers=2, d_model=16, num_heads=2, num_kv_heads=1,
                  head_dim=8, mlp_dim=32)


def test_logistic_fit_is_the_binomial_maximum_likelihood():
  rng = np.random.default_rng(0)
  # Intercept only: the maximum-likelihood probability is sum k / sum n, in closed form.
  n = rng.integers(4, 20, 300).astype(float)
  k = rng.binomial(n.astype(int), 0.3).astype(float)
  w = prior.fit_logistic(np.ones((300, 1)), k, n, l2=0.0)
  np.testing.assert_allclose(1 / (1 + np.exp(-w[0])), k.sum() / n.sum(), rtol=1e-9)
  # With features: recovers the generating weights from many samples, and the penalised
  # log-likelihood's gradient vanishes at the fit.
  x = np.concatenate([np.ones((4000, 1)), rng.normal(size=(4000, 2))], 1)
  w_true = np.array([-0.5, 1.2, -0.8])
  n = np.full(4000, 40.0)
  k = rng.binomial(40, 1 / (1 + np.exp(-(x @ w_true)))).astype(float)
  w = prior.fit_logistic(x, k, n, l2=1e-2)
  np.testing.assert_allclose(w, w_true, atol=0.05)
  p = 1 / (1 + np.exp(-(x @ w)))
  np.testing.assert_allclose(x.T @ (n * p - k) + 1e-2 * w, 0.0, atol=1e-6)


def test_prefill_features_ignore_left_padding():
  graphdef, params = init_params(CFG, 0)
  rng = np.random.default_rng(1)
  lens = np.array([5, 3, 7], np.int32)
  width = 7
  prompts = np.zeros((3, width), np.int32)
  rows = [rng.integers(4, CFG.vocab_size, n) for n in lens]
  for i, r in enumerate(rows):
    prompts[i, width - len(r):] = r
  ent, logtop, nll = prior.prefill_features(graphdef, params, jnp.asarray(prompts),
                                            jnp.asarray(lens), 0.7)
  for i, r in enumerate(rows):  # each prompt alone, unpadded, in plain numpy
    logits, _ = transformer.apply(graphdef, params, jnp.asarray(r)[None],
                                  jnp.arange(len(r))[None])
    logits = np.asarray(logits[0], np.float64)
    z = logits[-1] / 0.7
    lp = z - np.log(np.exp(z - z.max()).sum()) - z.max()
    np.testing.assert_allclose(ent[i], -(np.exp(lp) * lp).sum(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(logtop[i], lp.max(), rtol=1e-4, atol=1e-5)
    full = logits[:-1] - np.log(np.exp(logits[:-1]).sum(-1, keepdims=True))
    want = -np.mean(full[np.arange(len(r) - 1), r[1:]])
    np.testing.assert_allclose(nll[i], want, rtol=1e-4, atol=1e-5)


def _data(rng, n_prompts, rate_of_bucket, feature_noise):
  bucket = rng.integers(0, len(rate_of_bucket), n_prompts)
  p = np.asarray(rate_of_bucket)[bucket]
  r = rng.random((n_prompts, 16)) < p[:, None]
  return {"k": r.sum(1).astype(float), "n": np.full(n_prompts, 16.0),
          "first": r.astype(float), "bucket": bucket,
          "len": rng.normal(size=n_prompts) if feature_noise else p,
          "entropy": rng.normal(size=n_prompts), "log_top": rng.normal(size=n_prompts),
          "nll": rng.normal(size=n_prompts)}


def test_scores_when_the_bucket_is_the_whole_story():
  r = prior.evaluate(_data(np.random.default_rng(2), 800, [0.02, 0.5, 0.98], True),
                     np.random.default_rng(3), splits=5, g=8, keep_frac=0.25)
  mse = {m: v[0] for m, v in r["mse"].items()}
  # The bucket's rate leaves only the binomial noise of 12 held-out samples; flat 0.5 and
  # noise features explain nothing.
  assert mse["bucket"] < 1.3 * r["noise"]
  assert 1 - mse["bucket"] / r["var"] > 0.8
  assert 1 - mse["features"] / r["var"] < 0.05
  chosen = {m: v[0] for m, v in r["chosen"].items()}
  # Selection by the bucket picks the p = 0.5 prompts: as good as the oracle.
  assert chosen["bucket"] > chosen["random"] + 0.3
  assert abs(chosen["bucket"] - chosen["oracle"]) < 0.05


def test_the_spread_aware_bucket_score_sees_a_buckets_spread():
  rng = np.random.default_rng(4)
  d = _data(rng, 1200, [0.35, 0.02], True)
  # Bucket 1: half its prompts at 0.02, half at 0.98: mean 0.5, nearer 0.5 than bucket 0's
  # 0.35, but its groups are almost never mixed.
  ones = np.flatnonzero(d["bucket"] == 1)[::2]
  r = d["first"].copy()
  r[ones] = rng.random((len(ones), 16)) < 0.98
  d.update(first=r, k=r.sum(1))
  out = prior.evaluate(d, np.random.default_rng(5), splits=5, g=8, keep_frac=0.25)
  chosen = {m: v[0] for m, v in out["chosen"].items()}
  # Spread-aware picks bucket 0 (the oracle also picks within it: the highest p^ there).
  assert chosen["bucket, spread-aware"] > chosen["oracle"] - 0.1
  assert chosen["bucket"] < 0.3  # the mean alone prefers bucket 1


def test_the_teacher_forced_probe_is_scored_beside_the_others():
  """With each prompt's true pass rate as the teacher-forced probe (what it is on an
  exact-match task), its error is the held-out samples' binomial noise and it selects like
  the oracle, while the bucket cannot see a bucket split between 0.02 and 0.98; a run without
  the probe (NaN: a task it cannot read) leaves it out of the table."""
  rng = np.random.default_rng(6)
  d = _data(rng, 1200, [0.5, 0.5], True)
  p = np.where(rng.random(1200) < 0.5, 0.02, 0.5)
  r = rng.random((1200, 16)) < p[:, None]
  d.update(first=r.astype(float), k=r.sum(1).astype(float), tf_probe=p)
  out = prior.evaluate(d, np.random.default_rng(7), splits=5, g=8, keep_frac=0.25)
  mse = {m: v[0] for m, v in out["mse"].items()}
  chosen = {m: v[0] for m, v in out["chosen"].items()}
  assert mse["teacher-forced probe"] < 1.3 * out["noise"] < mse["bucket"]
  assert abs(chosen["teacher-forced probe"] - chosen["oracle"]) < 0.05
  assert chosen["teacher-forced probe"] > chosen["bucket"] + 0.2
  assert out["by_bucket"][0][3] == np.mean(p[d["bucket"] == 0])
  d["tf_probe"] = np.full(1200, np.nan)
  assert "teacher-forced probe" not in prior.evaluate(
      d, np.random.default_rng(7), splits=2, g=8, keep_frac=0.25)["mse"]
