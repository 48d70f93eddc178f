"""Device-resident replay ring of past rollouts, re-weighted for the policy that made them.

Each step writes its fresh rollouts that carry a learning signal (non-zero advantage) into a
fixed-capacity ring (write pointer modulo capacity) and mixes `num_samples` replayed rows into
the training batch. A row is eligible when it is valid, at most `max_staleness` optimizer
steps old and used fewer than `max_reuse` times; eligible rows are drawn without replacement
by priority with Gumbel top-k: probability proportional to |advantage| ("abs_adv"), to
exp(-3 * staleness) ("recency"), or uniform.

Stored with every row: the behaviour log-probs mu of its tokens, its advantage (computed in
its own group when it was generated), prompt id, policy version and step added. In the update
the proximal policy pi_old (the current parameters before this step's updates) is recomputed
and the loss applies the decoupled-PPO weight pi_old / mu, truncated or masked at C
(AReaL, Fu et al. 2025, arXiv 2505.24298; replay of past rollouts as in RePO, Li et al. 2025,
arXiv 2506.09340, and DOTS + rollout replay, Sun et al. 2025, arXiv 2506.05316).
The ring's arrays are split over the data-parallel mesh axes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from rlx import config_checks as chk
from rlx.errors import ConfigError

PRIORITIES = ("abs_adv", "recency", "uniform")
STALENESS_BINS = (0, 1, 2, 4, 8, 16)  # histogram edges (left-closed), last bin open


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
  capacity: int = 1024
  num_samples: int = 64  # replayed rows added to each training batch
  max_staleness: int = 4  # in policy versions (optimizer updates)
  max_reuse: int = 2
  priority: str = "abs_adv"

  def __post_init__(self):
    if self.priority not in PRIORITIES:
      raise ValueError(f"replay priority {self.priority!r}; expected one of {PRIORITIES}.")
    for name in ("capacity", "num_samples", "max_reuse"):
      if getattr(self, name) < 1:
        raise ValueError(f"replay {name}={getattr(self, name)}; expected >= 1.")
    if self.max_staleness < 0:
      raise ValueError(f"replay max_staleness={self.max_staleness}; expected >= 0.")
    if self.num_samples > self.capacity:
      raise ValueError(f"replay num_samples={self.num_samples} exceeds capacity="
                       f"{self.capacity}.")

  @classmethod
  def from_config(cls, config, num_batch_devices: int = 1) -> ReplayConfig | None:
    """config.replay, checked (one ConfigError); None when replay is off. The ring and the
    replayed rows are split over the `num_batch_devices` data-parallel devices."""
    fields = dict(config.replay)
    if not fields.pop("enabled", False):
      return None
    try:
      replay = cls(**fields)
    except (ValueError, TypeError) as e:
      raise ConfigError(f"config.replay: {e}") from None
    chk.need(replay.num_samples % num_batch_devices == 0,
             f"config.replay.num_samples={replay.num_samples} must be a multiple of the "
             f"{num_batch_devices} data-parallel devices.")
    chk.need(replay.capacity % num_batch_devices == 0,
             f"config.replay.capacity={replay.capacity} must be a multiple of the "
             f"{num_batch_devices} data-parallel devices (the ring is split over them).")
    return replay


@struct.dataclass
class ReplayState:
  prompts: jax.Array  # i32[C, P]
  prompt_lens: jax.Array  # i32[C]
  completions: jax.Array  # i32[C, T]
  behaviour_logp: jax.Array  # f32[C, T]
  lengths: jax.Array  # i32[C]
  rewards: jax.Array  # f32[C]
  advantages: jax.Array  # f32[C]
  prompt_ids: jax.Array  # i32[C]
  difficulty: jax.Array  # i32[C]
  policy_version: jax.Array  # i32[C] version of the policy that generated the row
  step_added: jax.Array  # i32[C]
  times_used: jax.Array  # i32[C]
  valid: jax.Array  # bool[C]
  write_ptr: jax.Array  # i32[]

  @classmethod
  def init(cls, capacity: int, prompt_width: int, max_new_tokens: int) -> "ReplayState":
    c = capacity
    zi = lambda *s: jnp.zeros(s, jnp.int32)
    return cls(prompts=zi(c, prompt_width), prompt_lens=zi(c),
               completions=zi(c, max_new_tokens),
               behaviour_logp=jnp.zeros((c, max_new_tokens), jnp.float32), lengths=zi(c),
               rewards=jnp.zeros((c,), jnp.float32), advantages=jnp.zeros((c,), jnp.float32),
               prompt_ids=zi(c), difficulty=zi(c), policy_version=zi(c), step_added=zi(c),
               times_used=zi(c), valid=jnp.zeros((c,), bool), write_ptr=jnp.zeros((), jnp.int32))

  @property
  def capacity(self) -> int:
    return self.valid.shape[0]


def add(ring: ReplayState, batch, keep_B, policy_version, step) -> ReplayState:
  """Writes the rows of `batch` where keep_B, packed, at the write pointer (wrapping)."""
  c = ring.capacity
  keep = keep_B.astype(jnp.int32)
  rank = jnp.cumsum(keep) - 1  # position among kept rows
  n_keep = keep.sum()
  # Rows not kept (or beyond capacity within one call) go to index c: dropped by the scatter.
  slot = jnp.where(keep_B & (rank < c), (ring.write_ptr + rank) % c, c)

  def put(dst, src):
    return dst.at[slot].set(src.astype(dst.dtype), mode="drop")

  b = batch
  n = keep_B.shape[0]
  return ring.replace(
      prompts=put(ring.prompts, b.prompts), prompt_lens=put(ring.prompt_lens, b.prompt_lens),
      completions=put(ring.completions, b.completions),
      behaviour_logp=put(ring.behaviour_logp, b.behaviour_logp),
      lengths=put(ring.lengths, b.lengths), rewards=put(ring.rewards, b.rewards),
      advantages=put(ring.advantages, b.advantages),
      prompt_ids=put(ring.prompt_ids, b.prompt_ids), difficulty=put(ring.difficulty,
                                                                    b.difficulty),
      policy_version=put(ring.policy_version, jnp.full((n,), policy_version)),
      step_added=put(ring.step_added, jnp.full((n,), step)),
      times_used=put(ring.times_used, jnp.zeros((n,), jnp.int32)),
      valid=put(ring.valid, jnp.ones((n,), bool)),
      write_ptr=(ring.write_ptr + jnp.minimum(n_keep, c)) % c)


def eligible(ring: ReplayState, cfg: ReplayConfig, policy_version):
  return (ring.valid & (policy_version - ring.policy_version <= cfg.max_staleness) &
          (ring.times_used < cfg.max_reuse))


def sample(ring: ReplayState, cfg: ReplayConfig, key, policy_version):
  """Draws cfg.num_samples distinct rows; returns (indices i32[R], used bool[R], ring).

  Rows drawn when fewer than num_samples are eligible have used=False (the caller masks
  them out of the loss). times_used is incremented for the used rows.
  """
  ok = eligible(ring, cfg, policy_version)
  if cfg.priority == "abs_adv":
    score = jnp.log(jnp.abs(ring.advantages) + 1e-6)
  elif cfg.priority == "recency":
    # Each version of staleness divides the odds by e^3: strongly prefer the newest rows.
    score = 3.0 * (ring.policy_version - policy_version).astype(jnp.float32)
  else:
    score = jnp.zeros(ring.advantages.shape, jnp.float32)
  score = score + jax.random.gumbel(key, score.shape)
  score = jnp.where(ok, score, -1e9)
  top, idx = jax.lax.top_k(score, cfg.num_samples)
  used = top > -1e8
  times = ring.times_used.at[idx].add(used.astype(jnp.int32))
  return idx, used, ring.replace(times_used=times)


def gather(ring: ReplayState, idx, used):
  """The replayed rows as Batch-like fields; unused rows get length 0 (no loss tokens)."""
  take = lambda x: jnp.take(x, idx, axis=0)
  return dict(prompts=take(ring.prompts), prompt_lens=take(ring.prompt_lens),
              completions=take(ring.completions), behaviour_logp=take(ring.behaviour_logp),
              lengths=jnp.where(used, take(ring.lengths), 0), rewards=take(ring.rewards),
              advantages=jnp.where(used, take(ring.advantages), 0.0),
              prompt_ids=take(ring.prompt_ids), difficulty=take(ring.difficulty),
              policy_version=take(ring.policy_version))


def staleness_histogram(staleness_R, used_R):
  edges = jnp.asarray(STALENESS_BINS)
  idx = jnp.clip(jnp.searchsorted(edges, staleness_R, side="right") - 1, 0, len(edges) - 1)
  return jnp.zeros((len(edges),), jnp.int32).at[idx].add(used_R.astype(jnp.int32))


def effective_sample_size(w, mask):
  """Kish ESS of importance weights over masked tokens, as a fraction of their count."""
  m = mask.astype(jnp.float32)
  s1 = (w * m).sum()
  s2 = (w * w * m).sum()
  n = jnp.maximum(m.sum(), 1.0)
  return jnp.where(s2 > 0, s1 * s1 / jnp.maximum(s2, 1e-30) / n, 1.0)
