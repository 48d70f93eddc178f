"""experiments/reasoning.py end to end (runlocal): worked solutions scored by their final
answer, with completion lengths in the eval metrics."""

import json
import os

import numpy as np

import rlx
from rlx import trainer, warm_start

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REASONING = os.path.join(REPO, "experiments", "reasoning.py")


def test_runlocal_trains_and_reports_lengths(tmp_path):
  config = rlx.load_config(REASONING, "runlocal")
  workdir = str(tmp_path / "run")
  logs = []
  summary = trainer.run(config, workdir, log=logs.append, show_progress=False)
  lines = rlx.read_metrics(workdir)
  assert [l["step"] for l in lines] == list(range(config.total_steps + 1))
  last = lines[-1]
  for key in ("eval/band_accuracy", "eval/accuracy_d3", "eval/len_mean", "eval/len_mean_d3",
              "eval/correct_len_mean", "ledger/tokens_generated"):
    assert key in last, key
  assert 1 <= last["eval/len_mean"] <= config.sampler.max_new_tokens
  meta = json.load(open(os.path.join(workdir, "base", warm_start.BASE_META)))
  assert meta["task"] == "column_add"
  assert meta["task_spec"]["teacher_verbose_rate"] == config.task.teacher_verbose_rate
  assert summary["after"]["eval/band_accuracy"] == last["eval/band_accuracy"]


def test_sweep_lists_length_control_arms():
  from rlx.experiments import reasoning  # pylint: disable=g-import-not-at-top
  runs = reasoning.get_sweep()
  assert {r["length.length_reward"] for r in runs} == {0.0, 0.5}
  for overrides in reasoning.get_sweep() + reasoning.get_sweep("runlocal"):
    rlx.with_overrides(reasoning.get_config(), overrides)  # every key exists


def test_the_probe_gets_each_prompts_two_correct_solutions(tmp_path):
  """selection.mode=probe on the reasoning task (a final-answer reward): the RL pool carries
  each prompt's concise and verbose correct solutions (+ EOS) for the probe to sum, those
  longer than max_new_tokens left out; a uniform run's pool carries none."""
  from rlx import configs, experiment  # pylint: disable=g-import-not-at-top
  from rlx.data import column_add  # pylint: disable=g-import-not-at-top
  config = rlx.with_overrides(rlx.load_config(REASONING, "runlocal"),
                              {"selection.mode": "probe", "selection.probe_factor": 2})
  spec = configs.resolve(config)
  exp = experiment.setup(spec, str(tmp_path / "run"), log=lambda s: None, show_progress=False)
  pool, tok = exp.train_pool, exp.tokenizer
  assert pool.references.shape[:2] == (pool.size, 2)
  assert trainer.step_config(spec, tok).probe_references
  lens = np.asarray(pool.reference_lens)
  for i in range(0, pool.size, 37):
    for r, text in enumerate(column_add.correct_solutions(exp.train_host.prompts[i])):
      ids = tok.encode(text) + [tok.eos_id]
      want = ids if len(ids) <= config.sampler.max_new_tokens else []
      assert np.asarray(pool.references[i, r, :lens[i, r]]).tolist() == want
  assert (lens[:, 0] > 0).all() and 0 < (lens[:, 1] > 0).mean() < 1  # long verbose ones cut
  plain = experiment.setup(configs.resolve(rlx.load_config(REASONING, "runlocal")),
                           str(tmp_path / "run"), log=lambda s: None, show_progress=False)
  assert plain.train_pool.references is None
