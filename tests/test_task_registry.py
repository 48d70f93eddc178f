"""Tasks by name: the built-in ones, one an experiment registers, and the warm-start cache key."""

import json
import os

import pytest

import rlx
from rlx import configs, trainer, warm_start
from rlx.data import registry
from rlx.data.tokenizer import train_sentencepiece

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_unknown_task_is_one_clear_error_before_any_work():
  config = configs.with_overrides(configs.defaults(), {"task.name": "arithmatic"})
  with pytest.raises(configs.ConfigError, match=r"^config.task.name='arithmatic'; expected one "
                     r"of \(.*'arithmetic'.*'column_add'.*\) or a task registered with "
                     r"rlx.data.registry.register_task.$"):
    configs.resolve(config)


def test_default_reward_comes_from_the_task():
  def reward(name, value=""):
    config = configs.with_overrides(configs.defaults(), {"task.name": name,
                                                          "task.reward": value})
    return configs.resolve(config).task.reward
  assert reward("arithmetic") == reward("column_add") == "exact_match"
  assert reward("gsm8k") == reward("math") == "math"
  assert reward("gsm8k", "exact") == "exact"


def test_verifier_of_each_task():
  tok = train_sentencepiece(["12+3=2+3=5|1|5;1=1||15;=>15"] * 20, 40, symbols=("=>",))
  spec = configs.resolve(configs.with_overrides(configs.defaults(),
                                                {"task.name": "column_add"}))
  v = registry.verifier_for(spec.task, tok)
  assert v.kind == "final_answer" and v.marker == tuple(tok.encode("=>")) and len(v.marker) == 1
  from rlx.data import column_add  # pylint: disable=g-import-not-at-top
  assert registry.get_task("column_add").answer_marker == column_add.MARKER
  spec = configs.resolve(configs.defaults())
  assert registry.verifier_for(spec.task, tok).kind == "exact_match"


def test_task_definitions_are_checked():
  load = lambda task, data_dir: ([], [])
  with pytest.raises(ValueError, match="verifier='final_answer' needs answer_marker"):
    registry.TaskDef(load=load, verifier="final_answer")
  with pytest.raises(ValueError, match="warm_start=True needs cache_key"):
    registry.TaskDef(load=load, warm_start=True)
  with pytest.raises(ValueError, match="verifier='regex'; expected one of"):
    registry.TaskDef(load=load, verifier="regex")
  with pytest.raises(ValueError, match="expected a TaskDef"):
    registry.register_task("x", load)


def test_arithmetic_cache_key_is_what_earlier_bases_recorded(tmp_path):
  """Bases written before tasks had names stay valid: same "task_spec", no "task" key."""
  config = rlx.load_config(os.path.join(REPO, "experiments", "arith.py"))
  spec = configs.resolve(config)
  key = json.loads(json.dumps(registry.cache_key(spec.task)))
  assert key == {"ops": ["add"], "levels": [2, 3, 4, 5], "num_train_per_level": 5000,
                 "num_eval_per_level": 200, "seed": 0, "reverse_answer": False,
                 "teacher_error_levels": [3, 4], "teacher_error_rate": 0.6}
  meta = {"task_spec": key, "model_overrides": spec.model.arch}
  (tmp_path / warm_start.BASE_META).write_text(json.dumps(meta))
  assert warm_start.base_matches(str(tmp_path), spec) == (True, "")
  other = configs.resolve(configs.with_overrides(config, {"task.name": "column_add"}))
  ok, why = warm_start.base_matches(str(tmp_path), other)
  assert not ok and "made for task 'arithmetic', the config asks for 'column_add'" in why


# ----------------------------------------------------------------------------- a task of its own


def _count_examples(task, data_dir):
  """"aaa?" -> count the letters, one step per letter, then "=>3" (teacher: always right)."""
  del data_dir
  def example(n):
    steps = ",".join(str(i) for i in range(1, n + 1))
    return {"prompt": "a" * n + "?", "answer": str(n), "teacher_answer": f"{steps}=>{n}",
            "difficulty": 1 if n < 5 else 2}
  train = [example(n) for n in range(1, 9)] * 20
  return train, [example(n) for n in range(1, 9)]


def register_count_task(version=1):
  registry.register_task("test_count", registry.TaskDef(
      load=_count_examples, cache_key=lambda task: {"version": version, "seed": task.seed},
      warm_start=True, verifier="final_answer", answer_marker="=>",
      tokenizer_symbols=("=>",)))


def count_config(**overrides):
  c = rlx.load_config(os.path.join(REPO, "experiments", "arith.py"), "runlocal")
  c = configs.with_overrides(c, {
      "task.name": "test_count", "task.levels": (1, 2), "task.rl_levels": (), "task.band": (2,),
      "sft.level_weights": {"1": 1.0, "2": 1.0}, "sft.max_len": 32, "sft.steps": 30,
      "sampler.max_new_tokens": 24, "total_steps": 2, "eval_every": 2, "checkpoint_every": 2,
      "tokenizer.vocab_size": 24, **overrides})
  return c


def test_a_registered_task_runs_end_to_end(tmp_path):
  register_count_task()
  workdir = str(tmp_path / "run")
  logs = []
  summary = trainer.run(count_config(), workdir, log=logs.append, show_progress=False)
  assert any("supervised warm start" in l for l in logs)
  meta = json.load(open(os.path.join(workdir, "base", warm_start.BASE_META)))
  assert meta["task"] == "test_count" and meta["task_spec"] == {"version": 1, "seed": 0}
  lines = rlx.read_metrics(workdir)
  assert [l["step"] for l in lines] == [0, 1, 2]
  for key in ("eval/accuracy_d1", "eval/accuracy_d2", "eval/len_mean", "eval/correct_len_mean"):
    assert key in lines[-1], key
  assert summary["after"]["eval/band_accuracy"] == lines[-1]["eval/band_accuracy"]

  # Another run of the same task reuses the base; a changed task definition does not.
  logs = []
  trainer.run(count_config(**{"warm_start.dir": os.path.join(workdir, "base")}),
              str(tmp_path / "reuse"), log=logs.append, show_progress=False)
  assert not any("supervised warm start" in l for l in logs), logs
  # (The trainer takes a base iff warm_start.base_matches says so; checked directly here
  # rather than with a third run.)
  register_count_task(version=2)
  ok, why = warm_start.base_matches(os.path.join(workdir, "base"),
                                    configs.resolve(count_config()))
  assert not ok and "'version': 1" in why, why


# ----------------------------------------------------------------------------- level mixes


def test_rl_level_weights_set_each_levels_share_of_the_pool():
  from rlx.experiment import mix_levels  # pylint: disable=g-import-not-at-top
  examples = [{"prompt": f"{l}-{i}", "difficulty": l} for l, n in ((1, 3), (2, 100), (3, 101))
              for i in range(n)]
  mixed = mix_levels(examples, ((1, 0.5), (2, 0.25), (3, 0.25), (4, 0.0)), seed=0)
  assert len(mixed) == len(examples)
  counts = {l: sum(e["difficulty"] == l for e in mixed) for l in (1, 2, 3)}
  assert counts == {1: 102, 2: 51, 3: 51}
  # A level with too few examples repeats them evenly; others are drawn without repeats.
  ones = sorted(e["prompt"] for e in mixed if e["difficulty"] == 1)
  assert {ones.count(p) for p in set(ones)} == {34}
  twos = [e["prompt"] for e in mixed if e["difficulty"] == 2]
  assert len(set(twos)) == len(twos)
  with pytest.raises(configs.ConfigError, match=r"rl_level_weights names levels \[5\] with no "
                     r"RL example"):
    mix_levels(examples, ((1, 1.0), (5, 1.0)), seed=0)
  config = configs.with_overrides(configs.defaults(), {"task.rl_level_weights": {"2": -1.0}})
  with pytest.raises(configs.ConfigError, match=r"config.task.rl_level_weights=\{'2': -1.0\}; "
                     r"expected non-negative weights"):
    configs.resolve(config)


def test_warm_start_batches_by_level_are_cut_to_their_length():
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rlx import sft  # pylint: disable=g-import-not-at-top
  lengths = np.asarray([10, 12, 40, 44, 90, 100])
  data = sft.SFTData(tokens=np.zeros((6, 128), np.int32), loss_mask=np.zeros((6, 128), bool),
                     lengths=lengths, difficulty=np.asarray([1, 1, 2, 2, 3, 3], np.int32))
  draw = sft.level_sampler(data, {1: 1.0, 2: 1.0, 3: 1.0}, seed=0, by_level=True)
  widths = set()
  for _ in range(30):
    idx = draw(8)
    assert len(set(data.difficulty[idx])) == 1  # one level per batch
    widths.add(sft.batch_width(lengths[idx], 128))
  assert widths == {32, 64, 128}  # the longest example, rounded up to 32, at most max_len
  assert sft.batch_width(np.asarray([15, 20]), 20) == 20  # arithmetic: always max_len
