"""Prompt selection from per-prompt pass-rate history: spend rollouts where they teach.

State (device arrays over the whole prompt pool, updated from every group's rewards):
  pass_rate  f32[N]  exponential moving average of each prompt's group pass rate
  prompt_group i32[N], group_rate f32[K]  a prompt's difficulty bucket and the bucket's
                     running pass rate: the estimate for prompts not visited yet (with
                     thousands of prompts most are never revisited within a run, and a flat
                     0.5 prior would make every unvisited prompt look maximally uncertain)
  group_pq   f32[K] or None  (`bucket_score="spread"`) the bucket's running mean of its
                     groups' unbiased p(1-p): band mode's score for unvisited prompts. Two
                     buckets with the same mean pass rate differ when one's prompts sit nearer
                     0 and 1 (fewer mixed groups): E[p(1-p)] = mean(1-mean) - Var(p) sees it,
                     the mean alone does not (measured: experiments/benchmarks/pass_rate_prior.py).
  visits     i32[N]
  last_all_correct bool[N], last_visit_step i32[N]
  zero_var_streak i32[N]  consecutive visits whose group had zero reward variance

Modes (`SelectionConfig.mode`):
  uniform  every prompt equally likely (the plain GRPO baseline).
  band     weight = floor + (1 - floor) * 4 p (1 - p): prompts near p = 0.5 give the largest
           GRPO signal (the group-variance argument of DOTS, Sun et al. 2025,
           arXiv 2506.05316); `floor` keeps exploration alive for every prompt.
  history  SRPO's history resampling (Zhang et al. 2025, arXiv 2504.14286): prompts whose
           last visit was all-correct are dropped; here they return after
           `history_cooldown` steps so that a forgotten skill is noticed. SRPO keeps the
           all-wrong ones (they may become solvable); a hopeless prompt rarely gives a mixed
           group, so here they are kept at relative weight `history_wrong_weight` (1: SRPO's
           rule as published).
  skip     GRESO's pre-rollout filtering (Li et al. 2025, arXiv 2506.02177): a prompt whose
           last z visits all had zero-variance groups is kept with probability
           `skip_keep_base ** z` (never 0, so it can come back), else skipped.
  oracle   a measuring instrument, not a lever: `oracle_candidates` prompts drawn uniformly
           are scored by their *true* current pass rate p, the probability of the task's one
           correct completion under the current policy (teacher-forced log-prob of the
           exact-match answer, rlx.train.oracle_choose; on a task whose reward accepts more,
           the sum over the correct completions it names, TaskDef.probe_references, a lower
           bound), and the n with the highest chance of
           a mixed group, 1 - p^G - (1-p)^G, are sampled. The probe forwards are counted in
           ledger/probe_tokens (FLOPs), not in generated tokens. It bounds what any
           history-based selection can win on a task (issue 36's headroom measurement).
  probe    the oracle's probe as a lever (exact-match tasks and tasks with probe
           references): `probe_factor` x the prompts
           sampled per step are drawn uniformly as candidates, each scored by one
           teacher-forced forward (prefill only, no generated token), and the n most likely
           to give a mixed group are sampled. It is the pre-rollout pass-rate prediction of
           GRESO (Li et al. 2025, arXiv 2506.02177) and MoPPS (Qu et al. 2025), here exact
           instead of estimated from history, and it costs candidates' prefill, not rollouts.
           Its price is probe_factor x (prompt + answer) prefill tokens per prompt sampled
           (per reference where a task names several). `probe_score="mixed_per_token"`
           ranks by that chance per expected generated token instead (the references'
           lengths weighted by their probabilities), for tasks whose uncertain prompts are
           their long ones.
           Against the tuned plain GRPO, at factor 8: op-chains 4.78x fewer generated tokens
           to target and 2.12x less compute; arithmetic 1.43x fewer tokens at 1.85x the
           compute (factor 4: 1.95x, the same compute); sorting digits, a family written
           after, 1.20x at 2.35x the compute; reasoning (column addition, probed through its
           two correct solutions) 0.74x on a 700-step warm start whose uncertain prompts were
           its long, off-band ones, and 0.87x on the shipped 1200-step one at 2 prompts per
           step, where its picks are all band groups but the task is step-limited (plain GRPO
           needs < 1 mixed band group per step) and band answers are the long ones; at 1
           prompt per step, where a plain step without signal is lost, 1.09x (8 seeds, CI 0.70-1.39). It pays where many steps go
           to groups without signal, not where the base learns in a few dozen steps
           (experiments/results/efficiency_chains.md, efficiency_probe_arith.md,
           efficiency_sort_digits.md, efficiency_probe_reasoning.md).
Independently, `dynamic_filter` is DAPO's dynamic sampling (Yu et al. 2025,
arXiv 2503.14476): sample `oversample` x the needed groups, keep groups with non-zero
reward variance first; the discarded rollouts are still counted in the token ledger.

Choosing n prompts without replacement from weights w uses Gumbel top-k on log w.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from rlx.errors import ConfigError

MODES = ("uniform", "band", "history", "skip", "oracle", "probe")
BUCKET_SCORES = ("mean", "spread")
PROBE_SCORES = ("mixed", "mixed_per_token")
HIST_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@dataclasses.dataclass(frozen=True)
class SelectionConfig:
  mode: str = "uniform"
  ema: float = 0.5  # weight of the newest visit in the pass-rate average
  floor: float = 0.05  # band: minimum relative weight
  history_cooldown: int = 50  # history: steps until an all-correct prompt may return
  history_wrong_weight: float = 0.25  # history: weight of prompts all-wrong at last visit
  skip_keep_base: float = 0.25  # skip: keep probability per zero-variance visit
  dynamic_filter: bool = False
  oversample: int = 2  # dynamic_filter: groups sampled per group kept
  group_ema: float = 0.1  # weight of a step's results in a difficulty bucket's pass rate
  # band mode, unvisited prompts: "mean" scores 4 p(1-p) at the bucket's mean pass rate;
  # "spread" scores 4 E[p(1-p)] over the bucket's groups (SelectorState.group_pq).
  bucket_score: str = "mean"
  oracle_candidates: int = 256  # oracle: prompts probed per step (0: the whole pool)
  probe_factor: int = 8  # probe: candidates probed per step = probe_factor x prompts sampled
  # oracle / probe: rank candidates by the chance of a mixed group ("mixed") or by that chance
  # per expected generated token ("mixed_per_token", `oracle_pick`).
  probe_score: str = "mixed"
  # history / skip modes, a measuring instrument: every `shadow_every` steps, `shadow_probe`
  # prompts drawn uniformly get their true pass rate probed (as the oracle does) and the
  # chance of a mixed group among those the rule excludes is logged (select/shadow_*). 0: off.
  shadow_probe: int = 0
  shadow_every: int = 10

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"selection mode {self.mode!r}; expected one of {MODES}.")
    if not 0 < self.ema <= 1:
      raise ValueError(f"selection ema={self.ema}; expected 0 < ema <= 1.")
    if not 0 <= self.floor <= 1:
      raise ValueError(f"selection floor={self.floor}; expected 0 <= floor <= 1.")
    if not 0 < self.history_wrong_weight <= 1:
      raise ValueError(f"selection history_wrong_weight={self.history_wrong_weight}; expected "
                       f"(0, 1].")
    if not 0 < self.skip_keep_base <= 1:
      raise ValueError(f"selection skip_keep_base={self.skip_keep_base}; expected (0, 1].")
    if self.oversample < 1:
      raise ValueError(f"selection oversample={self.oversample}; expected >= 1.")
    if self.oracle_candidates < 0:
      raise ValueError(f"selection oracle_candidates={self.oracle_candidates}; expected >= 0 "
                       f"(0: the whole pool).")
    if self.probe_factor < 1:
      raise ValueError(f"selection probe_factor={self.probe_factor}; expected >= 1 (the "
                       f"candidates probed per step, as a multiple of the prompts sampled).")
    if self.shadow_probe < 0 or self.shadow_every < 1:
      raise ValueError(f"selection shadow_probe={self.shadow_probe}, shadow_every="
                       f"{self.shadow_every}; expected shadow_probe >= 0 (0: off) and "
                       f"shadow_every >= 1.")
    if self.shadow_probe and self.mode not in ("history", "skip"):
      raise ValueError(f"selection shadow_probe={self.shadow_probe} with mode {self.mode!r}; "
                       f"the shadow probe measures the prompts a history or skip rule "
                       f"excludes (mode 'history' or 'skip').")
    if self.probe_score not in PROBE_SCORES:
      raise ValueError(f"selection probe_score={self.probe_score!r}; expected one of "
                       f"{PROBE_SCORES}.")
    if self.probe_score != "mixed" and self.mode not in ("oracle", "probe"):
      raise ValueError(f"selection probe_score={self.probe_score!r} with mode {self.mode!r}; "
                       f"it ranks the probed candidates of mode 'oracle' or 'probe'.")
    if self.bucket_score not in BUCKET_SCORES:
      raise ValueError(f"selection bucket_score={self.bucket_score!r}; expected one of "
                       f"{BUCKET_SCORES}.")

  @classmethod
  def from_config(cls, config) -> SelectionConfig:
    """config.selection, checked (one ConfigError)."""
    try:
      return cls(**dict(config.selection))
    except (ValueError, TypeError) as e:
      raise ConfigError(f"config.selection: {e}") from None

  @property
  def groups_sampled_factor(self) -> int:
    return self.oversample if self.dynamic_filter else 1


@struct.dataclass
class SelectorState:
  pass_rate: jax.Array  # f32[N]
  visits: jax.Array  # i32[N]
  last_all_correct: jax.Array  # bool[N]
  last_visit_step: jax.Array  # i32[N]
  zero_var_streak: jax.Array  # i32[N]
  prompt_group: jax.Array  # i32[N] difficulty bucket of each prompt
  group_rate: jax.Array  # f32[K] running pass rate of each bucket (prior 0.5)
  group_pq: jax.Array | None = None  # f32[K] running E[p(1-p)] of each bucket (prior 0.25)

  @classmethod
  def init(cls, num_prompts: int, prompt_group=None, num_groups: int = 1,
           spread: bool = False) -> "SelectorState":
    """spread: keep each bucket's E[p(1-p)] (`SelectionConfig.bucket_score="spread"`)."""
    if prompt_group is None:
      prompt_group = jnp.zeros((num_prompts,), jnp.int32)
    return cls(pass_rate=jnp.full((num_prompts,), 0.5, jnp.float32),
               visits=jnp.zeros((num_prompts,), jnp.int32),
               last_all_correct=jnp.zeros((num_prompts,), bool),
               last_visit_step=jnp.full((num_prompts,), -(10 ** 6), jnp.int32),
               zero_var_streak=jnp.zeros((num_prompts,), jnp.int32),
               prompt_group=jnp.asarray(prompt_group, jnp.int32),
               group_rate=jnp.full((num_groups,), 0.5, jnp.float32),
               group_pq=jnp.full((num_groups,), 0.25, jnp.float32) if spread else None)

  def estimate(self):
    """Pass-rate estimate f32[N]: a prompt's own history, else its bucket's rate."""
    return jnp.where(self.visits > 0, self.pass_rate, self.group_rate[self.prompt_group])


def weights(sel: SelectorState, cfg: SelectionConfig, step, key):
  """Unnormalised selection weights f32[N] (0 = excluded this step)."""
  p = sel.estimate()
  n = p.shape[0]
  if cfg.mode == "uniform":
    return jnp.ones((n,), jnp.float32)
  if cfg.mode == "band":
    pq = p * (1.0 - p)
    if sel.group_pq is not None:
      pq = jnp.where(sel.visits > 0, pq, sel.group_pq[sel.prompt_group])
    return cfg.floor + (1.0 - cfg.floor) * 4.0 * pq
  if cfg.mode == "history":
    dropped = sel.last_all_correct & (step - sel.last_visit_step < cfg.history_cooldown)
    # A zero-variance last visit that was not all-correct was all-wrong.
    all_wrong = (sel.visits > 0) & (sel.zero_var_streak > 0) & ~sel.last_all_correct
    return jnp.where(dropped, 0.0, jnp.where(all_wrong, cfg.history_wrong_weight, 1.0))
  keep_prob = cfg.skip_keep_base ** sel.zero_var_streak.astype(jnp.float32)
  kept = jax.random.uniform(key, (n,)) < keep_prob
  return jnp.where(kept, 1.0, 0.0)


def choose(sel: SelectorState | None, cfg: SelectionConfig, key, num_prompts: int, n: int,
           step):
  """n distinct prompt ids. Uniform mode draws exactly as the plain GRPO step does."""
  if sel is None or cfg.mode == "uniform":
    return jax.random.choice(key, num_prompts, (n,), replace=False).astype(jnp.int32)
  k_w, k_g = jax.random.split(key)
  w = weights(sel, cfg, step, k_w)
  # If fewer than n prompts have weight (everything skipped), fall back to uniform over the
  # rest rather than repeating prompts: tiny weight for excluded ones.
  logw = jnp.where(w > 0, jnp.log(jnp.maximum(w, 1e-30)), -1e9)
  gumbel = jax.random.gumbel(k_g, (num_prompts,))
  return jax.lax.top_k(logw + gumbel, n)[1].astype(jnp.int32)


def mixed_group_prob(p, group_size: int):
  """Chance that a group of `group_size` samples at pass rate p has both rewards (signal)."""
  p = jnp.clip(p, 0.0, 1.0)
  return 1.0 - p ** group_size - (1.0 - p) ** group_size


def oracle_pick(p_C, candidate_ids_C, n: int, group_size: int, key, length_C=None):
  """The n candidates most likely to give a mixed group (ties broken at random); with
  length_C (each candidate's expected completion length, `rlx.train.true_pass_rate`), the n
  with the most chance of a mixed group per expected generated token: the signal a group
  buys per token it costs, where a task's uncertain prompts are its long ones."""
  score = mixed_group_prob(p_C, group_size)
  if length_C is not None:
    score = score / jnp.maximum(length_C, 1.0)
  noise = 1e-6 * jax.random.uniform(key, score.shape)
  return candidate_ids_C[jax.lax.top_k(score + noise, n)[1]].astype(jnp.int32)


def update(sel: SelectorState, cfg: SelectionConfig, prompt_ids_P, rewards_PxG, step,
           valid_PxG=None):
  """Folds each visited prompt's group result into its history. valid_PxG: the members
  sampled (None: all; rlx.rl.adaptive's groups of unequal size, first member always)."""
  if valid_PxG is None:
    valid_PxG = jnp.ones(rewards_PxG.shape, bool)
    k = jnp.full((rewards_PxG.shape[0],), rewards_PxG.shape[1], jnp.float32)
    rate = rewards_PxG.mean(axis=1)
    all_correct = jnp.all(rewards_PxG >= 1.0, axis=1)
    zero_var = jnp.all(rewards_PxG == rewards_PxG[:, :1], axis=1)
  else:
    k = valid_PxG.sum(axis=1).astype(jnp.float32)
    rate = jnp.where(valid_PxG, rewards_PxG, 0.0).sum(axis=1) / k
    all_correct = jnp.all((rewards_PxG >= 1.0) | ~valid_PxG, axis=1)
    zero_var = jnp.all((rewards_PxG == rewards_PxG[:, :1]) | ~valid_PxG, axis=1)
  old = sel.pass_rate[prompt_ids_P]
  first = sel.visits[prompt_ids_P] == 0
  new_rate = jnp.where(first, rate, (1 - cfg.ema) * old + cfg.ema * rate)
  streak = jnp.where(zero_var, sel.zero_var_streak[prompt_ids_P] + 1, 0)
  # Bucket rates: EMA towards this step's mean pass rate of the bucket's visited prompts.
  nb = sel.group_rate.shape[0]
  grp = sel.prompt_group[prompt_ids_P]
  count = jnp.zeros((nb,), jnp.float32).at[grp].add(1.0)
  total = jnp.zeros((nb,), jnp.float32).at[grp].add(rate)
  step_rate = total / jnp.maximum(count, 1.0)
  group_rate = jnp.where(count > 0, (1 - cfg.group_ema) * sel.group_rate +
                         cfg.group_ema * step_rate, sel.group_rate)
  group_pq = sel.group_pq
  if group_pq is not None:
    # Each group's unbiased reward variance (= p(1-p) k/(k-1) for 0/1 rewards), bucket mean.
    dev = jnp.where(valid_PxG, rewards_PxG - rate[:, None], 0.0)
    pq = (dev * dev).sum(axis=1) / jnp.maximum(k - 1.0, 1.0)
    step_pq = jnp.zeros((nb,), jnp.float32).at[grp].add(pq) / jnp.maximum(count, 1.0)
    group_pq = jnp.where(count > 0, (1 - cfg.group_ema) * group_pq + cfg.group_ema * step_pq,
                         group_pq)
  return sel.replace(
      group_rate=group_rate, group_pq=group_pq,
      pass_rate=sel.pass_rate.at[prompt_ids_P].set(new_rate),
      visits=sel.visits.at[prompt_ids_P].add(1),
      last_all_correct=sel.last_all_correct.at[prompt_ids_P].set(all_correct),
      last_visit_step=sel.last_visit_step.at[prompt_ids_P].set(step),
      zero_var_streak=sel.zero_var_streak.at[prompt_ids_P].set(streak))


def dynamic_filter_order(rewards_PxG):
  """Group order putting non-zero-variance groups first (stable): DAPO's dynamic sampling."""
  zero_var = jnp.all(rewards_PxG == rewards_PxG[:, :1], axis=1)
  return jnp.argsort(zero_var.astype(jnp.int32), stable=True)


def pass_rate_histogram(sel: SelectorState, prompt_ids):
  """Counts of the chosen prompts' estimated pass rates in HIST_BINS (before this visit)."""
  p = sel.estimate()[prompt_ids]
  edges = jnp.asarray(HIST_BINS)
  idx = jnp.clip(jnp.searchsorted(edges, p, side="right") - 1, 0, len(HIST_BINS) - 2)
  return jnp.zeros((len(HIST_BINS) - 1,), jnp.int32).at[idx].add(1)
