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
The state, the rollouts and the static step config live in rlx.step_state, the update half
in rlx.update; every name is importable from here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from rlx import sharding as shd
from rlx import update_plan
from rlx.data.tasks import PromptPool
from rlx.model import lora as lora_lib
from rlx.rl import adaptive as adaptive_lib
from rlx.rl import advantages as adv_lib
from rlx.rl import length as length_lib
from rlx.rl import replay as replay_lib
from rlx.rl import selection
from rlx.rl.loss import LossConfig, policy_loss
from rlx.sampler import dense, paged
# The host-side shape planning (re-exported: tests, rlx.memory and benchmarks use them here).
from rlx.update_plan import micro_parts, part_widths, row_order, update_rows, update_width  # pylint: disable=unused-import
# The step's state, rollouts and static config (rlx.step_state) and the update half
# (rlx.update), re-exported: rlx.train is where the step reads as one data flow.
# pylint: disable=unused-import,g-multiple-import
from rlx.step_state import (Batch, Rollouts, StepConfig, TrainState, completion_logprobs,
                            model_params, policy_params, sampling_copy, sequence_inputs)
from rlx.update import (Ordered, _trim, guarded_apply, ledger, loss_and_grads, mix_replay,
                        optimise, order_rows, proximal_and_reference_logp,
                        split_micro_batches, update, update_metrics)
# pylint: enable=unused-import,g-multiple-import


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
  if cfg.selection.mode in ("oracle", "probe"):
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


def true_pass_rate(state: TrainState, pool: PromptPool, ids, *, graphdef, cfg: StepConfig,
                   with_length: bool = False):
  """f32[len(ids)]: each prompt's pass rate under the current policy at the sampling
  temperature, from teacher-forced forwards (top-k / top-p truncation, if set, ignored).

  On an exact-match task it is the probability of the one correct completion (the answer
  tokens + EOS), exactly. Where the pool carries probe references (a reward that accepts more
  than one completion, TaskDef.probe_references) it is the sum of their probabilities, one
  forward per reference in turn (the peak memory of one forward): a lower bound of the pass
  rate, exact when no other completion passes.

  with_length: also f32[len(ids)], each prompt's expected completion length (tokens + EOS):
  the answer's length on an exact-match task; with references, their lengths weighted by
  their probabilities (the length of a correct sample, which a task whose answers follow one
  format also takes for a wrong one), their mean where every probability is 0.
  """
  sub = pool.take(ids)
  params = policy_params(state, cfg)
  temperature = cfg.sampling.temperature or 1.0

  def prob(completions, lens):
    lp, mask = completion_logprobs(graphdef, params, sub.prompts, sub.prompt_lens,
                                   completions, lens, temperature, chunk=cfg.logprob_chunk)
    return jnp.where(lens > 0, jnp.exp(jnp.where(mask, lp, 0.0).sum(axis=1)), 0.0)

  if sub.references is None:
    p = prob(sub.answers, sub.answer_lens)
    return (p, sub.answer_lens.astype(jnp.float32)) if with_length else p
  # One reference at a time (lax.map: one forward compiled, never two in memory at once).
  per_ref = jax.lax.map(lambda x: prob(*x), (jnp.moveaxis(sub.references, 1, 0),
                                             jnp.moveaxis(sub.reference_lens, 1, 0))).T
  p = per_ref.sum(axis=1)
  if not with_length:
    return p
  lens, named = sub.reference_lens.astype(jnp.float32), sub.reference_lens > 0
  mean_len = jnp.where(named, lens, 0.0).sum(axis=1) / jnp.maximum(named.sum(axis=1), 1)
  weighted = (per_ref * lens).sum(axis=1) / jnp.where(p > 0, p, 1.0)
  return p, jnp.where(p > 0, weighted, mean_len)


def probe_tokens(sub: PromptPool):
  """f32: the tokens the probe's forwards over `sub` read (prompt + completion, per
  reference where the pool has them): its FLOPs in the ledger."""
  if sub.references is None:
    return (sub.prompt_lens + sub.answer_lens).sum().astype(jnp.float32)
  n_refs = (sub.reference_lens > 0).sum(axis=1)
  return (sub.prompt_lens * n_refs + sub.reference_lens.sum(axis=1)).sum().astype(jnp.float32)


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
      "ledger/shadow_probe_tokens": f32(due) * probe_tokens(sub),
  }


def oracle_choose(state: TrainState, pool: PromptPool, key, n: int, *, graphdef,
                  cfg: StepConfig):
  """selection.mode="oracle" / "probe": n prompts chosen by their true current pass rate.

  On an exact-match task a prompt's pass rate under sampling at temperature T is the
  probability of its one correct completion (the answer tokens + EOS), which one
  teacher-forced forward gives exactly (top-k / top-p truncation, if set, is ignored); on a
  task with probe references, the sum of theirs (`true_pass_rate`). The forwards are counted
  in ledger/probe_tokens: the oracle's cost is FLOPs, not generated tokens. Returns
  (ids i32[n], stats).
  """
  k_cand, k_tie = jax.random.split(key)
  sc = cfg.selection
  c = n * sc.probe_factor if sc.mode == "probe" else sc.oracle_candidates or pool.size
  c = min(c, pool.size)
  if c < pool.size:
    cand = jax.random.choice(k_cand, pool.size, (c,), replace=False).astype(jnp.int32)
  else:
    cand = jnp.arange(pool.size, dtype=jnp.int32)
  sub = pool.take(cand)
  p, length = true_pass_rate(state, pool, cand, graphdef=graphdef, cfg=cfg, with_length=True)
  ids = selection.oracle_pick(p, cand, n, cfg.group_size, k_tie,
                              length if sc.probe_score == "mixed_per_token" else None)
  picked = jnp.isin(cand, ids)
  stats = {
      "ledger/probe_tokens": probe_tokens(sub),
      "select/oracle_expected_len": jnp.where(picked, length, 0.0).sum() / n,
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
  length_adv = length_w = None
  guard_stats = {}
  if cfg.length.length_reward > 0:
    length_w = length_lib.length_weight(cfg.length, state.step)
    term = length_w * length_lib.group_length_reward(
        batch.lengths, correct, g, valid, cfg.length.length_scale)
    if state.length_guard is not None:  # per-level: off where a level lost accuracy
      guard, row_m, guard_stats = length_lib.guard_update(
          state.length_guard, cfg.length, state.step, batch.difficulty, correct, valid)
      state = state.replace(length_guard=guard)
      term = term * row_m
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
  if length_w is not None:
    stats["length/weight"] = length_w
  stats.update(guard_stats)
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




def train_step(state: TrainState, pool: PromptPool, *, graphdef, cfg: StepConfig, tx,
               mesh: Mesh | None = None) -> tuple[TrainState, dict]:
  """The fused step: rollout then update, one pure function."""
  state, ro = rollout(state, pool, graphdef=graphdef, cfg=cfg, mesh=mesh)
  return update(state, ro, graphdef=graphdef, cfg=cfg, tx=tx, mesh=mesh)




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
      replay=replay,
      length_guard=None if abstract_state.length_guard is None else jax.tree.map(
          lambda _: rep, abstract_state.length_guard))


def init_state(params, tx, seed: int, mesh: Mesh, *, with_ref: bool = False,
               num_prompts: int | None = None, prompt_groups=None,
               replay: replay_lib.ReplayConfig | None = None,
               prompt_width: int = 0, max_new_tokens: int = 0,
               lora: lora_lib.LoRAConfig | None = None,
               selector_spread: bool = False, length_levels=None,
               rules=shd.DEFAULT_RULES) -> TrainState:
  """Places params on the mesh and builds the optimizer state with matching shardings.

  lora: params become the frozen `base` (cast to lora.base_dtype) and the trainable
  `params` are fresh adapters (B = 0: the policy starts equal to the base; A drawn from
  `seed`); only the adapters get optimizer state, and no reference copy is made for KL.

  num_prompts: size of the prompt pool, for the pass-rate selector (None: no selector).
  prompt_groups: i32[num_prompts] difficulty bucket (0..K-1) of each prompt (None: one).
  selector_spread: the selector keeps each bucket's E[p(1-p)] (selection.bucket_score="spread").
  replay: the ring's config (None: no ring); prompt_width / max_new_tokens size its rows.
  length_levels: the pool's difficulty values, for the length term's per-level guard
  (rlx.rl.length.LengthGuard; None: no guard).
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
            replay.capacity, prompt_width, max_new_tokens),
        length_guard=None if length_levels is None else length_lib.LengthGuard.init(
            length_levels))
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
