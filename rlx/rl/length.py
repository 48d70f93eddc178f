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

Where the term enters (`length_mode`):
  "advantage" (default)  the term, centred on its group's mean, is added to the group
      advantage *after* GRPO's std normalisation: A_i = A_task_i + w (R_len(i) - mean_g R_len),
      so its push is bounded by the weight w (|.| <= w) in every group. Under std
      normalisation the "reward" placement is full-strength in every all-correct group whatever
      w is (their rewards differ only by length, and dividing by the group's std rescales that
      difference to unit size): once a level is solved, the shortening pressure never lets up,
      and on experiments/reasoning.py it broke levels the base already solved (1-digit sums
      100% -> 90%, 5-digit 96.9% -> 75%; experiments/results/reasoning_experiment.md). This is
      the Dr. GRPO observation (Liu et al. 2025, arXiv 2503.20783) applied to the length term
      alone: the task term keeps its normalisation.
  "reward"  Kimi k1.5 as written: w R_len is added to the task reward before the group
      advantage.

How lengths are compared (`length_scale`):
  "range" (Kimi k1.5)  lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len): the spread is
      always +-0.5, however small the length differences; a group whose answers differ by one
      token is pushed as hard as one whose answers differ twofold.
  "relative"  lambda_i = (min_len + max_len - 2 len_i) / (min_len + max_len), the length
      difference from the group's midrange relative to it: a verbose vs concise group (2x)
      spans +-1/3, a group of near-equal lengths (5% apart) +-0.025, so the pressure fades
      once a group's correct answers are all concise instead of squeezing out their last
      tokens. Same sign and ordering as "range"; the correct / wrong / no-correct-in-group
      rules above apply to both.

A per-level guard (`guard_margin` > 0, `LengthGuard`): each difficulty level's sampled
accuracy is measured at the start of RL, and the term fades to off at a level whose accuracy
falls `guard_margin` below that, so that shortening is pushed only where it costs the
level nothing (a length term strong enough to shorten otherwise moves levels the base has
solved onto the concise style they answer worse in). Measured there: it holds a level against
its own push, but the style is one switch for the whole model, which the band's push alone can
flip and which turning the term off does not undo (experiments/results/reasoning_levels.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from rlx.errors import ConfigError


LENGTH_MODES = ("advantage", "reward")
LENGTH_SCALES = ("range", "relative")


@dataclasses.dataclass(frozen=True)
class LengthConfig:
  overlong_shaping: bool = False
  overlong_buffer: int = 4  # L_cache, in tokens
  overlong_penalty: float = 1.0
  overlong_filter: bool = False
  length_reward: float = 0.0  # Kimi k1.5 group length reward coefficient (0: off)
  length_mode: str = "advantage"  # where the length term enters: "advantage" | "reward"
  length_scale: str = "range"  # how lengths are compared: "range" (Kimi) | "relative"
  length_warmup_steps: int = 0  # the weight ramps 0 -> length_reward over these RL steps
  # Per-level guard (`LengthGuard`): the term is off at a difficulty level whose sampled
  # accuracy falls guard_margin below what it was over the first guard_steps (0: no guard).
  guard_margin: float = 0.0
  guard_steps: int = 10  # calibration steps: the term is off, each level's reference is measured
  guard_decay: float = 0.9  # of the per-level accuracy's moving average after calibration

  def __post_init__(self):
    if self.length_mode not in LENGTH_MODES:
      raise ValueError(f"length length_mode={self.length_mode!r}; expected one of "
                       f"{LENGTH_MODES}.")
    if self.length_scale not in LENGTH_SCALES:
      raise ValueError(f"length length_scale={self.length_scale!r}; expected one of "
                       f"{LENGTH_SCALES}.")
    if not self.length_reward >= 0:
      raise ValueError(f"length length_reward={self.length_reward}; expected >= 0.")
    if not (isinstance(self.length_warmup_steps, int) and self.length_warmup_steps >= 0):
      raise ValueError(f"length length_warmup_steps={self.length_warmup_steps!r}; expected an "
                       "integer >= 0.")
    if not 0 <= self.guard_margin <= 1:
      raise ValueError(f"length guard_margin={self.guard_margin}; expected an accuracy "
                       "difference in [0, 1] (0: no guard).")
    if not (isinstance(self.guard_steps, int) and self.guard_steps >= 1):
      raise ValueError(f"length guard_steps={self.guard_steps!r}; expected an integer >= 1.")
    if not 0 <= self.guard_decay < 1:
      raise ValueError(f"length guard_decay={self.guard_decay}; expected a value in [0, 1).")
    if self.overlong_buffer < 1:
      raise ValueError(f"length overlong_buffer={self.overlong_buffer}; expected >= 1.")
    if self.overlong_penalty < 0:
      raise ValueError(f"length overlong_penalty={self.overlong_penalty}; expected >= 0.")

  @classmethod
  def from_config(cls, config) -> LengthConfig:
    """config.length, checked (one ConfigError)."""
    try:
      return cls(**dict(config.length))
    except (ValueError, TypeError) as e:
      raise ConfigError(f"config.length: {e}") from None


def length_weight(cfg: LengthConfig, step):
  """The length term's weight at RL step `step` (0-based): length_reward, ramped linearly
  from length_reward / warmup at step 0 to the full weight at step warmup - 1 when
  length_warmup_steps = warmup > 0 (Kimi k1.5 warms its length penalty up; on column
  addition a full-weight start jumps the policy into a style it cannot yet answer in)."""
  if cfg.length_warmup_steps <= 0:
    return jnp.float32(cfg.length_reward)
  ramp = jnp.minimum((jnp.asarray(step, jnp.float32) + 1) / cfg.length_warmup_steps, 1.0)
  return cfg.length_reward * ramp


def overlong_penalty(lengths_B, truncated_B, max_len: int, cfg: LengthConfig):
  """The (non-positive) shaping term per response."""
  start = max_len - cfg.overlong_buffer
  ramp = (start - lengths_B.astype(jnp.float32)) / cfg.overlong_buffer
  pen = jnp.where(lengths_B <= start, 0.0, jnp.maximum(ramp, -1.0))
  pen = jnp.where(truncated_B, -1.0, pen)
  return cfg.overlong_penalty * pen


def group_length_reward(lengths_B, correct_B, group_size: int, valid_B=None,
                        scale: str = "range"):
  """Kimi k1.5's length reward (unscaled) per response; groups are consecutive rows; 0 in
  groups without a correct response. valid_B: rows sampled (None: all; rlx.rl.adaptive),
  the others get 0 and do not count towards their group's shortest / longest. scale:
  `LENGTH_SCALES` (module docstring)."""
  lens = lengths_B.astype(jnp.float32).reshape(-1, group_size)
  ok = (correct_B > 0).reshape(-1, group_size)
  v = jnp.ones_like(ok) if valid_B is None else valid_B.reshape(-1, group_size)
  ok = ok & v
  lo = jnp.where(v, lens, jnp.inf).min(axis=1, keepdims=True)
  hi = jnp.where(v, lens, -jnp.inf).max(axis=1, keepdims=True)
  if scale == "range":
    lam = jnp.where(hi > lo, 0.5 - (lens - lo) / jnp.maximum(hi - lo, 1.0), 0.0)
  elif scale == "relative":
    lam = jnp.where(hi > lo, (lo + hi - 2 * lens) / jnp.maximum(lo + hi, 1.0), 0.0)
  else:
    raise ValueError(f"length scale={scale!r}; expected one of {LENGTH_SCALES}.")
  out = jnp.where(ok, lam, jnp.minimum(lam, 0.0))
  return jnp.where(ok.any(axis=1, keepdims=True) & v, out, 0.0).reshape(-1)


def centred_length_advantage(term_B, group_size: int, valid_B=None):
  """A length term (`group_length_reward`) minus its group's mean over the rows sampled: what
  length_mode="advantage" adds (times the weight) to the normalised advantages."""
  t = term_B.reshape(-1, group_size)
  v = jnp.ones_like(t, bool) if valid_B is None else valid_B.reshape(-1, group_size)
  mean = jnp.where(v, t, 0.0).sum(axis=1, keepdims=True) / jnp.maximum(
      v.sum(axis=1, keepdims=True), 1)
  return jnp.where(v, t - mean, 0.0).reshape(-1)


@struct.dataclass
class LengthGuard:
  """Per-level state of the length guard (in TrainState; checkpointed with it).

  Why (experiments/results/reasoning_levels.md): on column addition the warm start answers
  levels it has solved much better in its verbose style than in its concise one (1-digit sums
  99% vs 66% sampled), so a length term strong enough to shorten moves those levels onto the
  style they fail in, and they collapse at the switch (5-digit sums 98% -> 5.5%) while the
  band, where the concise style is the better one, gains. The guard makes the term a
  constraint-respecting push: over the first `guard_steps` RL steps the term is off and each
  difficulty level's sampled accuracy (the rollouts' task reward > 0) is averaged into its
  reference; afterwards a moving average of that accuracy is kept, and a level's length term
  is scaled by clip((avg - reference + margin) / margin, 0, 1): full while the level holds its
  reference, fading to off once it is `guard_margin` below. Correctness alone then pulls the
  level back (its mixed groups still carry the task advantage), and the term returns when it
  has recovered. Levels are the task's `difficulty` values (any integers).
  """

  levels: jax.Array  # i32[K] the difficulty values, sorted
  ref_sum: jax.Array  # f32[K] correct rows seen during calibration
  ref_rows: jax.Array  # f32[K] rows seen during calibration
  avg: jax.Array  # f32[K] moving average of the sampled accuracy after calibration

  @classmethod
  def init(cls, levels) -> LengthGuard:
    lv = jnp.asarray(sorted({int(l) for l in levels}), jnp.int32)
    z = jnp.zeros(lv.shape, jnp.float32)
    return cls(levels=lv, ref_sum=z, ref_rows=z, avg=z)

  def reference(self):
    """f32[K] each level's calibration accuracy (0 for a level never seen in calibration)."""
    return self.ref_sum / jnp.maximum(self.ref_rows, 1.0)


def guard_update(guard: LengthGuard, cfg: LengthConfig, step, difficulty_B, correct_B,
                 valid_B=None):
  """One step of the guard: (new guard, f32[B] multiplier of each row's length term, stats).

  At steps < guard_steps the multiplier is 0 and the rows are counted into the reference; at
  guard_steps the moving average starts from the reference; after it, levels with rows this
  step move their average by (1 - guard_decay) towards this step's accuracy (levels without
  rows keep theirs). A level never seen in calibration has no reference and is not guarded.
  """
  k = guard.levels.shape[0]
  idx = jnp.clip(jnp.searchsorted(guard.levels, difficulty_B), 0, k - 1)
  known = jnp.take(guard.levels, idx) == difficulty_B
  v = known if valid_B is None else known & valid_B
  one_hot = (idx[:, None] == jnp.arange(k)[None, :]) & v[:, None]  # [B, K]
  rows = one_hot.sum(axis=0).astype(jnp.float32)
  hits = (one_hot & (correct_B > 0)[:, None]).sum(axis=0).astype(jnp.float32)
  calibrating = step < cfg.guard_steps
  ref_sum = guard.ref_sum + jnp.where(calibrating, hits, 0.0)
  ref_rows = guard.ref_rows + jnp.where(calibrating, rows, 0.0)
  ref = ref_sum / jnp.maximum(ref_rows, 1.0)
  start = jnp.where(step == cfg.guard_steps, ref, guard.avg)
  acc = hits / jnp.maximum(rows, 1.0)
  moved = cfg.guard_decay * start + (1 - cfg.guard_decay) * acc
  avg = jnp.where(calibrating, guard.avg, jnp.where(rows > 0, moved, start))
  margin = max(cfg.guard_margin, 1e-6)  # a guard is only made with guard_margin > 0
  level_m = jnp.clip((avg - ref + margin) / margin, 0.0, 1.0)
  level_m = jnp.where(ref_rows > 0, level_m, 1.0)  # no reference: not guarded
  level_m = jnp.where(calibrating, 0.0, level_m)
  row_m = jnp.where(known, jnp.take(level_m, idx), jnp.where(calibrating, 0.0, 1.0))
  new = guard.replace(ref_sum=ref_sum, ref_rows=ref_rows, avg=avg)
  stats = {"length/guard_min": level_m.min(), "length/guard_mean": level_m.mean(),
           "length/guard_levels_off": (level_m < 0.5).sum().astype(jnp.float32)}
  for i in range(k):  # which level held its term when: the i-th smallest difficulty value
    stats[f"length/guard_m{i}"] = level_m[i]
  return new, row_m, stats
