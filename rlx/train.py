"""The pure GRPO training step and the state it carries.

    train_step(state, pool) -> (state, metrics)      # pure; jit; state donated
      ids      = choose prompts (uniform, by the state's key)
      rollouts = sampler.generate(params, prompts[ids] x G)   # tokens, behaviour logp mu
      rewards  = task verifier (jnp)
      adv      = group advantages (grpo | dr_grpo | rloo)
      old logp = trainer's log-probs at the start of the update (pi_old)
      repeat num_updates x num_minibatches: grads of policy_loss -> optax update
      metrics  = ledger + loss statistics

The step is two pure halves, `rollout` and `update`, composed by `train_step`; the host loop
may run them separately to time generation and update (and to run host-Python rewards in
between). Both halves are jitted over a Mesh with NamedShardings; the state is donated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding

from rlx import sharding as shd
from rlx.data.tasks import PromptPool, exact_match_reward
from rlx.model import transformer
from rlx.model.config import ModelConfig
from rlx.rl import advantages as adv_lib
from rlx.rl.loss import LossConfig, policy_loss
from rlx.sampler import dense, paged
from rlx.sampler.sampling import SamplingParams


@struct.dataclass
class TrainState:
  params: Any
  opt_state: Any
  rng: jax.Array  # u32[2] raw key data (checkpoint friendly)
  step: jax.Array  # i32[]
  policy_version: jax.Array  # i32[] number of optimizer updates applied
  ref_params: Any = None  # only allocated when kl_coef > 0


@struct.dataclass
class Batch:
  """One step's rollouts, group-major: rows i*G .. i*G+G-1 share prompt i."""

  prompts: jax.Array  # i32[B, P] left-padded
  prompt_lens: jax.Array  # i32[B]
  completions: jax.Array  # i32[B, T]
  behaviour_logp: jax.Array  # f32[B, T]
  lengths: jax.Array  # i32[B]
  truncated: jax.Array  # bool[B]
  rewards: jax.Array  # f32[B]
  advantages: jax.Array  # f32[B]
  prompt_ids: jax.Array  # i32[B]
  difficulty: jax.Array  # i32[B]


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

  @property
  def batch_size(self) -> int:
    return self.prompts_per_step * self.group_size


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
  ppos, pvalid = dense.prompt_positions(prompt_lens_B, p)
  steps = jnp.arange(t)[None, :]
  cpos = prompt_lens_B[:, None] + steps
  cvalid = steps < lengths_B[:, None]
  tokens = jnp.concatenate([prompts_BxP, completions_BxT], axis=1)
  pos = jnp.concatenate([ppos, cpos.astype(jnp.int32)], axis=1)
  valid = jnp.concatenate([pvalid, cvalid], axis=1)
  return tokens, pos, valid, cvalid


def completion_logprobs(graphdef, params, prompts_BxP, prompt_lens_B, completions_BxT,
                        lengths_B, temperature: float):
  """log pi(completion tokens) [B, T] (f32) and the response mask [B, T]."""
  tokens, pos, valid, mask = sequence_inputs(prompts_BxP, prompt_lens_B, completions_BxT,
                                             lengths_B)
  lp = transformer.token_logprobs(graphdef, params, tokens, pos, valid, temperature)
  return lp[:, prompts_BxP.shape[1] - 1:], mask


# ----------------------------------------------------------------------------- step halves


def sample(graphdef, params, prompts, prompt_lens, keys, cfg: StepConfig, mesh: Mesh | None):
  if cfg.sampler_impl == "dense":
    return dense.generate_unjitted(graphdef, params, prompts, prompt_lens, keys, cfg.sampling)
  if cfg.sampler_impl == "paged":
    return paged.generate_unjitted(graphdef, params, prompts, prompt_lens, keys, cfg.sampling,
                                   cfg.paged or paged.PagedConfig(),
                                   group_size=cfg.group_size, mesh=mesh)
  raise ValueError(f"sampler impl {cfg.sampler_impl!r}; expected 'dense' or 'paged'.")


def rollout(state: TrainState, pool: PromptPool, *, graphdef, cfg: StepConfig,
            mesh: Mesh | None = None) -> tuple[TrainState, Batch]:
  """Chooses prompts, samples G completions each, scores them and computes advantages."""
  rng, k_choose, k_sample = jax.random.split(jax.random.wrap_key_data(state.rng), 3)
  n, g = cfg.prompts_per_step, cfg.group_size
  ids = jax.random.choice(k_choose, pool.size, (n,), replace=False).astype(jnp.int32)
  rows = jnp.repeat(ids, g)
  chosen = pool.take(rows)
  keys = jax.random.split(k_sample, n * g)
  if mesh is not None:
    chosen, keys, rows = shd.constrain_batch((chosen, keys, rows), mesh)
  ro = sample(graphdef, state.params, chosen.prompts, chosen.prompt_lens, keys, cfg, mesh)
  rewards = exact_match_reward(ro.tokens, chosen.answers, chosen.answer_lens)
  advantages, _ = adv_lib.group_advantages(rewards, g, cfg.advantage)
  batch = Batch(prompts=chosen.prompts, prompt_lens=chosen.prompt_lens, completions=ro.tokens,
                behaviour_logp=ro.logprobs, lengths=ro.lengths, truncated=ro.truncated,
                rewards=rewards, advantages=advantages, prompt_ids=rows,
                difficulty=chosen.difficulty)
  if mesh is not None:
    batch = shd.constrain_batch(batch, mesh)
  return state.replace(rng=jax.random.key_data(rng)), batch


def _minibatches(tree, m: int):
  """[B, ...] -> [m, B/m, ...] with strided rows (each minibatch draws from every shard)."""
  def split(x):
    b = x.shape[0]
    return jnp.swapaxes(x.reshape(b // m, m, *x.shape[1:]), 0, 1)
  return jax.tree.map(split, tree)


def update(state: TrainState, batch: Batch, *, graphdef, cfg: StepConfig, tx,
           mesh: Mesh | None = None) -> tuple[TrainState, dict]:
  """num_updates passes of num_minibatches optimizer steps on the batch."""
  temp = cfg.sampling.policy_temperature
  logp_fn = functools.partial(completion_logprobs, graphdef, temperature=temp)
  old_logp, mask = logp_fn(state.params, batch.prompts, batch.prompt_lens, batch.completions,
                           batch.lengths)
  old_logp = jax.lax.stop_gradient(old_logp)
  ref_logp = None
  if cfg.loss.kl_coef > 0:
    ref_logp, _ = logp_fn(state.ref_params, batch.prompts, batch.prompt_lens,
                          batch.completions, batch.lengths)
  data = {"batch": batch, "old_logp": old_logp, "ref_logp": ref_logp}

  def loss_fn(params, d):
    b = d["batch"]
    logp, m = logp_fn(params, b.prompts, b.prompt_lens, b.completions, b.lengths)
    return policy_loss(logp, d["old_logp"], b.behaviour_logp, b.advantages, m, cfg.loss,
                       d["ref_logp"])

  def minibatch_step(carry, d):
    params, opt_state = carry
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, d)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics["grad_norm"] = optax.global_norm(grads)
    return (params, opt_state), metrics

  mbs = _minibatches(data, cfg.num_minibatches)

  def epoch(carry, _):
    return jax.lax.scan(minibatch_step, carry, mbs)

  (params, opt_state), metrics = jax.lax.scan(epoch, (state.params, state.opt_state), None,
                                              length=cfg.num_updates)
  metrics = jax.tree.map(jnp.mean, metrics)
  metrics.update(ledger(batch, mask, old_logp, cfg))
  new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1,
                            policy_version=state.policy_version + cfg.num_updates *
                            cfg.num_minibatches)
  return new_state, metrics


def ledger(batch: Batch, mask, old_logp, cfg: StepConfig) -> dict:
  """Where this step's compute went, plus reward statistics (device scalars)."""
  g = cfg.group_size
  lengths = batch.lengths.astype(jnp.float32)
  zero_var = jnp.all(batch.rewards.reshape(-1, g) == batch.rewards.reshape(-1, g)[:, :1],
                     axis=1)
  zero_rows = jnp.repeat(zero_var, g)
  drift = jnp.where(mask, jnp.abs(old_logp - batch.behaviour_logp), 0.0)
  return {
      "reward/mean": batch.rewards.mean(),
      "reward/pass_at_group": jnp.mean(jnp.any(batch.rewards.reshape(-1, g) > 0, axis=1)),
      "ledger/tokens_generated": lengths.sum(),
      "ledger/tokens_trained": jnp.where(zero_rows, 0.0, lengths).sum(),
      "ledger/tokens_zero_adv": jnp.where(zero_rows, lengths, 0.0).sum(),
      "ledger/zero_adv_group_frac": zero_var.astype(jnp.float32).mean(),
      "ledger/truncated_frac": batch.truncated.astype(jnp.float32).mean(),
      "ledger/response_len_mean": lengths.mean(),
      "ledger/logp_drift_max": drift.max(),
  }


def train_step(state: TrainState, pool: PromptPool, *, graphdef, cfg: StepConfig, tx,
               mesh: Mesh | None = None) -> tuple[TrainState, dict]:
  """The fused step: rollout then update, one pure function."""
  state, batch = rollout(state, pool, graphdef=graphdef, cfg=cfg, mesh=mesh)
  return update(state, batch, graphdef=graphdef, cfg=cfg, tx=tx, mesh=mesh)


# ----------------------------------------------------------------------------- state + jit


def state_shardings(abstract_state: TrainState, mesh: Mesh, rules=shd.DEFAULT_RULES):
  p_shard = shd.param_shardings(abstract_state.params, mesh, rules)
  rep = shd.replicated(mesh)
  return TrainState(
      params=p_shard,
      opt_state=shd.shardings_like_params(abstract_state.opt_state, p_shard, mesh),
      rng=rep, step=rep, policy_version=rep,
      ref_params=None if abstract_state.ref_params is None else p_shard)


def init_state(params, tx, seed: int, mesh: Mesh, *, with_ref: bool = False,
               rules=shd.DEFAULT_RULES) -> TrainState:
  """Places params on the mesh and builds the optimizer state with matching shardings."""
  def make(params):
    return TrainState(params=params, opt_state=tx.init(params),
                      rng=jax.random.key_data(jax.random.key(seed)),
                      step=jnp.zeros((), jnp.int32), policy_version=jnp.zeros((), jnp.int32),
                      ref_params=params if with_ref else None)
  abstract = jax.eval_shape(make, params)
  shardings = state_shardings(abstract, mesh, rules)
  params = jax.device_put(params, shardings.params)
  return jax.jit(make, out_shardings=shardings)(params)


@dataclasses.dataclass
class StepFns:
  """Jitted halves and the fused step, with donated state and fixed shardings."""

  rollout: Callable
  update: Callable
  train_step: Callable
  state_sharding: TrainState
  pool_sharding: Any


def make_step_fns(graphdef, cfg: StepConfig, tx, mesh: Mesh, abstract_state: TrainState,
                  rules=shd.DEFAULT_RULES) -> StepFns:
  s_shard = state_shardings(abstract_state, mesh, rules)
  rep = shd.replicated(mesh)
  kw = dict(graphdef=graphdef, cfg=cfg, mesh=mesh)
  roll = jax.jit(functools.partial(rollout, **kw), donate_argnums=0,
                 in_shardings=(s_shard, rep), out_shardings=(s_shard, None))
  upd = jax.jit(functools.partial(update, tx=tx, **kw), donate_argnums=0,
                in_shardings=(s_shard, None), out_shardings=(s_shard, rep))
  fused = jax.jit(functools.partial(train_step, tx=tx, **kw), donate_argnums=0,
                  in_shardings=(s_shard, rep), out_shardings=(s_shard, rep))
  return StepFns(rollout=roll, update=upd, train_step=fused, state_sharding=s_shard,
                 pool_sharding=rep)
