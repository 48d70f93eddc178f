"""The policy loss against hand-written numpy for every mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.rl.loss import LossConfig, policy_loss

RNG = np.random.default_rng(0)
B, T = 3, 5
LOGP = RNG.normal(-1.0, 0.5, (B, T)).astype(np.float32)
OLD = (LOGP + RNG.normal(0, 0.5, (B, T))).astype(np.float32)
MU = (OLD + RNG.normal(0, 0.8, (B, T))).astype(np.float32)
REF = (LOGP + RNG.normal(0, 0.2, (B, T))).astype(np.float32)
ADV = np.array([1.5, -0.7, 0.3], np.float32)
MASK = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], bool)


def numpy_loss(cfg: LossConfig, logp=LOGP):
  ratio = np.exp(logp - OLD)
  a = ADV[:, None]
  pg = np.maximum(-ratio * a, -np.clip(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high) * a)
  raw_w = np.exp(OLD - MU)
  w = np.minimum(raw_w, cfg.is_cap) if cfg.is_mode == "truncate" else np.where(
      raw_w > cfg.is_cap, 0.0, raw_w)
  per_tok = w * pg
  if cfg.kl_coef > 0:
    lr = REF - logp
    kl = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": np.exp(lr) - 1 - lr}[cfg.kl_estimator]
    per_tok = per_tok + cfg.kl_coef * kl
  m = MASK.astype(np.float64)
  if cfg.aggregation == "token_mean":
    return (per_tok * m).sum() / m.sum()
  if cfg.aggregation == "seq_mean_token_mean":
    return np.mean((per_tok * m).sum(1) / m.sum(1))
  return (per_tok * m).sum() / (B * T)


CASES = [
    LossConfig(),
    LossConfig(eps_low=0.2, eps_high=0.2),
    LossConfig(eps_low=0.1, eps_high=0.5),  # clip-higher, asymmetric
    LossConfig(aggregation="seq_mean_token_mean"),
    LossConfig(aggregation="seq_mean_token_sum_norm"),
    LossConfig(is_cap=1.2),  # the capped correction binds on some tokens
    LossConfig(is_cap=1.2, is_mode="mask"),
    LossConfig(kl_coef=0.1, kl_estimator="k1"),
    LossConfig(kl_coef=0.1, kl_estimator="k2"),
    LossConfig(kl_coef=0.1, kl_estimator="k3"),
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.aggregation}-{c.eps_low}-{c.eps_high}"
                         f"-{c.is_mode}{c.is_cap}-kl{c.kl_coef}{c.kl_estimator}")
def test_loss_matches_numpy(cfg):
  loss, metrics = policy_loss(jnp.asarray(LOGP), OLD, MU, ADV, MASK, cfg, REF)
  np.testing.assert_allclose(float(loss), numpy_loss(cfg), rtol=1e-5, atol=1e-6)
  # The cases must exercise what they name.
  raw_w = np.exp(OLD - MU)[MASK]
  if cfg.is_cap == 1.2:
    assert (raw_w > 1.2).any() and (raw_w <= 1.2).any()
    np.testing.assert_allclose(float(metrics["loss/is_capped_frac"]), (raw_w > 1.2).mean(),
                               rtol=1e-6)


def test_clip_fraction_and_clip_higher_are_active():
  ratio = np.exp(LOGP - OLD)[MASK]
  assert (ratio > 1.28).any() and (ratio < 0.8).any()  # both clip sides are hit
  a = np.broadcast_to(ADV[:, None], LOGP.shape)[MASK]
  clipped = np.clip(ratio, 0.8, 1.28)
  expected = np.mean(-clipped * a > -ratio * a)
  _, metrics = policy_loss(LOGP, OLD, MU, ADV, MASK, LossConfig())
  np.testing.assert_allclose(float(metrics["loss/clip_frac"]), expected, rtol=1e-6)


def test_gradient_matches_numpy_finite_difference():
  cfg = LossConfig(kl_coef=0.05)
  grad = jax.grad(lambda lp: policy_loss(lp, OLD, MU, ADV, MASK, cfg, REF)[0])(
      jnp.asarray(LOGP, jnp.float32))
  eps = 1e-3
  num = np.zeros_like(LOGP, dtype=np.float64)
  base = LOGP.astype(np.float64)
  for i in range(B):
    for j in range(T):
      hi, lo = base.copy(), base.copy()
      hi[i, j] += eps
      lo[i, j] -= eps
      num[i, j] = (numpy_loss(cfg, hi) - numpy_loss(cfg, lo)) / (2 * eps)
  np.testing.assert_allclose(np.asarray(grad), num, atol=2e-3)
  assert np.all(np.asarray(grad)[~MASK] == 0)


def test_sequence_level_ratio_gspo():
  cfg = LossConfig(ratio_level="sequence")
  loss, _ = policy_loss(LOGP, OLD, MU, ADV, MASK, cfg)
  m = MASK.astype(np.float64)
  s = np.exp(((LOGP - OLD) * m).sum(1) / m.sum(1))[:, None]
  a = ADV[:, None]
  pg = np.maximum(-s * a, -np.clip(s, 0.8, 1.28) * a)
  w = np.minimum(np.exp(OLD - MU), 2.0)
  np.testing.assert_allclose(float(loss), (w * pg * m).sum() / m.sum(), rtol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    ({"aggregation": "mean"}, "loss aggregation 'mean'"),
    ({"kl_estimator": "k4"}, "kl_estimator 'k4'"),
    ({"is_mode": "clip"}, "is_mode 'clip'"),
    ({"eps_low": -0.1}, "clip epsilons must be >= 0"),
])
def test_bad_loss_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    LossConfig(**kwargs)


def test_behaviour_anchor_is_off_policy_ppo_clip():
  # anchor="behaviour" is applied by the trainer passing mu as pi_old: w = 1, ratio pi / mu.
  cfg = LossConfig(anchor="behaviour")
  loss, metrics = policy_loss(LOGP, MU, MU, ADV, MASK, cfg)
  ratio = np.exp(LOGP - MU)
  a = ADV[:, None]
  pg = np.maximum(-ratio * a, -np.clip(ratio, 0.8, 1.28) * a)
  m = MASK.astype(np.float64)
  np.testing.assert_allclose(float(loss), (pg * m).sum() / m.sum(), rtol=1e-5)
  assert float(metrics["loss/is_weight_mean"]) == 1.0
