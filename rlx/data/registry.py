"""Tasks by name: what `config.task.name` can be.

A task is a `TaskDef`: how to load its train and held-out examples from `config.task`, whether
the built-in warm start can train on it, how its completions are scored and what its
tokenizer must keep whole. An experiment file registers its own task before `get_config`
returns, without editing rlx:

  from rlx.data import registry

  def load(task, data_dir):            # task: config.task as rlx.configs.TaskSpec
    train = [{"prompt": "2+2=", "answer": "4", "difficulty": 1, "teacher_answer": "4"}, ...]
    return train, held_out
  registry.register_task("my_add", registry.TaskDef(load=load, warm_start=True,
                                                    cache_key=lambda task: {...}))

An example is a dict with "prompt", "answer" (the final answer the verifier compares) and
"difficulty" (an int level: config.task.levels / rl_levels / band / eval_levels select by it);
warm-startable tasks add "teacher_answer" (the supervised target, a whole completion).

Built in:
  arithmetic   a+b / a*b answered directly (rlx.data.arithmetic); exact-match verifier
  column_add   a+b worked column by column, then "=>answer" (rlx.data.column_add); the
               final-answer verifier reads what follows the last "=>"
  op_chains    digit permutations applied in chains, with a per-operator unreliable teacher
               (rlx.data.op_chains); exact match on the written chain; the efficiency
               benchmark's many-skill task
  gsm8k, math  local JSONL files (rlx.data.math_datasets); the Python "math" reward
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

from rlx.errors import ConfigError

if TYPE_CHECKING:  # rlx.specs imports this module (task names are checked there)
  from rlx.specs import TaskSpec

Examples = list[dict]


@dataclasses.dataclass(frozen=True)
class TaskDef:
  """A task: its data, its warm start and its reward.

  load: (config.task, data_dir) -> (train examples, held-out examples); data_dir is where
    builders may cache prepared files. Raise ConfigError naming the config key on bad values.
  cache_key: config.task -> the JSON-able dataset spec a warm-start base records
    (rlx_base.json "task_spec"); a base is reused only when it equals the config's.
  warm_start: examples carry "teacher_answer" and the built-in supervised warm start may train
    on them (needs cache_key); otherwise the task needs config.model.path.
  verifier: the jnp verifier for config.task.reward="exact_match": "exact_match" (the
    completion is the answer) or "final_answer" (what follows the last `answer_marker`).
  reward: the default of config.task.reward (empty there): "exact_match" (the jnp verifier)
    or a Python reward name (rlx.rewards).
  tokenizer_symbols: strings a tokenizer trained for the task keeps as one token each.
  difficulty: what a level means (for messages).
  probe_references: example -> the completions whose probabilities the pass-rate probe
    (selection.mode oracle / probe, selection.shadow_probe) sums as the example's pass rate,
    the same number for every example: for a reward that accepts more than one completion,
    the ones a model of the task writes (each must pass; the sum is then a lower bound, exact
    when no other completion passes). None: only an exact-match task can be probed (its
    answer is its one correct completion).
  """

  load: Callable[[TaskSpec, str], tuple[Examples, Examples]]
  cache_key: Callable[[TaskSpec], dict[str, Any]] | None = None
  warm_start: bool = False
  verifier: str = "exact_match"
  answer_marker: str = ""
  reward: str = "exact_match"
  tokenizer_symbols: tuple[str, ...] = ()
  difficulty: str = "level"
  probe_references: Callable[[dict], Sequence[str]] | None = None

  def __post_init__(self):
    from rlx.data.tasks import VERIFIERS  # pylint: disable=g-import-not-at-top
    if not callable(self.load):
      raise ValueError(f"TaskDef load={self.load!r}; expected a function "
                       f"(task spec, data_dir) -> (train, held_out).")
    if self.verifier not in VERIFIERS:
      raise ValueError(f"TaskDef verifier={self.verifier!r}; expected one of {VERIFIERS}.")
    if self.verifier == "final_answer" and not self.answer_marker:
      raise ValueError("TaskDef verifier='final_answer' needs answer_marker (the text before "
                       "the final answer, e.g. '=>').")
    if self.warm_start and self.cache_key is None:
      raise ValueError("TaskDef warm_start=True needs cache_key (what a warm-start base "
                       "records, so that it is reused only for the same data).")


_TASKS: dict[str, TaskDef] = {}


def register_task(name: str, task: TaskDef) -> None:
  """Makes `name` a valid config.task.name (replacing an earlier task of that name: an
  experiment file may be imported more than once)."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"register_task name={name!r}; expected a non-empty string.")
  if not isinstance(task, TaskDef):
    raise ValueError(f"register_task({name!r}, {type(task).__name__}); expected a TaskDef.")
  _TASKS[name] = task


def task_names() -> tuple[str, ...]:
  return tuple(sorted(_TASKS))


def get_task(name: str) -> TaskDef:
  """The task registered as `name`; an unknown name is a ConfigError listing the known ones."""
  if name not in _TASKS:
    raise ConfigError(f"config.task.name={name!r}; expected one of {task_names()} or a task "
                      f"registered with rlx.data.registry.register_task.")
  return _TASKS[name]


def load_examples(task: TaskSpec, data_dir: str) -> tuple[Examples, Examples]:
  """(train examples, held-out examples) of config.task, quietly (TFDS prints progress)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  definition = get_task(task.name)
  tfds.disable_progress_bar()
  logging.getLogger("absl").setLevel(logging.ERROR)
  with contextlib.redirect_stdout(io.StringIO()):  # "Downloading and preparing ..."
    return definition.load(task, data_dir)


def cache_key(task: TaskSpec) -> dict[str, Any]:
  """What a warm-start base made for config.task records (and is matched against)."""
  definition = get_task(task.name)
  if definition.cache_key is None:
    raise ConfigError(f"config.task.name={task.name!r} has no built-in warm start; set "
                      f"config.model.path to a Hugging Face checkpoint directory.")
  return definition.cache_key(task)


def verifier_for(task: TaskSpec, tokenizer):
  """The task's jnp verifier (rlx.data.tasks.Verifier), its marker encoded by `tokenizer`."""
  from rlx.data.tasks import Verifier  # pylint: disable=g-import-not-at-top
  definition = get_task(task.name)
  if definition.verifier != "final_answer":
    return Verifier(definition.verifier)
  marker = tuple(tokenizer.encode(definition.answer_marker))
  if not marker:
    raise ConfigError(f"task {task.name!r}: the answer marker {definition.answer_marker!r} "
                      f"encodes to no token with this tokenizer.")
  return Verifier("final_answer", marker)


# ----------------------------------------------------------------------------- built-in tasks


def _check_sizes(task: TaskSpec, levels_meaning: str) -> None:
  for key in ("num_train_per_level", "num_eval_per_level"):
    if int(getattr(task, key)) < 1:
      raise ConfigError(f"config.task.{key}={getattr(task, key)} gives an empty dataset; "
                        f"expected >= 1.")
  if not task.levels or min(task.levels) < 1:
    raise ConfigError(f"config.task.levels={task.levels}; expected {levels_meaning} >= 1.")


def arithmetic_spec(task: TaskSpec):
  """The arithmetic dataset config.task describes (checked: ops, sizes, levels)."""
  from rlx.data import arithmetic  # pylint: disable=g-import-not-at-top
  for op in task.ops:
    if op not in arithmetic.OPS:
      raise ConfigError(f"config.task.ops contains {op!r}; expected ops from "
                        f"{arithmetic.OPS}.")
  _check_sizes(task, "digit counts")
  return arithmetic.ArithmeticSpec(
      ops=task.ops, levels=task.levels, num_train_per_level=task.num_train_per_level,
      num_eval_per_level=task.num_eval_per_level, seed=task.seed,
      reverse_answer=task.reverse_answer, teacher_error_levels=task.teacher_error_levels,
      teacher_error_rate=task.teacher_error_rate)


def _load_arithmetic(task: TaskSpec, data_dir: str) -> tuple[Examples, Examples]:
  from rlx.data import arithmetic  # pylint: disable=g-import-not-at-top
  sources = arithmetic.build(arithmetic_spec(task), data_dir)
  return arithmetic.read_all(sources["train"]), arithmetic.read_all(sources["eval"])


def column_add_spec(task: TaskSpec):
  """The column-addition dataset config.task describes (checked: sizes, levels)."""
  from rlx.data import column_add  # pylint: disable=g-import-not-at-top
  _check_sizes(task, "digit counts")
  return column_add.ColumnAddSpec(
      levels=task.levels, num_train_per_level=task.num_train_per_level,
      num_eval_per_level=task.num_eval_per_level, seed=task.seed,
      teacher_error_levels=task.teacher_error_levels,
      teacher_error_rate=task.teacher_error_rate,
      teacher_verbose_levels=task.teacher_verbose_levels,
      teacher_verbose_rate=task.teacher_verbose_rate)


def _load_column_add(task: TaskSpec, data_dir: str) -> tuple[Examples, Examples]:
  from rlx.data import column_add  # pylint: disable=g-import-not-at-top
  sources = column_add.build(column_add_spec(task), data_dir)
  return column_add.read_all(sources["train"]), column_add.read_all(sources["eval"])


def _column_add_references(example: dict) -> tuple[str, str]:
  from rlx.data import column_add  # pylint: disable=g-import-not-at-top
  return column_add.correct_solutions(example["prompt"])


def op_chains_spec(task: TaskSpec):
  """The op-chains dataset config.task describes (levels: 1 + op class, see op_chains)."""
  from rlx.data import op_chains  # pylint: disable=g-import-not-at-top
  _check_sizes(task, "op classes (1 + class)")
  try:
    return op_chains.OpChainsSpec(
        levels=task.levels, num_train_per_level=task.num_train_per_level,
        num_eval_per_level=task.num_eval_per_level, seed=task.seed)
  except ValueError as e:
    raise ConfigError(f"config.task: {e}") from None


def _load_op_chains(task: TaskSpec, data_dir: str) -> tuple[Examples, Examples]:
  from rlx.data import op_chains  # pylint: disable=g-import-not-at-top
  sources = op_chains.build(op_chains_spec(task), data_dir)
  return op_chains.read_all(sources["train"]), op_chains.read_all(sources["eval"])


def _load_math(task: TaskSpec, data_dir: str) -> tuple[Examples, Examples]:
  from rlx.data import math_datasets  # pylint: disable=g-import-not-at-top
  name = task.name
  if not task.manual_dir:
    raise ConfigError(f"config.task.name={name!r} reads local JSONL files: set "
                      f"config.task.manual_dir (see README, Datasets).")
  sources = math_datasets.build(name, task.manual_dir, data_dir)
  train = math_datasets.read_all(sources["train"]) if "train" in sources else []
  held_out = math_datasets.read_all(sources["test"]) if "test" in sources else []
  n_eval = task.num_eval
  if not held_out:  # no test file: hold out the tail of train
    n = n_eval or max(1, len(train) // 10)
    train, held_out = train[:-n], train[-n:]
  if n_eval:
    held_out = held_out[:n_eval]
  return train, held_out


def _asdict(make_spec):
  return lambda task: dataclasses.asdict(make_spec(task))


register_task("arithmetic", TaskDef(
    load=_load_arithmetic, cache_key=_asdict(arithmetic_spec), warm_start=True,
    difficulty="number of digits"))
register_task("column_add", TaskDef(
    load=_load_column_add, cache_key=_asdict(column_add_spec), warm_start=True,
    verifier="final_answer", answer_marker="=>", tokenizer_symbols=("=>",),
    difficulty="number of digits", probe_references=_column_add_references))
register_task("op_chains", TaskDef(
    load=_load_op_chains, cache_key=_asdict(op_chains_spec), warm_start=True,
    # op_chains.OP_SYMBOLS (not imported here: it pulls in TFDS): one token per operator.
    tokenizer_symbols=tuple("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"),
    difficulty="1 + the class of the chain's least reliable operator"))
register_task("gsm8k", TaskDef(load=_load_math, reward="math",
                               difficulty="number of solution steps"))
register_task("math", TaskDef(load=_load_math, reward="math", difficulty="MATH level"))
