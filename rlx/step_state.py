"""What the two halves of the training step share (rlx.train generates and scores, rlx.update
optimises): the state they carry (`TrainState`), the rollouts one hands the other (`Batch`,
`Rollouts`), the step's static config (`StepConfig`), and the policy's log-probs of sequences
with the params the model computes with (LoRA: the base with the adapters attached).

All are importable from rlx.train, where the step reads as one data flow.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from rlx.data.tasks import Verifier
from rlx.model import lora as lora_lib
from rlx.model import transformer
from rlx.rl import adaptive as adaptive_lib
from rlx.rl import length as length_lib
from rlx.rl import replay as replay_lib
from rlx.rl import selection
from rlx.rl.loss import LossConfig
from rlx.sampler import paged
from rlx.sampler.sampling import SamplingParams, prompt_positions


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
  length_guard: length_lib.LengthGuard | None = None  # per-level guard of the length term


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
  # The model's compute dtype (config.model.dtype, resolved): the sampler and evaluation
  # decode with a copy of the weight matrices cast to it once per call (`policy_params`)
  # where the params are wider (f32 masters under bf16 compute). "" or the params' own
  # dtype: no copy.
  compute_dtype: str = ""
  # The task names the completions the pass-rate probe sums (TaskDef.probe_references; the
  # pool then carries them): the probe runs on a reward that accepts more than the answer.
  probe_references: bool = False

  def __post_init__(self):
    probed = self.verifier.kind == "exact_match" or self.probe_references
    if self.selection.shadow_probe and not probed:
      raise ValueError(f"selection.shadow_probe={self.selection.shadow_probe} needs an "
                       f"exact-match task or one with probe references (its probe is the "
                       f"oracle's: the probability of the correct completions); this task's "
                       f"verifier is {self.verifier.kind!r} and it names none.")
    if self.selection.mode in ("oracle", "probe") and not probed:
      raise ValueError(f"selection.mode={self.selection.mode!r} needs an exact-match task (one "
                       f"correct completion, whose probability is the pass rate) or one with "
                       f"probe references (TaskDef.probe_references: the correct completions "
                       f"whose probabilities sum to it); this task's verifier is "
                       f"{self.verifier.kind!r} and it names none.")
    if self.adaptive is not None:
      self.adaptive.check(self.prompts_per_step, self.group_size,
                          self.selection.dynamic_filter)

  @classmethod
  def from_spec(cls, spec, *, sampling: SamplingParams, verifier: Verifier,
                probe_references: bool = False) -> StepConfig:
    """The step of a run's spec (`rlx.configs.RunSpec`): config.rl's keys by name (a new
    update knob is a field of RLSpec and of StepConfig of the same name), the other sections
    as they are; `sampling` and `verifier` need the tokenizer, `probe_references` the task."""
    rl = {f.name: getattr(spec.rl, f.name) for f in dataclasses.fields(spec.rl)}
    return cls(**rl, sampling=sampling, sampler_impl=spec.sampler.impl,
               paged=spec.sampler.paged if spec.sampler.impl == "paged" else None,
               selection=spec.selection, replay=spec.replay, length=spec.length,
               reward_range=spec.guard.reward_range, verifier=verifier, lora=spec.lora,
               staleness_hist=spec.pipeline.mode == "overlap", adaptive=spec.adaptive,
               ledger_levels=tuple(sorted(set(spec.task.rl_levels or spec.task.levels))),
               compute_dtype=spec.model.dtype, probe_references=probe_references)

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


# ----------------------------------------------------------------------------- LoRA


def model_params(params, base, cfg: StepConfig):
  """What the update's model computes with: `params` itself, or (LoRA) the frozen base with
  the adapters in `params` attached on the unmerged low-rank path (gradients reach only the
  adapters, and no [in, out] weight gradient is formed)."""
  return params if cfg.lora is None else lora_lib.attach(base, params, cfg.lora)


def policy_params(state: TrainState, cfg: StepConfig):
  """What the sampler and evaluation decode with: the params, or (LoRA) the base with the
  adapters merged (cfg.lora.merge_for_sampling: W + scale * A @ B once per call, so each
  decoded token costs what the full-parameter model's does) or attached unmerged; weight
  matrices wider than the compute dtype cast to it once per call (`sampling_copy`)."""
  if cfg.lora is None:
    params = state.params
  elif cfg.lora.merge_for_sampling:
    params = _merge(state.base, state.params, cfg.lora)
  else:
    params = lora_lib.attach(state.base, state.params, cfg.lora)
  return sampling_copy(params, cfg.compute_dtype)


def sampling_copy(params, compute_dtype: str):
  """`params` with every float matrix (ndim >= 2) wider than `compute_dtype` cast to it.

  The model casts each weight to the compute dtype at its matmul (`lora.linear`), so decoding
  with this copy gives the same numbers, while the sampler's loop reads half the bytes per
  token (f32 masters under bf16 compute) and no cast runs per decoded token. Vectors (norm
  scales, biases) are kept: RMSNorm computes in f32 from its scale as stored.
  """
  if not compute_dtype:
    return params
  dt = jnp.dtype(compute_dtype)

  def cast(x):
    wider = (jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2
                and jnp.dtype(x.dtype).itemsize > dt.itemsize)
    return x.astype(dt) if wider else x
  return jax.tree.map(cast, params)


_merge = jax.jit(lora_lib.merge, static_argnums=2)
