r"""A task family registered from its experiment file: sort the digits of a digit string.

The held-out family of the efficiency benchmark (issue 36): the levers were designed and
tuned on arithmetic, op-chains and column addition; this one was written after, and
measures whether what they save carries over (`experiments/results/efficiency_sort_digits.md`).
It is also a worked example of a task of one's own: nothing in rlx/ knows it.

A prompt is a string of d digits and "=" ("50391="), the answer the same digits in ascending
order ("01359"); level d = the number of digits (4-7). The supervised warm start learns from
an imperfect teacher: on the levels in `task.teacher_error_levels` it sorts all digits but the
last, then writes the last one where it stood (at the end) at `task.teacher_error_rate`, a
habit the model copies; the held-out set and the reward always use the true order (exact
match). The base thus sorts the short strings, is uncertain on 5-6 digits (the band) and,
never taught 7 digits, mostly fails there.

  python -m rlx.main --config=experiments/sort_digits.py --workdir=/tmp/rlx_sort
  python -m rlx.main --config=experiments/sort_digits.py:runlocal --workdir=/tmp/rlx_sort_local
  python -m experiments.benchmarks.efficiency --task=experiments/sort_digits.py \
      --workdir_root=/tmp/eff_sort --arms=B0,E --seeds=3   # E: selection.mode=probe
"""

import random

import ml_collections as mlc

from rlx import configs
from rlx.data import registry
from rlx.errors import ConfigError

MIN_DIGITS, MAX_DIGITS = 2, 9  # an answer + EOS fits sampler.max_new_tokens = 10


def teacher_sort(digits: str, wrong: bool) -> str:
  """The teacher's answer: the digits sorted, or (wrong) all but the last sorted and the last
  left at the end (right anyway when it is the largest)."""
  if not wrong:
    return "".join(sorted(digits))
  return "".join(sorted(digits[:-1])) + digits[-1]


def spec(task) -> dict:
  """The dataset config.task describes (checked); also what a warm-start base records."""
  for key in ("num_train_per_level", "num_eval_per_level"):
    if int(getattr(task, key)) < 1:
      raise ConfigError(f"config.task.{key}={getattr(task, key)} gives an empty dataset; "
                        f"expected >= 1.")
  levels = tuple(int(d) for d in task.levels)
  if not levels or min(levels) < MIN_DIGITS or max(levels) > MAX_DIGITS:
    raise ConfigError(f"config.task.levels={task.levels}; expected numbers of digits in "
                      f"{MIN_DIGITS}..{MAX_DIGITS}.")
  for d in levels:
    need = int(task.num_train_per_level) + int(task.num_eval_per_level)
    if need > 10 ** d:
      raise ConfigError(f"config.task: {need} distinct {d}-digit strings asked "
                        f"(num_train_per_level + num_eval_per_level); only {10 ** d} exist.")
  return {"levels": levels, "num_train_per_level": int(task.num_train_per_level),
          "num_eval_per_level": int(task.num_eval_per_level), "seed": int(task.seed),
          "teacher_error_levels": tuple(int(d) for d in task.teacher_error_levels),
          "teacher_error_rate": float(task.teacher_error_rate)}  # [0, 1]: rlx.specs checks


def make_examples(s: dict) -> tuple[list[dict], list[dict]]:
  """(train, held-out) examples of a spec: distinct strings per level, no held-out prompt in
  train; the same spec gives the same examples."""
  rng = random.Random(s["seed"])
  train, held_out = [], []
  for d in s["levels"]:
    n_train, n_eval = s["num_train_per_level"], s["num_eval_per_level"]
    strings = [f"{i:0{d}d}" for i in rng.sample(range(10 ** d), n_train + n_eval)]
    for k, digits in enumerate(strings):
      wrong = d in s["teacher_error_levels"] and rng.random() < s["teacher_error_rate"]
      ex = {"prompt": digits + "=", "answer": "".join(sorted(digits)), "difficulty": d,
            "teacher_answer": teacher_sort(digits, wrong)}
      (train if k < n_train else held_out).append(ex)
  return train, held_out


def _load(task, data_dir):
  del data_dir  # made in memory: a few thousand short strings
  return make_examples(spec(task))


registry.register_task("sort_digits", registry.TaskDef(
    load=_load, cache_key=spec, warm_start=True,
    tokenizer_symbols=tuple("0123456789="), difficulty="number of digits"))


def get_config(arg: str = "") -> mlc.ConfigDict:
  runlocal = arg == "runlocal"
  if arg not in ("", "runlocal"):
    raise ValueError(f"Unknown config variant {arg!r}; expected '' or 'runlocal'.")
  c = configs.defaults()
  if runlocal:
    c.total_steps, c.eval_every, c.checkpoint_every = 8, 4, 4

  c.task.name = "sort_digits"
  c.task.levels = (4, 5, 6) if runlocal else (4, 5, 6, 7)
  c.task.num_train_per_level = 300 if runlocal else 5000
  c.task.num_eval_per_level = 32 if runlocal else 200
  c.task.teacher_error_levels = (5, 6)
  c.task.teacher_error_rate = 0.6
  c.task.rl_levels = (4, 5, 6, 7) if not runlocal else (4, 5, 6)
  c.task.band = (5, 6)
  c.tokenizer.vocab_size = 32

  c.model.num_layers = 2 if runlocal else 4
  c.model.d_model = 32 if runlocal else 128
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 8 if runlocal else 32
  c.model.mlp_dim = 64 if runlocal else 384

  c.sft.steps = 20 if runlocal else 1000
  c.sft.batch_size = 32 if runlocal else 128
  c.sft.warmup_steps = 5 if runlocal else 100
  c.sft.level_weights = {"4": 1.0, "5": 1.0, "6": 1.0}

  c.rl.prompts_per_step = 4 if runlocal else 16
  c.rl.group_size = 4 if runlocal else 8
  c.optim.lr = 3e-4
  c.optim.schedule = "cosine"
  c.sampler.max_prompt_len = 16
  c.sampler.max_new_tokens = 10
  return c
