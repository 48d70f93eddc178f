"""Adaptive rollout budgets: a second round of samples for the groups that can still teach.

Each step samples n prompts x G0 completions (round 1), scores them with the task's jnp
verifier inside the jitted step, then gives `extend_groups` = n2 of those groups G2 more
completions (round 2), so an extended group has G = G0 + G2 members (config.rl.group_size)
and the others keep G0. Per step: n G0 + n2 G2 sequences instead of plain GRPO's n G.

Which groups are extended (`priority`), from the round-1 rewards s/G0 of each group:
  uncertain  the Laplace-smoothed pass rate p = (s + 1) / (G0 + 2) maximises p (1 - p):
             mixed groups first, the ones nearest p = 1/2 before the others. The variance of
             the group's rewards is the expected size of its GRPO signal (the argument behind
             DOTS, arXiv 2506.05316, and Knapsack-RL's value of a rollout budget, arXiv
             2509.25849, where a prompt's budget goes where p (1 - p) gains most).
  unsolved   groups with no correct sample first (AR3PO's adaptive rollout, arXiv
             2509.25808: more responses only for the prompts that have none right), then
             mixed ones by p (1 - p); all-correct groups last.
Ties are broken at random (uniform noise from the step's key, below half the smallest gap
between distinct priorities, so it never reorders them).

Layout: the batch keeps n x G rows, group-major as everywhere in rlx; the G2 trailing rows of
a group that was not extended are *unsampled* (valid = False: no tokens, reward 0, advantage
0). Every consumer of groups takes `valid`: the advantages use each group's own size
(rlx.rl.advantages.group_advantages(valid=...)), the loss is normalised by the sampled rows
(train.update), the selector and the ledger count sampled rows only, the replay ring stores
only rows with signal (never an unsampled one). Shapes stay static, so nothing recompiles.

Keys: member j of the group of prompt slot i is sampled with fold_in(group_key_i, j) in
either round, so an extended group is exactly the group sampled at once with G members
(tests/rl/test_adaptive.py). Round 2 prefills its prompts again (one prefill per extended
group, shared by its G2 members in the paged sampler): the paged sampler releases a
prompt's pages when its round-1 group finishes, and keeping them across the verifier call
would hold every group's prompt pages through round 2.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rlx import config_checks as chk
from rlx.errors import ConfigError

PRIORITIES = ("uncertain", "unsolved")


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
  first: int  # G0: round-1 samples per prompt (>= 2)
  extend_groups: int  # n2: groups given G - G0 more samples in round 2 (>= 1)
  priority: str = "uncertain"

  def __post_init__(self):
    if self.priority not in PRIORITIES:
      raise ValueError(f"adaptive.priority={self.priority!r}; expected one of {PRIORITIES}.")
    if self.first < 2:
      raise ValueError(f"adaptive.first={self.first}; expected >= 2 (round-1 samples per "
                       f"prompt: advantages compare samples within a group).")
    if self.extend_groups < 1:
      raise ValueError(f"adaptive.extend_groups={self.extend_groups}; expected >= 1.")

  def check(self, prompts_per_step: int, group_size: int, dynamic_filter: bool = False
            ) -> None:
    """The checks that need the rest of the step's config."""
    if dynamic_filter:
      raise ValueError("adaptive.first > 0 with selection.dynamic_filter=True: both decide "
                       "which groups get samples; use one of them.")
    if not self.first < group_size:
      raise ValueError(f"adaptive.first={self.first} with rl.group_size={group_size}: an "
                       f"extended group has rl.group_size members, so first must be smaller.")
    if self.extend_groups > prompts_per_step:
      raise ValueError(f"adaptive.extend_groups={self.extend_groups} > rl.prompts_per_step="
                       f"{prompts_per_step}: at most every group can be extended.")

  @classmethod
  def from_config(cls, config, num_batch_devices: int = 1) -> AdaptiveConfig | None:
    """config.adaptive, checked against config.rl / selection / pipeline (one ConfigError);
    None when first == 0 (configs written before it existed: None)."""
    if "adaptive" not in config or not config.adaptive.first:
      return None
    rl = config.rl
    try:
      adaptive = cls(first=chk.integer(config, "adaptive.first", 0),
                     extend_groups=chk.integer(config, "adaptive.extend_groups", 0),
                     priority=config.adaptive.priority)
      adaptive.check(rl.prompts_per_step, rl.group_size, config.selection.dynamic_filter)
    except (ValueError, TypeError) as e:
      raise ConfigError(f"config.{e}") from None
    chk.need(not ("pipeline" in config and config.pipeline.mode == "overlap"),
             "config.adaptive.first > 0 with config.pipeline.mode='overlap': adaptive rollout "
             "budgets run in the sync pipeline only.")
    for what, rows in (("prompts_per_step * adaptive.first", rl.prompts_per_step *
                        adaptive.first),
                       ("adaptive.extend_groups * (group_size - adaptive.first)",
                        adaptive.extend_groups * (rl.group_size - adaptive.first))):
      chk.need(rows % num_batch_devices == 0,
               f"config.{what} = {rows} rollouts per round cannot be split over the "
               f"{num_batch_devices} data-parallel devices; use a multiple of "
               f"{num_batch_devices}.")
    return adaptive

  def sequences(self, prompts_per_step: int, group_size: int) -> int:
    """Sequences sampled per step: n G0 + n2 (G - G0)."""
    return prompts_per_step * self.first + self.extend_groups * (group_size - self.first)


def row_keys(group_keys, members):
  """Keys [n, len(members)]: member j of group i draws with fold_in(group_keys[i], j)."""
  members = jnp.asarray(members, jnp.uint32)
  return jax.vmap(lambda k: jax.vmap(lambda j: jax.random.fold_in(k, j))(members))(group_keys)


def priority(rewards_NxG0, mode: str):
  """Extension priority f32[n] of each group from its round-1 rewards (higher first)."""
  r = rewards_NxG0.astype(jnp.float32)
  g0 = r.shape[1]
  solved = (r > 0).sum(axis=1).astype(jnp.float32)
  p = (solved + 1.0) / (g0 + 2.0)
  score = p * (1.0 - p)
  if mode == "uncertain":
    return score
  if mode == "unsolved":  # none right: 2 + ..., mixed: 1 + ..., all right: p (1 - p) < 1
    none = solved == 0
    mixed = (solved > 0) & (solved < g0)
    return score + jnp.where(none, 2.0, jnp.where(mixed, 1.0, 0.0))
  raise ValueError(f"adaptive priority {mode!r}; expected one of {PRIORITIES}.")


def choose_extended(rewards_NxG0, cfg: AdaptiveConfig, key):
  """Indices i32[n2] of the groups extended in round 2 (highest priority, random ties)."""
  pri = priority(rewards_NxG0, cfg.priority)
  # Distinct p (1 - p) = a (m - a) / m^2 (m = G0 + 2, a integer) differ by >= 1 / m^2, so
  # noise below half of that only breaks ties.
  m = rewards_NxG0.shape[1] + 2
  noise = (0.5 / m ** 2) * jax.random.uniform(key, pri.shape)
  return jax.lax.top_k(pri + noise, cfg.extend_groups)[1].astype(jnp.int32)


def merge_rounds(first_NG0, second_N2G2, extended_N2, n: int):
  """Round-1 rows [n G0, ...] and round-2 rows [n2 G2, ...] -> [n G, ...] group-major; the
  rows of a group that was not extended past G0 are zeros."""
  g0 = first_NG0.shape[0] // n
  n2 = extended_N2.shape[0]
  g2 = second_N2G2.shape[0] // n2
  a = first_NG0.reshape(n, g0, *first_NG0.shape[1:])
  b = jnp.zeros((n, g2, *second_N2G2.shape[1:]), second_N2G2.dtype).at[extended_N2].set(
      second_N2G2.reshape(n2, g2, *second_N2G2.shape[1:]))
  return jnp.concatenate([a, b], axis=1).reshape(n * (g0 + g2), *first_NG0.shape[1:])


def valid_rows(extended_N2, n: int, first: int, group_size: int):
  """bool[n G]: which rows were sampled (all of round 1, round 2 of the extended groups)."""
  ext = jnp.zeros((n,), bool).at[extended_N2].set(True)
  member = jnp.arange(group_size)[None, :]
  return ((member < first) | ext[:, None]).reshape(-1)
