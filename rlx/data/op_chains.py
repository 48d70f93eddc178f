"""Op-chains: many small skills whose uncertain band moves as RL fixes them (a TFDS builder).

The benchmark task of experiments/benchmarks/efficiency.py --task=chains, built so that prompt
selection and reuse have room (issue 36): most groups are zero-variance (solved or hopeless) and
which skills are uncertain changes during the run.

K operators (letters a..z, A..V for K=48) are fixed random permutations of the digits 0-9. A
prompt is an input digit followed by a chain of 1-4 operators, applied left to right; the
completion names each operator again and writes the digit it gives:

  prompt "7kQf="   completion "k3Q5f1"   (k(7)=3, Q(3)=5, f(5)=1)

The verifier is exact match on the whole completion, so exactly one completion is correct and a
prompt's true pass rate is the probability of that one sequence (what the oracle selector of
rlx.rl.oracle computes by teacher forcing).

Operator classes: the ops are split into classes by the warm-start teacher's error rate
(`class_rates`, default 0 / 0.6 / 0.85 / 0.97: half the ops are never wrong, the rest are
wrong at those rates in equal thirds). A wrong application uses the op's fixed *wrong*
permutation (another derangement of the digits), and the rest of the teacher's chain follows
from the wrong digit. The supervised base model thus applies a class-c op correctly with
probability ~(1 - rate_c) per application: chains of reliable ops are solved, chains with a
0.97 op are hopeless, and the uncertain band moves from the 0.6 class to the 0.85 class to the
0.97 class as RL fixes each.

Difficulty (the level): 1 + the class of the chain's least reliable op (1: only reliable ops,
4: at least one 0.97 op). The train split holds `num_train_per_level` pool chains per level
(each with at least one op of that class, the others drawn from easier classes) plus
`num_warm_start` chains at level 0 over all ops that only the warm start trains on
(config.task.rl_levels=(1, 2, 3, 4) leaves them out of the RL pool; a larger supervised set
teaches the error *rates* instead of memorising the pool's teacher answers). The eval split
holds new (chain, input) pairs: none appears in train.
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Iterator, Sequence

import numpy as np
import tensorflow_datasets as tfds

from rlx.data import arithmetic

OP_SYMBOLS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclasses.dataclass(frozen=True)
class OpChainsSpec:
  num_ops: int = 48
  # Teacher error rate of each op class; the first class is the reliable one.
  class_rates: tuple[float, ...] = (0.0, 0.6, 0.85, 0.97)
  # Share of the ops in each class (the rest of the reliable class's share: half by default).
  class_shares: tuple[float, ...] = (0.5, 1 / 6, 1 / 6, 1 / 6)
  max_chain: int = 4
  levels: tuple[int, ...] = (1, 2, 3, 4)  # pool levels generated (1 + op class)
  num_train_per_level: int = 1000
  num_eval_per_level: int = 128
  num_warm_start: int = 16000  # level-0 chains over all ops, for the warm start only
  seed: int = 0

  def __post_init__(self):
    if not 2 <= self.num_ops <= len(OP_SYMBOLS):
      raise ValueError(f"op_chains num_ops={self.num_ops}; expected 2..{len(OP_SYMBOLS)}.")
    if len(self.class_rates) != len(self.class_shares) or not self.class_rates:
      raise ValueError(f"op_chains class_rates {self.class_rates} and class_shares "
                       f"{self.class_shares}; expected one share per class.")
    if any(not 0 <= r < 1 for r in self.class_rates):
      raise ValueError(f"op_chains class_rates={self.class_rates}; expected rates in [0, 1).")
    if not 1 <= self.max_chain <= 8:
      raise ValueError(f"op_chains max_chain={self.max_chain}; expected 1..8.")
    bad = [l for l in self.levels if not 1 <= l <= len(self.class_rates)]
    if bad:
      raise ValueError(f"op_chains levels {bad}; expected levels 1..{len(self.class_rates)} "
                       f"(1 + an op class).")

  def name(self) -> str:
    rates = "_".join(f"{r:g}" for r in self.class_rates)
    shares = "_".join(f"{s:.3g}" for s in self.class_shares)
    levels = "_".join(str(l) for l in self.levels)
    return (f"k{self.num_ops}-r{rates}-c{shares}-L{self.max_chain}-d{levels}-"
            f"n{self.num_train_per_level}-e{self.num_eval_per_level}-w{self.num_warm_start}-"
            f"s{self.seed}")


@dataclasses.dataclass(frozen=True)
class Operators:
  """The task's fixed operators: symbols, true and wrong permutations, classes, rates."""

  symbols: tuple[str, ...]
  true: np.ndarray  # i32[K, 10]
  wrong: np.ndarray  # i32[K, 10]: differs from `true` at every digit
  op_class: np.ndarray  # i32[K]
  rates: np.ndarray  # f32[K] teacher error rate of each op

  def by_class(self, c: int) -> list[int]:
    return [int(o) for o in np.flatnonzero(self.op_class == c)]


def operators(spec: OpChainsSpec) -> Operators:
  """The K permutations (seeded by spec.seed) and each op's class."""
  rng = np.random.default_rng([spec.seed, 7321])
  k = spec.num_ops
  true = np.stack([rng.permutation(10) for _ in range(k)]).astype(np.int32)
  # The wrong table: the true one followed by a random derangement, so a wrong application
  # never gives the right digit by chance.
  wrong = np.empty_like(true)
  for o in range(k):
    while True:
      d = rng.permutation(10)
      if not np.any(d == np.arange(10)):
        break
    wrong[o] = true[o][d]
  counts = [int(round(s * k)) for s in spec.class_shares]
  counts[0] = k - sum(counts[1:])
  if min(counts) < 1:
    raise ValueError(f"op_chains: {k} ops split by class_shares {spec.class_shares} leaves a "
                     f"class without ops ({counts}); raise num_ops.")
  op_class = np.repeat(np.arange(len(counts)), counts).astype(np.int32)
  op_class = op_class[rng.permutation(k)]
  rates = np.asarray(spec.class_rates, np.float32)[op_class]
  return Operators(tuple(OP_SYMBOLS[:k]), true, wrong, op_class, rates)


def apply_chain(ops: Operators, chain: Sequence[int], x: int,
                wrong_at: Sequence[bool] = ()) -> list[int]:
  """The digits a chain writes (one per op); wrong_at[i]: the i-th application goes wrong."""
  out = []
  for i, o in enumerate(chain):
    table = ops.wrong if (i < len(wrong_at) and wrong_at[i]) else ops.true
    x = int(table[o, x])
    out.append(x)
  return out


def format_prompt(ops: Operators, chain: Sequence[int], x: int) -> str:
  return f"{x}" + "".join(ops.symbols[o] for o in chain) + "="


def format_completion(ops: Operators, chain: Sequence[int], digits: Sequence[int]) -> str:
  return "".join(f"{ops.symbols[o]}{d}" for o, d in zip(chain, digits))


def level_of(ops: Operators, chain: Sequence[int]) -> int:
  """1 + the class of the chain's least reliable op."""
  return 1 + int(max(ops.op_class[o] for o in chain))


def true_pass_rate(ops: Operators, chain: Sequence[int]) -> float:
  """The teacher's chance of a fully correct chain (what a perfectly fit base model gets)."""
  return float(np.prod([1.0 - ops.rates[o] for o in chain]))


def _draw_chain(ops: Operators, rng: random.Random, level: int, max_chain: int) -> list[int]:
  """A chain of level `level` (>= 1): one op of class level-1, the rest from easier classes;
  level 0: any ops."""
  length = rng.randint(1, max_chain)
  if level == 0:
    return [rng.randrange(len(ops.symbols)) for _ in range(length)]
  c = level - 1
  easier = [o for o in range(len(ops.symbols)) if ops.op_class[o] <= c]
  chain = [rng.choice(easier) for _ in range(length)]
  chain[rng.randrange(length)] = rng.choice(ops.by_class(c))
  return chain


def generate(spec: OpChainsSpec) -> tuple[list[dict], list[dict]]:
  """(train examples, eval examples); eval (chain, input) pairs never appear in train."""
  ops = operators(spec)
  rng = random.Random(f"{spec.seed}-op-chains")
  teacher = random.Random(f"{spec.seed}-op-chains-teacher")
  seen: set[tuple] = set()

  def draw(level: int, n: int, split: str) -> list[dict]:
    out, tries = [], 0
    while len(out) < n:
      tries += 1
      if tries > 200 * n + 10000:
        raise ValueError(f"op_chains: only {len(out)} distinct level-{level} chains of "
                         f"{n} asked for ({split}); lower the count or raise max_chain.")
      chain = _draw_chain(ops, rng, level, spec.max_chain)
      x = rng.randrange(10)
      key = (tuple(chain), x)
      if key in seen:
        continue
      seen.add(key)
      digits = apply_chain(ops, chain, x)
      wrong = [teacher.random() < float(ops.rates[o]) for o in chain]
      t_digits = apply_chain(ops, chain, x, wrong) if split == "train" else digits
      out.append({
          "prompt": format_prompt(ops, chain, x),
          "answer": format_completion(ops, chain, digits),
          "teacher_answer": format_completion(ops, chain, t_digits),
          "difficulty": level if level else 0,
          "chain_length": len(chain),
          "teacher_mistake": int(t_digits != digits),
      })
    return out

  # Eval first, so the train draws (the larger ones) skip what eval holds.
  eval_ex = [e for l in spec.levels for e in draw(l, spec.num_eval_per_level, "eval")]
  train = [e for l in spec.levels for e in draw(l, spec.num_train_per_level, "train")]
  train += draw(0, spec.num_warm_start, "train")
  return train, eval_ex


class OpChainsConfig(tfds.core.BuilderConfig):

  def __init__(self, spec: OpChainsSpec):
    super().__init__(name=spec.name(), description="Chains of digit permutations.")
    self.spec = spec


class OpChains(tfds.core.GeneratorBasedBuilder):
  """TFDS builder generating the op-chains task locally (no download)."""

  VERSION = tfds.core.Version("1.0.0")
  # TFDS refuses a requested config named as a listed one but not equal to it: list a tiny
  # one no experiment asks for.
  BUILDER_CONFIGS = [OpChainsConfig(OpChainsSpec(num_train_per_level=1, num_eval_per_level=1,
                                                 num_warm_start=1))]

  def _info(self) -> tfds.core.DatasetInfo:
    return arithmetic.LocalDatasetInfo(
        builder=self,
        description="Chains of digit permutations with a per-operator unreliable teacher.",
        features=tfds.features.FeaturesDict({
            "prompt": tfds.features.Text(),
            "answer": tfds.features.Text(),
            "teacher_answer": tfds.features.Text(),
            "difficulty": np.int32,
            "chain_length": np.int32,
            "teacher_mistake": np.int32,
        }),
        supervised_keys=None,
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples("train"),
            "eval": self._generate_examples("eval")}

  def _generate_examples(self, split: str) -> Iterator[tuple[str, dict]]:
    train, eval_ex = generate(self.builder_config.spec)  # both splits: eval excludes train
    for i, e in enumerate(train if split == "train" else eval_ex):
      yield f"{e['difficulty']}-{i}", e


_REGENERATE = "the next run generates it again"


def build(spec: OpChainsSpec, data_dir: str) -> dict[str, Sequence[dict]]:
  """Prepares (once, cached in data_dir) and returns {'train': source, 'eval': source}."""
  os.makedirs(data_dir, exist_ok=True)
  sources = arithmetic.open_prepared(OpChains, OpChainsConfig(spec), data_dir, _REGENERATE)
  return {"train": sources["train"], "eval": sources["eval"]}


def read_all(source) -> list[dict]:
  """All examples of a source from build() in file order (a corrupt shard: ValueError)."""
  return arithmetic.read_prepared(source, _REGENERATE)
