"""Synthetic arithmetic task family with a difficulty knob, as a TFDS builder.

Difficulty d (number of digits):
  add: a + b with both operands of exactly d digits (d=1: 0..9).
  mul: a * b with a of exactly d digits and b a single digit 2..9.
Prompts look like "123+456=" and the answer is the decimal result ("579").

The builder writes array_record files and is read with `as_data_source()`, so TensorFlow is
never needed. The eval split is held out: no eval prompt appears in train.
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Iterator, Sequence

import numpy as np
import tensorflow_datasets as tfds

OPS = ("add", "mul")
_SYMBOL = {"add": "+", "mul": "*"}


def _operand_range(digits: int) -> tuple[int, int]:
  return (0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def _space(op: str, digits: int) -> int:
  lo, hi = _operand_range(digits)
  n = hi - lo + 1
  return n * n if op == "add" else n * 8


def _nth_problem(op: str, digits: int, index: int) -> tuple[int, int]:
  lo, hi = _operand_range(digits)
  n = hi - lo + 1
  if op == "add":
    return lo + index // n, lo + index % n
  return lo + index // 8, 2 + index % 8


def carries(op: str, a: int, b: int) -> list[int]:
  """Carry out of each digit position of the schoolbook algorithm (lowest digit first)."""
  out, carry, k = [], 0, 0
  while a > 0 or (op == "add" and b > 0) or carry > 0 or k == 0:
    if op == "add":
      s = a % 10 + b % 10 + carry
      b //= 10
    else:
      s = (a % 10) * b + carry
    carry = s // 10
    out.append(carry)
    a //= 10
    k += 1
    if a == 0 and (op != "add" or b == 0):
      break
  return out


def sloppy_result(op: str, a: int, b: int) -> int:
  """The answer with the lowest carry dropped (a classic schoolbook mistake).

  Equal to the true result when the problem has no carry.
  """
  result = a + b if op == "add" else a * b
  for k, c in enumerate(carries(op, a, b)):
    if c:
      return result - c * 10 ** (k + 1)
  return result


def format_problem(op: str, a: int, b: int, *, reverse: bool = False,
                   result: int | None = None) -> tuple[str, str]:
  """("123+456=", "579"); with reverse=True the answer is written lowest digit first."""
  if result is None:
    result = a + b if op == "add" else a * b
  answer = str(result)
  return f"{a}{_SYMBOL[op]}{b}=", answer[::-1] if reverse else answer


def generate_split_problems(op: str, digits: int, num_train: int, num_eval: int,
                            seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
  """Disjoint (train, eval) operand lists; small spaces are enumerated and split."""
  if op not in OPS:
    raise ValueError(f"Unknown arithmetic op {op!r}; expected one of {OPS}.")
  if digits < 1:
    raise ValueError(f"digits={digits}; expected >= 1.")
  rng = random.Random(f"{seed}-{op}-{digits}")
  space = _space(op, digits)
  if space <= 200_000:
    order = list(range(space))
    rng.shuffle(order)
    num_eval = min(num_eval, space // 2)
    eval_idx = order[:num_eval]
    train_idx = order[num_eval:num_eval + num_train]
    return ([_nth_problem(op, digits, i) for i in train_idx],
            [_nth_problem(op, digits, i) for i in eval_idx])
  seen: set[int] = set()
  picks: list[int] = []
  while len(picks) < num_eval + num_train:
    i = rng.randrange(space)
    if i not in seen:
      seen.add(i)
      picks.append(i)
  problems = [_nth_problem(op, digits, i) for i in picks]
  return problems[num_eval:], problems[:num_eval]


@dataclasses.dataclass(frozen=True)
class ArithmeticSpec:
  ops: tuple[str, ...] = OPS
  levels: tuple[int, ...] = (1, 2, 3, 4, 5)
  num_train_per_level: int = 2000
  num_eval_per_level: int = 200
  seed: int = 0
  # Answers written lowest digit first: the format small transformers learn fastest
  # (Lee et al. 2023, arXiv 2307.03381), because each digit then depends only on digits
  # already seen.
  reverse_answer: bool = False
  # The warm-start "teacher" answer of a train example at these levels drops the lowest carry
  # with probability `teacher_error_rate` (the eval split and the RL reward always use the
  # true answer). This stands in for the noisy data a real base model is pretrained on.
  teacher_error_levels: tuple[int, ...] = ()
  teacher_error_rate: float = 0.0

  def name(self) -> str:
    ops = "_".join(self.ops)
    levels = "_".join(str(l) for l in self.levels)
    name = (f"{ops}-d{levels}-n{self.num_train_per_level}-e{self.num_eval_per_level}"
            f"-s{self.seed}")
    if self.reverse_answer:
      name += "-rev"
    if self.teacher_error_levels and self.teacher_error_rate > 0:
      lv = "_".join(str(l) for l in self.teacher_error_levels)
      name += f"-te{lv}_{self.teacher_error_rate:g}"
    return name


class LocalDatasetInfo(tfds.core.DatasetInfo):
  """DatasetInfo for a dataset generated on this machine. TFDS looks a builder's metadata up
  on GCS whenever its directory is not prepared yet, and makes a temporary directory for it
  first (`tempfile.mkdtemp("tfds")`) that it never removes, even with GCS lookups off: one
  empty /tmp/tmp*tfds per new builder. Nothing here is on GCS, so the lookup is skipped."""

  def initialize_from_bucket(self) -> None:
    return None


class ArithmeticConfig(tfds.core.BuilderConfig):

  def __init__(self, spec: ArithmeticSpec):
    super().__init__(name=spec.name(), description="Synthetic arithmetic.")
    self.spec = spec


class Arithmetic(tfds.core.GeneratorBasedBuilder):
  """TFDS builder generating the arithmetic task locally (no download)."""

  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS = [ArithmeticConfig(ArithmeticSpec())]

  def _info(self) -> tfds.core.DatasetInfo:
    return LocalDatasetInfo(
        builder=self,
        description="Synthetic arithmetic (addition, multiplication) by number of digits.",
        features=tfds.features.FeaturesDict({
            "prompt": tfds.features.Text(),
            "answer": tfds.features.Text(),
            "teacher_answer": tfds.features.Text(),
            "op": tfds.features.Text(),
            "difficulty": np.int32,
        }),
        supervised_keys=None,
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples("train"), "eval": self._generate_examples("eval")}

  def _generate_examples(self, split: str) -> Iterator[tuple[str, dict]]:
    spec: ArithmeticSpec = self.builder_config.spec
    noise = random.Random(f"{spec.seed}-teacher")
    for op in spec.ops:
      for digits in spec.levels:
        train, held_out = generate_split_problems(op, digits, spec.num_train_per_level,
                                                  spec.num_eval_per_level, spec.seed)
        for i, (a, b) in enumerate(train if split == "train" else held_out):
          prompt, answer = format_problem(op, a, b, reverse=spec.reverse_answer)
          teacher = answer
          if (split == "train" and digits in spec.teacher_error_levels and
              noise.random() < spec.teacher_error_rate):
            _, teacher = format_problem(op, a, b, reverse=spec.reverse_answer,
                                        result=sloppy_result(op, a, b))
          yield f"{op}-{digits}-{i}", {"prompt": prompt, "answer": answer,
                                       "teacher_answer": teacher, "op": op,
                                       "difficulty": digits}


def _one_line(text, limit: int = 160) -> str:
  text = " ".join(str(text).split())
  return text if len(text) <= limit else text[:limit] + "..."


def _corrupt(directory: str, error: BaseException, regenerate: str) -> ValueError:
  return ValueError(f"The prepared dataset in {directory} cannot be read ({_one_line(error)}); "
                    f"its files are corrupt: delete {directory} and {regenerate}.")


def open_prepared(builder_cls, config: tfds.core.BuilderConfig, data_dir: str, regenerate: str,
                  download_config=None) -> dict[str, Sequence[dict]]:
  """Prepares builder_cls(config) in data_dir once and returns its data sources by split.

  A prepared directory whose metadata cannot be read is a ValueError that names it and says
  `regenerate` (what deleting it does).
  """
  prepared = os.path.join(data_dir, builder_cls.name, config.name, str(builder_cls.VERSION))
  existed = os.path.isdir(prepared)
  try:
    builder = builder_cls(config=config, data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare(download_config=download_config)
    return builder.as_data_source()
  except Exception as e:  # pylint: disable=broad-except  # TFDS, protobuf and JSON errors
    if not existed:
      raise
    raise _corrupt(prepared, e, regenerate) from e


def read_prepared(source, regenerate: str) -> list[dict]:
  """All examples of a data source from open_prepared, with str text fields.

  An unreadable shard (or one that reads as empty records) is a ValueError that names the
  prepared directory and says `regenerate` (what deleting it does).
  """
  directory = source.dataset_info.data_dir
  examples = []
  for i in range(len(source)):
    try:
      ex = decode_example(source[i])
    except Exception as e:  # pylint: disable=broad-except  # array_record raises RuntimeError
      raise _corrupt(directory, e, regenerate) from e
    if not ex or any(v is None for v in ex.values()):  # a truncated shard gives empty records
      raise _corrupt(directory, f"example {i} of split {source.split!r} is empty", regenerate)
    examples.append(ex)
  return examples


_REGENERATE = "the next run generates it again"


def build(spec: ArithmeticSpec, data_dir: str) -> dict[str, Sequence[dict]]:
  """Prepares (once, cached in data_dir) and returns {'train': source, 'eval': source}."""
  os.makedirs(data_dir, exist_ok=True)
  sources = open_prepared(Arithmetic, ArithmeticConfig(spec), data_dir, _REGENERATE)
  return {"train": sources["train"], "eval": sources["eval"]}


def decode_example(ex: dict) -> dict:
  """TFDS data sources return bytes for Text features; give back str."""
  return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in ex.items()}


def read_all(source) -> list[dict]:
  """All examples of a source from build(); a corrupt shard is a ValueError naming its dir."""
  return read_prepared(source, _REGENERATE)
