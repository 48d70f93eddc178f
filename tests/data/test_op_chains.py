"""The op-chains task: operators, chains, the teacher's error rates, the builder, the verifier."""

import random

import numpy as np
import pytest

from rlx import configs
from rlx.data import op_chains, registry, tasks
from rlx.data.tokenizer import train_sentencepiece

SMALL = op_chains.OpChainsSpec(num_train_per_level=60, num_eval_per_level=20,
                               num_warm_start=3000, seed=3)


def test_operators_are_permutations_with_a_wrong_table_that_never_agrees():
  ops = op_chains.operators(op_chains.OpChainsSpec())
  assert len(ops.symbols) == 48 and len(set(ops.symbols)) == 48
  for o in range(48):
    assert sorted(ops.true[o]) == list(range(10)) and sorted(ops.wrong[o]) == list(range(10))
    assert not np.any(ops.true[o] == ops.wrong[o])
  # Half reliable, the rest in equal thirds at 0.6 / 0.85 / 0.97.
  np.testing.assert_array_equal(np.bincount(ops.op_class), [24, 8, 8, 8])
  for c, rate in enumerate((0.0, 0.6, 0.85, 0.97)):
    np.testing.assert_allclose(ops.rates[ops.op_class == c], rate)


def test_a_chain_is_applied_left_to_right_and_written_op_then_digit():
  ops = op_chains.operators(SMALL)
  chain, x = [5, 0, 17], 7
  d1 = ops.true[5, 7]
  d2 = ops.true[0, d1]
  d3 = ops.true[17, d2]
  assert op_chains.apply_chain(ops, chain, x) == [d1, d2, d3]
  s = ops.symbols
  assert op_chains.format_prompt(ops, chain, x) == f"7{s[5]}{s[0]}{s[17]}="
  assert op_chains.format_completion(ops, chain, [d1, d2, d3]) == (
      f"{s[5]}{d1}{s[0]}{d2}{s[17]}{d3}")
  # A wrong second application: the rest follows from the wrong digit.
  w2 = ops.wrong[0, d1]
  assert op_chains.apply_chain(ops, chain, x, [False, True, False]) == [d1, w2, ops.true[17, w2]]


def _parse(ops, prompt, completion):
  x = int(prompt[0])
  chain = [ops.symbols.index(ch) for ch in prompt[1:-1]]
  written = [(completion[2 * i], int(completion[2 * i + 1])) for i in range(len(chain))]
  return x, chain, written


def test_examples_levels_answers_and_held_out_split():
  train, held = op_chains.generate(SMALL)
  ops = op_chains.operators(SMALL)
  assert len(held) == 4 * 20 and len(train) == 4 * 60 + 3000
  train_keys = {e["prompt"] for e in train}
  assert not train_keys & {e["prompt"] for e in held}  # new (chain, input) pairs only
  for e in train + held:
    x, chain, written = _parse(ops, e["prompt"], e["answer"])
    assert 1 <= len(chain) <= 4
    assert [o for o, _ in written] == [ops.symbols[o] for o in chain]
    assert [d for _, d in written] == op_chains.apply_chain(ops, chain, x)
    level = op_chains.level_of(ops, chain)
    assert e["difficulty"] in (0, level)
  for e in held:
    assert e["teacher_answer"] == e["answer"]
  pool = [e for e in train if e["difficulty"] > 0]
  assert sorted({e["difficulty"] for e in pool}) == [1, 2, 3, 4]
  assert sum(e["difficulty"] == 0 for e in train) == 3000


def test_the_teacher_errs_at_each_operators_rate():
  spec = op_chains.OpChainsSpec(num_train_per_level=1, num_eval_per_level=1,
                                num_warm_start=20000, seed=1)
  train, _ = op_chains.generate(spec)
  ops = op_chains.operators(spec)
  wrong = np.zeros(4)
  count = np.zeros(4)
  for e in train:
    if e["difficulty"] != 0:
      continue
    x, chain, written = _parse(ops, e["prompt"], e["teacher_answer"])
    prev = x
    for o, (_, d) in zip(chain, written):  # each application on the teacher's own digit
      c = ops.op_class[o]
      count[c] += 1
      wrong[c] += d != ops.true[o, prev]
      assert d in (ops.true[o, prev], ops.wrong[o, prev])
      prev = d
  rates = wrong / count
  np.testing.assert_allclose(rates, [0.0, 0.6, 0.85, 0.97], atol=0.03)


def test_builder_through_the_registry_and_exact_match_verifier(tmp_path):
  base = configs.defaults()
  base.task.name = "op_chains"
  base.task.levels = (1, 2, 3, 4)
  base.task.num_train_per_level = 60
  base.task.num_eval_per_level = 20
  base.task.seed = 3
  spec = configs.resolve(base).task
  train, held = registry.load_examples(spec, str(tmp_path))
  # The builder's files hold what generate() makes (the warm-start set is the default size).
  want_train, want_held = op_chains.generate(registry.op_chains_spec(spec))
  assert sorted(e["prompt"] for e in held) == sorted(e["prompt"] for e in want_held)
  assert len(train) == len(want_train)
  # A tokenizer trained with the task's symbols keeps every operator one token.
  tok = train_sentencepiece([e["prompt"] + e["teacher_answer"] for e in train[:3000]], 80,
                            symbols=registry.get_task("op_chains").tokenizer_symbols)
  ex = held[:16]
  for e in ex:
    assert len(tok.encode(e["prompt"])) == len(e["prompt"])
  pool, _ = tasks.tokenize_pool(ex, tok, 8, 10)
  verifier = registry.verifier_for(spec, tok)
  rng = random.Random(0)
  right = np.full((16, 10), tok.pad_id, np.int32)
  wrong = right.copy()
  for i, e in enumerate(ex):
    ids = tok.encode(e["answer"]) + [tok.eos_id]
    right[i, :len(ids)] = ids
    bad = list(e["answer"])
    j = 2 * rng.randrange(len(bad) // 2) + 1  # one written digit changed
    bad[j] = str((int(bad[j]) + 1) % 10)
    ids = tok.encode("".join(bad)) + [tok.eos_id]
    wrong[i, :len(ids)] = ids
  np.testing.assert_array_equal(verifier(right, pool.answers, pool.answer_lens), 1.0)
  np.testing.assert_array_equal(verifier(wrong, pool.answers, pool.answer_lens), 0.0)


@pytest.mark.parametrize("kwargs, match", [
    ({"num_ops": 60}, "num_ops=60"),
    ({"class_rates": (0.0, 1.0), "class_shares": (0.5, 0.5)}, "class_rates"),
    ({"levels": (5,)}, "levels"),
])
def test_bad_specs_name_the_value(kwargs, match):
  with pytest.raises(ValueError, match=match):
    op_chains.OpChainsSpec(**kwargs)


def test_bad_levels_in_the_config_are_one_config_error(tmp_path):
  base = configs.defaults()
  base.task.name = "op_chains"
  base.task.levels = (1, 7)
  with pytest.raises(configs.ConfigError, match="levels"):
    registry.load_examples(configs.resolve(base).task, str(tmp_path))
