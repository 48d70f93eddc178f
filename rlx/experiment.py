"""Builds what an experiment config describes: task data, tokenizer, model and base weights.

Base weights, in order of preference:
  1. config.model.path: a Hugging Face checkpoint directory (weights + tokenizer).
  2. config.warm_start.dir: a base checkpoint written by `python -m rlx.sft` (the default
     experiment ships one in rlx/assets/), used when its task spec matches the config.
  3. A supervised warm start run now on the task's teacher answers, cached in WORKDIR/base
     (Hugging Face format), so a rerun or resume does not repeat it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import time
from typing import Any

import ml_collections as mlc
import tensorflow_datasets as tfds

from rlx import configs, distributed
from rlx.data import arithmetic, tasks
from rlx.data.tokenizer import Tokenizer, load_tokenizer, train_sentencepiece
from rlx.model import transformer
from rlx.model.config import ModelConfig

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
BASE_META = "rlx_base.json"


@dataclasses.dataclass
class Experiment:
  config: mlc.ConfigDict
  tokenizer: Any
  model_cfg: ModelConfig
  graphdef: Any
  base_params: Any
  train_pool: tasks.PromptPool  # RL prompts (numpy)
  train_host: tasks.HostExamples
  eval_pool: tasks.PromptPool
  eval_host: tasks.HostExamples
  base_source: str  # where the base weights came from (for the log)


def task_spec(config: mlc.ConfigDict) -> arithmetic.ArithmeticSpec:
  t = config.task
  if t.name != "arithmetic":
    raise configs.ConfigError(f"config.task.name={t.name!r}: the warm start is built only for "
                              f"'arithmetic'.")
  for op in t.ops:
    if op not in arithmetic.OPS:
      raise configs.ConfigError(f"config.task.ops contains {op!r}; expected ops from "
                                f"{arithmetic.OPS}.")
  for key in ("num_train_per_level", "num_eval_per_level"):
    if int(t[key]) < 1:
      raise configs.ConfigError(f"config.task.{key}={t[key]} gives an empty dataset; expected "
                                f">= 1.")
  if not t.levels or min(int(l) for l in t.levels) < 1:
    raise configs.ConfigError(f"config.task.levels={tuple(t.levels)}; expected digit counts "
                              f">= 1.")
  return arithmetic.ArithmeticSpec(
      ops=tuple(t.ops), levels=tuple(int(l) for l in t.levels),
      num_train_per_level=t.num_train_per_level, num_eval_per_level=t.num_eval_per_level,
      seed=t.get("seed", 0), reverse_answer=t.get("reverse_answer", False),
      teacher_error_levels=tuple(int(l) for l in t.get("teacher_error_levels", ())),
      teacher_error_rate=float(t.get("teacher_error_rate", 0.0)))


TASKS = ("arithmetic", "gsm8k", "math")


def load_task(config: mlc.ConfigDict, data_dir: str) -> tuple[list[dict], list[dict]]:
  """(train examples, held-out examples), each {'prompt', 'answer', 'difficulty', ...}."""
  tfds.disable_progress_bar()
  logging.getLogger("absl").setLevel(logging.ERROR)
  name = config.task.name
  if name == "arithmetic":
    with contextlib.redirect_stdout(io.StringIO()):  # TFDS prints "Downloading and preparing"
      sources = arithmetic.build(task_spec(config), data_dir)
    return arithmetic.read_all(sources["train"]), arithmetic.read_all(sources["eval"])
  if name in ("gsm8k", "math"):
    from rlx.data import math_datasets  # pylint: disable=g-import-not-at-top
    manual = config.task.get("manual_dir", "")
    if not manual:
      raise configs.ConfigError(f"config.task.name={name!r} reads local JSONL files: set "
                                f"config.task.manual_dir (see README, Datasets).")
    with contextlib.redirect_stdout(io.StringIO()):
      sources = math_datasets.build(name, manual, data_dir)
    train = math_datasets.read_all(sources["train"]) if "train" in sources else []
    held_out = math_datasets.read_all(sources["test"]) if "test" in sources else []
    n_eval = int(config.task.get("num_eval", 0) or 0)
    if not held_out:  # no test file: hold out the tail of train
      n = n_eval or max(1, len(train) // 10)
      train, held_out = train[:-n], train[-n:]
    if n_eval:
      held_out = held_out[:n_eval]
    return train, held_out
  raise configs.ConfigError(f"config.task.name={name!r}; expected one of {TASKS}.")


def _resolve(path: str) -> str:
  """Paths starting with 'assets/' are looked up in the package's assets directory."""
  if path.startswith("assets/"):
    return os.path.join(ASSETS_DIR, path[len("assets/"):])
  return os.path.expanduser(path)


def read_base_meta(directory: str) -> dict[str, Any] | None:
  path = os.path.join(directory, BASE_META)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def base_matches(directory: str, config: mlc.ConfigDict) -> tuple[bool, str]:
  """Whether a warm-start directory was made for this task and model architecture."""
  meta = read_base_meta(directory)
  if meta is None:
    return False, f"{directory} has no {BASE_META}"
  want = json.loads(json.dumps(dataclasses.asdict(task_spec(config))))
  got = meta.get("task_spec", {})
  if got != want:
    return False, f"{directory} was made for task {got}, the config asks for {want}"
  arch = json.loads(json.dumps({k: v for k, v in config.model.items() if k != "path"}))
  if meta.get("model_overrides") != arch:
    return False, f"{directory} was made for model {meta.get('model_overrides')}, not {arch}"
  return True, ""


def setup(config: mlc.ConfigDict, workdir: str, *, log=print,
          resuming: bool = False) -> Experiment:
  """Everything the trainer needs, built (or read from cache) on the host.

  resuming: the workdir holds checkpoints; its cached base model must then match the config
  (otherwise the run would silently continue from a different starting point).
  """
  from rlx.model import hf  # local import: pulls in the safetensors reader only when needed

  # Process 0 prepares what is cached on disk (data, tokenizer, warm start); the others
  # then read it.
  chosen, source = distributed.main_first(
      lambda: _prepare(config, workdir, log=log, resuming=resuming), "rlx_prepare")
  data_dir = _resolve(config.task.get("data_dir", "") or os.path.join(workdir, "data"))
  train_ex, eval_ex = load_task(config, data_dir)
  model_path = config.model.get("path", "")
  if model_path:
    tokenizer = load_tokenizer(config.tokenizer.path or model_path)
    model_cfg, params = hf.load_hf(model_path, dtype=config.model.get("dtype", "float32"),
                                   param_dtype=config.model.get("param_dtype", None))
  else:
    tokenizer = Tokenizer.load(os.path.join(chosen, "tokenizer.model"))
    model_cfg, params = hf.load_hf(chosen, dtype=config.model.get("dtype", "float32"))
  graphdef = transformer.graphdef_for(model_cfg)

  eval_levels = tuple(config.task.get("eval_levels", ()) or ())
  if eval_levels:
    eval_ex = [e for e in eval_ex if int(e["difficulty"]) in set(int(l) for l in eval_levels)]
    if not eval_ex:
      raise configs.ConfigError(f"config.task.eval_levels={eval_levels} selects no eval "
                                f"example (task.levels={tuple(config.task.levels)}).")
  rl_levels = set(int(l) for l in (config.task.get("rl_levels", ()) or ()))
  rl_ex = [e for e in train_ex if not rl_levels or int(e["difficulty"]) in rl_levels]
  if not rl_ex:
    raise configs.ConfigError(f"config.task.rl_levels={tuple(config.task.rl_levels)} selects no "
                              f"training example (task.levels={tuple(config.task.levels)}).")
  max_p = config.sampler.max_prompt_len
  max_a = config.sampler.max_new_tokens
  fmt, special = prompt_formatter(config, tokenizer)
  rl_ex = [{**e, "prompt": fmt(e["prompt"])} for e in rl_ex]
  eval_ex = [{**e, "prompt": fmt(e["prompt"])} for e in eval_ex]
  train_pool, train_host = tasks.tokenize_pool(rl_ex, tokenizer, max_p, max_a,
                                               task_name=f"{config.task.name} train",
                                               add_special_tokens=special)
  eval_pool, eval_host = tasks.tokenize_pool(eval_ex, tokenizer, max_p, max_a,
                                             task_name=f"{config.task.name} eval",
                                             add_special_tokens=special)
  return Experiment(config=config, tokenizer=tokenizer, model_cfg=model_cfg, graphdef=graphdef,
                    base_params=params, train_pool=train_pool, train_host=train_host,
                    eval_pool=eval_pool, eval_host=eval_host, base_source=source)


def prompt_formatter(config: mlc.ConfigDict, tokenizer):
  """(question -> prompt text, whether to add the tokenizer's special tokens).

  config.task.instruction is a format string with {prompt}; with
  config.tokenizer.chat_template the result becomes the user turn of the model's own chat
  template (after an optional config.tokenizer.system_prompt), which spells out the special
  tokens itself.
  """
  instruction = config.task.get("instruction", "") or "{prompt}"
  if "{prompt}" not in instruction:
    raise configs.ConfigError(f"config.task.instruction={instruction!r} must contain "
                              f"'{{prompt}}'.")
  use_chat = bool(config.get("tokenizer", {}).get("chat_template", False))
  system = config.get("tokenizer", {}).get("system_prompt", "")
  if use_chat and not getattr(tokenizer, "chat_template", None):
    raise configs.ConfigError("config.tokenizer.chat_template=True, but the tokenizer has no "
                              "chat template (tokenizer_config.json 'chat_template' or "
                              "chat_template.jinja).")

  def fmt(question: str) -> str:
    text = instruction.format(prompt=question)
    if not use_chat:
      return text
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

  return fmt, not use_chat


def _prepare(config: mlc.ConfigDict, workdir: str, *, log, resuming: bool
             ) -> tuple[str | None, str]:
  """Prepares the data and picks (or trains) the base model; returns (base dir, source)."""
  from rlx import sft

  data_dir = _resolve(config.task.get("data_dir", "") or os.path.join(workdir, "data"))
  train_ex, eval_ex = load_task(config, data_dir)
  if not train_ex or not eval_ex:
    raise configs.ConfigError(
        f"config.task produced {len(train_ex)} train and {len(eval_ex)} eval examples; "
        f"expected at least one of each (check task.levels and num_*_per_level).")

  model_path = config.model.get("path", "")
  if not model_path and config.task.name != "arithmetic":
    raise configs.ConfigError(f"config.task.name={config.task.name!r} needs a base model: set "
                              f"config.model.path to a Hugging Face checkpoint directory (the "
                              f"built-in warm start exists only for 'arithmetic').")
  warm_dir = _resolve(config.get("warm_start", {}).get("dir", "") or "")
  if warm_dir and not os.path.isdir(warm_dir):
    raise FileNotFoundError(f"config.warm_start.dir={warm_dir!r} is not a directory; expected a "
                            f"base model written by an earlier run (WORKDIR/base).")
  base_dir = os.path.join(workdir, "base")
  source = ""
  if model_path:
    if not os.path.isdir(model_path):
      raise FileNotFoundError(f"config.model.path={model_path!r} is not a directory.")
    return None, f"Hugging Face checkpoint {model_path}"
  else:
    chosen = None
    for d in (base_dir, warm_dir):
      if d and os.path.isdir(d):
        ok, why = base_matches(d, config)
        if ok:
          chosen = d
          break
        if d == base_dir and resuming:
          from rlx.checkpoint import CheckpointError  # pylint: disable=g-import-not-at-top
          raise CheckpointError(
              f"--workdir={workdir} holds a run made with another task or model ({why}). Use "
              f"a new --workdir, or the config it was made with.")
        log(f"[rlx] not using warm start {d}: {why}")
    if chosen is None:
      tokenizer = _task_tokenizer(config, train_ex, workdir)
      model_cfg = configs.model_config(config, tokenizer.vocab_size)
      t0 = time.time()
      log(f"[rlx] supervised warm start: {config.sft.steps} steps on the task's teacher "
          f"answers (cached in {base_dir})")
      params = sft.train(config, model_cfg, tokenizer, train_ex, eval_ex, log=log)
      sft.save_base(base_dir, config, model_cfg, params, tokenizer,
                    extra={"sft_seconds": round(time.time() - t0, 1)})
      chosen = base_dir
      source = f"warm start trained now ({time.time() - t0:.0f}s), saved to {base_dir}"
    else:
      source = f"warm start {chosen}"
  return chosen, source


def _task_tokenizer(config: mlc.ConfigDict, train_ex: list[dict], workdir: str) -> Tokenizer:
  if config.tokenizer.path:
    return load_tokenizer(config.tokenizer.path)
  path = os.path.join(workdir, "tokenizer.model")
  if os.path.exists(path):
    return Tokenizer.load(path)
  texts = []
  for e in train_ex:
    texts.append(e["prompt"] + e["answer"])
    if e.get("teacher_answer", e["answer"]) != e["answer"]:
      texts.append(e["prompt"] + e["teacher_answer"])
  tok = train_sentencepiece(texts, config.tokenizer.vocab_size)
  os.makedirs(workdir, exist_ok=True)
  tok.save(path)
  return tok
