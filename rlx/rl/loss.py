"""The policy-gradient loss: GRPO / Dr.GRPO / DAPO / decoupled PPO in one function.

Per response token t of sequence i (mask m_it), with pi the current policy, pi_old the policy
at the start of this batch's updates (the "proximal" policy) and mu the behaviour policy that
sampled the token (its log-prob stored by the sampler or the replay ring):

  r_it   = pi(y_it) / pi_old(y_it)
  pg_it  = -min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)
           PPO clipping (Schulman et al. 2017, arXiv 1707.06347) with DAPO's decoupled
           "clip-higher" eps_high > eps_low (Yu et al. 2025, arXiv 2503.14476).
  w_it   = pi_old(y_it) / mu(y_it), stop-gradient, either truncated at C ("truncate",
           truncated importance sampling) or zeroed above C ("mask") -- the decoupled PPO
           objective of AReaL (Fu et al. 2025, arXiv 2505.24298), which keeps the trust region
           around pi_old while correcting for data that a stale policy mu generated.
  kl_it  = KL(pi || pi_ref) estimated per token (Schulman's k1/k2/k3,
           http://joschu.net/blog/kl-approx.html), only when kl_coef > 0:
             k1 = log pi - log pi_ref,  k2 = (log pi - log pi_ref)^2 / 2,
             k3 = exp(log pi_ref - log pi) - 1 - (log pi_ref - log pi).
  l_it   = w_it * pg_it + kl_coef * kl_it

Aggregation over the batch (B sequences, T response slots):
  token_mean               sum_it l m / sum_it m         (DAPO token-level loss)
  seq_mean_token_mean      mean_i (sum_t l m / sum_t m)  (GRPO as published)
  seq_mean_token_sum_norm  sum_it l m / (B * T)          (Dr. GRPO, arXiv 2503.20783:
                                                          constant normaliser, no length bias)

`anchor="behaviour"` instead uses the stored behaviour log-probs as pi_old (standard
off-policy PPO-clip, no separate correction, w = 1): the trust region is then around the
policy that generated the data, which bounds how far replayed samples can push the policy.

Optionally `ratio_level="sequence"` uses GSPO's sequence ratio (Zheng et al. 2025,
arXiv 2507.18071): s_i = exp(mean_t log r_it), applied to every token of sequence i.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rlx.errors import ConfigError

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_MODES = ("truncate", "mask")
ANCHORS = ("proximal", "behaviour")
RATIO_LEVELS = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  eps_low: float = 0.2
  eps_high: float = 0.28
  aggregation: str = "token_mean"
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  is_cap: float = 2.0  # C
  is_mode: str = "truncate"
  ratio_level: str = "token"
  anchor: str = "proximal"  # pi_old: recomputed proximal policy, or the behaviour policy

  def __post_init__(self):
    def need(ok, msg):
      if not ok:
        raise ValueError(msg)
    need(self.aggregation in AGGREGATIONS,
         f"loss aggregation {self.aggregation!r}; expected one of {AGGREGATIONS}.")
    need(self.kl_estimator in KL_ESTIMATORS,
         f"kl_estimator {self.kl_estimator!r}; expected one of {KL_ESTIMATORS}.")
    need(self.is_mode in IS_MODES, f"is_mode {self.is_mode!r}; expected one of {IS_MODES}.")
    need(self.anchor in ANCHORS, f"anchor {self.anchor!r}; expected one of {ANCHORS}.")
    need(self.ratio_level in RATIO_LEVELS,
         f"ratio_level {self.ratio_level!r}; expected one of {RATIO_LEVELS}.")
    need(self.eps_low >= 0 and self.eps_high >= 0,
         f"clip epsilons must be >= 0, got eps_low={self.eps_low}, eps_high={self.eps_high}.")
    need(self.is_cap > 0, f"is_cap={self.is_cap}; expected > 0.")
    need(self.kl_coef >= 0, f"kl_coef={self.kl_coef}; expected >= 0.")

  @classmethod
  def from_config(cls, config) -> LossConfig:
    """The loss keys of config.rl, checked (one ConfigError)."""
    rl = config.rl
    try:
      return cls(**{f.name: rl[f.name] for f in dataclasses.fields(cls)})
    except ValueError as e:
      raise ConfigError(f"config.rl: {e}") from None


def kl_estimate(logp, ref_logp, estimator: str):
  log_ratio = ref_logp - logp  # log(pi_ref / pi)
  if estimator == "k1":
    return -log_ratio
  if estimator == "k2":
    return 0.5 * log_ratio ** 2
  return jnp.exp(log_ratio) - 1.0 - log_ratio


def importance_weights(old_logp, behaviour_logp, cap: float, mode: str):
  """Returns (w, capped): w = pi_old / mu truncated at cap, or zeroed above cap."""
  raw = jnp.exp(old_logp - behaviour_logp)
  capped = raw > cap
  if mode == "truncate":
    w = jnp.minimum(raw, cap)
  else:
    w = jnp.where(capped, 0.0, raw)
  return jax.lax.stop_gradient(w), capped


def aggregate(per_token_BxT, mask_BxT, mode: str, norm_len: int | None = None,
              norm_rows: int | None = None, norm_tokens=None):
  """norm_len / norm_rows / norm_tokens: the batch the mean is over when the update computes
  on part of it (fewer columns: max_new_tokens; rows whose terms are all zero left out: the
  full row and token counts). Defaults: the array's own T, rows and mask."""
  m = mask_BxT.astype(jnp.float32)
  x = per_token_BxT * m
  rows = norm_rows or per_token_BxT.shape[0]
  if mode == "token_mean":
    return x.sum() / jnp.maximum(m.sum() if norm_tokens is None else norm_tokens, 1.0)
  if mode == "seq_mean_token_mean":
    return (x.sum(axis=1) / jnp.maximum(m.sum(axis=1), 1.0)).sum() / rows
  return x.sum() / (rows * (norm_len or per_token_BxT.shape[1]))


def policy_loss(logp_BxT, old_logp_BxT, behaviour_logp_BxT, advantages_B, mask_BxT,
                cfg: LossConfig, ref_logp_BxT=None, *, norm_len: int | None = None,
                norm_rows: int | None = None, norm_tokens=None):
  """Returns (loss scalar, metrics dict). All log-probs f32; mask bool/float [B, T]."""
  mask = mask_BxT.astype(jnp.float32)
  old_logp_BxT = jax.lax.stop_gradient(old_logp_BxT)
  log_ratio = logp_BxT - old_logp_BxT
  if cfg.ratio_level == "sequence":
    seq_log_ratio = (log_ratio * mask).sum(1) / jnp.maximum(mask.sum(1), 1.0)
    # s_i forward, d s_i / d logp_it = s_i / |y_i| backward (GSPO's token-wise form).
    log_ratio = jax.lax.stop_gradient(seq_log_ratio)[:, None] + logp_BxT - jax.lax.stop_gradient(
        logp_BxT)
  ratio = jnp.exp(log_ratio)
  adv = advantages_B[:, None].astype(jnp.float32)
  clipped_ratio = jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
  pg_unclipped = -ratio * adv
  pg_clipped = -clipped_ratio * adv
  pg = jnp.maximum(pg_unclipped, pg_clipped)
  w, capped = importance_weights(old_logp_BxT, behaviour_logp_BxT, cfg.is_cap, cfg.is_mode)
  per_token = w * pg
  kl = None
  if cfg.kl_coef > 0:
    if ref_logp_BxT is None:
      raise ValueError("kl_coef > 0 needs reference log-probs (ref_logp_BxT).")
    kl = kl_estimate(logp_BxT, jax.lax.stop_gradient(ref_logp_BxT), cfg.kl_estimator)
    per_token = per_token + cfg.kl_coef * kl
  loss = aggregate(per_token, mask, cfg.aggregation, norm_len, norm_rows, norm_tokens)

  n = jnp.maximum(mask.sum(), 1.0)
  mean = lambda x: (x * mask).sum() / n
  metrics = {
      "loss/policy": loss,
      "loss/clip_frac": mean((pg_clipped > pg_unclipped).astype(jnp.float32)),
      "loss/ratio_mean": mean(ratio),
      "loss/approx_kl_old": mean(0.5 * log_ratio ** 2),
      "loss/is_weight_mean": mean(w),
      "loss/is_capped_frac": mean(capped.astype(jnp.float32)),
  }
  if kl is not None:
    metrics["loss/kl_ref"] = mean(kl)
  return loss, metrics
