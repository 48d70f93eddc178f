"""From an experiment's ml_collections config to the typed, validated objects rlx runs on.

Every check here runs before anything is compiled or written, so a mistake in a config costs
seconds: each failure is one sentence naming the config key, the bad value and what was
expected.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections as mlc

from rlx.data import registry
from rlx.errors import ConfigError
from rlx.model.config import ModelConfig
from rlx.model.lora import LoRAConfig
from rlx.rl import advantages as adv_lib
from rlx.rl.length import LengthConfig
from rlx.rl.loss import LossConfig
from rlx.rl.adaptive import AdaptiveConfig
from rlx.rl.replay import ReplayConfig
from rlx.rl.selection import SelectionConfig
from rlx.sampler.sampling import SamplingParams

SAMPLER_IMPLS = ("dense", "paged")
_MODEL_KEYS_NOT_ARCH = ("path",)


def _need(ok: bool, msg: str) -> None:
  if not ok:
    raise ConfigError(msg)


def _get(config, key: str):
  value = config
  for part in key.split("."):
    value = value[part]
  return value


def _number(config, key: str, lo: float | None = None, hi: float | None = None, *,
            lo_open: bool = False, hi_open: bool = False, what: str = "") -> float:
  value = _get(config, key)
  # Non-finite values are refused: an infinite lr or weight decay would turn finite gradients
  # into non-finite params, which the update's guard (gradient norm only) does not check.
  ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  try:
    ok = ok and math.isfinite(value)
  except OverflowError:  # an int beyond float range (10**400)
    ok = False
  if ok and lo is not None:
    ok = value > lo if lo_open else value >= lo
  if ok and hi is not None:
    ok = value < hi if hi_open else value <= hi
  if not ok:
    lo_s = "" if lo is None else f"{lo:g} {'<' if lo_open else '<='} "
    hi_s = "" if hi is None else f" {'<' if hi_open else '<='} {hi:g}"
    leaf = key.rsplit(".", 1)[-1]
    raise ConfigError(f"config.{key}={value!r}; expected {what or lo_s + leaf + hi_s}.")
  return float(value)


def _int(config, key: str, lo: int = 1, hi: int | None = None) -> int:
  value = _get(config, key)
  ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (
      hi is None or value <= hi)
  if not ok:
    rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise ConfigError(f"config.{key}={value!r}; expected an integer {rng}.")
  return value


def _micro_rows(config) -> int:
  """rl.update_micro_rows, or where it is 0 on the CPU backend the rows of
  rl.cpu_micro_tokens padded tokens (max_prompt_len + max_new_tokens each; one minibatch)."""
  micro = _int(config, "rl.update_micro_rows", 0, MAX_TOKENS)
  tokens = _int(config, "rl.cpu_micro_tokens", 0, MAX_TOKENS) if "cpu_micro_tokens" in \
      config.rl else 0
  if micro or not tokens or config.rl.num_minibatches != 1:
    return micro
  if jax.default_backend() != "cpu":
    return 0
  return max(1, tokens // (config.sampler.max_prompt_len + config.sampler.max_new_tokens))


# Far beyond any real run; a value above is a typo (1e9) that would otherwise fail deep inside
# XLA while sizing buffers.
MAX_TOKENS = 1 << 20


# ----------------------------------------------------------------------------- typed specs
# The ConfigDict is read here, once; everything below takes these frozen specs.


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  name: str
  ops: tuple[str, ...]
  levels: tuple[int, ...]
  num_train_per_level: int
  num_eval_per_level: int
  reverse_answer: bool
  teacher_error_levels: tuple[int, ...]
  teacher_error_rate: float
  teacher_verbose_levels: tuple[int, ...]
  teacher_verbose_rate: float
  seed: int
  manual_dir: str
  num_eval: int
  rl_levels: tuple[int, ...]
  rl_level_weights: tuple[tuple[int, float], ...]  # (level, share of the RL pool); () = as is
  band: tuple[int, ...]
  eval_levels: tuple[int, ...]
  data_dir: str
  instruction: str
  reward: str  # resolved: config.task.reward, or the task's default when that is empty
  reward_timeout_s: float


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
  vocab_size: int
  path: str
  chat_template: bool
  system_prompt: str


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  path: str  # a Hugging Face checkpoint directory ("" = the tiny model of `arch`)
  dtype: str
  param_dtype: str
  arch_items: tuple[tuple[str, Any], ...]  # config.model without `path`, in key order

  @property
  def arch(self) -> dict[str, Any]:
    """The architecture keys as written in the config (recorded with a warm-start base)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.arch_items}

  def tiny(self, vocab_size: int) -> ModelConfig:
    """The architecture of config.model (HF checkpoints bring their own)."""
    try:
      return ModelConfig.from_dict({**dict(self.arch_items), "vocab_size": vocab_size})
    except (ValueError, TypeError) as e:
      raise ConfigError(f"config.model: {e}") from None


@dataclasses.dataclass(frozen=True)
class SFTSpec:
  steps: int
  batch_size: int
  lr: float
  warmup_steps: int
  max_len: int
  level_weights: tuple[tuple[int, float], ...]
  batch_by_level: bool = False

  def as_record(self) -> dict[str, Any]:
    """As stored with a warm-start base (the ConfigDict's JSON form)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    out["level_weights"] = {str(k): v for k, v in self.level_weights}
    return out


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
  impl: str
  paged: Any  # rlx.sampler.paged.PagedConfig
  max_prompt_len: int
  max_new_tokens: int
  temperature: float
  top_k: int
  top_p: float
  eval_batch_size: int

  def sampling(self, *, eos_id: int, pad_id: int, stop_ids: tuple[int, ...] = (),
               greedy: bool = False) -> SamplingParams:
    try:
      return SamplingParams(max_new_tokens=self.max_new_tokens,
                            temperature=0.0 if greedy else self.temperature,
                            top_k=0 if greedy else self.top_k,
                            top_p=1.0 if greedy else self.top_p,
                            eos_id=eos_id, pad_id=pad_id, stop_ids=tuple(stop_ids))
    except ValueError as e:
      raise ConfigError(f"config.sampler: {e}") from None


@dataclasses.dataclass(frozen=True)
class RLSpec:
  prompts_per_step: int
  group_size: int
  advantage: str
  num_updates: int
  num_minibatches: int
  loss: LossConfig
  logprob_chunk: int
  remat: bool
  fuse_pi_old: bool
  update_buckets: int
  drop_zero_adv_rows: bool
  update_parts: int
  update_micro_rows: int


@dataclasses.dataclass(frozen=True)
class OptimSpec:
  lr: float
  schedule: str
  warmup_steps: int
  weight_decay: float
  grad_clip: float
  b1: float
  b2: float


@dataclasses.dataclass(frozen=True)
class GuardSpec:
  max_consecutive_skips: int
  reward_range: tuple[float, float]


@dataclasses.dataclass(frozen=True)
class MemorySpec:
  device_bytes: int
  activation_margin: float
  check: bool


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  data: int
  fsdp: int
  tensor: int


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
  """config.pipeline (rlx.pipeline): "sync" runs generation and the update in turn on one
  mesh; "overlap" splits the devices into a generator and a learner sub-mesh and runs them at
  once, the generator `max_staleness` steps ahead."""

  mode: str = "sync"
  generator_devices: int = 0  # overlap: devices that generate (0: half of them)
  generator_tensor: int = 1  # overlap: tensor-parallel size of the generator sub-mesh
  max_staleness: int = 1  # overlap: batches in flight (0: the sync step on two sub-meshes)


PIPELINE_MODES = ("sync", "overlap")


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
  every: int
  keep: int  # newest checkpoints kept (>= 1); 0 keeps every checkpoint


@dataclasses.dataclass(frozen=True, eq=False)
class RunSpec:
  """One experiment config, validated and typed (`resolve`)."""

  seed: int
  total_steps: int
  eval_every: int
  fused_step: bool
  checkpoint: CheckpointSpec
  task: TaskSpec
  tokenizer: TokenizerSpec
  model: ModelSpec
  warm_start_dir: str
  sft: SFTSpec
  rl: RLSpec
  selection: SelectionConfig
  replay: ReplayConfig | None
  length: LengthConfig
  sampler: SamplerSpec
  optim: OptimSpec
  guard: GuardSpec
  memory: MemorySpec
  mesh: MeshSpec
  record: dict[str, Any]  # the ConfigDict as JSON (config.json, checkpoint metadata)
  lora: LoRAConfig | None = None  # None: full-parameter training
  pipeline: PipelineSpec = PipelineSpec()
  adaptive: AdaptiveConfig | None = None  # None: every group gets rl.group_size samples


def validate(config: mlc.ConfigDict, num_batch_devices: int = 1) -> None:
  """Semantic checks that ml_collections' type checks do not cover (see `resolve`)."""
  resolve(config, num_batch_devices)


def resolve(config: mlc.ConfigDict | RunSpec, num_batch_devices: int = 1) -> RunSpec:
  """Checks `config` and returns it as a RunSpec; every failure is one ConfigError naming the
  key, its value and what was expected."""
  if isinstance(config, RunSpec):
    return config
  for key in ("total_steps", "eval_every", "checkpoint_every", "rl.prompts_per_step",
              "rl.group_size", "rl.num_updates", "rl.num_minibatches",
              "sampler.max_prompt_len", "sampler.eval_batch_size", "sft.batch_size",
              "sft.max_len"):
    _int(config, key)
  _int(config, "sampler.max_new_tokens", 1, MAX_TOKENS)
  _int(config, "sampler.max_prompt_len", 1, MAX_TOKENS)
  keep = _int(config, "keep_checkpoints", 0)
  rl = config.rl
  _need(rl.advantage in adv_lib.MODES,
        f"config.rl.advantage={rl.advantage!r}; expected one of {adv_lib.MODES}.")
  _need(rl.group_size >= 2 or rl.advantage not in adv_lib.GROUP_MODES,
        f"config.rl.group_size={rl.group_size}: advantage '{rl.advantage}' normalises rewards "
        f"within a group, so group_size must be >= 2.")
  batch = rl.prompts_per_step * rl.group_size
  replay = replay_config(config)
  train_batch = batch + (replay.num_samples if replay else 0)
  _need(train_batch % rl.num_minibatches == 0,
        f"the training batch of {train_batch} rows (prompts_per_step * group_size"
        f"{' + replay.num_samples' if replay else ''}) does not split into "
        f"config.rl.num_minibatches={rl.num_minibatches} equal minibatches.")
  micro = rl.get("update_micro_rows", 0)
  _need(not micro or rl.num_minibatches == 1,
        f"config.rl.update_micro_rows={micro} (gradient accumulation within one optimizer "
        f"step) needs config.rl.num_minibatches=1, got {rl.num_minibatches}.")
  if replay:
    _need(replay.num_samples % num_batch_devices == 0,
          f"config.replay.num_samples={replay.num_samples} must be a multiple of the "
          f"{num_batch_devices} data-parallel devices.")
    _need(replay.capacity % num_batch_devices == 0,
          f"config.replay.capacity={replay.capacity} must be a multiple of the "
          f"{num_batch_devices} data-parallel devices (the ring is split over them).")
  selection = selection_config(config)
  adaptive = adaptive_config(config)
  if adaptive is not None:
    try:
      adaptive.check(rl.prompts_per_step, rl.group_size, selection.dynamic_filter)
    except ValueError as e:
      raise ConfigError(f"config.{e}") from None
    _need(not ("pipeline" in config and config.pipeline.mode == "overlap"),
          "config.adaptive.first > 0 with config.pipeline.mode='overlap': adaptive rollout "
          "budgets run in the sync pipeline only.")
    for what, rows in (("prompts_per_step * adaptive.first", rl.prompts_per_step *
                        adaptive.first),
                       ("adaptive.extend_groups * (group_size - adaptive.first)",
                        adaptive.extend_groups * (rl.group_size - adaptive.first))):
      _need(rows % num_batch_devices == 0,
            f"config.{what} = {rows} rollouts per round cannot be split over the "
            f"{num_batch_devices} data-parallel devices; use a multiple of {num_batch_devices}.")
  length = length_config(config)
  _need(batch % num_batch_devices == 0,
        f"config.rl.prompts_per_step * config.rl.group_size = {batch} rollouts cannot be split "
        f"over the {num_batch_devices} data-parallel devices (mesh data x fsdp); use a "
        f"multiple of {num_batch_devices}.")
  _need(config.sampler.impl in SAMPLER_IMPLS,
        f"config.sampler.impl={config.sampler.impl!r}; expected one of {SAMPLER_IMPLS}.")
  # (Overlap mode evaluates on the generator's sub-mesh: rlx.pipeline.make_meshes checks it.)
  overlap = "pipeline" in config and config.pipeline.mode == "overlap"
  _need(overlap or config.sampler.eval_batch_size % num_batch_devices == 0,
        f"config.sampler.eval_batch_size={config.sampler.eval_batch_size} must be a multiple "
        f"of the {num_batch_devices} data-parallel devices.")
  loss = loss_config(config)
  pc = paged_config(config)
  if config.sampler.impl == "paged":
    from rlx.sampler.paged import min_num_pages  # pylint: disable=g-import-not-at-top
    minimum = min_num_pages(config.sampler.max_prompt_len, config.sampler.max_new_tokens,
                            pc.page_size, rl.group_size)
    _need(pc.num_pages == 0 or pc.num_pages >= minimum,
          f"config.sampler.num_pages={pc.num_pages} is too small: one group of "
          f"{rl.group_size} samples with a prompt of up to {config.sampler.max_prompt_len} "
          f"tokens and max_new_tokens={config.sampler.max_new_tokens} (page_size="
          f"{pc.page_size}) needs num_pages >= {minimum} per data shard (page 0 is reserved).")
  s = config.sampler
  sampler = SamplerSpec(impl=s.impl, paged=pc, max_prompt_len=s.max_prompt_len,
                        max_new_tokens=s.max_new_tokens, temperature=float(s.temperature),
                        top_k=int(s.top_k), top_p=float(s.top_p),
                        eval_batch_size=s.eval_batch_size)
  sampler.sampling(eos_id=3, pad_id=0)  # validates temperature / top-k / top-p

  o = config.optim
  _number(config, "optim.lr", 0, lo_open=True)
  _int(config, "optim.warmup_steps", 0)
  _number(config, "optim.weight_decay", 0)
  _number(config, "optim.grad_clip", 0, what="grad_clip >= 0 (0: no clipping)")
  _number(config, "optim.b1", 0, 1, hi_open=True)
  _number(config, "optim.b2", 0, 1, hi_open=True)
  _need(o.schedule in ("constant", "cosine"),
        f"config.optim.schedule={o.schedule!r}; expected 'constant' or 'cosine'.")
  optim = OptimSpec(lr=float(o.lr), schedule=o.schedule, warmup_steps=o.warmup_steps,
                    weight_decay=float(o.weight_decay), grad_clip=float(o.grad_clip),
                    b1=float(o.b1), b2=float(o.b2))

  sft = config.sft
  _int(config, "sft.steps", 0)
  _int(config, "sft.warmup_steps", 0)
  _number(config, "sft.lr", 0, lo_open=True)
  weights = _level_weights(config, "sft.level_weights")
  sft_spec = SFTSpec(steps=sft.steps, batch_size=sft.batch_size, lr=float(sft.lr),
                     warmup_steps=sft.warmup_steps, max_len=sft.max_len, level_weights=weights,
                     batch_by_level=bool(sft.batch_by_level))

  g = config.guard
  _int(config, "guard.max_consecutive_skips", 1)
  try:
    lo, hi = (float(x) for x in g.reward_range)
  except (TypeError, ValueError):
    raise ConfigError(f"config.guard.reward_range={g.reward_range!r}; expected (low, high)."
                      ) from None
  _need(lo <= hi, f"config.guard.reward_range={tuple(g.reward_range)!r} is empty; expected "
                  f"(low, high) with low <= high.")
  guard = GuardSpec(max_consecutive_skips=g.max_consecutive_skips, reward_range=(lo, hi))

  m = config.memory
  _int(config, "memory.device_bytes", 0)
  _number(config, "memory.activation_margin", 1.0)
  memory_spec = MemorySpec(device_bytes=m.device_bytes,
                           activation_margin=float(m.activation_margin), check=bool(m.check))
  for axis in ("data", "fsdp", "tensor"):
    v = config.mesh[axis]
    _need(isinstance(v, int) and (v >= 1 or (axis == "data" and v == -1)),
          f"config.mesh.{axis}={v!r}; expected a positive integer"
          f"{' or -1 (the devices left over)' if axis == 'data' else ''}.")
  mesh = MeshSpec(data=config.mesh.data, fsdp=config.mesh.fsdp, tensor=config.mesh.tensor)
  lora = lora_config(config)
  pipeline = pipeline_spec(config)

  return RunSpec(
      # jax.random.key keeps 32 bits of the seed: 2**32 would run as seed 0.
      seed=_int(config, "seed", 0, 2 ** 32 - 1), total_steps=config.total_steps,
      eval_every=config.eval_every,
      fused_step=bool(config.fused_step),
      checkpoint=CheckpointSpec(every=config.checkpoint_every, keep=keep),
      task=_task_spec(config), tokenizer=_tokenizer_spec(config), model=_model_spec(config),
      warm_start_dir=config.warm_start.dir or "", sft=sft_spec,
      rl=RLSpec(prompts_per_step=rl.prompts_per_step, group_size=rl.group_size,
                advantage=rl.advantage, num_updates=rl.num_updates,
                num_minibatches=rl.num_minibatches, loss=loss,
                logprob_chunk=_int(config, "rl.logprob_chunk", 0, MAX_TOKENS),
                remat=bool(rl.remat), fuse_pi_old=bool(rl.fuse_pi_old),
                update_buckets=_int(config, "rl.update_buckets", 1, 64),
                drop_zero_adv_rows=bool(rl.drop_zero_adv_rows),
                update_parts=_int(config, "rl.update_parts", 1, 64),
                update_micro_rows=_micro_rows(config)),
      selection=selection, replay=replay, length=length, sampler=sampler, optim=optim,
      guard=guard, memory=memory_spec, mesh=mesh, record=to_plain(config), lora=lora,
      pipeline=pipeline, adaptive=adaptive)


def pipeline_spec(config: mlc.ConfigDict) -> PipelineSpec:
  """config.pipeline as a PipelineSpec (configs written before it existed: sync)."""
  if "pipeline" not in config:
    return PipelineSpec()
  p = config.pipeline
  _need(p.mode in PIPELINE_MODES,
        f"config.pipeline.mode={p.mode!r}; expected one of {PIPELINE_MODES}.")
  spec = PipelineSpec(mode=p.mode,
                      generator_devices=_int(config, "pipeline.generator_devices", 0),
                      generator_tensor=_int(config, "pipeline.generator_tensor", 1),
                      max_staleness=_int(config, "pipeline.max_staleness", 0, 64))
  if spec.mode == "overlap":
    _need(not config.fused_step,
          "config.fused_step=True with config.pipeline.mode='overlap': the fused step runs "
          "generation and the update as one program on one mesh; overlap runs them as two.")
  return spec


def _ints(config, key: str) -> tuple[int, ...]:
  value = _get(config, key)
  try:
    return tuple(int(x) for x in (value or ()))
  except (TypeError, ValueError):
    raise ConfigError(f"config.{key}={value!r}; expected a tuple of integers.") from None


def _level_weights(config, key: str, *, allow_empty: bool = False
                   ) -> tuple[tuple[int, float], ...]:
  """{'level': weight} as sorted (level, weight) pairs: weights >= 0, at least one > 0."""
  value = dict(_get(config, key))
  if not value and allow_empty:
    return ()
  try:
    weights = tuple(sorted((int(k), float(v)) for k, v in value.items()))
  except (TypeError, ValueError):
    raise ConfigError(f"config.{key}={value!r}; expected {{'level': weight}} with integer "
                      f"levels and numeric weights.") from None
  _need(all(w >= 0 for _, w in weights) and any(w > 0 for _, w in weights),
        f"config.{key}={value!r}; expected non-negative weights, at least one positive.")
  return weights


def _task_spec(config) -> TaskSpec:
  t = config.task
  task = registry.get_task(t.name)  # an unknown name fails here, before any work
  _number(config, "task.teacher_error_rate", 0, 1)
  _number(config, "task.teacher_verbose_rate", 0, 1)
  _int(config, "task.num_eval", 0)
  _number(config, "task.reward_timeout_s", 0, lo_open=True)
  return TaskSpec(
      name=t.name, ops=tuple(t.ops), levels=_ints(config, "task.levels"),
      num_train_per_level=t.num_train_per_level, num_eval_per_level=t.num_eval_per_level,
      reverse_answer=bool(t.reverse_answer),
      teacher_error_levels=_ints(config, "task.teacher_error_levels"),
      teacher_error_rate=float(t.teacher_error_rate),
      teacher_verbose_levels=_ints(config, "task.teacher_verbose_levels"),
      teacher_verbose_rate=float(t.teacher_verbose_rate), seed=t.seed, manual_dir=t.manual_dir,
      num_eval=t.num_eval, rl_levels=_ints(config, "task.rl_levels"),
      rl_level_weights=_level_weights(config, "task.rl_level_weights", allow_empty=True),
      band=_ints(config, "task.band"), eval_levels=_ints(config, "task.eval_levels"),
      data_dir=t.data_dir, instruction=t.instruction or "{prompt}",
      reward=t.reward or task.reward, reward_timeout_s=float(t.reward_timeout_s))


def _tokenizer_spec(config) -> TokenizerSpec:
  t = config.tokenizer
  _int(config, "tokenizer.vocab_size", 1)
  return TokenizerSpec(vocab_size=t.vocab_size, path=t.path,
                       chat_template=bool(t.chat_template), system_prompt=t.system_prompt)


def _model_spec(config) -> ModelSpec:
  m = config.model
  arch = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in m.items()
               if k not in _MODEL_KEYS_NOT_ARCH)
  return ModelSpec(path=m.path, dtype=m.dtype, param_dtype=m.param_dtype, arch_items=arch)


def loss_config(config: mlc.ConfigDict) -> LossConfig:
  rl = config.rl
  try:
    return LossConfig(eps_low=rl.eps_low, eps_high=rl.eps_high, aggregation=rl.aggregation,
                      kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator, is_cap=rl.is_cap,
                      is_mode=rl.is_mode, ratio_level=rl.ratio_level, anchor=rl.anchor)
  except ValueError as e:
    raise ConfigError(f"config.rl: {e}") from None


def selection_config(config: mlc.ConfigDict) -> SelectionConfig:
  try:
    return SelectionConfig(**dict(config.selection))
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config.selection: {e}") from None


def adaptive_config(config: mlc.ConfigDict) -> AdaptiveConfig | None:
  """config.adaptive (rlx.rl.adaptive) or None when first == 0 (configs written before it
  existed: None)."""
  if "adaptive" not in config or not config.adaptive.first:
    return None
  a = config.adaptive
  try:
    return AdaptiveConfig(first=_int(config, "adaptive.first", 0),
                          extend_groups=_int(config, "adaptive.extend_groups", 0),
                          priority=a.priority)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config.{e}") from None


def replay_config(config: mlc.ConfigDict) -> ReplayConfig | None:
  fields = dict(config.replay)
  if not fields.pop("enabled", False):
    return None
  try:
    return ReplayConfig(**fields)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config.replay: {e}") from None


def length_config(config: mlc.ConfigDict) -> LengthConfig:
  try:
    return LengthConfig(**dict(config.length))
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config.length: {e}") from None


def lora_config(config: mlc.ConfigDict) -> LoRAConfig | None:
  """config.lora as a LoRAConfig (None when rank is 0: full-parameter training)."""
  if "lora" not in config:
    return None
  lc = config.lora
  rank = _int(config, "lora.rank", 0)
  if rank == 0:
    return None
  _number(config, "lora.alpha", 0, lo_open=True)
  _need(float(lc.dropout) == 0.0,
        f"config.lora.dropout={lc.dropout!r}: rlx's adapters have no dropout (RL updates see "
        f"each rollout a few times at most); expected 0.")
  _need(lc.base_dtype in ("", "float32", "bfloat16"),
        f"config.lora.base_dtype={lc.base_dtype!r}; expected '' (the model's param dtype), "
        f"'float32' or 'bfloat16'.")
  _need(isinstance(lc.targets, str) and lc.targets.strip() != "",
        f"config.lora.targets={lc.targets!r}; expected a regex over parameter paths such as "
        f"'(q|v)_proj$' (paths look like 'layer_0/attn/q_proj').")
  try:
    try:  # the wider of the base's and the compute dtype (see LoRAConfig.merge_dtype)
      merge = str(jnp.promote_types(jnp.dtype(lc.base_dtype or config.model.param_dtype),
                                    jnp.dtype(config.model.dtype)))
    except TypeError:  # a bad model dtype: the model's own check names it
      merge = ""
    return LoRAConfig(rank=rank, alpha=float(lc.alpha), targets=(lc.targets,),
                      base_dtype=lc.base_dtype, merge_for_sampling=bool(lc.merge_for_sampling),
                      merge_dtype=merge)
  except ValueError as e:
    raise ConfigError(f"config.lora: {e}") from None


def paged_config(config: mlc.ConfigDict):
  from rlx.sampler.paged import PagedConfig  # pylint: disable=g-import-not-at-top
  s = config.sampler
  try:
    return PagedConfig(page_size=s.page_size, num_pages=s.num_pages, max_slots=s.max_slots,
                       attention_impl=s.attention, cascade=s.cascade)
  except ValueError as e:
    raise ConfigError(f"config.sampler: {e}") from None


def sampling_params(config: mlc.ConfigDict, *, eos_id: int, pad_id: int,
                    stop_ids: tuple[int, ...] = (), greedy: bool = False) -> SamplingParams:
  return resolve(config).sampler.sampling(eos_id=eos_id, pad_id=pad_id, stop_ids=stop_ids,
                                          greedy=greedy)


def model_config(config: mlc.ConfigDict, vocab_size: int) -> ModelConfig:
  """The tiny-model architecture from config.model (HF checkpoints bring their own)."""
  return _model_spec(config).tiny(vocab_size)


def to_plain(config: mlc.ConfigDict) -> dict[str, Any]:
  """JSON-able dict (tuples become lists)."""
  return config.to_dict()


def defaults() -> mlc.ConfigDict:
  """Every config key rlx reads, at its default; experiment files override what they need.

  An override of a key that is not here is an error ("Did you mean ..."), so the names below
  are the complete vocabulary of a config.
  """
  c = mlc.ConfigDict()
  c.seed = 0
  c.total_steps = 200
  c.eval_every = 25
  c.checkpoint_every = 50
  c.keep_checkpoints = 2  # newest checkpoints kept (>= 1); 0 keeps every checkpoint
  c.fused_step = False  # True: one jitted step (no generation/update time split)

  c.task = mlc.ConfigDict()
  # arithmetic | column_add | gsm8k | math, or a task an experiment registered
  # (rlx.data.registry.register_task)
  c.task.name = "arithmetic"
  c.task.ops = ("add",)  # arithmetic: ("add", "mul")
  c.task.levels = (2, 3, 4, 5)  # arithmetic: numbers of digits
  c.task.num_train_per_level = 5000
  c.task.num_eval_per_level = 200
  c.task.reverse_answer = False  # arithmetic: answers lowest digit first
  c.task.teacher_error_levels = ()  # arithmetic: warm-start answers drop a carry here ...
  c.task.teacher_error_rate = 0.0  # ... with this probability
  c.task.teacher_verbose_levels = ()  # column_add: warm-start solutions padded here ...
  c.task.teacher_verbose_rate = 0.0  # ... with this probability
  c.task.seed = 0
  c.task.manual_dir = ""  # gsm8k / math: the directory holding the JSONL files
  c.task.num_eval = 0  # gsm8k / math: cap on held-out examples (0: all)
  c.task.rl_levels = ()  # difficulty levels RL trains on (empty: all)
  # Share of each level in the RL prompt pool, {"level": weight} (empty: every train example of
  # rl_levels once); the pool keeps its size, levels short of examples repeat them.
  c.task.rl_level_weights = {}
  c.task.band = ()  # levels whose accuracy is the headline (empty: all)
  c.task.eval_levels = ()  # levels of the held-out set to evaluate (empty: all)
  c.task.data_dir = ""  # where TFDS prepares the data (empty: WORKDIR/data)
  c.task.instruction = "{prompt}"  # prompt template; {prompt} is the problem text
  # "exact_match": the task's jnp verifier inside the jitted step (exact match, or the final
  # answer after a marker). A registered Python reward ("math", "exact") or
  # "package.module:function" runs on the host between the halves. Empty: the task's default
  # (exact_match for arithmetic / column_add, math for gsm8k / math).
  c.task.reward = ""
  # A host reward that has not returned after this many seconds stops the run (one line);
  # SIGTERM while it runs still checkpoints the last finished step and exits 75.
  c.task.reward_timeout_s = 600.0

  c.tokenizer = mlc.ConfigDict()
  c.tokenizer.vocab_size = 64  # for a sentencepiece model trained on the task text
  c.tokenizer.path = ""  # a .model / tokenizer.json / HF directory (empty: model.path or train)
  c.tokenizer.chat_template = False  # render prompts with the tokenizer's chat template
  c.tokenizer.system_prompt = ""

  c.model = mlc.ConfigDict()
  c.model.path = ""  # a Hugging Face checkpoint directory (empty: the tiny model below)
  c.model.num_layers = 4
  c.model.d_model = 128
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 32
  c.model.mlp_dim = 384
  c.model.rope_theta = 10_000.0
  c.model.tie_embeddings = True
  c.model.dtype = "float32"  # activations; bf16 is slow on XLA:CPU
  c.model.param_dtype = "float32"

  c.warm_start = mlc.ConfigDict()
  # A base model directory written by an earlier run (WORKDIR/base); empty: look in this
  # workdir, else run the supervised warm start (config.sft).
  c.warm_start.dir = ""

  c.sft = mlc.ConfigDict()
  c.sft.steps = 1000
  c.sft.batch_size = 128
  c.sft.lr = 2e-3
  c.sft.warmup_steps = 100
  c.sft.max_len = 20
  c.sft.level_weights = {"2": 1.0, "3": 1.0, "4": 1.0}  # sampling weight per level
  # Each batch from one level (drawn by level_weights), cut to that level's longest example:
  # with long worked solutions most of a mixed batch would be padding.
  c.sft.batch_by_level = False

  c.rl = mlc.ConfigDict()
  c.rl.prompts_per_step = 16
  c.rl.group_size = 8
  c.rl.advantage = "grpo"  # grpo | dr_grpo | rloo
  c.rl.num_updates = 1  # passes over each batch
  c.rl.num_minibatches = 1  # optimizer steps per pass
  c.rl.eps_low = 0.2
  c.rl.eps_high = 0.28  # DAPO clip-higher
  c.rl.aggregation = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
  c.rl.kl_coef = 0.0  # > 0 allocates reference params
  c.rl.kl_estimator = "k3"
  c.rl.is_cap = 2.0  # C of the decoupled correction pi_old / mu
  c.rl.is_mode = "truncate"  # truncate | mask
  c.rl.ratio_level = "token"  # token | sequence (GSPO)
  # PPO trust region around pi_old = the recomputed proximal policy (decoupled PPO, with the
  # correction above) or the behaviour policy that sampled the data (off-policy PPO-clip).
  c.rl.anchor = "proximal"
  # Update cost and memory (rlx.train.update). Log-probs over `logprob_chunk` completion
  # positions at a time (0: all at once; long completions x large vocabularies want 128-512:
  # [rows, chunk, V] f32 logits live instead of [rows, T, V]); per-layer rematerialisation;
  # pi_old taken from the first minibatch's gradient pass (no separate forward); the update
  # compiles for `update_buckets` completion widths and cuts the padding columns.
  c.rl.logprob_chunk = 0
  c.rl.remat = False
  c.rl.fuse_pi_old = True
  c.rl.update_buckets = 4
  # With one minibatch and no KL term, zero-advantage rows add nothing to the gradient: the
  # update then computes on half the rows when at most half carry signal (same result).
  c.rl.drop_zero_adv_rows = True
  # With one minibatch, the rows are sorted by length and split into `update_parts` equal
  # micro-batches, each cut to its own width (gradients summed: one optimizer step, same
  # result); short rows stop paying for the longest row's width. 1 = off.
  c.rl.update_parts = 2
  # Gradient accumulation: > 0 splits the update (one minibatch) into micro-batches of at most
  # this many rows, run as a scan (one part's activations live at a time), also when their
  # widths are equal; the gradients are summed (same step). A memory knob, and on CPU a speed
  # one: 8 at 100M cut XLA's temporary buffer 5.05 -> 1.05 GB and the update 36.5 -> 24.6 s
  # (`experiments/bench_faults.py --micro_rows=8`). 0 = off (`update_parts` alone).
  c.rl.update_micro_rows = 0
  # On the CPU backend, where update_micro_rows is 0 and there is one minibatch: micro-batches
  # of at most this many padded tokens (rows x (max_prompt_len + max_new_tokens)). There the
  # whole batch's temporaries cost page faults and cache misses more than the smaller GEMMs
  # lose: at 2048 tokens, update 0.89x on the default experiment (2 parts) and on the
  # reasoning one (8 parts), 0.67x at 100M (4 parts; README "Gradient accumulation"); 1024
  # against 2048: 0.85-0.88x at 100M (8 parts of 4 rows), 0.95x / 0.98x on the default /
  # reasoning experiments; 512 no better than 1024 at 100M. Accelerators keep the whole
  # batch (not measured there). 0 = off.
  c.rl.cpu_micro_tokens = 1024

  # Sample efficiency (rlx.rl.selection / replay / length); off = plain GRPO.
  c.selection = mlc.ConfigDict()
  c.selection.mode = "uniform"  # uniform | band | history | skip
  c.selection.ema = 0.5
  c.selection.floor = 0.05
  c.selection.history_cooldown = 50
  c.selection.history_wrong_weight = 0.25
  # history / skip: probe this many uniform prompts' true pass rates every shadow_every steps
  # and log how often the rule's excluded ones would have given a mixed group (exact-match
  # tasks; rlx.train.shadow_probe). 0: off.
  c.selection.shadow_probe = 0
  c.selection.shadow_every = 10
  c.selection.skip_keep_base = 0.25
  c.selection.dynamic_filter = False  # DAPO dynamic sampling
  c.selection.oversample = 2
  # band mode, unvisited prompts: "mean" (4 p(1-p) at the bucket's mean pass rate) or
  # "spread" (4 E[p(1-p)] over the bucket's groups; see rlx.rl.selection).
  c.selection.bucket_score = "mean"

  c.replay = mlc.ConfigDict()
  c.replay.enabled = False
  c.replay.capacity = 1024
  c.replay.num_samples = 64
  c.replay.max_staleness = 4
  c.replay.max_reuse = 2
  c.replay.priority = "abs_adv"  # abs_adv | recency | uniform

  # Adaptive rollout budgets (rlx.rl.adaptive): `first` samples per prompt, then
  # rl.group_size - first more for `extend_groups` groups chosen by `priority` from the first
  # round's rewards. first = 0: off (every group gets rl.group_size samples).
  c.adaptive = mlc.ConfigDict()
  c.adaptive.first = 0
  c.adaptive.extend_groups = 0
  c.adaptive.priority = "uncertain"  # uncertain | unsolved

  c.length = mlc.ConfigDict()
  c.length.overlong_shaping = False
  c.length.overlong_buffer = 2
  c.length.overlong_penalty = 1.0
  c.length.overlong_filter = False
  # Kimi k1.5 group-relative length reward (rlx.rl.length): shorter correct answers in a group
  # gain up to +0.5 x this, longer ones lose up to -0.5 x this; wrong answers never gain.
  c.length.length_reward = 0.0
  # Where it enters: "advantage" adds it after GRPO's std normalisation (its push bounded by
  # the weight; rlx.rl.length says why), "reward" to the task reward as Kimi k1.5 writes it.
  c.length.length_mode = "advantage"

  c.sampler = mlc.ConfigDict()
  c.sampler.impl = "paged"  # paged (default) | dense (the reference oracle)
  c.sampler.page_size = 16  # paged: tokens per KV page
  c.sampler.num_pages = 0  # paged: pages per data shard (0: enough for every slot)
  c.sampler.max_slots = 0  # paged: sequences decoded at once per shard (0: all of them)
  c.sampler.attention = "reference"  # paged: reference | pallas | interpret
  c.sampler.cascade = False  # paged: GRPO prompt pages attended once per group (accelerators)
  c.sampler.max_prompt_len = 16
  c.sampler.max_new_tokens = 8
  c.sampler.temperature = 1.0
  c.sampler.top_k = 0
  c.sampler.top_p = 1.0
  c.sampler.eval_batch_size = 256

  c.optim = mlc.ConfigDict()
  c.optim.lr = 3e-4
  c.optim.schedule = "cosine"  # constant | cosine
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.0
  c.optim.grad_clip = 1.0
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999

  c.guard = mlc.ConfigDict()
  c.guard.max_consecutive_skips = 3  # steps with non-finite loss/grads before stopping
  c.guard.reward_range = (-10.0, 10.0)  # a reward outside stops the run, naming the example

  c.memory = mlc.ConfigDict()
  c.memory.device_bytes = 0  # per-device memory for the plan (0: ask the device / host RAM)
  c.memory.activation_margin = 1.2
  c.memory.check = True  # refuse to start a run whose plan does not fit

  # LoRA (rlx.model.lora): adapters on the projections, the base frozen (and the KL reference
  # for free). rank 0 = full-parameter training.
  c.lora = mlc.ConfigDict()
  c.lora.rank = 0
  c.lora.alpha = 32.0  # the update is scaled by alpha / rank
  c.lora.targets = r"(q|k|v|o|gate|up|down)_proj$"  # regex over paths like layer_0/attn/q_proj
  c.lora.dropout = 0.0  # only 0 is supported
  c.lora.base_dtype = ""  # frozen base dtype: "" (the model's) | float32 | bfloat16
  c.lora.merge_for_sampling = True  # the sampler decodes with W + scale*A@B merged per step

  # Generation and training on two sub-meshes at once (rlx.pipeline). config.mesh then shapes
  # the learner's sub-mesh; the generator's is data-parallel (x generator_tensor).
  c.pipeline = mlc.ConfigDict()
  c.pipeline.mode = "sync"  # sync | overlap
  c.pipeline.generator_devices = 0  # overlap: devices that generate (0: half)
  c.pipeline.generator_tensor = 1
  c.pipeline.max_staleness = 1  # overlap: the generator runs this many steps ahead

  c.mesh = mlc.ConfigDict()
  c.mesh.data = -1  # -1: the devices left over
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  return c


def with_overrides(config: mlc.ConfigDict, overrides: dict[str, Any]) -> mlc.ConfigDict:
  """A copy of `config` with dotted-key overrides applied ({"rl.group_size": 8}); the keys
  must exist (as on the command line)."""
  out = mlc.ConfigDict(config.to_dict())
  for key, value in overrides.items():
    node = out
    *parents, leaf = key.split(".")
    for p in parents:
      if p not in node:
        raise ConfigError(f"override {key!r}: config has no section {p!r}.")
      node = node[p]
    if leaf not in node:
      raise ConfigError(f"override {key!r}: config has no key {leaf!r}.")
    node[leaf] = value
  return out
