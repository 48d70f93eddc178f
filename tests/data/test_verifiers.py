"""The jnp verifiers against plain-Python references: exact match and final answer."""

import jax
import numpy as np
import pytest

from rlx.data.tasks import Verifier, final_answer_reward, tokenize_pool
from rlx.data.tokenizer import train_sentencepiece

PAD, EOS, MARK = 0, 3, 9  # token ids of the hand-made cases (answers use 4..8)


def final_answer_reference(completion, answer, marker) -> float:
  """The tokens after the last marker before the first EOS are the answer (+ EOS)."""
  completion = list(completion)
  end = completion.index(EOS) if EOS in completion else len(completion)
  m = len(marker)
  starts = [j for j in range(end - m + 1) if completion[j:j + m] == list(marker)]
  if not starts:
    return 0.0
  rest = completion[starts[-1] + m:end + 1]
  return float(rest == list(answer) + [EOS])


def run(rows, answers, marker=(MARK,), width=None):
  t = width or max(map(len, rows))
  comp = np.full((len(rows), t), PAD, np.int32)
  for i, r in enumerate(rows):
    comp[i, :len(r)] = r[:t]
  a = max(map(len, answers)) + 1
  ans = np.full((len(answers), a), PAD, np.int32)
  for i, x in enumerate(answers):
    ans[i, :len(x) + 1] = list(x) + [EOS]
  lens = np.asarray([len(x) + 1 for x in answers], np.int32)
  got = np.asarray(jax.jit(final_answer_reward, static_argnums=3)(comp, ans, lens, marker))
  want = [final_answer_reference(r[:t], x, marker) for r, x in zip(rows, answers)]
  return got, want


def test_final_answer_by_hand():
  ans = [4, 5]
  cases = {  # completion -> reward
      (6, 7, MARK, 4, 5, EOS): 1,  # worked solution, marker, answer, EOS
      (MARK, 4, 5, EOS, 8, 8): 1,  # tokens after EOS do not count
      (6, 7, 4, 5, EOS): 0,  # no marker
      (6, MARK, 4, 6, EOS): 0,  # wrong answer
      (6, MARK, 4, EOS): 0,  # answer cut short
      (6, MARK, 4, 5, 5, EOS): 0,  # extra token before EOS
      (6, MARK, 4, 5, MARK, EOS): 0,  # a later marker with nothing after it wins
      (MARK, 8, MARK, 4, 5, EOS): 1,  # the last marker counts
      (MARK, 4, 5, MARK): 0,  # no EOS: truncated
      (6, MARK, 4, 5): 0,  # no EOS
      (6, EOS, MARK, 4, 5, EOS): 0,  # the marker after the first EOS does not count
  }
  rows = [list(c) for c in cases]
  got, want = run(rows, [ans] * len(rows))
  np.testing.assert_array_equal(got, [cases[c] for c in cases])
  np.testing.assert_array_equal(got, want)


def test_final_answer_multi_token_marker_and_narrow_buffers():
  marker = (MARK, 8)
  rows = [[6, MARK, 8, 4, EOS], [6, MARK, 4, EOS], [MARK, 8, MARK, 8, 4, EOS], [MARK]]
  got, want = run(rows, [[4]] * 4, marker=marker)
  np.testing.assert_array_equal(got, [1, 0, 1, 0])
  np.testing.assert_array_equal(got, want)
  # A buffer too short for the marker, or for marker + answer, scores 0.
  got, _ = run([[MARK, 8]], [[4]], marker=marker, width=1)
  assert got.tolist() == [0.0]
  got, _ = run([[MARK, 8, 4, EOS]], [[4]], marker=marker, width=3)
  assert got.tolist() == [0.0]


@pytest.mark.parametrize("seed", range(4))
def test_final_answer_matches_the_reference_on_random_completions(seed):
  rng = np.random.default_rng(seed)
  rows, answers = [], []
  for _ in range(200):
    answer = list(rng.integers(4, 8, size=rng.integers(1, 4)))
    body = list(rng.choice([4, 5, 6, 7, MARK, EOS, PAD], size=rng.integers(0, 12),
                           p=[.2, .2, .15, .15, .1, .1, .1]))
    if rng.random() < 0.6:  # plant the answer (sometimes corrupted) after a marker
      tail = list(answer) + [EOS]
      if rng.random() < 0.3:
        tail[rng.integers(len(tail))] = int(rng.integers(4, 8))
      body += [MARK] + tail
    rows.append([int(x) for x in body] or [PAD])
    answers.append([int(x) for x in answer])
  got, want = run(rows, answers)
  np.testing.assert_array_equal(got, want)
  assert 0.1 < np.mean(want) < 0.9  # the cases cover both outcomes


def test_verifier_dispatch_and_pool_answer_width():
  tok = train_sentencepiece(["12+34=1+4=5|3|5;2+3=5||55;=>46"] * 20, 40, symbols=("=>",))
  examples = [{"prompt": "12+34=", "answer": "46"}, {"prompt": "1+2=", "answer": "3"}]
  pool, _ = tokenize_pool(examples, tok, max_prompt_len=8, max_answer_len=200)
  # Answers are as wide as the longest answer (+ EOS), not max_answer_len.
  assert pool.answers.shape == (2, 3)
  marker = tuple(tok.encode("=>"))
  comp = np.zeros((2, 16), np.int32)
  for i, text in enumerate(["2+4=6||6;=>46", "=>3"]):
    ids = tok.encode(text) + [tok.eos_id]
    comp[i, :len(ids)] = ids
  final = Verifier("final_answer", marker)
  np.testing.assert_array_equal(final(comp, pool.answers, pool.answer_lens), [1, 1])
  exact = Verifier()
  np.testing.assert_array_equal(exact(comp, pool.answers, pool.answer_lens), [0, 0])
  with pytest.raises(ValueError, match="verifier kind 'fuzzy'; expected one of"):
    Verifier("fuzzy")
  with pytest.raises(ValueError, match="needs the marker's token ids"):
    Verifier("final_answer")


def test_pool_probe_references_are_tokenized_with_eos_deduplicated_and_capped():
  """tokenize_pool(references=...): each example's probe completions (+ EOS) in
  pool.references, a repeat of an earlier one or one longer than max_answer_len absent
  (length 0); unequal counts are one clear error."""
  tok = train_sentencepiece(["12+34=1+4=5|3|5;2+3=5||55;=>46"] * 20, 40, symbols=("=>",))
  examples = [{"prompt": "12+34=", "answer": "46"}, {"prompt": "1+2=", "answer": "3"}]
  refs = [("2+4=6||6;=>46", "2+4=6||6;=>46"), ("=>3", "1+2=3||3;" * 30 + "=>3")]
  pool, _ = tokenize_pool(examples, tok, max_prompt_len=8, max_answer_len=40,
                          references=refs)
  first = tok.encode("2+4=6||6;=>46") + [tok.eos_id]
  assert pool.references.shape[:2] == (2, 2)
  assert pool.reference_lens.tolist() == [[len(first), 0], [len(tok.encode("=>3")) + 1, 0]]
  assert pool.references[0, 0, :len(first)].tolist() == first
  assert pool.take(np.array([1])).reference_lens.tolist() == [[len(tok.encode("=>3")) + 1, 0]]
  plain, _ = tokenize_pool(examples, tok, max_prompt_len=8, max_answer_len=40)
  assert plain.references is None and plain.reference_lens is None
  with pytest.raises(ValueError, match=r"probe references have counts \[1, 2\]"):
    tokenize_pool(examples, tok, max_prompt_len=8, max_answer_len=40,
                  references=[("=>46",), ("=>3", "3=>3")])
