"""The warm-start base cache: what a base model directory was made for, and writing one.

A base directory (WORKDIR/base, or config.warm_start.dir) holds Hugging Face safetensors, the
tokenizer and `rlx_base.json`: the task's name ("task"), its dataset spec ("task_spec", the
registered task's `cache_key`) and the model spec it was trained for; a run reuses it only
when these match its own config. (Bases written before tasks had names are arithmetic ones.)
"""

from __future__ import annotations

import json
import os
from typing import Any

from rlx import configs
from rlx.checkpoint import read_json
from rlx.data import registry

BASE_META = "rlx_base.json"


def retrain_advice(directory: str) -> str:
  """What makes the next run work when a workdir's own base has a damaged or no BASE_META:
  deleting the whole base (deleting BASE_META alone leaves a base a resume cannot check) has
  the warm start trained again (the same seed gives the same base); the checkpoints hold the
  trained policy and are resumed."""
  return (f"Delete the directory {directory} to have the warm start trained again (the "
          f"checkpoints are kept and resumed), or use a new --workdir.")


def read_base_meta(directory: str, remedy: str | None = None) -> dict[str, Any] | None:
  path = os.path.join(directory, BASE_META)
  if not os.path.exists(path):
    return None
  return read_json(path, remedy or (
      f"Delete it, and {directory} is not used (a warm start is trained instead), or set "
      f"config.warm_start.dir to a base written by an rlx run (WORKDIR/base)."))


def base_matches(directory: str, spec: configs.RunSpec,
                 remedy: str | None = None) -> tuple[bool, str]:
  """Whether a warm-start directory was made for this task and model architecture.

  remedy: the advice ending the error for a damaged BASE_META."""
  meta = read_base_meta(directory, remedy)
  if meta is None:
    return False, f"{directory} has no {BASE_META}"
  name = meta.get("task", "arithmetic")
  if name != spec.task.name:
    return False, (f"{directory} was made for task {name!r}, the config asks for "
                   f"{spec.task.name!r}")
  want = json.loads(json.dumps(registry.cache_key(spec.task)))
  got = meta.get("task_spec", {})
  if got != want:
    return False, f"{directory} was made for task {got}, the config asks for {want}"
  arch = json.loads(json.dumps(spec.model.arch))
  if _identity(meta.get("model_overrides")) != _identity(arch):
    return False, f"{directory} was made for model {meta.get('model_overrides')}, not {arch}"
  return True, ""


def _identity(arch: dict[str, Any] | None) -> dict[str, Any] | None:
  """What makes two bases the same model: the architecture without the compute dtype, since a
  base's weights are stored in its param dtype and a base trained in float32 (on CPU) serves
  a bfloat16 run (model.dtype="auto" on a GPU) as it is."""
  return None if arch is None else {k: v for k, v in arch.items() if k != "dtype"}


def save_base(directory: str, spec: configs.RunSpec, model_cfg, params, tokenizer, *,
              extra: dict[str, Any] | None = None) -> None:
  """Writes a warm-start base: HF safetensors + tokenizer, then (last, atomically) the spec it
  was made for, so a crash mid-write leaves a directory that is not reused."""
  from rlx.model import hf  # pylint: disable=g-import-not-at-top
  os.makedirs(directory, exist_ok=True)
  hf.save_hf(model_cfg, params, directory, architecture="LlamaForCausalLM")
  tokenizer.save(os.path.join(directory, "tokenizer.model"))
  meta = {
      "task": spec.task.name,
      "task_spec": registry.cache_key(spec.task),
      "model_overrides": spec.model.arch,
      "sft": spec.sft.as_record(),
      "seed": spec.seed,
      **(extra or {}),
  }
  tmp = os.path.join(directory, BASE_META + ".tmp")
  with open(tmp, "w") as f:
    json.dump(meta, f, indent=2, sort_keys=True)
  os.replace(tmp, os.path.join(directory, BASE_META))
