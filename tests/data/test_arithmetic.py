"""The arithmetic task: TFDS builder splits, teacher errors, tokenizer, jnp verifier."""

import random

import numpy as np
import pytest

from rlx.data import arithmetic as ar
from rlx.data.tasks import exact_match_reward, tokenize_pool
from rlx.data.tokenizer import EOS_ID, PAD_ID, train_sentencepiece


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  spec = ar.ArithmeticSpec(ops=("add", "mul"), levels=(1, 2, 3), num_train_per_level=150,
                           num_eval_per_level=40, teacher_error_levels=(3,),
                           teacher_error_rate=0.5)
  src = ar.build(spec, str(tmp_path_factory.mktemp("tfds")))
  return spec, ar.read_all(src["train"]), ar.read_all(src["eval"])


def _true(ex):
  a, b = ex["prompt"][:-1].replace("*", "+").split("+")
  return int(a) + int(b) if "+" in ex["prompt"] else int(a) * int(b)


def test_splits_are_disjoint_stratified_and_correct(built):
  spec, train, evals = built
  assert not {e["prompt"] for e in train} & {e["prompt"] for e in evals}
  for ex in train + evals:
    assert int(ex["answer"]) == _true(ex)
  for op in ("add", "mul"):
    for lv in (2, 3):
      n = sum(1 for e in evals if e["op"] == op and e["difficulty"] == lv)
      assert n == 40
  # 1-digit multiplication has only 80 problems: half goes to eval, half to train.
  assert sum(1 for e in evals if e["op"] == "mul" and e["difficulty"] == 1) == 40
  assert sum(1 for e in train if e["op"] == "mul" and e["difficulty"] == 1) == 40


def test_teacher_errors_only_where_configured(built):
  _, train, evals = built
  assert all(e["teacher_answer"] == e["answer"] for e in evals)
  assert all(e["teacher_answer"] == e["answer"] for e in train if e["difficulty"] != 3)
  wrong = [e for e in train if e["teacher_answer"] != e["answer"]]
  level3_with_carry = [e for e in train if e["difficulty"] == 3 and
                       any(ar.carries(e["op"], *map(int, e["prompt"][:-1].replace("*", "+")
                                                    .split("+"))))]
  assert 0.3 < len(wrong) / len(level3_with_carry) < 0.7  # rate 0.5 on problems with a carry


def test_builder_is_cached_and_deterministic(built, tmp_path):
  spec, train, _ = built
  again = ar.read_all(ar.build(spec, str(tmp_path))["train"])
  assert sorted(map(str, again)) == sorted(map(str, train))


@pytest.mark.parametrize("seed", range(3))
def test_sloppy_result_drops_the_lowest_carry(seed):
  rng = random.Random(seed)
  for _ in range(300):
    op = rng.choice(["add", "mul"])
    a = rng.randint(0, 99999)
    b = rng.randint(0, 99999) if op == "add" else rng.randint(2, 9)
    # Schoolbook column arithmetic with the first carry forced to zero.
    da = [int(c) for c in str(a)[::-1]]
    db = [int(c) for c in str(b)[::-1]] if op == "add" else []
    digits, carry, dropped = [], 0, False
    for k in range(max(len(da), len(db))):
      s = (da[k] if k < len(da) else 0) + (db[k] if k < len(db) else 0) if op == "add" else \
          da[k] * b
      s += carry
      carry = s // 10
      digits.append(s % 10)
      if carry and not dropped:
        carry, dropped = 0, True
    if carry:
      digits.append(carry)
    expected = int("".join(map(str, digits[::-1])))
    assert ar.sloppy_result(op, a, b) == expected, (op, a, b)


def test_reverse_format():
  assert ar.format_problem("add", 573, 522, reverse=True) == ("573+522=", "5901")
  assert ar.format_problem("mul", 940, 8) == ("940*8=", "7520")


def test_tokenizer_splits_digits_and_round_trips(built):
  _, train, _ = built
  tok = train_sentencepiece([e["prompt"] + e["answer"] for e in train], 64)
  assert tok.pad_id == PAD_ID and tok.eos_id == EOS_ID
  for text in ("12345", "907+88=995", "4*7=28"):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
  assert len(tok.encode("12345")) == 5  # one token per digit
  assert tok.encode("12+3=", add_special_tokens=True)[0] == tok.bos_id


def test_exact_match_verifier():
  tok = train_sentencepiece(["12+34=46", "7*8=56", "99+1=100"] * 50, 32)
  examples = [{"prompt": "12+34=", "answer": "46"}, {"prompt": "99+1=", "answer": "100"}]
  pool, _ = tokenize_pool(examples, tok, max_prompt_len=8, max_answer_len=5)
  e = tok.eos_id
  d = lambda s: tok.encode(s)
  completions = np.full((6, 6), tok.pad_id, np.int32)
  rows = [d("46") + [e], d("46") + d("1") + [e], d("4") + [e], d("100") + [e], d("10") + [e],
          d("100")]  # last: no EOS (truncated) -> wrong
  for i, r in enumerate(rows):
    completions[i, :len(r)] = r
  answers = pool.answers[[0, 0, 0, 1, 1, 1]]
  lens = pool.answer_lens[[0, 0, 0, 1, 1, 1]]
  np.testing.assert_array_equal(exact_match_reward(completions, answers, lens),
                                [1, 0, 0, 1, 0, 0])
  # A completion buffer shorter than the answer cannot match.
  assert float(exact_match_reward(completions[3:4, :2], answers[3:4], lens[3:4])[0]) == 0


def test_empty_dataset_is_an_error():
  tok = train_sentencepiece(["1+1=2"] * 20, 16)
  with pytest.raises(ValueError, match="the dataset is empty"):
    tokenize_pool([], tok, 8, 4, task_name="arith")


def test_preparing_a_builder_leaves_no_temporary_directory(tmp_path, monkeypatch):
  # TFDS's own DatasetInfo makes an empty mkdtemp("tfds") directory per unprepared builder
  # and never removes it; LocalDatasetInfo (every rlx builder's) skips that lookup.
  import tempfile

  from rlx.data import column_add as ca
  scratch = tmp_path / "tmp"
  scratch.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(scratch))
  ar.build(ar.ArithmeticSpec(ops=("add",), levels=(1,), num_train_per_level=5,
                             num_eval_per_level=2), str(tmp_path / "a"))
  ca.build(ca.ColumnAddSpec(levels=(1,), num_train_per_level=5, num_eval_per_level=2),
           str(tmp_path / "c"))
  assert sorted(p.name for p in scratch.iterdir()) == []
