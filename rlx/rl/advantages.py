"""Group-relative advantages for GRPO-family methods.

Rewards arrive group-major: the G samples of prompt i sit at rows i*G .. i*G+G-1.

  grpo     (Shao et al. 2024, arXiv 2402.03300): (r - mean_g) / (std_g + eps), std unbiased.
  dr_grpo  (Liu et al. 2025, arXiv 2503.20783): r - mean_g (no std normalisation).
  rloo     (Ahmadian et al. 2024, arXiv 2402.14740): r_i - mean_{j != i} r_j
           = G / (G - 1) * (r_i - mean_g).

Groups of unequal size (rlx.rl.adaptive): `valid` marks the rows sampled; each group's mean,
std and G are over its own sampled rows, and unsampled rows get advantage 0.
"""

from __future__ import annotations

import jax.numpy as jnp

MODES = ("grpo", "dr_grpo", "rloo")
# Modes whose baseline uses the other members of the group: meaningless for G = 1.
GROUP_MODES = MODES


def group_advantages(rewards_N, group_size: int, mode: str = "grpo", eps: float = 1e-6,
                     valid=None):
  """Returns (advantages f32[N], zero_variance bool[N // G] per group).

  valid: bool[N] rows sampled (None: all); a group then has sum(valid) members, and every
  group must keep its first member and at least two (rlx.rl.adaptive's layout).
  """
  if mode not in MODES:
    raise ValueError(f"advantage mode {mode!r}; expected one of {MODES}.")
  if group_size < 2:
    raise ValueError(f"group_size={group_size}: '{mode}' advantages compare samples within a "
                     f"group, so group_size must be >= 2.")
  if valid is not None:
    return _unequal_group_advantages(rewards_N, valid, group_size, mode, eps)
  r = rewards_N.astype(jnp.float32).reshape(-1, group_size)
  mean = r.mean(axis=1, keepdims=True)
  centered = r - mean
  # Exact equality, not |r - mean| < tol: the f32 mean of equal non-dyadic rewards (0.1, 2.2)
  # is off by an ulp, and grpo would divide that rounding error by a noise-sized std.
  zero_var = jnp.all(r == r[:, :1], axis=1)
  adv = jnp.where(zero_var[:, None], 0.0, _scaled(centered, group_size, mode, eps))
  return adv.reshape(-1), zero_var


def _scaled(centered, k, mode: str, eps: float):
  """The mode's advantage from rewards centred on their group mean (k: the group's size)."""
  if mode == "grpo":
    std = jnp.sqrt(jnp.sum(centered ** 2, axis=1, keepdims=True) / (k - 1))
    return centered / (std + eps)
  if mode == "dr_grpo":
    return centered
  return centered * (k / (k - 1))


def _unequal_group_advantages(rewards_N, valid_N, group_size: int, mode: str, eps: float):
  v = valid_N.reshape(-1, group_size)
  r = jnp.where(v, rewards_N.astype(jnp.float32).reshape(-1, group_size), 0.0)
  k = v.sum(axis=1, keepdims=True).astype(jnp.float32)  # this group's size
  mean = r.sum(axis=1, keepdims=True) / k
  centered = jnp.where(v, r - mean, 0.0)
  zero_var = jnp.all((r == r[:, :1]) | ~v, axis=1)
  adv = jnp.where(zero_var[:, None] | ~v, 0.0, _scaled(centered, k, mode, eps))
  return adv.reshape(-1), zero_var
