"""The warm-start base cache: what a base model directory was made for, and writing one.

A base directory (WORKDIR/base, or config.warm_start.dir) holds Hugging Face safetensors, the
tokenizer and `rlx_base.json`, the task and model spec it was trained for; a run reuses it only
when that spec matches its own config.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from rlx import configs
from rlx.checkpoint import read_json
from rlx.data import arithmetic

BASE_META = "rlx_base.json"


def arithmetic_spec(task: configs.TaskSpec) -> arithmetic.ArithmeticSpec:
  """The arithmetic dataset a task spec describes (checked: ops, sizes, levels)."""
  if task.name != "arithmetic":
    raise configs.ConfigError(f"config.task.name={task.name!r}: the warm start is built only "
                              f"for 'arithmetic'.")
  for op in task.ops:
    if op not in arithmetic.OPS:
      raise configs.ConfigError(f"config.task.ops contains {op!r}; expected ops from "
                                f"{arithmetic.OPS}.")
  for key in ("num_train_per_level", "num_eval_per_level"):
    if int(getattr(task, key)) < 1:
      raise configs.ConfigError(f"config.task.{key}={getattr(task, key)} gives an empty "
                                f"dataset; expected >= 1.")
  if not task.levels or min(task.levels) < 1:
    raise configs.ConfigError(f"config.task.levels={task.levels}; expected digit counts >= 1.")
  return arithmetic.ArithmeticSpec(
      ops=task.ops, levels=task.levels, num_train_per_level=task.num_train_per_level,
      num_eval_per_level=task.num_eval_per_level, seed=task.seed,
      reverse_answer=task.reverse_answer, teacher_error_levels=task.teacher_error_levels,
      teacher_error_rate=task.teacher_error_rate)


def read_base_meta(directory: str) -> dict[str, Any] | None:
  path = os.path.join(directory, BASE_META)
  if not os.path.exists(path):
    return None
  return read_json(path)


def base_matches(directory: str, spec: configs.RunSpec) -> tuple[bool, str]:
  """Whether a warm-start directory was made for this task and model architecture."""
  meta = read_base_meta(directory)
  if meta is None:
    return False, f"{directory} has no {BASE_META}"
  want = json.loads(json.dumps(dataclasses.asdict(arithmetic_spec(spec.task))))
  got = meta.get("task_spec", {})
  if got != want:
    return False, f"{directory} was made for task {got}, the config asks for {want}"
  arch = json.loads(json.dumps(spec.model.arch))
  if meta.get("model_overrides") != arch:
    return False, f"{directory} was made for model {meta.get('model_overrides')}, not {arch}"
  return True, ""


def save_base(directory: str, spec: configs.RunSpec, model_cfg, params, tokenizer, *,
              extra: dict[str, Any] | None = None) -> None:
  """Writes a warm-start base: HF safetensors + tokenizer, then (last, atomically) the spec it
  was made for, so a crash mid-write leaves a directory that is not reused."""
  from rlx.model import hf  # pylint: disable=g-import-not-at-top
  os.makedirs(directory, exist_ok=True)
  hf.save_hf(model_cfg, params, directory, architecture="LlamaForCausalLM")
  tokenizer.save(os.path.join(directory, "tokenizer.model"))
  meta = {
      "task_spec": dataclasses.asdict(arithmetic_spec(spec.task)),
      "model_overrides": spec.model.arch,
      "sft": spec.sft.as_record(),
      "seed": spec.seed,
      **(extra or {}),
  }
  tmp = os.path.join(directory, BASE_META + ".tmp")
  with open(tmp, "w") as f:
    json.dump(meta, f, indent=2, sort_keys=True)
  os.replace(tmp, os.path.join(directory, BASE_META))
