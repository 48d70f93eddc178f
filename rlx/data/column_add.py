"""Column addition with a written scratchpad: a reasoning task family, as a TFDS builder.

Difficulty d (number of digits): a + b with both operands of exactly d digits (d=1: 0..9).
The prompt is "4821+3907="; the completion works the sum column by column, lowest first, and
ends with the final answer after the marker "=>":

  1+7=8|482+390|8;2+0=2|48+39|28;8+9=17|4+3|728;4+3+c1=8||8728;=>8728

Each column line is "digits[+c1]=sum|what is left of the operands|the result so far;": the
carry into a column is written as "+c1", the operands are rewritten without the digits just
used and the result so far gains the sum's last digit. Every step thus reads only the line
before it (no counting back into the prompt), and the solution grows as d^2 / 2 tokens, so
completion lengths grow with difficulty and are long-tailed over a mix of levels. A carry out
of the top column gets a line of its own ("c1=1||1728;").

The warm-start teacher (`teacher_answer`; train split only, the eval split and the reward
always use the true answer) is imperfect and verbose:
  * mistake: at `teacher_error_levels`, with probability `teacher_error_rate`, it forgets the
    first carry (the column after the first sum >= 10 is added without it; the rest of its
    solution follows consistently, so its final answer is wrong);
  * verbosity: at `teacher_verbose_levels`, with probability `teacher_verbose_rate`, it
    numbers the columns, restates the operands left before each column (as the line before
    already did), writes zero carries and spells out the digit written and the carry (nothing
    it adds changes the answer; ~2x the tokens):

  col1:4821+3907>1+7+c0=8,write8,carry0|482+390|8;col2:482+390>2+0+c0=2,write2,carry0|48+39|28;..

The builder writes array_record files read with `as_data_source()` (no TensorFlow); the eval
split is held out: no eval prompt appears in train.
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Iterator, Sequence

import numpy as np
import tensorflow_datasets as tfds

from rlx.data import arithmetic

MARKER = "=>"  # the final answer follows it (the task's tokenizer keeps it one piece)


@dataclasses.dataclass(frozen=True)
class Column:
  """One line of the worked solution."""

  digits: tuple[int, ...]  # this column's operand digits (a's first)
  carry_in: int  # the carry written into this column (0: none written)
  total: int  # digits + carry_in
  rest: tuple[str, ...]  # the operands' digits still to add (empty strings dropped)
  partial: str  # the result so far (this column's digit first)


def columns(a: int, b: int, *, drop_first_carry: bool = False) -> list[Column]:
  """The column-by-column working of a + b; drop_first_carry forgets the first carry."""
  if a < 0 or b < 0:
    raise ValueError(f"column addition of {a} + {b}; expected non-negative operands.")
  da, db = str(a), str(b)
  out, carry, partial, dropped, i = [], 0, "", False, 0
  while i < max(len(da), len(db)) or carry:
    digits = tuple(int(s[-1 - i]) for s in (da, db) if i < len(s))
    if carry and not dropped:
      dropped = True
      if drop_first_carry:
        carry = 0
    if not digits and not carry:
      break
    total = sum(digits) + carry
    partial = str(total % 10) + partial
    rest = tuple(r for r in (da[:max(len(da) - 1 - i, 0)], db[:max(len(db) - 1 - i, 0)]) if r)
    out.append(Column(digits, carry, total, rest, partial))
    carry, i = total // 10, i + 1
  return out


def result_of(cols: Sequence[Column]) -> int:
  """The final answer a worked solution arrives at."""
  return int(cols[-1].partial)


def format_solution(a: int, b: int, cols: Sequence[Column], *, verbose: bool = False) -> str:
  """The completion text: the column lines, then MARKER and the final answer."""
  lines = []
  left = tuple(str(x) for x in (a, b))  # the operands' digits still to add
  for k, c in enumerate(cols):
    terms = [str(d) for d in c.digits]
    if verbose:
      lines.append(f"col{k + 1}:{'+'.join(left)}>" + "+".join(terms + [f"c{c.carry_in}"]) +
                   f"={c.total},write{c.total % 10},carry{c.total // 10}|{'+'.join(c.rest)}|"
                   f"{c.partial};")
      left = c.rest
    else:
      carry = [f"c{c.carry_in}"] if c.carry_in else []
      lines.append("+".join(terms + carry) + f"={c.total}|{'+'.join(c.rest)}|{c.partial};")
  return "".join(lines) + MARKER + cols[-1].partial


def parse_final_answer(completion: str) -> str | None:
  """The text after the last MARKER (None without one): what the verifier compares."""
  i = completion.rfind(MARKER)
  return None if i < 0 else completion[i + len(MARKER):]


def correct_solutions(prompt: str) -> tuple[str, str]:
  """The two correct worked solutions of the prompt "a+b=" (concise, verbose): the completions
  a model warm-started on this task writes when it is right, whose probabilities the
  pass-rate probe sums (TaskDef.probe_references)."""
  head, _, rest = prompt.partition("+")
  if not (head.isdigit() and rest.endswith("=") and rest[:-1].isdigit()):
    raise ValueError(f"column_add prompt {prompt!r}; expected 'a+b=' with decimal a and b.")
  a, b = int(head), int(rest[:-1])
  cols = columns(a, b)
  return format_solution(a, b, cols), format_solution(a, b, cols, verbose=True)


def has_carry(a: int, b: int) -> bool:
  return any(c.carry_in for c in columns(a, b))


@dataclasses.dataclass(frozen=True)
class ColumnAddSpec:
  levels: tuple[int, ...] = (1, 2, 3, 4, 5)  # numbers of digits
  num_train_per_level: int = 2000
  num_eval_per_level: int = 200
  seed: int = 0
  # The warm-start teacher forgets the first carry at these levels with this probability ...
  teacher_error_levels: tuple[int, ...] = ()
  teacher_error_rate: float = 0.0
  # ... and writes its solution verbosely at these levels with this probability.
  teacher_verbose_levels: tuple[int, ...] = ()
  teacher_verbose_rate: float = 0.0

  def name(self) -> str:
    levels = "_".join(str(l) for l in self.levels)
    name = f"d{levels}-n{self.num_train_per_level}-e{self.num_eval_per_level}-s{self.seed}"
    if self.teacher_error_levels and self.teacher_error_rate > 0:
      lv = "_".join(str(l) for l in self.teacher_error_levels)
      name += f"-te{lv}_{self.teacher_error_rate:g}"
    if self.teacher_verbose_levels and self.teacher_verbose_rate > 0:
      lv = "_".join(str(l) for l in self.teacher_verbose_levels)
      name += f"-tv{lv}_{self.teacher_verbose_rate:g}"
    return name


def make_example(a: int, b: int, digits: int, *, mistake: bool = False,
                 verbose: bool = False) -> dict:
  """One example: the true answer and solution, and the teacher's (mistake / verbose) one."""
  true_cols = columns(a, b)
  teacher_cols = columns(a, b, drop_first_carry=mistake)
  return {"prompt": f"{a}+{b}=", "answer": str(a + b),
          "solution": format_solution(a, b, true_cols),
          "teacher_answer": format_solution(a, b, teacher_cols, verbose=verbose),
          "difficulty": digits,
          "teacher_mistake": int(result_of(teacher_cols) != a + b),
          "teacher_verbose": int(verbose)}


class ColumnAddConfig(tfds.core.BuilderConfig):

  def __init__(self, spec: ColumnAddSpec):
    super().__init__(name=spec.name(), description="Column addition with a scratchpad.")
    self.spec = spec


class ColumnAdd(tfds.core.GeneratorBasedBuilder):
  """TFDS builder generating the column-addition task locally (no download)."""

  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS = [ColumnAddConfig(ColumnAddSpec())]

  def _info(self) -> tfds.core.DatasetInfo:
    return arithmetic.LocalDatasetInfo(
        builder=self,
        description="Multi-digit addition worked column by column, by number of digits.",
        features=tfds.features.FeaturesDict({
            "prompt": tfds.features.Text(),
            "answer": tfds.features.Text(),
            "solution": tfds.features.Text(),
            "teacher_answer": tfds.features.Text(),
            "difficulty": np.int32,
            "teacher_mistake": np.int32,
            "teacher_verbose": np.int32,
        }),
        supervised_keys=None,
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples("train"), "eval": self._generate_examples("eval")}

  def _generate_examples(self, split: str) -> Iterator[tuple[str, dict]]:
    spec: ColumnAddSpec = self.builder_config.spec
    noise = random.Random(f"{spec.seed}-column-add-teacher")
    for digits in spec.levels:
      train, held_out = arithmetic.generate_split_problems(
          "add", digits, spec.num_train_per_level, spec.num_eval_per_level, spec.seed)
      for i, (a, b) in enumerate(train if split == "train" else held_out):
        # Both draws happen for every train example, so one rate does not shift the other's.
        err, verb = noise.random(), noise.random()
        teach = split == "train"
        mistake = teach and digits in spec.teacher_error_levels and (
            err < spec.teacher_error_rate)
        verbose = teach and digits in spec.teacher_verbose_levels and (
            verb < spec.teacher_verbose_rate)
        yield f"{digits}-{i}", make_example(a, b, digits, mistake=mistake, verbose=verbose)


_REGENERATE = "the next run generates it again"


def build(spec: ColumnAddSpec, data_dir: str) -> dict[str, Sequence[dict]]:
  """Prepares (once, cached in data_dir) and returns {'train': source, 'eval': source}."""
  os.makedirs(data_dir, exist_ok=True)
  sources = arithmetic.open_prepared(ColumnAdd, ColumnAddConfig(spec), data_dir, _REGENERATE)
  return {"train": sources["train"], "eval": sources["eval"]}


def read_all(source) -> list[dict]:
  """All examples of a source from build(); a corrupt shard is a ValueError naming its dir."""
  return arithmetic.read_prepared(source, _REGENERATE)
