"""Length control: DAPO's overlong reward shaping and overlong filtering.

DAPO (Yu et al. 2025, arXiv 2503.14476), "soft overlong punishment": with L_max the maximum
response length and L_cache a buffer before it,
    R_len(L) = 0                                   if L <= L_max - L_cache
             = ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
             = -1                                  if L > L_max
scaled here by `overlong_penalty` and added to the task reward. Responses that hit L_max
without a stop token count as L > L_max (they were cut, their true length is longer).
"Overlong filtering" instead removes truncated responses from the loss.

Kimi k1.5 (Kimi Team 2025, arXiv 2501.12599, Sec. 2.3.3), a group-relative length reward that
acts at every length, not only near L_max: over the G responses to one prompt, with lengths
from min_len to max_len,
    lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len)      (0 when max_len == min_len)
    R_len(i) = lambda_i            if response i is correct (task reward > 0)
             = min(0, lambda_i)    otherwise
scaled by `length_reward` and added to the task reward: shorter correct answers gain up to
+0.5, longer ones lose up to -0.5, and a wrong answer is never rewarded for being short.
One change to the paper's formula: a group with no correct response gets no length term at
all. Group advantages are relative, so min(0, lambda) over an all-wrong group still ranks its
wrong answers by length and teaches the policy to give up early; with GRPO's std
normalisation that ranking is a full-strength signal whatever the coefficient. On the
column-addition task (experiments/reasoning.py) the verbatim formula collapsed the policy to
empty answers within 50 steps; with this change it shortened correct answers by ~45% while
accuracy rose.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LengthConfig:
  overlong_shaping: bool = False
  overlong_buffer: int = 4  # L_cache, in tokens
  overlong_penalty: float = 1.0
  overlong_filter: bool = False
  length_reward: float = 0.0  # Kimi k1.5 group length reward coefficient (0: off)

  def __post_init__(self):
    if not self.length_reward >= 0:
      raise ValueError(f"length length_reward={self.length_reward}; expected >= 0.")
    if self.overlong_buffer < 1:
      raise ValueError(f"length overlong_buffer={self.overlong_buffer}; expected >= 1.")
    if self.overlong_penalty < 0:
      raise ValueError(f"length overlong_penalty={self.overlong_penalty}; expected >= 0.")


def overlong_penalty(lengths_B, truncated_B, max_len: int, cfg: LengthConfig):
  """The (non-positive) shaping term per response."""
  start = max_len - cfg.overlong_buffer
  ramp = (start - lengths_B.astype(jnp.float32)) / cfg.overlong_buffer
  pen = jnp.where(lengths_B <= start, 0.0, jnp.maximum(ramp, -1.0))
  pen = jnp.where(truncated_B, -1.0, pen)
  return cfg.overlong_penalty * pen


def group_length_reward(lengths_B, correct_B, group_size: int, valid_B=None):
  """Kimi k1.5's length reward (unscaled) per response; groups are consecutive rows; 0 in
  groups without a correct response. valid_B: rows sampled (None: all; rlx.rl.adaptive),
  the others get 0 and do not count towards their group's shortest / longest."""
  lens = lengths_B.astype(jnp.float32).reshape(-1, group_size)
  ok = (correct_B > 0).reshape(-1, group_size)
  v = jnp.ones_like(ok) if valid_B is None else valid_B.reshape(-1, group_size)
  ok = ok & v
  lo = jnp.where(v, lens, jnp.inf).min(axis=1, keepdims=True)
  hi = jnp.where(v, lens, -jnp.inf).max(axis=1, keepdims=True)
  lam = jnp.where(hi > lo, 0.5 - (lens - lo) / jnp.maximum(hi - lo, 1.0), 0.0)
  out = jnp.where(ok, lam, jnp.minimum(lam, 0.0))
  return jnp.where(ok.any(axis=1, keepdims=True) & v, out, 0.0).reshape(-1)
