"""From an experiment's ml_collections config to the typed, validated objects rlx runs on.

Every check here runs before anything is compiled or written, so a mistake in a config costs
seconds: each failure is one sentence naming the config key, the bad value and what was
expected.
"""

from __future__ import annotations

from typing import Any

import ml_collections as mlc

from rlx.model.config import ModelConfig
from rlx.rl import advantages as adv_lib
from rlx.rl.length import LengthConfig
from rlx.rl.loss import LossConfig
from rlx.rl.replay import ReplayConfig
from rlx.rl.selection import SelectionConfig
from rlx.sampler.sampling import SamplingParams

SAMPLER_IMPLS = ("dense", "paged")
_MODEL_KEYS_NOT_ARCH = ("path",)


class ConfigError(ValueError):
  """A config value that cannot work; the message names the key."""


def _need(ok: bool, msg: str) -> None:
  if not ok:
    raise ConfigError(msg)


def _positive_int(c, key: str) -> int:
  value = c
  for part in key.split("."):
    value = value[part]
  _need(isinstance(value, int) and not isinstance(value, bool) and value > 0,
        f"config.{key}={value!r}; expected a positive integer.")
  return value


def validate(config: mlc.ConfigDict, num_batch_devices: int = 1) -> None:
  """Semantic checks that ml_collections' type checks do not cover."""
  for key in ("total_steps", "eval_every", "checkpoint_every", "rl.prompts_per_step",
              "rl.group_size", "rl.num_updates", "rl.num_minibatches",
              "sampler.max_prompt_len", "sampler.max_new_tokens", "sampler.eval_batch_size"):
    _positive_int(config, key)
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
  if replay:
    _need(replay.num_samples % num_batch_devices == 0,
          f"config.replay.num_samples={replay.num_samples} must be a multiple of the "
          f"{num_batch_devices} data-parallel devices.")
    _need(replay.capacity % num_batch_devices == 0,
          f"config.replay.capacity={replay.capacity} must be a multiple of the "
          f"{num_batch_devices} data-parallel devices (the ring is split over them).")
  selection_config(config)
  length_config(config)
  _need(batch % num_batch_devices == 0,
        f"config.rl.prompts_per_step * config.rl.group_size = {batch} rollouts cannot be split "
        f"over the {num_batch_devices} data-parallel devices (mesh data x fsdp); use a "
        f"multiple of {num_batch_devices}.")
  _need(config.sampler.impl in SAMPLER_IMPLS,
        f"config.sampler.impl={config.sampler.impl!r}; expected one of {SAMPLER_IMPLS}.")
  _need(config.sampler.eval_batch_size % num_batch_devices == 0,
        f"config.sampler.eval_batch_size={config.sampler.eval_batch_size} must be a multiple "
        f"of the {num_batch_devices} data-parallel devices.")
  # These constructors validate their own fields with named errors.
  loss_config(config)
  if config.sampler.impl == "paged":
    pc = paged_config(config)
    from rlx.sampler.paged import min_num_pages  # pylint: disable=g-import-not-at-top
    minimum = min_num_pages(config.sampler.max_prompt_len, config.sampler.max_new_tokens,
                            pc.page_size, rl.group_size)
    _need(pc.num_pages == 0 or pc.num_pages >= minimum,
          f"config.sampler.num_pages={pc.num_pages} is too small: one group of "
          f"{rl.group_size} samples with a prompt of up to {config.sampler.max_prompt_len} "
          f"tokens and max_new_tokens={config.sampler.max_new_tokens} (page_size="
          f"{pc.page_size}) needs num_pages >= {minimum} per data shard (page 0 is reserved).")
  sampling_params(config, eos_id=3, pad_id=0)


def loss_config(config: mlc.ConfigDict) -> LossConfig:
  rl = config.rl
  try:
    return LossConfig(eps_low=rl.eps_low, eps_high=rl.eps_high, aggregation=rl.aggregation,
                      kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator, is_cap=rl.is_cap,
                      is_mode=rl.is_mode, ratio_level=rl.ratio_level,
                      anchor=rl.get("anchor", "proximal"))
  except ValueError as e:
    raise ConfigError(f"config.rl: {e}") from None


def _section(config: mlc.ConfigDict, name: str) -> dict:
  return dict(config[name]) if name in config else {}


def selection_config(config: mlc.ConfigDict) -> SelectionConfig:
  try:
    return SelectionConfig(**_section(config, "selection"))
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config.selection: {e}") from None


def replay_config(config: mlc.ConfigDict) -> ReplayConfig | None:
  fields = _section(config, "replay")
  if not fields.pop("enabled", False):
    return None
  try:
    return ReplayConfig(**fields)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config.replay: {e}") from None


def length_config(config: mlc.ConfigDict) -> LengthConfig:
  try:
    return LengthConfig(**_section(config, "length"))
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config.length: {e}") from None


def paged_config(config: mlc.ConfigDict):
  from rlx.sampler.paged import PagedConfig  # pylint: disable=g-import-not-at-top
  s = config.sampler
  try:
    return PagedConfig(page_size=s.get("page_size", 16), num_pages=s.get("num_pages", 0),
                       max_slots=s.get("max_slots", 0),
                       attention_impl=s.get("attention", "reference"),
                       cascade=s.get("cascade", False))
  except ValueError as e:
    raise ConfigError(f"config.sampler: {e}") from None


def sampling_params(config: mlc.ConfigDict, *, eos_id: int, pad_id: int,
                    stop_ids: tuple[int, ...] = (), greedy: bool = False) -> SamplingParams:
  s = config.sampler
  try:
    return SamplingParams(max_new_tokens=s.max_new_tokens,
                          temperature=0.0 if greedy else s.temperature,
                          top_k=0 if greedy else s.top_k, top_p=1.0 if greedy else s.top_p,
                          eos_id=eos_id, pad_id=pad_id, stop_ids=tuple(stop_ids))
  except ValueError as e:
    raise ConfigError(f"config.sampler: {e}") from None


def model_config(config: mlc.ConfigDict, vocab_size: int) -> ModelConfig:
  """The tiny-model architecture from config.model (HF checkpoints bring their own)."""
  fields = {k: v for k, v in config.model.items() if k not in _MODEL_KEYS_NOT_ARCH}
  fields["vocab_size"] = vocab_size
  fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in fields.items()}
  try:
    return ModelConfig.from_dict(fields)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config.model: {e}") from None


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
  c.keep_checkpoints = 2
  c.fused_step = False  # True: one jitted step (no generation/update time split)

  c.task = mlc.ConfigDict()
  c.task.name = "arithmetic"  # arithmetic | gsm8k | math
  c.task.ops = ("add",)  # arithmetic: ("add", "mul")
  c.task.levels = (2, 3, 4, 5)  # arithmetic: numbers of digits
  c.task.num_train_per_level = 5000
  c.task.num_eval_per_level = 200
  c.task.reverse_answer = False  # arithmetic: answers lowest digit first
  c.task.teacher_error_levels = ()  # arithmetic: warm-start answers drop a carry here ...
  c.task.teacher_error_rate = 0.0  # ... with this probability
  c.task.seed = 0
  c.task.manual_dir = ""  # gsm8k / math: the directory holding the JSONL files
  c.task.num_eval = 0  # gsm8k / math: cap on held-out examples (0: all)
  c.task.rl_levels = ()  # difficulty levels RL trains on (empty: all)
  c.task.band = ()  # levels whose accuracy is the headline (empty: all)
  c.task.eval_levels = ()  # levels of the held-out set to evaluate (empty: all)
  c.task.data_dir = ""  # where TFDS prepares the data (empty: WORKDIR/data)
  c.task.instruction = "{prompt}"  # prompt template; {prompt} is the problem text
  # "exact_match": the jnp verifier inside the jitted step. A registered Python reward
  # ("math", "exact") or "package.module:function" runs on the host between the halves.
  c.task.reward = "exact_match"

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

  # Sample efficiency (rlx.rl.selection / replay / length); off = plain GRPO.
  c.selection = mlc.ConfigDict()
  c.selection.mode = "uniform"  # uniform | band | history | skip
  c.selection.ema = 0.5
  c.selection.floor = 0.05
  c.selection.history_cooldown = 50
  c.selection.skip_keep_base = 0.25
  c.selection.dynamic_filter = False  # DAPO dynamic sampling
  c.selection.oversample = 2

  c.replay = mlc.ConfigDict()
  c.replay.enabled = False
  c.replay.capacity = 1024
  c.replay.num_samples = 64
  c.replay.max_staleness = 4
  c.replay.max_reuse = 2
  c.replay.priority = "abs_adv"  # abs_adv | recency | uniform

  c.length = mlc.ConfigDict()
  c.length.overlong_shaping = False
  c.length.overlong_buffer = 2
  c.length.overlong_penalty = 1.0
  c.length.overlong_filter = False

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
