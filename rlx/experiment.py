"""Builds what an experiment config describes: task data, tokenizer, model and base weights.

Base weights, in order of preference:
  1. config.model.path: a Hugging Face checkpoint directory (weights + tokenizer).
  2. config.warm_start.dir: a base directory written by an earlier run (WORKDIR/base; see
     rlx.warm_start), used when the task and model spec it records match the config.
  3. A supervised warm start run now on the task's teacher answers, cached in WORKDIR/base
     (Hugging Face format), so a rerun or resume does not repeat it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any

import numpy as np

from rlx import configs, distributed, sft, warm_start
from rlx.data import registry, tasks
from rlx.data.tokenizer import Tokenizer, load_tokenizer, train_sentencepiece
from rlx.model import transformer
from rlx.model.config import ModelConfig

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")


@dataclasses.dataclass
class Experiment:
  spec: configs.RunSpec
  tokenizer: Any
  model_cfg: ModelConfig
  graphdef: Any
  base_params: Any
  train_pool: tasks.PromptPool  # RL prompts (numpy)
  train_host: tasks.HostExamples
  eval_pool: tasks.PromptPool
  eval_host: tasks.HostExamples
  base_source: str  # where the base weights came from (for the log)


def load_task(task: configs.TaskSpec, data_dir: str) -> tuple[list[dict], list[dict]]:
  """(train examples, held-out examples) of the registered task config.task.name, each
  {'prompt', 'answer', 'difficulty', ...} (rlx.data.registry)."""
  return registry.load_examples(task, data_dir)


def _resolve(path: str) -> str:
  """Paths starting with 'assets/' are looked up in the package's assets directory."""
  if path.startswith("assets/"):
    return os.path.join(ASSETS_DIR, path[len("assets/"):])
  return os.path.expanduser(path)


def data_dir_of(spec: configs.RunSpec, workdir: str) -> str:
  return _resolve(spec.task.data_dir or os.path.join(workdir, "data"))


def setup(spec: configs.RunSpec, workdir: str, *, log=print, resuming: bool = False,
          show_progress: bool = True, check_stop=None, mesh=None) -> Experiment:
  """Everything the trainer needs, built (or read from cache) on the host.

  mesh: the base model's weights are placed on it as they load (sharded by the default
  rules), so a model larger than one device's memory never sits on one device; a LoRA run
  loads its frozen base in lora.base_dtype.

  resuming: the workdir holds checkpoints; its cached base model must then match the config
  (otherwise the run would silently continue from a different starting point).
  """
  from rlx.model import hf  # local import: pulls in the safetensors reader only when needed

  # Process 0 prepares what is cached on disk (data, tokenizer, warm start); the others
  # then read it.
  chosen, source = distributed.main_first(
      lambda: _prepare(spec, workdir, log=log, resuming=resuming,
                       show_progress=show_progress, check_stop=check_stop), "rlx_prepare")
  task = spec.task
  train_ex, eval_ex = load_task(task, data_dir_of(spec, workdir))
  model_path = spec.model.path
  if model_path:
    tokenizer = load_tokenizer(spec.tokenizer.path or model_path)
    model_cfg, params = hf.load_hf(
        model_path, dtype=spec.model.dtype, mesh=mesh,
        param_dtype=(spec.lora.base_dtype if spec.lora else "") or spec.model.param_dtype)
  else:
    tokenizer = Tokenizer.load(os.path.join(chosen, "tokenizer.model"))
    model_cfg, params = hf.load_hf(chosen, dtype=spec.model.dtype, mesh=mesh,
                                   param_dtype=spec.model.param_dtype)
  model_cfg = spec.model.run_as(model_cfg)
  graphdef = transformer.graphdef_for(model_cfg)

  if task.eval_levels:
    eval_ex = [e for e in eval_ex if int(e["difficulty"]) in set(task.eval_levels)]
    if not eval_ex:
      raise configs.ConfigError(f"config.task.eval_levels={task.eval_levels} selects no eval "
                                f"example (task.levels={task.levels}).")
  rl_levels = set(task.rl_levels)
  rl_ex = [e for e in train_ex if not rl_levels or int(e["difficulty"]) in rl_levels]
  if not rl_ex:
    raise configs.ConfigError(f"config.task.rl_levels={task.rl_levels} selects no "
                              f"training example (task.levels={task.levels}).")
  if task.rl_level_weights:
    rl_ex = mix_levels(rl_ex, task.rl_level_weights, task.seed)
  max_p = spec.sampler.max_prompt_len
  max_a = spec.sampler.max_new_tokens
  # The pass-rate probe's completions (read from the unformatted examples), only when a
  # probe runs and the task's reward accepts more than the answer.
  sel, make_refs = spec.selection, registry.get_task(task.name).probe_references
  refs = None
  if make_refs is not None and (sel.mode in ("oracle", "probe") or sel.shadow_probe):
    refs = [tuple(make_refs(e)) for e in rl_ex]
  fmt, special = prompt_formatter(spec, tokenizer)
  rl_ex = [{**e, "prompt": fmt(e["prompt"])} for e in rl_ex]
  eval_ex = [{**e, "prompt": fmt(e["prompt"])} for e in eval_ex]
  train_pool, train_host = tasks.tokenize_pool(rl_ex, tokenizer, max_p, max_a,
                                               task_name=f"{task.name} train",
                                               add_special_tokens=special, references=refs)
  eval_pool, eval_host = tasks.tokenize_pool(eval_ex, tokenizer, max_p, max_a,
                                             task_name=f"{task.name} eval",
                                             add_special_tokens=special)
  return Experiment(spec=spec, tokenizer=tokenizer, model_cfg=model_cfg, graphdef=graphdef,
                    base_params=params, train_pool=train_pool, train_host=train_host,
                    eval_pool=eval_pool, eval_host=eval_host, base_source=source)


def mix_levels(examples: list[dict], weights, seed: int) -> list[dict]:
  """The RL pool with each level's share of it set by `weights` ((level, weight) pairs): as
  many examples as given, each level's drawn without replacement and repeated only when the
  level has fewer than its share (levels of weight 0 or not named are left out)."""
  by_level: dict[int, list[dict]] = {}
  for e in examples:
    by_level.setdefault(int(e["difficulty"]), []).append(e)
  missing = [l for l, w in weights if w > 0 and l not in by_level]
  if missing:
    raise configs.ConfigError(f"config.task.rl_level_weights names levels {missing} with no RL "
                              f"example (levels present: {sorted(by_level)}).")
  total = sum(w for _, w in weights)
  rng = np.random.default_rng(seed)
  out = []
  for level, w in weights:
    if w <= 0:
      continue
    pool = by_level[level]
    k = max(1, round(len(examples) * w / total))
    order = np.concatenate([rng.permutation(len(pool)) for _ in range(-(-k // len(pool)))])
    out += [pool[i] for i in order[:k]]
  return out


def prompt_formatter(spec: configs.RunSpec, tokenizer):
  """(question -> prompt text, whether to add the tokenizer's special tokens).

  config.task.instruction is a format string with {prompt}; with
  config.tokenizer.chat_template the result becomes the user turn of the model's own chat
  template (after an optional config.tokenizer.system_prompt), which spells out the special
  tokens itself.
  """
  instruction = spec.task.instruction
  if "{prompt}" not in instruction:
    raise configs.ConfigError(f"config.task.instruction={instruction!r} must contain "
                              f"'{{prompt}}'.")
  use_chat = spec.tokenizer.chat_template
  system = spec.tokenizer.system_prompt
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


def _prepare(spec: configs.RunSpec, workdir: str, *, log, resuming: bool,
             show_progress: bool, check_stop=None) -> tuple[str | None, str]:
  """Prepares the data and picks (or trains) the base model; returns (base dir, source)."""
  # The first line of a run: building a task's data can take seconds before anything else.
  log(f"[rlx] task {spec.task.name}: preparing its data in {data_dir_of(spec, workdir)} ...")
  train_ex, eval_ex = load_task(spec.task, data_dir_of(spec, workdir))
  if not train_ex or not eval_ex:
    raise configs.ConfigError(
        f"config.task produced {len(train_ex)} train and {len(eval_ex)} eval examples; "
        f"expected at least one of each (check task.levels and num_*_per_level).")

  model_path = spec.model.path
  if not model_path and not registry.get_task(spec.task.name).warm_start:
    raise configs.ConfigError(f"config.task.name={spec.task.name!r} needs a base model: set "
                              f"config.model.path to a Hugging Face checkpoint directory (the "
                              f"task has no teacher answers for the built-in warm start).")
  warm_dir = _resolve(spec.warm_start_dir)
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
        own = d == base_dir
        ok, why = warm_start.base_matches(
            d, spec, warm_start.retrain_advice(base_dir) if own else None)
        if ok:
          chosen = d
          break
        if own and resuming:
          from rlx.checkpoint import CheckpointError  # pylint: disable=g-import-not-at-top
          if warm_start.read_base_meta(d) is None:  # nothing to compare: not another task
            raise CheckpointError(
                f"{base_dir} has no {warm_start.BASE_META} (the record of the task and model "
                f"its warm start was made for), so it cannot be checked against this run. "
                f"{warm_start.retrain_advice(base_dir)}")
          raise CheckpointError(
              f"--workdir={workdir} holds a run made with another task or model ({why}). Use "
              f"a new --workdir, or the config it was made with.")
        log(f"[rlx] not using warm start {d}: {why}")
    if chosen is None:
      tokenizer = _task_tokenizer(spec, train_ex, workdir)
      model_cfg = spec.model.tiny(tokenizer.vocab_size)
      if spec.lora is not None:  # refused before the warm start, not after it (memory plan)
        from rlx import memory  # pylint: disable=g-import-not-at-top
        memory.lora_targets(transformer.abstract_params(model_cfg)[1], spec.lora)
      t0 = time.time()
      log(f"[rlx] supervised warm start: {spec.sft.steps} steps on the task's teacher "
          f"answers (cached in {base_dir})")
      params = sft.train(spec.sft, spec.seed, model_cfg, tokenizer, train_ex,
                         show_progress=show_progress, check_stop=check_stop)
      warm_start.save_base(base_dir, spec, model_cfg, params, tokenizer,
                           extra={"sft_seconds": round(time.time() - t0, 1)})
      chosen = base_dir
      source = f"warm start trained now ({time.time() - t0:.0f}s), saved to {base_dir}"
    else:
      source = f"warm start {chosen}"
  return chosen, source


def _task_tokenizer(spec: configs.RunSpec, train_ex: list[dict], workdir: str) -> Tokenizer:
  if spec.tokenizer.path:
    return load_tokenizer(spec.tokenizer.path)
  path = os.path.join(workdir, "tokenizer.model")
  if os.path.exists(path):
    return Tokenizer.load(path)
  texts = []
  for e in train_ex:
    texts.append(e["prompt"] + e["answer"])
    seen = {e["answer"]}
    for key in ("solution", "teacher_answer"):  # worked solutions, the warm start's targets
      if e.get(key, e["answer"]) not in seen:
        seen.add(e[key])
        texts.append(e["prompt"] + e[key])
  try:
    tok = train_sentencepiece(texts, spec.tokenizer.vocab_size,
                              symbols=registry.get_task(spec.task.name).tokenizer_symbols)
  except RuntimeError as e:  # sentencepiece's trainer: "... 5 vs 16. Increase vocab_size ..."
    need = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
    if need is None:
      raise
    raise configs.ConfigError(
        f"config.tokenizer.vocab_size={spec.tokenizer.vocab_size} is too small for task "
        f"{spec.task.name!r}: its characters and special tokens alone need {need.group(1)} "
        f"tokens; set config.tokenizer.vocab_size >= {need.group(1)}.") from None
  os.makedirs(workdir, exist_ok=True)
  tok.save(path)
  return tok
