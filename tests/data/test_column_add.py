"""The column-addition reasoning task: worked solutions, teacher mistakes and verbosity,
lengths by difficulty, and the TFDS builder."""

import random
import re

import numpy as np
import pytest

from rlx.data import column_add as ca
from rlx.data.tokenizer import train_sentencepiece

_LINE = re.compile(r"^(?:col(\d+):([0-9+]*)>)?([0-9c+]+)=(\d+)(?:,write(\d),carry(\d))?"
                   r"\|([0-9+]*)\|(\d+)$")


def check_solution(a: int, b: int, text: str, *, carries: bool = True) -> int:
  """Recomputes every line of a worked solution; returns its final answer.

  Each line's terms must be the next column's digits (plus the carry it writes: with
  `carries`, exactly the previous total's carry), its total their sum, the rest the operands
  without the columns used, the result so far the totals' last digits. Raises AssertionError
  naming the first wrong line.
  """
  body, final = text.split(ca.MARKER)
  lines = [l for l in body.split(";") if l]
  da, db = str(a), str(b)
  partial, carry = "", 0
  for i, line in enumerate(lines):
    m = _LINE.match(line)
    assert m, (line, text)
    col, left, terms, total, write, carry_out, rest, got_partial = m.groups()
    if col is not None:  # verbose: the column's number and the operands left before it
      assert int(col) == i + 1, line
      assert left == "+".join(s[:len(s) - i] for s in (da, db) if len(s) - i > 0), line
    terms = terms.split("+")
    digits = [int(t) for t in terms if not t.startswith("c")]
    written = [int(t[1:]) for t in terms if t.startswith("c")]
    assert digits == [int(s[-1 - i]) for s in (da, db) if i < len(s)], line
    assert sum(digits) + sum(written) == int(total), line
    if carries:
      assert sum(written) == carry, line
    if write is not None:
      assert int(write) == int(total) % 10 and int(carry_out) == int(total) // 10, line
    expect_rest = [s[:len(s) - 1 - i] for s in (da, db) if len(s) - 1 - i > 0]
    assert rest == "+".join(expect_rest), line
    partial = str(int(total) % 10) + partial
    assert got_partial == partial, line
    carry = int(total) // 10
  assert not (carries and carry), f"the last carry is never added: {text}"
  assert final == partial, text
  return int(final)


def test_worked_solutions_by_hand():
  assert ca.format_solution(4821, 3907, ca.columns(4821, 3907)) == (
      "1+7=8|482+390|8;2+0=2|48+39|28;8+9=17|4+3|728;4+3+c1=8||8728;=>8728")
  # A carry out of the top column gets a line of its own.
  assert ca.format_solution(95, 87, ca.columns(95, 87)) == (
      "5+7=12|9+8|2;9+8+c1=18||82;c1=1||182;=>182")
  # The teacher's mistake: the first carry is forgotten, the rest follows from it.
  assert ca.format_solution(95, 87, ca.columns(95, 87, drop_first_carry=True)) == (
      "5+7=12|9+8|2;9+8=17||72;c1=1||172;=>172")
  assert ca.format_solution(4821, 3907, ca.columns(4821, 3907), verbose=True) == (
      "col1:4821+3907>1+7+c0=8,write8,carry0|482+390|8;"
      "col2:482+390>2+0+c0=2,write2,carry0|48+39|28;"
      "col3:48+39>8+9+c0=17,write7,carry1|4+3|728;col4:4+3>4+3+c1=8,write8,carry0||8728;"
      "=>8728")
  assert ca.format_solution(95, 87, ca.columns(95, 87), verbose=True) == (
      "col1:95+87>5+7+c0=12,write2,carry1|9+8|2;col2:9+8>9+8+c1=18,write8,carry1||82;"
      "col3:>c1=1,write1,carry0||182;=>182")
  assert ca.parse_final_answer("1+2=3||3;=>3") == "3"
  assert ca.parse_final_answer("1+2=3||3;") is None


@pytest.mark.parametrize("seed", range(3))
def test_solutions_recompute_to_the_sum(seed):
  rng = random.Random(seed)
  for _ in range(300):
    a, b = rng.randint(0, 10 ** rng.randint(1, 7)), rng.randint(0, 10 ** rng.randint(1, 7))
    cols = ca.columns(a, b)
    sloppy = ca.columns(a, b, drop_first_carry=True)
    for verbose in (False, True):
      assert check_solution(a, b, ca.format_solution(a, b, cols, verbose=verbose)) == a + b
      assert check_solution(a, b, ca.format_solution(a, b, sloppy, verbose=verbose),
                            carries=False) == ca.result_of(sloppy)
    # Forgetting the first carry costs exactly that carry's place value (none if no carry).
    first = next((k for k, c in enumerate(cols) if c.carry_in), None)
    assert ca.result_of(sloppy) == a + b - (10 ** first if first is not None else 0)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  spec = ca.ColumnAddSpec(levels=(1, 2, 3, 4), num_train_per_level=600, num_eval_per_level=40,
                          teacher_error_levels=(3, 4), teacher_error_rate=0.6,
                          teacher_verbose_levels=(2, 3, 4), teacher_verbose_rate=0.5)
  src = ca.build(spec, str(tmp_path_factory.mktemp("tfds")))
  return spec, ca.read_all(src["train"]), ca.read_all(src["eval"])


def _operands(ex):
  return tuple(int(x) for x in ex["prompt"][:-1].split("+"))


def test_examples_are_correct_and_splits_disjoint(built):
  _, train, evals = built
  assert not {e["prompt"] for e in train} & {e["prompt"] for e in evals}
  for ex in train + evals:
    a, b = _operands(ex)
    assert ex["answer"] == str(a + b)
    assert check_solution(a, b, ex["solution"]) == a + b
    assert len(str(a)) == len(str(b)) == ex["difficulty"] or ex["difficulty"] == 1
    assert ca.parse_final_answer(ex["solution"]) == ex["answer"]
  for lv in (2, 3, 4):
    assert sum(e["difficulty"] == lv for e in evals) == 40
    assert sum(e["difficulty"] == lv for e in train) == 600


def test_teacher_mistakes_only_on_the_band_at_the_configured_rate(built):
  _, train, evals = built
  for ex in evals:  # held-out examples always carry the true, concise solution
    assert ex["teacher_answer"] == ex["solution"]
  for ex in train:
    a, b = _operands(ex)
    if ex["teacher_mistake"]:  # consistent working from a forgotten carry: a wrong answer
      assert ex["difficulty"] in (3, 4)
      with pytest.raises(AssertionError):
        check_solution(a, b, ex["teacher_answer"])
      wrong = check_solution(a, b, ex["teacher_answer"], carries=False)
      assert wrong != a + b and int(ca.parse_final_answer(ex["teacher_answer"])) == wrong
    else:
      assert check_solution(a, b, ex["teacher_answer"]) == a + b
  band = [e for e in train if e["difficulty"] in (3, 4) and ca.has_carry(*_operands(e))]
  rate = np.mean([e["teacher_mistake"] for e in band])
  assert abs(rate - 0.6) < 4 * np.sqrt(0.6 * 0.4 / len(band)), rate


def test_teacher_pads_some_solutions_at_the_configured_rate(built):
  _, train, _ = built
  assert not any(e["teacher_verbose"] for e in train if e["difficulty"] == 1)
  padded = [e for e in train if e["difficulty"] in (2, 3, 4)]
  rate = np.mean([e["teacher_verbose"] for e in padded])
  assert abs(rate - 0.5) < 4 * np.sqrt(0.25 / len(padded)), rate
  for ex in padded:
    verbose = ex["teacher_answer"].startswith("col1:")
    assert verbose == bool(ex["teacher_verbose"])
    if verbose:  # padding only: the same working and answer, ~2x the characters
      assert len(ex["teacher_answer"]) > 1.5 * len(ex["solution"])
      if not ex["teacher_mistake"]:
        assert ca.parse_final_answer(ex["teacher_answer"]) == ex["answer"]


def test_completion_length_grows_with_difficulty(built):
  _, train, _ = built
  tok = train_sentencepiece([e["prompt"] + e["teacher_answer"] for e in train], 64,
                            symbols=(ca.MARKER,))
  marker = tok.encode(ca.MARKER)
  assert len(marker) == 1  # one token wherever it appears
  means = []
  for lv in (1, 2, 3, 4):
    ids = [tok.encode(e["solution"]) for e in train if e["difficulty"] == lv]
    assert all(t[-len(e) - 1] == marker[0] for t, e in zip(
        ids, [x["answer"] for x in train if x["difficulty"] == lv]))
    means.append(np.mean([len(t) for t in ids]))
  assert all(b > 1.3 * a for a, b in zip(means, means[1:])), means
  assert means[-1] > 64, means  # 4 digits: a worked solution of ~75 tokens


def test_builder_is_cached_and_deterministic(built, tmp_path):
  spec, train, _ = built
  again = ca.read_all(ca.build(spec, str(tmp_path))["train"])
  assert sorted(map(str, again)) == sorted(map(str, train))


def test_correct_solutions_are_the_two_styles_and_pass_the_verifier():
  """The probe's references (TaskDef.probe_references): the concise solution the examples
  carry and the verbose one, both with the true answer; a prompt that is not 'a+b=' is one
  clear error."""
  from rlx.data import registry
  ex = ca.make_example(4821, 3907, 4)
  concise, verbose = ca.correct_solutions(ex["prompt"])
  assert concise == ex["solution"]
  assert verbose == ca.make_example(4821, 3907, 4, verbose=True)["teacher_answer"]
  for text in (concise, verbose):
    assert ca.parse_final_answer(text) == "8728"
    assert check_solution(4821, 3907, text) == 8728
  assert registry.get_task("column_add").probe_references(ex) == (concise, verbose)
  with pytest.raises(ValueError, match=r"'4821\*3907='; expected 'a\+b='"):
    ca.correct_solutions("4821*3907=")
