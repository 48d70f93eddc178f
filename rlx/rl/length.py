"""Length control: DAPO's overlong reward shaping and overlong filtering.

DAPO (Yu et al. 2025, arXiv 2503.14476), "soft overlong punishment": with L_max the maximum
response length and L_cache a buffer before it,
    R_len(L) = 0                                   if L <= L_max - L_cache
             = ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
             = -1                                  if L > L_max
scaled here by `overlong_penalty` and added to the task reward. Responses that hit L_max
without a stop token count as L > L_max (they were cut, their true length is longer).
"Overlong filtering" instead removes truncated responses from the loss.
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

  def __post_init__(self):
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
