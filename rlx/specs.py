"""The typed, frozen sections of a run's config, each with the checks of its own keys.

`rlx.configs.resolve` reads the ml_collections ConfigDict once, through each section's
`from_config` (here, and beside the code that owns a section: rlx.rl.loss.LossConfig,
rlx.rl.replay.ReplayConfig, rlx.model.lora.LoRAConfig, ...); everything after takes these
specs. Each failure is one ConfigError naming the key, the bad value and what was expected.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from rlx import config_checks as chk
from rlx.data import registry
from rlx.errors import ConfigError
from rlx.model.config import DTYPES, ModelConfig, model_dtype
from rlx.rl import advantages as adv_lib
from rlx.rl.loss import LossConfig
from rlx.sampler.sampling import SamplingParams

SAMPLER_IMPLS = ("dense", "paged")
PIPELINE_MODES = ("sync", "overlap")
_MODEL_KEYS_NOT_ARCH = ("path", "scan_layers")  # scan_layers: execution (ModelSpec.scan)


def _overlap(config) -> bool:
  return "pipeline" in config and config.pipeline.mode == "overlap"


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

  @classmethod
  def from_config(cls, config) -> TaskSpec:
    t = config.task
    task = registry.get_task(t.name)  # an unknown name fails here, before any work
    chk.number(config, "task.teacher_error_rate", 0, 1)
    chk.number(config, "task.teacher_verbose_rate", 0, 1)
    chk.integer(config, "task.num_eval", 0)
    chk.number(config, "task.reward_timeout_s", 0, lo_open=True)
    return cls(
        name=t.name, ops=tuple(t.ops), levels=chk.integers(config, "task.levels"),
        num_train_per_level=t.num_train_per_level, num_eval_per_level=t.num_eval_per_level,
        reverse_answer=bool(t.reverse_answer),
        teacher_error_levels=chk.integers(config, "task.teacher_error_levels"),
        teacher_error_rate=float(t.teacher_error_rate),
        teacher_verbose_levels=chk.integers(config, "task.teacher_verbose_levels"),
        teacher_verbose_rate=float(t.teacher_verbose_rate), seed=t.seed,
        manual_dir=t.manual_dir, num_eval=t.num_eval,
        rl_levels=chk.integers(config, "task.rl_levels"),
        rl_level_weights=chk.level_weights(config, "task.rl_level_weights", allow_empty=True),
        band=chk.integers(config, "task.band"),
        eval_levels=chk.integers(config, "task.eval_levels"), data_dir=t.data_dir,
        instruction=t.instruction or "{prompt}", reward=t.reward or task.reward,
        reward_timeout_s=float(t.reward_timeout_s))


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
  vocab_size: int
  path: str
  chat_template: bool
  system_prompt: str

  @classmethod
  def from_config(cls, config) -> TokenizerSpec:
    t = config.tokenizer
    chk.integer(config, "tokenizer.vocab_size", 1)
    return cls(vocab_size=t.vocab_size, path=t.path, chat_template=bool(t.chat_template),
               system_prompt=t.system_prompt)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  path: str  # a Hugging Face checkpoint directory ("" = the tiny model of `arch`)
  dtype: str  # the compute dtype, resolved ("auto" -> bfloat16 on GPU/TPU, float32 on CPU)
  param_dtype: str  # master params (and so the optimizer state) are stored in this
  arch_items: tuple[tuple[str, Any], ...]  # config.model without `path`, in key order
  auto_dtype: bool = False  # dtype was "auto" in the config (chosen for the backend)
  scan_layers: bool = False  # run the layers as one lax.scan (ModelConfig.scan_layers)

  @classmethod
  def from_config(cls, config, platform: str | None = None) -> ModelSpec:
    """config.model with its dtype resolved for `platform` (default: jax.default_backend())."""
    m = config.model
    dtype = model_dtype(config, platform)
    chk.need(isinstance(m.param_dtype, str) and m.param_dtype in DTYPES,
             f"config.model.param_dtype={m.param_dtype!r}; expected one of {tuple(DTYPES)} "
             f"(the master params' dtype; 'auto' is for config.model.dtype).")
    arch = tuple((k, dtype if k == "dtype" else tuple(v) if isinstance(v, list) else v)
                 for k, v in m.items() if k not in _MODEL_KEYS_NOT_ARCH)
    chk.need(isinstance(m.scan_layers, bool),
             f"config.model.scan_layers={m.scan_layers!r}; expected True or False.")
    return cls(path=m.path, dtype=dtype, param_dtype=m.param_dtype, arch_items=arch,
               auto_dtype=m.dtype == "auto", scan_layers=m.scan_layers)

  def run_as(self, cfg: ModelConfig) -> ModelConfig:
    """An architecture (the tiny one or an HF checkpoint's) with this run's execution
    choices that are not architecture (scan_layers)."""
    return dataclasses.replace(cfg, scan_layers=self.scan_layers)

  @property
  def arch(self) -> dict[str, Any]:
    """The architecture keys as written in the config, dtype resolved (recorded with a
    warm-start base)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.arch_items}

  def tiny(self, vocab_size: int) -> ModelConfig:
    """The architecture of config.model (HF checkpoints bring their own)."""
    try:
      return ModelConfig.from_dict({**dict(self.arch_items), "vocab_size": vocab_size,
                                    "scan_layers": self.scan_layers})
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

  @classmethod
  def from_config(cls, config) -> SFTSpec:
    sft = config.sft
    for key in ("sft.batch_size", "sft.max_len"):
      chk.integer(config, key)
    chk.integer(config, "sft.steps", 0)
    chk.integer(config, "sft.warmup_steps", 0)
    chk.number(config, "sft.lr", 0, lo_open=True)
    weights = chk.level_weights(config, "sft.level_weights")
    return cls(steps=sft.steps, batch_size=sft.batch_size, lr=float(sft.lr),
               warmup_steps=sft.warmup_steps, max_len=sft.max_len, level_weights=weights,
               batch_by_level=bool(sft.batch_by_level))

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

  @classmethod
  def from_config(cls, config, num_batch_devices: int = 1) -> SamplerSpec:
    """config.sampler; the paged sampler's pages must hold one group of config.rl.group_size
    (checked before this)."""
    s = config.sampler
    cls.check_sizes(config)
    chk.need(s.impl in SAMPLER_IMPLS,
             f"config.sampler.impl={s.impl!r}; expected one of {SAMPLER_IMPLS}.")
    # (Overlap mode evaluates on the generator's sub-mesh: rlx.pipeline.make_meshes checks it.)
    chk.need(_overlap(config) or s.eval_batch_size % num_batch_devices == 0,
             f"config.sampler.eval_batch_size={s.eval_batch_size} must be a multiple of the "
             f"{num_batch_devices} data-parallel devices.")
    pc = paged_config(config)
    if s.impl == "paged":
      from rlx.sampler.paged import min_num_pages  # pylint: disable=g-import-not-at-top
      group = config.rl.group_size
      minimum = min_num_pages(s.max_prompt_len, s.max_new_tokens, pc.page_size, group)
      chk.need(pc.num_pages == 0 or pc.num_pages >= minimum,
               f"config.sampler.num_pages={pc.num_pages} is too small: one group of {group} "
               f"samples with a prompt of up to {s.max_prompt_len} tokens and max_new_tokens="
               f"{s.max_new_tokens} (page_size={pc.page_size}) needs num_pages >= {minimum} "
               f"per data shard (page 0 is reserved).")
    sampler = cls(impl=s.impl, paged=pc, max_prompt_len=s.max_prompt_len,
                  max_new_tokens=s.max_new_tokens, temperature=float(s.temperature),
                  top_k=int(s.top_k), top_p=float(s.top_p), eval_batch_size=s.eval_batch_size)
    sampler.sampling(eos_id=3, pad_id=0)  # validates temperature / top-k / top-p
    return sampler

  @staticmethod
  def check_sizes(config) -> None:
    """The sampler's sizes (the update's shape reads them too: RLSpec)."""
    chk.integer(config, "sampler.max_prompt_len")
    chk.integer(config, "sampler.eval_batch_size")
    chk.integer(config, "sampler.max_new_tokens", 1, chk.MAX_TOKENS)
    chk.integer(config, "sampler.max_prompt_len", 1, chk.MAX_TOKENS)

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


def paged_config(config):
  """The paged sampler's settings of config.sampler (rlx.sampler.paged.PagedConfig)."""
  from rlx.sampler.paged import PagedConfig  # pylint: disable=g-import-not-at-top
  s = config.sampler
  try:
    return PagedConfig(page_size=s.page_size, num_pages=s.num_pages, max_slots=s.max_slots,
                       attention_impl=s.attention, cascade=s.cascade)
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
  update_buckets: int  # config.update_shape (the step's fields of the same name)
  update_parts: int
  update_micro_rows: int

  @classmethod
  def from_config(cls, config, replay_rows: int = 0, num_batch_devices: int = 1) -> RLSpec:
    """config.rl; `replay_rows` replayed rows join each training batch (config.replay)."""
    rl = config.rl
    for key in ("prompts_per_step", "group_size", "num_updates", "num_minibatches"):
      chk.integer(config, f"rl.{key}")
    chk.need(rl.advantage in adv_lib.MODES,
             f"config.rl.advantage={rl.advantage!r}; expected one of {adv_lib.MODES}.")
    chk.need(rl.group_size >= 2 or rl.advantage not in adv_lib.GROUP_MODES,
             f"config.rl.group_size={rl.group_size}: advantage '{rl.advantage}' normalises "
             f"rewards within a group, so group_size must be >= 2.")
    batch = rl.prompts_per_step * rl.group_size
    chk.need((batch + replay_rows) % rl.num_minibatches == 0,
             f"the training batch of {batch + replay_rows} rows (prompts_per_step * group_size"
             f"{' + replay.num_samples' if replay_rows else ''}) does not split into "
             f"config.rl.num_minibatches={rl.num_minibatches} equal minibatches.")
    micro = config.update_shape.micro_rows if "update_shape" in config else 0
    chk.need(not micro or rl.num_minibatches == 1,
             f"config.update_shape.micro_rows={micro} (gradient accumulation within one "
             f"optimizer step) needs config.rl.num_minibatches=1, got {rl.num_minibatches}.")
    chk.need(batch % num_batch_devices == 0,
             f"config.rl.prompts_per_step * config.rl.group_size = {batch} rollouts cannot be "
             f"split over the {num_batch_devices} data-parallel devices (mesh data x fsdp); "
             f"use a multiple of {num_batch_devices}.")
    return cls(prompts_per_step=rl.prompts_per_step, group_size=rl.group_size,
               advantage=rl.advantage, num_updates=rl.num_updates,
               num_minibatches=rl.num_minibatches, loss=LossConfig.from_config(config),
               logprob_chunk=chk.integer(config, "rl.logprob_chunk", 0, chk.MAX_TOKENS),
               remat=bool(rl.remat), fuse_pi_old=bool(rl.fuse_pi_old),
               **_update_shape(config))


def _update_shape(config) -> dict[str, Any]:
  """config.update_shape as RLSpec's (and the step's) update_* fields (rlx.update_plan)."""
  if "update_shape" not in config:  # configs written before it existed: the defaults
    return dict(update_buckets=4, update_parts=2, update_micro_rows=0)
  return dict(update_buckets=chk.integer(config, "update_shape.width_buckets", 1, 64),
              update_parts=chk.integer(config, "update_shape.length_parts", 1, 64),
              update_micro_rows=_micro_rows(config))


def _micro_rows(config) -> int:
  """update_shape.micro_rows, or where it is 0 on the CPU backend the rows of
  update_shape.cpu_micro_tokens padded tokens (max_prompt_len + max_new_tokens each; one
  minibatch)."""
  micro = chk.integer(config, "update_shape.micro_rows", 0, chk.MAX_TOKENS)
  tokens = chk.integer(config, "update_shape.cpu_micro_tokens", 0, chk.MAX_TOKENS)
  if micro or not tokens or config.rl.num_minibatches != 1:
    return micro
  if jax.default_backend() != "cpu":
    return 0
  SamplerSpec.check_sizes(config)
  return max(1, tokens // (config.sampler.max_prompt_len + config.sampler.max_new_tokens))


@dataclasses.dataclass(frozen=True)
class OptimSpec:
  lr: float
  schedule: str
  warmup_steps: int
  weight_decay: float
  grad_clip: float
  b1: float
  b2: float

  @classmethod
  def from_config(cls, config) -> OptimSpec:
    o = config.optim
    chk.number(config, "optim.lr", 0, lo_open=True)
    chk.integer(config, "optim.warmup_steps", 0)
    chk.number(config, "optim.weight_decay", 0)
    chk.number(config, "optim.grad_clip", 0, what="grad_clip >= 0 (0: no clipping)")
    chk.number(config, "optim.b1", 0, 1, hi_open=True)
    chk.number(config, "optim.b2", 0, 1, hi_open=True)
    chk.need(o.schedule in ("constant", "cosine"),
             f"config.optim.schedule={o.schedule!r}; expected 'constant' or 'cosine'.")
    return cls(lr=float(o.lr), schedule=o.schedule, warmup_steps=o.warmup_steps,
               weight_decay=float(o.weight_decay), grad_clip=float(o.grad_clip),
               b1=float(o.b1), b2=float(o.b2))


@dataclasses.dataclass(frozen=True)
class GuardSpec:
  max_consecutive_skips: int
  reward_range: tuple[float, float]

  @classmethod
  def from_config(cls, config) -> GuardSpec:
    g = config.guard
    chk.integer(config, "guard.max_consecutive_skips", 1)
    try:
      lo, hi = (float(x) for x in g.reward_range)
    except (TypeError, ValueError):
      raise ConfigError(f"config.guard.reward_range={g.reward_range!r}; expected "
                        f"(low, high).") from None
    chk.need(lo <= hi, f"config.guard.reward_range={tuple(g.reward_range)!r} is empty; "
                       f"expected (low, high) with low <= high.")
    return cls(max_consecutive_skips=g.max_consecutive_skips, reward_range=(lo, hi))


@dataclasses.dataclass(frozen=True)
class MemorySpec:
  device_bytes: int
  activation_margin: float
  check: bool

  @classmethod
  def from_config(cls, config) -> MemorySpec:
    m = config.memory
    chk.integer(config, "memory.device_bytes", 0)
    chk.number(config, "memory.activation_margin", 1.0)
    return cls(device_bytes=m.device_bytes, activation_margin=float(m.activation_margin),
               check=bool(m.check))


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  data: int
  fsdp: int
  tensor: int

  @classmethod
  def from_config(cls, config) -> MeshSpec:
    for axis in ("data", "fsdp", "tensor"):
      v = config.mesh[axis]
      chk.need(isinstance(v, int) and (v >= 1 or (axis == "data" and v == -1)),
               f"config.mesh.{axis}={v!r}; expected a positive integer"
               f"{' or -1 (the devices left over)' if axis == 'data' else ''}.")
    return cls(data=config.mesh.data, fsdp=config.mesh.fsdp, tensor=config.mesh.tensor)


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
  """config.pipeline (rlx.pipeline): "sync" runs generation and the update in turn on one
  mesh; "overlap" splits the devices into a generator and a learner sub-mesh and runs them at
  once, the generator `max_staleness` steps ahead."""

  mode: str = "sync"
  generator_devices: int = 0  # overlap: devices that generate (0: half of them)
  generator_tensor: int = 1  # overlap: tensor-parallel size of the generator sub-mesh
  max_staleness: int = 1  # overlap: batches in flight (0: the sync step on two sub-meshes)

  @classmethod
  def from_config(cls, config) -> PipelineSpec:
    """config.pipeline (configs written before it existed: sync)."""
    if "pipeline" not in config:
      return cls()
    p = config.pipeline
    chk.need(p.mode in PIPELINE_MODES,
             f"config.pipeline.mode={p.mode!r}; expected one of {PIPELINE_MODES}.")
    spec = cls(mode=p.mode,
               generator_devices=chk.integer(config, "pipeline.generator_devices", 0),
               generator_tensor=chk.integer(config, "pipeline.generator_tensor", 1),
               max_staleness=chk.integer(config, "pipeline.max_staleness", 0, 64))
    if spec.mode == "overlap":
      chk.need(not config.fused_step,
               "config.fused_step=True with config.pipeline.mode='overlap': the fused step "
               "runs generation and the update as one program on one mesh; overlap runs them "
               "as two.")
    return spec


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
  every: int
  keep: int  # newest checkpoints kept (>= 1); 0 keeps every checkpoint

  @classmethod
  def from_config(cls, config) -> CheckpointSpec:
    return cls(every=chk.integer(config, "checkpoint_every"),
               keep=chk.integer(config, "keep_checkpoints", 0))
