"""The host-Python reward API: registry, math/exact rewards, output checks, error messages."""

import math
import os
import re
import signal
import sys
import threading
import time

import numpy as np
import pytest

from rlx import reward_worker, rewards

PROMPTS = ["What is 1/2 + 1/4?", "How many clips?", "Janet's ducks?"]
COMPLETIONS = ["It is $\\boxed{\\frac{3}{4}}$.", "48 + 24 = 72\n#### 72", "She makes $17."]
ANSWERS = ["0.75", "72", "18"]


def test_math_reward_scores_final_answers():
  fn = rewards.get_reward("math")
  assert fn(PROMPTS, COMPLETIONS, answer=ANSWERS, difficulty=[1, 2, 3]) == [1.0, 1.0, 0.0]


def test_exact_reward_is_string_equality_after_strip():
  fn = rewards.get_reward("exact")
  assert fn(["a", "b", "c"], [" 72\n", "72.0", "x"], answer=["72", "72", "X"]) == [1.0, 0.0, 0.0]


def test_unknown_reward_lists_the_known_ones():
  with pytest.raises(ValueError, match=r"Unknown reward 'maths'; expected one of \[.*'exact', "
                     r"'math'.*\]"):
    rewards.get_reward("maths")


def test_register_and_wrap_a_custom_reward():
  def length_penalty(prompts, completions, *, answer, **unused):
    return [1.0 - 0.01 * len(c) for c in completions]

  rewards.register_reward("length_penalty_test", length_penalty)
  checked = rewards.wrap_reward("length_penalty_test", task_name="gsm8k")
  out = checked(PROMPTS, COMPLETIONS, answer=ANSWERS)
  assert out.dtype == np.float32 and out.shape == (3,)
  np.testing.assert_allclose(out, [1.0 - 0.01 * len(c) for c in COMPLETIONS], rtol=1e-6)


@pytest.mark.parametrize("values, message", [
    ([1.0, float("nan"), 0.0], r"reward gave nan for gsm8k example 1 \(prompt 'How many "
                               r"clips\?'\); expected a finite number"),
    ([1.0, 0.0, math.inf], r"reward gave inf for gsm8k example 2 \(prompt \"Janet's ducks\?\"\)"),
    ([1.0, 11.0, 0.0], r"reward gave 11 for gsm8k example 1 .* outside the allowed range "
                       r"\[-10, 10\]"),
    ([1.0, "1.0", 0.0], r"reward gave str '1.0' for gsm8k example 1 .*; expected a number"),
    ([None, 1.0, 0.0], r"reward gave NoneType None for gsm8k example 0"),
    ([1.0, 0.0], r"gsm8k: reward returned 2 values for 3 completions"),
    (1.0, r"gsm8k: reward returned float 1.0; expected a list of 3 floats"),
])
def test_check_rewards_names_task_and_example(values, message):
  with pytest.raises(ValueError, match=message):
    rewards.check_rewards(values, 3, "gsm8k", PROMPTS)


def test_check_rewards_accepts_numbers_of_any_kind_and_a_custom_range():
  out = rewards.check_rewards([True, np.float64(0.5), np.int32(-2), np.array(3.0)], 4, "t")
  np.testing.assert_array_equal(out, np.array([1.0, 0.5, -2.0, 3.0], np.float32))
  rewards.check_rewards([50.0], 1, "t", low=0, high=100)
  with pytest.raises(ValueError, match=r"outside the allowed range \[0, 1\]"):
    rewards.check_rewards([-0.5], 1, "t", low=0, high=1)


def test_a_raising_reward_names_itself_and_the_first_failing_example():
  def picky(prompts, completions, *, answer, **unused):
    return [float(c) for c in completions]  # fails on a non-numeric completion

  with pytest.raises(ValueError, match=r"reward function .*picky raised ValueError: could not "
                     r"convert string to float: 'x' on math500 example 1 \(prompt 'p1', "
                     r"completion 'x', fields \{'answer': '2'\}\)") as info:
    rewards.compute_rewards(picky, ["p0", "p1", "p2"], ["1", "x", "y"], task_name="math500",
                            answer=["1", "2", "3"])
  assert isinstance(info.value.__cause__, ValueError)


def test_a_reward_failing_only_on_the_whole_batch_says_so():
  def batch_of_one_only(prompts, completions, **unused):
    if len(prompts) > 1:
      raise RuntimeError("batch too large")
    return [0.0]

  with pytest.raises(ValueError, match=r"batch_of_one_only raised RuntimeError: batch too large "
                     r"on the t batch of 2 examples \(each example alone succeeds\)"):
    rewards.compute_rewards(batch_of_one_only, ["a", "b"], ["c", "d"], task_name="t")


def test_registered_name_appears_in_errors_of_bad_outputs():
  checked = rewards.wrap_reward(lambda p, c, **f: [0.0] * (len(c) + 1), task_name="t")
  with pytest.raises(ValueError, match=r"reward function .*<lambda> returned 3 values for 2"):
    checked(["a", "b"], ["c", "d"])


@pytest.mark.parametrize("fields, message", [
    ({"answer": ["1"]}, r"t: example field 'answer' has 1 entries for 2 prompts"),
    ({"answer": "12"}, r"t: example field 'answer' is str; expected a list aligned"),
])
def test_misaligned_example_fields(fields, message):
  with pytest.raises(ValueError, match=message):
    rewards.compute_rewards(rewards.math_reward, ["a", "b"], ["1", "2"], task_name="t", **fields)


# The worker process the trainer runs host rewards in (rlx.reward_worker).

class _Stop:
  signum = None


def _scored(prompts, completions, **unused):
  if completions[0] == "regex":  # catastrophic backtracking: C code that holds the GIL for hours
    re.match(r"(a+)+$", "a" * 40 + "b")
  if completions[0] == "exit":
    os._exit(0)  # pylint: disable=protected-access
  if completions[0] == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
  if completions[0] == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
  if completions[0] == "sys.exit":
    sys.exit(3)
  if completions[0] == "raise":
    raise ZeroDivisionError("reward exploded")
  return [float(len(c)) for c in completions]


def test_a_reward_holding_the_gil_is_killed_at_its_timeout_and_the_worker_restarts():
  worker = reward_worker.RewardWorker(_scored, name="'scored'")
  try:
    assert worker.call((["p"], ["ab"]), {}, timeout_s=30) == [2.0]
    first = worker.pid
    t0 = time.monotonic()
    with pytest.raises(reward_worker.RewardError, match=r"reward function 'scored' did not "
                       r"return within 0.5 s \(config.task.reward_timeout_s\)"):
      worker.call((["p"], ["regex"]), {}, timeout_s=0.5)
    # The regex backtracks for hours; 60 s leaves room for a loaded machine (load 14 made a
    # 5 s bound fail) and still cannot pass unless the worker was killed.
    assert time.monotonic() - t0 < 60
    assert worker.call((["p"], ["abc"]), {}, timeout_s=30) == [3.0]  # a fresh worker
    assert worker.pid != first and worker.starts == 2
  finally:
    worker.close()


def test_a_stop_signal_ends_a_reward_holding_the_gil():
  worker, stop = reward_worker.RewardWorker(_scored, name="'scored'"), _Stop()
  threading.Timer(0.3, lambda: setattr(stop, "signum", signal.SIGTERM)).start()
  t0 = time.monotonic()
  try:
    assert worker.call((["p"], ["regex"]), {}, timeout_s=600, stop=stop) is None
  finally:
    worker.close()
  assert time.monotonic() - t0 < 60  # the regex alone runs for hours (see above)


@pytest.mark.parametrize("completion, message", [
    ("exit", r"reward function 'scored' ended its worker process \(exit status 0, e.g. "
             r"os._exit or a crash\) instead of returning; a reward must return one float"),
    ("sigkill", r"ended its worker process \(killed by SIGKILL"),
    ("sys.exit", r"reward function 'scored' called sys.exit\(3\); a reward must return"),
])
def test_a_reward_ending_its_process_is_one_error(completion, message):
  worker = reward_worker.RewardWorker(_scored, name="'scored'")
  try:
    with pytest.raises(reward_worker.RewardError, match=message) as info:
      worker.call((["p"], [completion]), {}, timeout_s=30, stop=_Stop())
    assert "\n" not in str(info.value)
  finally:
    worker.close()


def test_a_reward_sigterming_its_own_process_is_a_stop_request():
  worker, stop = reward_worker.RewardWorker(_scored, name="'scored'"), _Stop()
  try:
    assert worker.call((["p"], ["sigterm"]), {}, timeout_s=30, stop=stop) is None
  finally:
    worker.close()
  assert stop.signum == signal.SIGTERM


def test_a_reward_exception_comes_back_as_itself():
  worker = reward_worker.RewardWorker(_scored, name="'scored'")
  try:
    with pytest.raises(ZeroDivisionError, match="reward exploded"):
      worker.call((["p"], ["raise"]), {}, timeout_s=30)
    assert worker.call((["p", "q"], ["a", "bcd"]), {"answer": ["1", "2"]}, timeout_s=30) == [
        1.0, 3.0]  # the same worker goes on
    assert worker.starts == 1
  finally:
    worker.close()


def test_the_worker_does_not_keep_the_workdir_locked(tmp_path):
  from rlx.workdir import WorkdirLock  # pylint: disable=g-import-not-at-top
  worker = reward_worker.RewardWorker(_scored, name="'scored'")
  try:
    with WorkdirLock(str(tmp_path)):
      assert worker.call((["p"], ["a"]), {}, timeout_s=30) == [1.0]  # forked while held
    with WorkdirLock(str(tmp_path)):  # the worker, still alive, holds no copy of the flock
      assert worker.pid is not None
  finally:
    worker.close()
