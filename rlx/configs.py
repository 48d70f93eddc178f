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
  sampling_params(config, eos_id=3, pad_id=0)


def loss_config(config: mlc.ConfigDict) -> LossConfig:
  rl = config.rl
  try:
    return LossConfig(eps_low=rl.eps_low, eps_high=rl.eps_high, aggregation=rl.aggregation,
                      kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator, is_cap=rl.is_cap,
                      is_mode=rl.is_mode, ratio_level=rl.ratio_level)
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
