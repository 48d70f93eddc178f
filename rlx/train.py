"""The pure GRPO training step and the state it carries.

    train_step(state, pool) -> (state, metrics)          # pure; jit; state donated
      generate:
        ids      = selection.choose(state.selector, key)      # uniform | band | history | skip
        rollouts = sampler(params, prompts[ids] x G)          # paged (default) or dense;
                                                              # tokens + behaviour logp mu
        rewards  = task verifier (jnp)                        # or host Python between halves
                   (adaptive budgets, rlx.rl.adaptive: G0 per prompt, the verifier, then
                    G - G0 more for the chosen groups; the rest stay unsampled rows)
      score:
        rewards  = + DAPO overlong shaping, + Kimi k1.5 length reward (optional)
        selector = selection.update(selector, ids, rewards)
        groups   = DAPO dynamic filtering (optional; discarded tokens are counted)
        adv      = group advantages (grpo | dr_grpo | rloo)
      update:
        batch    = fresh rollouts + replay.sample(ring); ring = replay.add(ring, fresh)
        pi_old   = trainer log-probs before the updates (minibatch by minibatch)
        num_updates x num_minibatches: grads of policy_loss (w = pi_old/mu capped) -> optax
        metrics  = ledger (generated / trained / replayed / wasted tokens, ...) + losses

`rollout` (= generate + score) and `update` are the two halves the host loop times
separately; `train_step` fuses them; `generate` + `score_update` is the split used when the
reward is host Python. All are jitted over a Mesh with NamedShardings, the state donated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh

from rlx import distributed
from rlx import sharding as shd
from rlx import update_plan
from rlx.data.tasks import PromptPool, Verifier
from rlx.model import lora as lora_lib
from rlx.model import transformer
from rlx.rl import adaptive as adaptive_lib
from rlx.rl import advantages as adv_lib
from rlx.rl import length as length_lib
from rlx.rl import replay as replay_lib
from rlx.rl import selection
from rlx.rl.loss import LossConfig, importance_weights, policy_loss
from rlx.sampler import dense, paged
from rlx.sampler.sampling import SamplingParams, prompt_positions
# The host-side shape planning (re-exported: tests, rlx.memory and benchmarks use them here).
from rlx.update_plan import micro_parts, part_widths, row_order, update_rows, update_width  # pylint: disable=unused-import


@struct.dataclass
class TrainState:
  params: Any
  opt_state: Any
  rng: jax.Array  # u32[2] raw key data (checkpoint friendly)
  step: jax.Array  # i32[]
  policy_version: jax.Array  # i32[] number of optimizer updates applied
  ref_params: Any = None  # only allocated when kl_coef > 0 (never with LoRA: see `base`)
  # LoRA (StepConfig.lora): `params` holds the adapters only (so only they get optimizer
  # state) and `base` the frozen base weights, which are also the KL reference.
  base: Any = None
  selector: selection.SelectorState | None = None  # per-prompt pass-rate history
  replay: replay_lib.ReplayState | None = None  # ring of past rollouts


@struct.dataclass
class Batch:
  """One step's rollouts, group-major: rows i*G .. i*G+G-1 share prompt i."""

  prompts: jax.Array  # i32[B, P] left-padded
  prompt_lens: jax.Array  # i32[B]
  completions: jax.Array  # i32[B, T]
  behaviour_logp: jax.Array  # f32[B, T]
  lengths: jax.Array  # i32[B]
  truncated: jax.Array  # bool[B]
  rewards: jax.Array  # f32[B] the task's reward (verifier or host Python), set by `score`
  advantages: jax.Array  # f32[B] from the (optionally shaped) rewards, set by `score`
  prompt_ids: jax.Array  # i32[B]
  difficulty: jax.Array  # i32[B]
  policy_version: jax.Array  # i32[B] version of the policy that generated each row


class Rollouts(NamedTuple):
  """What the rollout half hands the update half: the rows and the rollout-side ledger."""

  batch: Batch
  stats: dict  # ledger scalars of the rollout (tokens generated incl. discarded, selector)
  # bool[B] rows sampled (adaptive rollout budgets, rlx.rl.adaptive: a group not extended
  # leaves its last G - G0 rows unsampled); None: every row.
  valid: Any = None


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Everything static about a training step (hashable)."""

  prompts_per_step: int
  group_size: int
  advantage: str
  num_updates: int
  num_minibatches: int
  loss: LossConfig
  sampling: SamplingParams
  sampler_impl: str = "dense"
  paged: paged.PagedConfig | None = None  # sampler_impl="paged" settings; None = defaults
  selection: selection.SelectionConfig = selection.SelectionConfig()
  replay: replay_lib.ReplayConfig | None = None
  length: length_lib.LengthConfig = length_lib.LengthConfig()
  reward_range: tuple[float, float] = (-10.0, 10.0)  # rewards outside stop the run
  # Update-side cost and memory (see `update`): log-prob chunk (positions per vocabulary
  # projection, 0 = all at once), per-layer rematerialisation, pi_old fused into the first
  # minibatch's gradient pass, completion-width buckets the update compiles for.
  logprob_chunk: int = 0
  remat: bool = False
  fuse_pi_old: bool = True
  update_buckets: int = 4
  drop_zero_adv_rows: bool = True  # see `update_shape`
  update_parts: int = 2  # length-sorted micro-batches, each at its own width (`update`)
  update_micro_rows: int = 0  # > 0: micro-batches of at most this many rows (`update_shape`)
  verifier: Verifier = Verifier()  # the task's jnp reward (exact match, final answer, ...)
  lora: lora_lib.LoRAConfig | None = None  # None: full-parameter training
  staleness_hist: bool = False  # log the fresh rows' staleness histogram (overlap mode)
  # Adaptive rollout budgets (rlx.rl.adaptive): G0 samples per prompt, then group_size - G0
  # more for extend_groups of the groups. None: every group gets group_size samples.
  adaptive: adaptive_lib.AdaptiveConfig | None = None
  # Difficulty levels whose mixed (non-zero-variance) groups the ledger counts per step
  # (ledger/mixed_groups_d<level>): where the uncertain band is.
  ledger_levels: tuple[int, ...] = ()

  def __post_init__(self):
    if self.selection.shadow_probe and self.verifier.kind != "exact_match":
      raise ValueError(f"selection.shadow_probe={self.selection.shadow_probe} needs an "
                       f"exact-match task (its probe is the oracle's: the probability of the "
                       f"one correct completion); this task's verifier is "
                       f"{self.verifier.kind!r}.")
    if self.selection.mode == "oracle" and self.verifier.kind != "exact_match":
      raise ValueError(f"selection.mode='oracle' needs an exact-match task (one correct "
                       f"completion, whose probability is the pass rate); this task's verifier "
                       f"is {self.verifier.kind!r}.")
    if self.adaptive is not None:
      self.adaptive.check(self.prompts_per_step, self.group_size,
                          self.selection.dynamic_filter)

  @classmethod
  def from_spec(cls, spec, *, sampling: SamplingParams, verifier: Verifier) -> StepConfig:
    """The step of a run's spec (`rlx.configs.RunSpec`): config.rl's keys by name (a new
    update knob is a field of RLSpec and of StepConfig of the same name), the other sections
    as they are; `sampling` and `verifier` need the tokenizer."""
    rl = {f.name: getattr(spec.rl, f.name) for f in dataclasses.fields(spec.rl)}
    return cls(**rl, sampling=sampling, sampler_impl=spec.sampler.impl,
               paged=spec.sampler.paged if spec.sampler.impl == "paged" else None,
               selection=spec.selection, replay=spec.replay, length=spec.length,
               reward_range=spec.guard.reward_range, verifier=verifier, lora=spec.lora,
               staleness_hist=spec.pipeline.mode == "overlap", adaptive=spec.adaptive,
               ledger_levels=tuple(sorted(set(spec.task.rl_levels or spec.task.levels))))

  @property
  def batch_size(self) -> int:
    """Fresh rows per step (after dynamic filtering), group-major; with adaptive budgets
    some are unsampled (`sampled_rows`)."""
    return self.prompts_per_step * self.group_size

  @property
  def sampled_rows(self) -> int:
    """Fresh rows actually sampled and trained on per step."""
    if self.adaptive is None:
      return self.batch_size
    return self.adaptive.sequences(self.prompts_per_step, self.group_size)

  @property
  def train_batch_size(self) -> int:
    return self.batch_size + (self.replay.num_samples if self.replay else 0)

  @property
  def sampled_groups(self) -> int:
    return self.prompts_per_step * self.selection.groups_sampled_factor


def make_optimizer(lr: float, total_steps: int, *, warmup_steps: int = 0,
                   schedule: str = "constant", weight_decay: float = 0.0,
                   grad_clip: float = 1.0, b1: float = 0.9, b2: float = 0.999,
                   updates_per_step: int = 1) -> optax.GradientTransformation:
  total = max(1, total_steps * updates_per_step)
  warm = warmup_steps * updates_per_step
  if schedule == "constant":
    sched = optax.join_schedules(
        [optax.linear_schedule(0.0, lr, max(warm, 1)), optax.constant_schedule(lr)], [warm]
    ) if warm else optax.constant_schedule(lr)
  elif schedule == "cosine":
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warm, 1), max(total, warm + 1),
                                               end_value=0.1 * lr)
  else:
    raise ValueError(f"optim.schedule={schedule!r}; expected 'constant' or 'cosine'.")
  parts = []
  if grad_clip and grad_clip > 0:
    parts.append(optax.clip_by_global_norm(grad_clip))
  parts.append(optax.adamw(sched, b1=b1, b2=b2, weight_decay=weight_decay))
  return optax.chain(*parts)


# ----------------------------------------------------------------------------- sequences


def sequence_inputs(prompts_BxP, prompt_lens_B, completions_BxT, lengths_B):
  """Concatenates left-padded prompts and completions: tokens, positions, valid, resp mask."""
  p = prompts_BxP.shape[1]
  t = completions_BxT.shape[1]
  ppos, pvalid = prompt_positions(prompt_lens_B, p)
  steps = jnp.arange(t)[None, :]
  cpos = prompt_lens_B[:, None] + steps
  cvalid = steps < lengths_B[:, None]
  tokens = jnp.concatenate([prompts_BxP, completions_BxT], axis=1)
  pos = jnp.concatenate([ppos, cpos.astype(jnp.int32)], axis=1)
  valid = jnp.concatenate([pvalid, cvalid], axis=1)
  return tokens, pos, valid, cvalid


def completion_logprobs(graphdef, params, prompts_BxP, prompt_lens_B, completions_BxT,
                        lengths_B, temperature: float, *, chunk: int = 0, remat: bool = False):
  """log pi(completion tokens) [B, T] (f32) and the response mask [B, T].

  chunk / remat: see `transformer.token_logprobs` (memory for long completions).
  """
  tokens, pos, valid, mask = sequence_inputs(prompts_BxP, prompt_lens_B, completions_BxT,
                                             lengths_B)
  lp = transformer.token_logprobs(graphdef, params, tokens, pos, valid, temperature,
                                  first=prompts_BxP.shape[1] - 1, chunk=chunk, remat=remat)
  return lp, mask


# ----------------------------------------------------------------------------- step halves


def sample(graphdef, params, prompts, prompt_lens, keys, cfg: StepConfig, mesh: Mesh | None,
           group_size: int | None = None):
  """group_size: consecutive rows sharing a prompt (None: cfg.group_size)."""
  if cfg.sampler_impl == "dense":
    return dense.generate_unjitted(graphdef, params, prompts, prompt_lens, keys, cfg.sampling)
  if cfg.sampler_impl == "paged":
    return paged.generate_unjitted(graphdef, params, prompts, prompt_lens, keys, cfg.sampling,
                                   cfg.paged or paged.PagedConfig(),
                                   group_size=group_size or cfg.group_size, mesh=mesh)
  raise ValueError(f"sampler impl {cfg.sampler_impl!r}; expected 'dense' or 'paged'.")


def generate(state: TrainState, pool: PromptPool, *, graphdef, cfg: StepConfig,
             mesh: Mesh | None = None) -> tuple[TrainState, Rollouts, jax.Array]:
  """Chooses prompts and samples G completions each.

  Returns (state, rollouts, verifier rewards f32[B]): the task's jnp verifier on the
  completions (what `rollout` scores with; a host reward replaces it). With dynamic filtering,
  `oversample` x prompts_per_step groups are sampled here and `score` keeps prompts_per_step.
  """
  rng, k_choose, k_sample = jax.random.split(jax.random.wrap_key_data(state.rng), 3)
  n, g = cfg.sampled_groups, cfg.group_size
  stats = {}
  if cfg.selection.mode == "oracle":
    ids, stats = oracle_choose(state, pool, k_choose, n, graphdef=graphdef, cfg=cfg)
  else:
    ids = selection.choose(state.selector, cfg.selection, k_choose, pool.size, n, state.step)
    if cfg.selection.shadow_probe:
      stats.update(shadow_probe(state, pool, k_choose, graphdef=graphdef, cfg=cfg))
  rows = jnp.repeat(ids, g)
  chosen = pool.take(rows)
  valid = None
  if cfg.adaptive is not None:
    ro, rewards, valid, more = _generate_adaptive(state, pool, ids, k_sample,
                                                  graphdef=graphdef, cfg=cfg, mesh=mesh)
    stats.update(more)
    if mesh is not None:
      chosen, rows = shd.constrain_batch((chosen, rows), mesh)
  else:
    keys = jax.random.split(k_sample, n * g)
    if mesh is not None:
      chosen, keys, rows = shd.constrain_batch((chosen, keys, rows), mesh)
    ro = sample(graphdef, policy_params(state, cfg), chosen.prompts, chosen.prompt_lens, keys,
                cfg, mesh)
    rewards = cfg.verifier(ro.tokens, chosen.answers, chosen.answer_lens)
  if state.selector is not None:
    hist = selection.pass_rate_histogram(state.selector, ids)
    for i in range(hist.shape[0]):
      lo, hi = selection.HIST_BINS[i], selection.HIST_BINS[i + 1]
      stats[f"select/pass_rate_hist_{lo:.1f}-{hi:.1f}"] = hist[i].astype(jnp.float32)
  # Prompt tokens prefilled (one per sampled sequence: the dense sampler's count; the paged
  # one prefills each group's prompt once): the compute-cost column of efficiency.py.
  sampled = jnp.ones(rows.shape, bool) if valid is None else valid
  stats["ledger/prompt_tokens"] = jnp.where(sampled, chosen.prompt_lens, 0).sum().astype(
      jnp.float32)
  zeros = jnp.zeros(rows.shape, jnp.float32)
  batch = Batch(prompts=chosen.prompts, prompt_lens=chosen.prompt_lens, completions=ro.tokens,
                behaviour_logp=ro.logprobs, lengths=ro.lengths, truncated=ro.truncated,
                rewards=zeros, advantages=zeros, prompt_ids=rows,
                difficulty=chosen.difficulty,
                policy_version=jnp.full(rows.shape, state.policy_version, jnp.int32))
  if mesh is not None:
    batch, rewards = shd.constrain_batch((batch, rewards), mesh)
    if valid is not None:
      valid = shd.constrain_batch(valid, mesh)
  return state.replace(rng=jax.random.key_data(rng)), Rollouts(batch, stats, valid), rewards


def true_pass_rate(state: TrainState, pool: PromptPool, ids, *, graphdef, cfg: StepConfig):
  """f32[len(ids)]: each prompt's pass rate under the current policy on an exact-match task,
  the probability of its one correct completion (the answer tokens + EOS) at the sampling
  temperature, from one teacher-forced forward (top-k / top-p truncation, if set, ignored)."""
  sub = pool.take(ids)
  lp, mask = completion_logprobs(graphdef, policy_params(state, cfg), sub.prompts,
                                 sub.prompt_lens, sub.answers, sub.answer_lens,
                                 cfg.sampling.temperature or 1.0, chunk=cfg.logprob_chunk)
  return jnp.exp(jnp.where(mask, lp, 0.0).sum(axis=1))


def shadow_probe(state: TrainState, pool: PromptPool, k_choose, *, graphdef,
                 cfg: StepConfig) -> dict:
  """The falsification check of the history and skip rules (issue 36): would the prompts a
  rule excludes have given mixed groups? Every `shadow_every` steps, `shadow_probe` prompts
  drawn uniformly are probed for their true pass rate p (`true_pass_rate`); with this step's
  weights (the skip rule's keep draws re-made from the key `selection.choose` used), the
  stats sum 1 - p^G - (1-p)^G over the excluded candidates (weight 0) and, in history mode,
  the down-weighted ones (all-wrong at their last visit), next to their counts and the
  candidates' total. The probes are an instrument: ledger/shadow_probe_tokens, not in the
  FLOPs column."""
  sc = cfg.selection
  c = min(sc.shadow_probe, pool.size)
  w = selection.weights(state.selector, sc, state.step, jax.random.split(k_choose)[0])
  cand = jax.random.choice(jax.random.fold_in(k_choose, 1), pool.size, (c,),
                           replace=False).astype(jnp.int32)
  due = state.step % sc.shadow_every == 0
  mixed = jax.lax.cond(
      due, lambda: selection.mixed_group_prob(
          true_pass_rate(state, pool, cand, graphdef=graphdef, cfg=cfg), cfg.group_size),
      lambda: jnp.zeros((c,), jnp.float32))
  wc = w[cand]
  excluded = (wc <= 0) & due
  down = (wc > 0) & (wc < 1) & due
  sub = pool.take(cand)
  f32 = lambda x: x.astype(jnp.float32)
  return {
      "select/shadow_probed": f32(due) * c,
      "select/shadow_mixed_sum": jnp.where(due, mixed, 0.0).sum(),
      "select/shadow_excluded": f32(excluded.sum()),
      "select/shadow_excluded_mixed_sum": jnp.where(excluded, mixed, 0.0).sum(),
      "select/shadow_down": f32(down.sum()),
      "select/shadow_down_mixed_sum": jnp.where(down, mixed, 0.0).sum(),
      "ledger/shadow_probe_tokens": f32(due) * (sub.prompt_lens + sub.answer_lens).sum(),
  }


def oracle_choose(state: TrainState, pool: PromptPool, key, n: int, *, graphdef,
                  cfg: StepConfig):
  """selection.mode="oracle": n prompts chosen by their true current pass rate.

  On an exact-match task a prompt's pass rate under sampling at temperature T is the
  probability of its one correct completion (the answer tokens + EOS), which one
  teacher-forced forward gives exactly (top-k / top-p truncation, if set, is ignored). The
  forwards are counted in ledger/probe_tokens: the oracle's cost is FLOPs, not generated
  tokens. Returns (ids i32[n], stats).
  """
  k_cand, k_tie = jax.random.split(key)
  c = min(cfg.selection.oracle_candidates or pool.size, pool.size)
  if c < pool.size:
    cand = jax.random.choice(k_cand, pool.size, (c,), replace=False).astype(jnp.int32)
  else:
    cand = jnp.arange(pool.size, dtype=jnp.int32)
  sub = pool.take(cand)
  p = true_pass_rate(state, pool, cand, graphdef=graphdef, cfg=cfg)
  ids = selection.oracle_pick(p, cand, n, cfg.group_size, k_tie)
  picked = jnp.isin(cand, ids)
  stats = {
      "ledger/probe_tokens": (sub.prompt_lens + sub.answer_lens).sum().astype(jnp.float32),
      "select/oracle_pass_rate": jnp.where(picked, p, 0.0).sum() / n,
      "select/oracle_mixed_prob": jnp.where(
          picked, selection.mixed_group_prob(p, cfg.group_size), 0.0).sum() / n,
      "select/oracle_pool_mixed_prob": selection.mixed_group_prob(p, cfg.group_size).mean(),
  }
  return ids, stats


def _generate_adaptive(state: TrainState, pool: PromptPool, ids, key, *, graphdef,
                       cfg: StepConfig, mesh: Mesh | None):
  """Two rounds (rlx.rl.adaptive): n x G0 samples, the verifier, then G - G0 more for the
  extended groups. Returns (rollout [n G] group-major with unsampled rows zeroed, verifier
  rewards f32[n G], valid bool[n G], stats)."""
  ac = cfg.adaptive
  n, g, g0 = cfg.prompts_per_step, cfg.group_size, ac.first
  k_groups, k_ext = jax.random.split(key)
  group_keys = jax.random.split(k_groups, n)
  params = policy_params(state, cfg)

  def sample_round(slot_ids, members):
    rows = jnp.repeat(ids[slot_ids], len(members))
    chosen = pool.take(rows)
    keys = adaptive_lib.row_keys(group_keys[slot_ids], members).reshape(-1)
    if mesh is not None:
      chosen, keys = shd.constrain_batch((chosen, keys), mesh)
    ro = sample(graphdef, params, chosen.prompts, chosen.prompt_lens, keys, cfg, mesh,
                group_size=len(members))
    return ro, cfg.verifier(ro.tokens, chosen.answers, chosen.answer_lens)

  ro1, r1 = sample_round(jnp.arange(n), range(g0))
  ext = adaptive_lib.choose_extended(r1.reshape(n, g0), ac, k_ext)
  ro2, r2 = sample_round(ext, range(g0, g))
  merge = lambda a, b: adaptive_lib.merge_rounds(a, b, ext, n)
  ro = jax.tree.map(merge, ro1, ro2)
  rewards = merge(r1, r2)
  valid = adaptive_lib.valid_rows(ext, n, g0, g)
  solved = (r1.reshape(n, g0) > 0).sum(axis=1)
  mixed = (solved > 0) & (solved < g0)
  ext_mixed = jnp.take(mixed, ext)
  stats = {
      "adaptive/round1_mixed_groups": mixed.astype(jnp.float32).sum(),
      "adaptive/extended_mixed_groups": ext_mixed.astype(jnp.float32).sum(),
      "adaptive/extended_unsolved_groups": (jnp.take(solved, ext) == 0).astype(
          jnp.float32).sum(),
      "adaptive/round2_tokens": ro2.lengths.astype(jnp.float32).sum(),
  }
  return ro, rewards, valid, stats


def score(state: TrainState, ro: Rollouts, rewards, *, cfg: StepConfig,
          mesh: Mesh | None = None) -> tuple[TrainState, Rollouts]:
  """Task rewards -> shaped rewards, selector update, dynamic filtering, group advantages."""
  batch = ro.batch
  g = cfg.group_size
  valid = ro.valid  # None: every row sampled
  correct = rewards.astype(jnp.float32)
  if valid is not None:  # unsampled rows (rlx.rl.adaptive): reward 0, never invalid
    correct = jnp.where(valid, correct, 0.0)
  lo, hi = cfg.reward_range
  invalid = ~jnp.isfinite(correct) | (correct < lo) | (correct > hi)
  if valid is not None:
    invalid = invalid & valid
  rewards = correct
  if cfg.length.overlong_shaping:
    rewards = rewards + length_lib.overlong_penalty(
        batch.lengths, batch.truncated, cfg.sampling.max_new_tokens, cfg.length)
  length_adv = None
  if cfg.length.length_reward > 0:
    term = cfg.length.length_reward * length_lib.group_length_reward(
        batch.lengths, correct, g, valid)
    if cfg.length.length_mode == "reward":
      rewards = rewards + term
    else:  # after normalisation: a push bounded by the weight (rlx.rl.length)
      length_adv = length_lib.centred_length_advantage(term, g, valid)
  groups = correct.reshape(-1, g)
  if state.selector is not None:
    state = state.replace(selector=selection.update(
        state.selector, cfg.selection, batch.prompt_ids[::g], groups, state.step,
        None if valid is None else valid.reshape(-1, g)))
  lengths = batch.lengths.astype(jnp.float32)
  stats = dict(ro.stats)
  # Checked on the host after the step: the loop names the offending example.
  stats["reward/invalid_count"] = invalid.sum().astype(jnp.float32)
  first = jnp.argmax(invalid)
  stats["reward/first_invalid_prompt"] = batch.prompt_ids[first].astype(jnp.float32)
  stats["reward/first_invalid_value"] = jnp.where(invalid.any(), correct[first], 0.0)
  stats["ledger/tokens_generated"] = lengths.sum()
  if state.replay is not None:  # bounds the replayed rows' width (see `update_width`)
    stats["replay/ring_max_len"] = jnp.where(state.replay.valid, state.replay.lengths,
                                             0).max().astype(jnp.float32)
  stats["ledger/groups_sampled"] = jnp.asarray(groups.shape[0], jnp.float32)
  if cfg.selection.dynamic_filter:
    order = selection.dynamic_filter_order(rewards.reshape(-1, g))[:cfg.prompts_per_step]
    kept_rows = (order[:, None] * g + jnp.arange(g)[None, :]).reshape(-1)
    kept_tokens = jnp.take(lengths, kept_rows).sum()
    stats["ledger/tokens_discarded"] = lengths.sum() - kept_tokens
    batch = jax.tree.map(lambda v: jnp.take(v, kept_rows, axis=0), batch)
    rewards = jnp.take(rewards, kept_rows)
    correct = jnp.take(correct, kept_rows)
    if length_adv is not None:
      length_adv = jnp.take(length_adv, kept_rows)
  else:
    stats["ledger/tokens_discarded"] = jnp.zeros((), jnp.float32)
  advantages, _ = adv_lib.group_advantages(rewards, g, cfg.advantage, valid=valid)
  if length_adv is not None:
    advantages = advantages + length_adv
  if cfg.length.overlong_filter:
    advantages = jnp.where(batch.truncated, 0.0, advantages)
  batch = batch.replace(rewards=correct, advantages=advantages)
  # What the host needs to size the update (`update_shape`), as replicated scalars.
  stats["ledger/longest_row"] = batch.lengths.max().astype(jnp.float32)
  stats["ledger/signal_rows"] = (advantages != 0).sum().astype(jnp.float32)
  if mesh is not None:
    batch = shd.constrain_batch(batch, mesh)
  return state, Rollouts(batch, stats, valid)


def rollout(state: TrainState, pool: PromptPool, *, graphdef, cfg: StepConfig,
            mesh: Mesh | None = None) -> tuple[TrainState, Rollouts]:
  """generate + score with the task's jnp verifier: the rollout half of the fused step."""
  state, ro, rewards = generate(state, pool, graphdef=graphdef, cfg=cfg, mesh=mesh)
  return score(state, ro, rewards, cfg=cfg, mesh=mesh)


def _unminibatch(x):
  """Inverse of `_minibatches` for one array: [m, B/m, ...] -> [B, ...]."""
  return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def _minibatches(tree, m: int):
  """[B, ...] -> [m, B/m, ...] with strided rows (each minibatch draws from every shard)."""
  def split(x):
    b = x.shape[0]
    return jnp.swapaxes(x.reshape(b // m, m, *x.shape[1:]), 0, 1)
  return jax.tree.map(split, tree)


def _with_replay(state: TrainState, fresh: Batch, cfg: StepConfig):
  """Mixes replayed rows into the batch and writes the fresh signal-carrying rows to the ring.

  Returns (state, training batch, replayed-row flags bool[B+R]).
  """
  key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), 1)
  idx, used, ring = replay_lib.sample(state.replay, cfg.replay, key, state.policy_version)
  rep = replay_lib.gather(ring, idx, used)
  ring = replay_lib.add(ring, fresh, fresh.advantages != 0, state.policy_version, state.step)
  rep["truncated"] = jnp.zeros(idx.shape, bool)
  fields = {k: jnp.concatenate([getattr(fresh, k), rep[k].astype(getattr(fresh, k).dtype)])
            for k in rep}
  batch = Batch(**fields)
  replayed = jnp.concatenate([jnp.zeros(fresh.lengths.shape, bool), used])
  return state.replace(replay=ring), batch, replayed


def _trim(batch: Batch, width: int) -> Batch:
  return batch.replace(completions=batch.completions[:, :width],
                       behaviour_logp=batch.behaviour_logp[:, :width])


# ----------------------------------------------------------------------------- the update
#
# `update` is a composition of phases, each a module-level function:
#   mix_replay -> order_rows -> split_micro_batches -> proximal_and_reference_logp ->
#   optimise (epochs x minibatches; gradient accumulation over micro-batches; finite guard)
#   -> update_metrics


class Ordered(NamedTuple):
  """The rows the update computes on (`order_rows`).

  batch: those rows (ordered; the whole batch when nothing is reordered), at the update's
  width; full: the whole batch at that width; order: batch row k is full row order[k] (None:
  the same rows); full_t: completion columns before any cut (the loss's length normaliser);
  norms: the loss's row / token normalisers (the whole batch's); left_out: signal rows not
  computed on (must be 0); drop: rows were left out.
  """

  batch: Batch
  full: Batch
  order: jax.Array | None
  full_t: int
  norms: dict
  left_out: jax.Array | None
  drop: bool


def mix_replay(state: TrainState, fresh: Batch, cfg: StepConfig, mesh: Mesh | None):
  """Phase 1: the fresh rows plus the replayed ones (state's ring updated). Returns (state,
  batch, replayed bool[B+R] or None)."""
  if cfg.replay is None:
    return state, fresh, None
  state, batch, replayed = _with_replay(state, fresh, cfg)
  if mesh is not None:
    batch, replayed = shd.constrain_batch((batch, replayed), mesh)
  return state, batch, replayed


def order_rows(batch: Batch, n_fresh: int, cfg: StepConfig, mesh: Mesh | None,
               width: int | None, rows: int | None, parts: tuple[int, ...] | None) -> Ordered:
  """Phase 2: cut the batch to `width` columns; with `rows`, keep the rows `row_order` picks;
  with `parts`, sort them longest first (each micro-batch's width was sized for its rows)."""
  full_t = batch.completions.shape[1]
  if width is not None and width < full_t:
    batch = _trim(batch, width)
  all_rows = batch.lengths.shape[0]
  t = batch.completions.shape[1]
  m = cfg.num_minibatches
  drop = rows is not None and rows < all_rows
  if drop and (m != 1 or cfg.loss.kl_coef > 0):
    raise ValueError(f"update rows={rows} < {all_rows} needs one minibatch and no KL term.")
  if parts is not None and (m != 1 or (rows or all_rows) % len(parts) or max(parts) > t):
    raise ValueError(f"update parts={parts} needs one minibatch, rows={rows or all_rows} "
                     f"divisible by {len(parts)} and widths <= {t}.")
  # Rows the loss averages over: the sampled ones (adaptive budgets leave some unsampled:
  # no tokens, advantage 0; they must not dilute seq_mean_* aggregations).
  unsampled = cfg.batch_size - cfg.sampled_rows
  norms = dict(norm_rows=all_rows - unsampled) if unsampled else {}
  if not drop and parts is None:
    return Ordered(batch, batch, None, full_t, norms, None, False)
  is_rep = jnp.arange(all_rows) >= n_fresh
  if drop:
    zero = (batch.advantages == 0) & ~is_rep
    order = row_order(is_rep, zero, batch.lengths, full_t, rows, xp=jnp)
  else:
    order = jnp.arange(all_rows)
  if parts is not None:  # longest first: the host sized each micro-batch's width for it
    order = order[jnp.argsort(-jnp.take(batch.lengths, order), stable=True)]
  signal = batch.advantages != 0
  left_out = signal.sum() - jnp.take(signal, order).sum()
  # (from the lengths: rows left out may be longer than the columns computed on)
  norms = dict(norm_rows=all_rows - unsampled,
               norm_tokens=batch.lengths.astype(jnp.float32).sum())
  ordered = jax.tree.map(lambda x: jnp.take(x, order, axis=0), batch)
  if mesh is not None:
    ordered = shd.constrain_batch(ordered, mesh)
  return Ordered(ordered, batch, order, full_t, norms, left_out, drop)


def split_micro_batches(batch: Batch, widths: tuple[int, ...], mesh: Mesh | None,
                        m: int) -> tuple[Batch, ...]:
  """Phase 3: equal row slices, slice i cut to widths[i] columns, each split into the
  optimizer's m minibatches ([m, rows/m, ...], strided)."""
  r = batch.lengths.shape[0] // len(widths)
  if len(widths) == 1:
    part_batches = [batch]
  else:
    part_batches = [_trim(jax.tree.map(lambda x, i=i: x[i * r:(i + 1) * r], batch), w)
                    for i, w in enumerate(widths)]
    if mesh is not None:
      part_batches = [shd.constrain_batch(b, mesh) for b in part_batches]
  return tuple(_minibatches(b, m) for b in part_batches)


@dataclasses.dataclass(frozen=True)
class _Policy:
  """The trainable model's completion log-probs (LoRA: adapters on the unmerged path)."""

  graphdef: Any
  cfg: StepConfig
  base: Any

  def model_logp(self, params, *seqs):  # params: a whole model's weights
    return completion_logprobs(self.graphdef, params, *seqs,
                               temperature=self.cfg.sampling.policy_temperature,
                               chunk=self.cfg.logprob_chunk, remat=self.cfg.remat)

  def __call__(self, params, *seqs):  # params: the trainable tree
    return self.model_logp(model_params(params, self.base, self.cfg), *seqs)

  def forward(self, params, seqs, fn=None):
    """No-grad log-probs over [m, ...] minibatches, one minibatch live at a time."""
    fn = fn or self
    return jax.lax.map(lambda x: fn(params, *x)[0], seqs)


def _seqs(b: Batch):
  return (b.prompts, b.prompt_lens, b.completions, b.lengths)


def proximal_and_reference_logp(state: TrainState, mb_parts, policy: _Policy,
                                cfg: StepConfig):
  """Phase 4: pi_old per micro-batch (the policy before this update; with fuse_pi_old the
  first minibatch's gradient pass yields it, so only the others need a forward) and the KL
  reference's log-probs (None without a KL term; LoRA: the base with the adapters off)."""
  m = cfg.num_minibatches

  def first_pi_old(b):
    if not cfg.fuse_pi_old:
      return policy.forward(state.params, _seqs(b))
    first = jnp.zeros((1, *b.behaviour_logp.shape[1:]), jnp.float32)
    if m == 1:
      return first
    rest = jax.tree.map(lambda x: x[1:], _seqs(b))
    return jnp.concatenate([first, policy.forward(state.params, rest)])

  pi_old = jax.lax.stop_gradient(tuple(first_pi_old(b) for b in mb_parts))
  ref_logp = None
  if cfg.loss.kl_coef > 0:
    ref_logp = tuple(policy.forward(state.base, _seqs(b), policy.model_logp)
                     if cfg.lora is not None else policy.forward(state.ref_params, _seqs(b))
                     for b in mb_parts)
  return pi_old, ref_logp


@dataclasses.dataclass(frozen=True)
class _Loss:
  """One micro-batch's share of the loss (the whole batch's normalisers) and its gradient."""

  policy: _Policy
  cfg: StepConfig
  full_t: int
  norms: tuple[tuple[str, Any], ...]

  def __call__(self, params, b, ref, old_in, is_first):
    logp, mask = self.policy(params, *_seqs(b))
    old = jnp.where(is_first, jax.lax.stop_gradient(logp), old_in)
    anchor = b.behaviour_logp if self.cfg.loss.anchor == "behaviour" else old
    loss, metrics = policy_loss(logp, anchor, b.behaviour_logp, b.advantages, mask,
                                self.cfg.loss, ref, norm_len=self.full_t, **dict(self.norms))
    return loss, (metrics, old, mask.astype(jnp.float32).sum())

  def grad(self, *args):
    return jax.value_and_grad(self.__call__, has_aux=True)(*args)


def _accumulate_equal_parts(loss: _Loss, params, bs, refs, olds_in, is_first):
  """Equal-shape micro-batches as one scan: part k+1 reuses part k's buffers. (A Python loop
  of value-and-grads, even with an optimization barrier between the parts, kept every part's
  activations live in XLA's buffer assignment: measured, tests/test_memory.py.)"""
  def body(acc, xs):
    b, ref, old_in = xs
    (l, (metrics, old, count)), g = loss.grad(params, b, ref, old_in, is_first)
    return (g if acc is None else jax.tree.map(jnp.add, acc, g)), (l, metrics, old, count)
  if len(bs) == 1:
    g, (l, metrics, old, count) = body(None, (bs[0], refs and refs[0], olds_in[0]))
    return g, l[None], {k: v[None] for k, v in metrics.items()}, [old], count[None]
  stack = lambda xs: None if xs is None else jax.tree.map(lambda *x: jnp.stack(x), *xs)
  g, (losses, metrics, olds, counts) = jax.lax.scan(
      body, jax.tree.map(jnp.zeros_like, params), (stack(bs), stack(refs), stack(olds_in)))
  return g, losses, metrics, [olds[k] for k in range(len(bs))], counts


def loss_and_grads(loss: _Loss, params, bs, refs, olds_in, is_first):
  """The batch's loss and gradient, micro-batch by micro-batch (gradient accumulation).

  Each part's loss already carries the whole batch's normalisers, so the summed gradient is
  the batch's. Consecutive parts of one width run as a scan (`_accumulate_equal_parts`), so
  at most one part per distinct width is live: with `update_micro_rows` at equal widths, one.
  """
  if len(bs) == 1:
    (l, (metrics, old, _)), grads = loss.grad(
        params, bs[0], None if refs is None else refs[0], olds_in[0], is_first)
    return l, metrics, (old,), grads
  runs, start = [], 0
  for k in range(1, len(bs) + 1):
    if k == len(bs) or bs[k].completions.shape != bs[start].completions.shape:
      runs.append(list(range(start, k)))
      start = k
  grads, losses, mets, olds, counts = None, [], [], [], []
  for run in runs:
    pick = lambda xs, run=run: None if xs is None else [xs[k] for k in run]
    g, l, metrics, old, count = _accumulate_equal_parts(loss, params, pick(bs), pick(refs),
                                                        pick(olds_in), is_first)
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    losses.append(l)
    mets.append(metrics)
    olds += old
    counts.append(count)
  losses, counts = jnp.concatenate(losses), jnp.concatenate(counts)
  n = counts.sum()  # token means over all parts, weighted by their tokens
  metrics = {k: (jnp.concatenate([m[k] for m in mets]) * counts).sum() / jnp.maximum(n, 1.0)
             for k in mets[0]}
  metrics["loss/policy"] = losses.sum()
  return losses.sum(), metrics, tuple(olds), grads


def guarded_apply(tx, grads, loss, params, opt_state):
  """One optimizer update, skipped (params and state unchanged) when the loss or the
  gradient's global norm is non-finite. Returns (params, opt_state, grad_norm, finite).

  The norm is one fused reduction (non-finite iff an entry is, or the squares overflow f32);
  the optimizer runs under lax.cond, so a skipped update computes nothing and a kept one
  needs no select over params and optimizer state (at 100M on CPU, per-leaf isfinite on
  grads and new params plus those selects cost ~0.3 s per update; traced). With finite
  gradients, clip + AdamW give finite results. The host loop stops after K skips in a row.
  """
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

  def apply(params, opt_state):
    updates, new_opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt_state
  params, opt_state = jax.lax.cond(finite, apply, lambda p, s: (p, s), params, opt_state)
  return params, opt_state, grad_norm, finite


def optimise(state: TrainState, mb_parts, pi_old, ref_logp, loss: _Loss, cfg: StepConfig, tx):
  """Phase 5: num_updates epochs x num_minibatches guarded optimizer steps (one scan each).
  Returns (params, opt_state, pi_old per micro-batch as computed, mean metrics)."""
  m = cfg.num_minibatches

  def minibatch_step(carry, xs):
    params, opt_state, store, epoch = carry
    j, b, ref = xs
    is_first = (epoch == 0) & (j == 0) & cfg.fuse_pi_old
    l, metrics, old, grads = loss_and_grads(loss, params, b, ref,
                                            tuple(s[j] for s in store), is_first)
    store = tuple(s.at[j].set(o) for s, o in zip(store, old))
    params, opt_state, grad_norm, finite = guarded_apply(tx, grads, l, params, opt_state)
    metrics["grad_norm"] = jnp.where(finite, grad_norm, 0.0)
    metrics["guard/skipped_updates"] = (~finite).astype(jnp.float32)
    return (params, opt_state, store, epoch), metrics

  def epoch_step(carry, epoch):
    params, opt_state, store = carry
    (params, opt_state, store, _), metrics = jax.lax.scan(
        minibatch_step, (params, opt_state, store, epoch), (jnp.arange(m), mb_parts, ref_logp))
    return (params, opt_state, store), metrics

  (params, opt_state, pi_old), metrics = jax.lax.scan(
      epoch_step, (state.params, state.opt_state, pi_old), jnp.arange(cfg.num_updates))
  skipped = metrics.pop("guard/skipped_updates").sum()
  metrics = jax.tree.map(jnp.mean, metrics)
  metrics["guard/skipped_updates"] = skipped
  return params, opt_state, pi_old, metrics


def update_metrics(metrics: dict, state: TrainState, ro: Rollouts, o: Ordered,
                   widths: tuple[int, ...], pi_old, replayed, cfg: StepConfig) -> dict:
  """Phase 6: the update's guards and shape, then the step's ledger over the whole batch."""
  batch = o.batch
  t = batch.completions.shape[1]
  r = batch.lengths.shape[0] // len(widths)
  old_logp = jnp.concatenate([jnp.pad(_unminibatch(p), ((0, 0), (0, t - w)))
                              for p, w in zip(pi_old, widths)])
  mask = jnp.arange(t)[None, :] < batch.lengths[:, None]
  # Tokens past a row's computed width would be silently dropped: must be 0 (the host sizes
  # the widths from the rows' lengths); the trainer checks it.
  row_width = jnp.repeat(jnp.asarray(widths, jnp.int32), r)
  metrics["guard/rows_over_width"] = (batch.lengths > row_width).sum().astype(jnp.float32)
  computed = sum(r * (batch.prompts.shape[1] + w) for w in widths)
  counted = (batch.advantages != 0) if o.drop else jnp.ones(batch.lengths.shape, bool)
  real = jnp.where(counted, batch.prompt_lens + batch.lengths, 0).astype(jnp.float32).sum()
  rows_c = batch.lengths.shape[0]
  if o.order is not None:  # back to the whole batch's rows; rows left out have no pi_old
    full_mask = jnp.arange(t)[None, :] < o.full.lengths[:, None]
    old_logp = jnp.zeros(full_mask.shape, jnp.float32).at[o.order].set(old_logp)
    mask = jnp.zeros(full_mask.shape, bool).at[o.order].set(mask)
    batch = o.full
  metrics["ledger/update_width"] = jnp.asarray(t, jnp.float32)
  metrics["ledger/update_rows"] = jnp.asarray(rows_c, jnp.float32)
  metrics["ledger/update_parts"] = jnp.asarray(len(widths), jnp.float32)
  # Must be 0 (the host sizes `rows` from the signal count); the trainer checks it.
  metrics["guard/signal_rows_left_out"] = (o.left_out if o.order is not None else
                                           jnp.zeros((), jnp.int32)).astype(jnp.float32)
  # Token slots the update computed on that were padding (cut columns, left-out rows and the
  # columns past each micro-batch's width are not computed, so they do not count).
  metrics["ledger/update_pad_frac"] = 1.0 - jnp.minimum(real, computed) / computed
  metrics.update(ledger(ro.batch, ro.stats, batch, mask, old_logp, replayed,
                        state.policy_version, cfg, ro.valid))
  return metrics


def update(state: TrainState, ro: Rollouts, *, graphdef, cfg: StepConfig, tx,
           mesh: Mesh | None = None, width: int | None = None,
           rows: int | None = None, parts: tuple[int, ...] | None = None
           ) -> tuple[TrainState, dict]:
  """num_updates passes of num_minibatches optimizer steps on the (fresh + replayed) batch.

  width / rows / parts: the update's static shape (`rlx.update_plan.plan`; None: all of it).
  width: completion columns computed on (columns past every row's length are padding:
    cutting them changes no result; the loss normaliser stays max_new_tokens).
  rows: with one minibatch and no KL term a zero-advantage row adds exactly nothing to the
    gradient (every per-token term is w * A * ratio), so the rows with signal (replayed rows
    first) are moved to the front and only the first `rows` are computed on; the loss keeps
    the whole batch's row and token counts as its normalisers, so the result is unchanged.
  parts: length-sorted micro-batches (one minibatch only): rows sorted longest first, split
    into len(parts) equal micro-batches, micro-batch i cut to parts[i] columns; their summed
    gradient is the batch's (one optimizer step) while short rows stop paying for the
    longest row's width.
  pi_old (the proximal policy) is the current policy's log-prob before any update: the first
  minibatch's gradient pass yields it (cfg.fuse_pi_old); later passes reuse it.
  """
  parts = tuple(parts) if parts is not None and len(parts) > 1 else None
  state, batch, replayed = mix_replay(state, ro.batch, cfg, mesh)
  o = order_rows(batch, ro.batch.lengths.shape[0], cfg, mesh, width, rows, parts)
  widths = parts or (o.batch.completions.shape[1],)
  mb_parts = split_micro_batches(o.batch, widths, mesh, cfg.num_minibatches)
  policy = _Policy(graphdef, cfg, state.base)
  pi_old, ref_logp = proximal_and_reference_logp(state, mb_parts, policy, cfg)
  loss = _Loss(policy, cfg, o.full_t, tuple(sorted(o.norms.items())))
  params, opt_state, pi_old, metrics = optimise(state, mb_parts, pi_old, ref_logp, loss, cfg,
                                                tx)
  metrics = update_metrics(metrics, state, ro, o, widths, pi_old, replayed, cfg)
  new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1,
                            policy_version=state.policy_version + cfg.num_updates *
                            cfg.num_minibatches)
  return new_state, metrics


def ledger(fresh: Batch, stats: dict, batch: Batch, mask, old_logp, replayed, policy_version,
           cfg: StepConfig, valid=None) -> dict:
  """Where this step's compute went, plus reward and replay statistics (device scalars).

  fresh: this step's rollouts (after dynamic filtering); batch: what was trained on (fresh
  plus replayed rows); mask / old_logp are over `batch`; valid: fresh rows sampled (None:
  all; rlx.rl.adaptive). Every generated token is counted once:
    tokens_generated = tokens_trained - tokens_replayed (fresh rows with signal)
                       + tokens_zero_adv (fresh rows with advantage 0)
                       + tokens_discarded (dynamic filtering)
  """
  g = cfg.group_size
  b = fresh.lengths.shape[0]
  lengths = fresh.lengths.astype(jnp.float32)
  v = jnp.ones((b,), bool) if valid is None else valid
  vf = v.astype(jnp.float32)
  n_rows = vf.sum()
  groups = fresh.rewards.reshape(-1, g)
  # Zero-signal groups by their advantages (what the loss and the replay ring see), not by the
  # task rewards: shaped rewards can differ where the verifier's do not, and the other way round.
  zero_var = jnp.all(fresh.advantages.reshape(-1, g) == 0, axis=1)
  signal = fresh.advantages != 0
  # batch's first b rows are the fresh ones (at the update's width).
  drift = jnp.where(mask[:b], jnp.abs(old_logp[:b] - batch.behaviour_logp[:b]), 0.0)
  out = {
      "reward/mean": jnp.where(v, fresh.rewards, 0.0).sum() / n_rows,
      "reward/pass_at_group": jnp.mean(jnp.any((groups > 0) & v.reshape(-1, g), axis=1)),
      "ledger/tokens_trained": jnp.where(signal, lengths, 0.0).sum(),
      # Every fresh row without signal: zero-variance groups, and rows whose advantage is 0
      # in a group with signal (a filtered overlong row, a reward equal to the group mean).
      "ledger/tokens_zero_adv": jnp.where(signal, 0.0, lengths).sum(),
      "ledger/zero_adv_group_frac": zero_var.astype(jnp.float32).mean(),
      "ledger/truncated_frac": (fresh.truncated & v).astype(jnp.float32).sum() / n_rows,
      "ledger/response_len_mean": lengths.sum() / n_rows,
      "ledger/sequences": n_rows,
      "ledger/logp_drift_max": drift.max(),
      # Optimizer updates between the policy that generated each fresh row and the one
      # trained (0 in the sync step; up to pipeline.max_staleness x updates per step in
      # overlap mode, rlx.pipeline).
      "ledger/staleness_mean": ((policy_version - fresh.policy_version) * vf).sum() / n_rows,
      "ledger/staleness_max": (policy_version - fresh.policy_version).max().astype(
          jnp.float32),
      **stats,
  }
  out["ledger/tokens_wasted"] = out["ledger/tokens_zero_adv"] + out["ledger/tokens_discarded"]
  level_G = fresh.difficulty.reshape(-1, g)[:, 0]
  for level in cfg.ledger_levels:
    out[f"ledger/mixed_groups_d{level}"] = jnp.sum(
        (level_G == level) & ~zero_var).astype(jnp.float32)
  if cfg.staleness_hist:  # fresh rows per staleness bin (rlx.pipeline: up to max_staleness)
    hist = replay_lib.staleness_histogram(policy_version - fresh.policy_version,
                                          jnp.ones(fresh.lengths.shape, bool))
    for i, lo in enumerate(replay_lib.STALENESS_BINS):
      out[f"ledger/staleness_hist_{lo}"] = hist[i].astype(jnp.float32)
  if replayed is not None:
    rep_len = jnp.where(replayed, batch.lengths, 0).astype(jnp.float32)
    rep_tokens = rep_len.sum()
    rep_mask = mask & replayed[:, None]
    w_raw = jnp.exp(old_logp - batch.behaviour_logp)
    staleness = policy_version - batch.policy_version
    hist = replay_lib.staleness_histogram(staleness, replayed)
    out.update({
        "ledger/tokens_replayed": rep_tokens,
        "replay/rows": replayed.astype(jnp.float32).sum(),
        "replay/reuse_ratio": rep_tokens / jnp.maximum(
            rep_tokens + out["ledger/tokens_trained"], 1.0),
        "replay/ess": replay_lib.effective_sample_size(
            importance_weights(old_logp, batch.behaviour_logp, cfg.loss.is_cap,
                               cfg.loss.is_mode)[0], rep_mask),
        "replay/capped_frac": (jnp.where(rep_mask, w_raw > cfg.loss.is_cap, False).sum() /
                               jnp.maximum(rep_mask.sum(), 1)),
        "replay/staleness_mean": (jnp.where(replayed, staleness, 0).sum() /
                                  jnp.maximum(replayed.sum(), 1)),
    })
    for i, lo in enumerate(replay_lib.STALENESS_BINS):
      out[f"replay/staleness_hist_{lo}"] = hist[i].astype(jnp.float32)
    out["ledger/tokens_trained"] = out["ledger/tokens_trained"] + rep_tokens
  else:
    out["ledger/tokens_replayed"] = jnp.zeros((), jnp.float32)
  return out


def train_step(state: TrainState, pool: PromptPool, *, graphdef, cfg: StepConfig, tx,
               mesh: Mesh | None = None) -> tuple[TrainState, dict]:
  """The fused step: rollout then update, one pure function."""
  state, ro = rollout(state, pool, graphdef=graphdef, cfg=cfg, mesh=mesh)
  return update(state, ro, graphdef=graphdef, cfg=cfg, tx=tx, mesh=mesh)


# ----------------------------------------------------------------------------- LoRA


def model_params(params, base, cfg: StepConfig):
  """What the update's model computes with: `params` itself, or (LoRA) the frozen base with
  the adapters in `params` attached on the unmerged low-rank path (gradients reach only the
  adapters, and no [in, out] weight gradient is formed)."""
  return params if cfg.lora is None else lora_lib.attach(base, params, cfg.lora)


def policy_params(state: TrainState, cfg: StepConfig):
  """What the sampler and evaluation decode with: the params, or (LoRA) the base with the
  adapters merged (cfg.lora.merge_for_sampling: W + scale * A @ B once per call, so each
  decoded token costs what the full-parameter model's does) or attached unmerged."""
  if cfg.lora is None:
    return state.params
  if cfg.lora.merge_for_sampling:
    return _merge(state.base, state.params, cfg.lora)
  return lora_lib.attach(state.base, state.params, cfg.lora)


_merge = jax.jit(lora_lib.merge, static_argnums=2)


# ----------------------------------------------------------------------------- state + jit


def state_shardings(abstract_state: TrainState, mesh: Mesh, rules=shd.DEFAULT_RULES):
  p_shard = shd.param_shardings(abstract_state.params, mesh, rules)
  rep = shd.replicated(mesh)
  replay = None
  if abstract_state.replay is not None:
    # The ring's rows are split over the data-parallel axes; the write pointer is global.
    replay = jax.tree.map(lambda x: shd.batch_sharding(mesh, x.ndim) if x.ndim else rep,
                          abstract_state.replay)
  return TrainState(
      params=p_shard,
      opt_state=shd.shardings_like_params(abstract_state.opt_state, p_shard, mesh),
      rng=rep, step=rep, policy_version=rep,
      ref_params=None if abstract_state.ref_params is None else p_shard,
      base=None if abstract_state.base is None else shd.param_shardings(
          abstract_state.base, mesh, rules),
      selector=None if abstract_state.selector is None else jax.tree.map(
          lambda _: rep, abstract_state.selector),
      replay=replay)


def init_state(params, tx, seed: int, mesh: Mesh, *, with_ref: bool = False,
               num_prompts: int | None = None, prompt_groups=None,
               replay: replay_lib.ReplayConfig | None = None,
               prompt_width: int = 0, max_new_tokens: int = 0,
               lora: lora_lib.LoRAConfig | None = None,
               selector_spread: bool = False,
               rules=shd.DEFAULT_RULES) -> TrainState:
  """Places params on the mesh and builds the optimizer state with matching shardings.

  lora: params become the frozen `base` (cast to lora.base_dtype) and the trainable
  `params` are fresh adapters (B = 0: the policy starts equal to the base; A drawn from
  `seed`); only the adapters get optimizer state, and no reference copy is made for KL.

  num_prompts: size of the prompt pool, for the pass-rate selector (None: no selector).
  prompt_groups: i32[num_prompts] difficulty bucket (0..K-1) of each prompt (None: one).
  selector_spread: the selector keeps each bucket's E[p(1-p)] (selection.bucket_score="spread").
  replay: the ring's config (None: no ring); prompt_width / max_new_tokens size its rows.
  """
  def make(params):
    base = None
    if lora is not None:
      base = lora_lib.cast_base(params, lora)
      params = lora_lib.init_adapters(params, lora, seed)
    return TrainState(
        params=params, opt_state=tx.init(params),
        rng=jax.random.key_data(jax.random.key(seed)),
        step=jnp.zeros((), jnp.int32), policy_version=jnp.zeros((), jnp.int32),
        ref_params=params if with_ref and lora is None else None, base=base,
        selector=None if num_prompts is None else selection.SelectorState.init(
            num_prompts, prompt_groups,
            1 if prompt_groups is None else int(np.max(prompt_groups)) + 1,
            spread=selector_spread),
        replay=None if replay is None else replay_lib.ReplayState.init(
            replay.capacity, prompt_width, max_new_tokens))
  abstract = jax.eval_shape(make, params)
  shardings = state_shardings(abstract, mesh, rules)
  params = shd.put(params, shardings.params if lora is None else shardings.base)
  return jax.jit(make, out_shardings=shardings)(params)


@dataclasses.dataclass
class StepFns:
  """Jitted halves and the fused step, with donated state and fixed shardings."""

  rollout: Callable  # (state, pool) -> (state, rollouts)
  update: Callable  # (state, rollouts) -> (state, metrics)
  train_step: Callable  # (state, pool) -> (state, metrics): rollout + update, fused
  generate: Callable  # (state, pool) -> (state, rollouts, _): for host-Python rewards ...
  score_update: Callable  # (state, rollouts, rewards) -> (state, metrics): ... then this
  state_sharding: TrainState
  pool_sharding: Any


def score_update(state: TrainState, ro: Rollouts, rewards, *, graphdef, cfg: StepConfig, tx,
                 mesh: Mesh | None = None, width: int | None = None,
                 rows: int | None = None, parts: tuple[int, ...] | None = None
                 ) -> tuple[TrainState, dict]:
  """The update half for rewards computed on the host (see rlx.rewards)."""
  state, ro = score(state, ro, rewards, cfg=cfg, mesh=mesh)
  return update(state, ro, graphdef=graphdef, cfg=cfg, tx=tx, mesh=mesh, width=width,
                rows=rows, parts=parts)


def update_shape(ro: Rollouts, cfg: StepConfig, num_batch_devices: int = 1, *,
                 scored: bool = True) -> dict:
  """`update`'s static shape for these rollouts as keyword arguments (host side, waits for
  the rollout): `rlx.update_plan.plan(...).kwargs()`."""
  return update_plan.plan(ro, cfg, num_batch_devices, scored=scored).kwargs()


class _ByShape:
  """One jitted function per static update shape (`update_shape`: at most update_buckets
  widths x 2 row counts, times the non-increasing width tuples of the micro-batches)."""

  def __init__(self, make: Callable[..., Callable]):
    self._make = make
    self._fns: dict[tuple, Callable] = {}

  def __call__(self, *args, width: int | None = None, rows: int | None = None,
               parts: tuple[int, ...] | None = None):
    key = (width, rows, parts)
    if key not in self._fns:
      self._fns[key] = self._make(width, rows, parts)
    return self._fns[key](*args)

  def _cache_size(self) -> int:
    return sum(fn._cache_size() for fn in self._fns.values())  # pylint: disable=protected-access


def make_step_fns(graphdef, cfg: StepConfig, tx, mesh: Mesh, abstract_state: TrainState,
                  rules=shd.DEFAULT_RULES) -> StepFns:
  s_shard = state_shardings(abstract_state, mesh, rules)
  rep = shd.replicated(mesh)
  kw = dict(graphdef=graphdef, cfg=cfg, mesh=mesh)
  roll = jax.jit(functools.partial(rollout, **kw), donate_argnums=0,
                 in_shardings=(s_shard, rep), out_shardings=(s_shard, None))
  upd = _ByShape(lambda w, r, p: jax.jit(
      functools.partial(update, tx=tx, width=w, rows=r, parts=p, **kw), donate_argnums=0,
      in_shardings=(s_shard, None), out_shardings=(s_shard, rep)))
  fused = jax.jit(functools.partial(train_step, tx=tx, **kw), donate_argnums=0,
                  in_shardings=(s_shard, rep), out_shardings=(s_shard, rep))
  gen = jax.jit(functools.partial(generate, **kw), donate_argnums=0,
                in_shardings=(s_shard, rep), out_shardings=(s_shard, None, None))
  sc_upd = _ByShape(lambda w, r, p: jax.jit(
      functools.partial(score_update, tx=tx, width=w, rows=r, parts=p, **kw), donate_argnums=0,
      in_shardings=(s_shard, None, None), out_shardings=(s_shard, rep)))
  return StepFns(rollout=roll, update=upd, train_step=fused, generate=gen,
                 score_update=sc_upd, state_sharding=s_shard, pool_sharding=rep)
