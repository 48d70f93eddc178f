"""experiments/sort_digits.py: a task family registered from its experiment file (issue 36's
held-out family), checked as the built-in ones are: examples, teacher, split, errors."""

import collections

import numpy as np
import pytest

import rlx
from rlx import configs
from rlx.data import registry, tasks
from rlx.data.tokenizer import train_sentencepiece
from rlx.errors import ConfigError
from rlx.experiments import sort_digits


def test_the_teacher_sorts_or_leaves_the_last_digit_where_it_stood():
  assert sort_digits.teacher_sort("50391", wrong=False) == "01359"
  assert sort_digits.teacher_sort("50391", wrong=True) == "03591"  # 5039 sorted, then 1
  assert sort_digits.teacher_sort("10329", wrong=True) == "01239"  # the last is the largest


def _spec(**kw):
  c = rlx.load_config("sort_digits")
  c.task.num_train_per_level, c.task.num_eval_per_level = 400, 100
  for k, v in kw.items():
    c.task[k] = v
  return sort_digits.spec(configs.resolve(c).task)


def test_examples_levels_answers_teacher_rate_and_held_out_split():
  train, held = sort_digits.make_examples(_spec())
  assert len(train) == 4 * 400 and len(held) == 4 * 100
  assert not {e["prompt"] for e in train} & {e["prompt"] for e in held}
  for e in train + held:
    digits = e["prompt"][:-1]
    assert e["prompt"][-1] == "=" and len(digits) == e["difficulty"]
    assert e["answer"] == "".join(sorted(digits))
  wrong = collections.Counter(e["difficulty"] for e in train
                              if e["teacher_answer"] != e["answer"])
  assert wrong[4] == 0 and wrong[7] == 0
  for d in (5, 6):  # 0.6 x P(the last digit is not the largest) ~ 0.6 x 0.85
    assert 0.35 < wrong[d] / 400 < 0.65, (d, wrong[d])
  assert sort_digits.make_examples(_spec()) == (train, held)  # the same spec, the same data


def test_through_the_registry_with_one_token_per_digit_and_exact_match(tmp_path):
  spec = configs.resolve(rlx.load_config("sort_digits", "runlocal")).task
  train, held = registry.load_examples(spec, str(tmp_path))
  tok = train_sentencepiece([e["prompt"] + e["teacher_answer"] for e in train], 32,
                            symbols=registry.get_task("sort_digits").tokenizer_symbols)
  ex = held[:8]
  for e in ex:
    assert len(tok.encode(e["prompt"])) == len(e["prompt"])
  pool, _ = tasks.tokenize_pool(ex, tok, 8, 10)
  verifier = registry.verifier_for(spec, tok)
  right = np.full((8, 10), tok.pad_id, np.int32)
  wrong = right.copy()
  for i, e in enumerate(ex):
    ids = tok.encode(e["answer"]) + [tok.eos_id]
    right[i, :len(ids)] = ids
    ids = tok.encode(e["answer"][::-1]) + [tok.eos_id]  # descending: wrong unless all equal
    wrong[i, :len(ids)] = ids
  np.testing.assert_array_equal(verifier(right, pool.answers, pool.answer_lens), 1.0)
  want = [1.0 if len(set(e["answer"])) == 1 else 0.0 for e in ex]
  np.testing.assert_array_equal(verifier(wrong, pool.answers, pool.answer_lens), want)


@pytest.mark.parametrize("kw, match", [
    ({"levels": (1, 4)}, "levels"),
    ({"levels": (4, 10)}, "levels"),
    ({"num_eval_per_level": 0}, "num_eval_per_level=0"),
    ({"teacher_error_rate": 1.5}, "teacher_error_rate=1.5"),
    ({"levels": (2, 4)}, "distinct 2-digit"),
])
def test_bad_task_values_are_one_config_error_naming_them(kw, match):
  with pytest.raises(ConfigError, match=match):
    _spec(**kw)
