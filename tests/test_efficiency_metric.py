"""The tokens-to-target rule and bootstrap ratio of experiments/benchmarks/efficiency.py."""

import math
import re

import numpy as np
import pytest

from rlx.experiments.benchmarks import efficiency


def curve(accs, tokens_per_eval=1000):
  return [(5 * i, tokens_per_eval * i, a) for i, a in enumerate(accs)]


def test_an_early_transient_above_the_target_does_not_count():
  # Jumps above 0.70 at the first two evaluations, falls back, then climbs for good.
  c = curve([0.44, 0.71, 0.72, 0.60, 0.62, 0.69, 0.71, 0.70, 0.73, 0.75])
  assert efficiency.tokens_to_target(c, 0.70) == 6000
  # A dip within the margin after reaching it is noise; the next one below it is not.
  assert efficiency.tokens_to_target(curve([0.5, 0.70, 0.68, 0.72]), 0.70) == 1000
  assert math.isinf(efficiency.tokens_to_target(curve([0.5, 0.70, 0.66, 0.72]), 0.70))
  assert efficiency.tokens_to_target(curve([0.5, 0.70, 0.66, 0.72, 0.71]), 0.70) == 3000


def test_the_last_evaluation_alone_or_never_is_censored():
  assert math.isinf(efficiency.tokens_to_target(curve([0.4, 0.5, 0.8]), 0.7))
  assert math.isinf(efficiency.tokens_to_target(curve([0.4, 0.5, 0.6]), 0.7))


def test_bootstrap_ratio_is_the_ratio_of_medians_with_an_interval_around_it():
  point, (lo, hi) = efficiency.bootstrap_ratio([100, 110, 90, 105], [50, 55, 60, 52])
  assert point == np.median([100, 110, 90, 105]) / np.median([50, 55, 60, 52])
  assert lo <= point <= hi


def test_arms_at_their_own_learning_rates():
  assert efficiency.split_arm("R32@7.5e-5") == ("R32", 7.5e-5)
  assert efficiency.split_arm("S+R") == ("S+R", None)
  for bad in ("R32@", "R32@fast", "R32@-1e-4", "@1e-4", "B0@nan"):
    with pytest.raises(ValueError, match="expected <arm>@<learning rate>"):
      efficiency.split_arm(bad)
  assert efficiency.expand_arms(["B0", "R32"], []) == ["B0", "R32"]
  assert efficiency.expand_arms(["B0", "R32", "S@1e-3"], ["1e-4", "2e-4"]) == [
      "B0@0.0001", "B0@0.0002", "R32@0.0001", "R32@0.0002", "S@1e-3"]
  for bad in ("x", "0", "-1e-4", "inf"):
    with pytest.raises(ValueError, match=f"--lrs: '{bad}'; expected positive learning rates"):
      efficiency.expand_arms(["B0", "S@1e-3"], ["1e-4", bad])
  # The main table compares a cell with B0 at its rate, else with plain B0.
  cells = {"B0": 0, "B0@0.0001": 0, "R@0.0001": 0, "R@0.0002": 0}
  assert efficiency.b0_of("R@0.0001", cells) == "B0@0.0001"
  assert efficiency.b0_of("R@1e-4", cells) == "B0@0.0001"  # the same rate, written otherwise
  assert efficiency.b0_of("R@0.0002", cells) == "B0"
  assert efficiency.b0_of("R", {"R": 0}) is None


def test_arm_names_are_checked_and_k_takes_a_weight():
  assert efficiency.arm_overrides("B0", "band") == {}
  assert efficiency.arm_overrides("K", "band") == {"length.length_reward": 0.5}
  assert efficiency.arm_overrides("K0.2", "band") == {"length.length_reward": 0.2}
  assert efficiency.arm_overrides("S+K.1", "band") == {"selection.mode": "band",
                                                      "length.length_reward": 0.1}
  assert efficiency.arm_overrides("D+K0.2", "band") == {"rl.advantage": "dr_grpo",
                                                       "length.length_reward": 0.2}
  # A typo used to run as plain GRPO under the typo's name; now it stops before any run.
  for bad, part in (("Z", "Z"), ("K0.2x", "K0.2x"), ("S+", ""), ("N", "N"), ("B0+S", "B0")):
    with pytest.raises(ValueError, match=re.escape(f"arm {bad!r}: unknown part(s) [{part!r}]")):
      efficiency.arm_overrides(bad, "band")


def test_best_cells_pick_each_arms_lowest_median_with_censored_runs_infinite():
  inf = math.inf
  ttt = {"B0@1": [10, 12, 14], "B0@2": [9, 30, inf], "R@1": [inf, inf, 8], "R@2": [20, 21, 22],
         "S": [5, 6, 7]}
  assert efficiency.best_cells(ttt) == {"B0": "B0@1", "R": "R@2", "S": "S"}


def test_new_arms_history_skip_oracle_and_batch_shape():
  assert efficiency.arm_overrides("H", "band") == {"selection.mode": "history"}
  assert efficiency.arm_overrides("G", "band") == {"selection.mode": "skip"}
  assert efficiency.arm_overrides("X+P8", "band") == {"selection.mode": "oracle",
                                                     "rl.prompts_per_step": 8}
  assert efficiency.arm_overrides("P8", "band") == {"rl.prompts_per_step": 8}
  assert efficiency.arm_overrides("E+P8", "band") == {"selection.mode": "probe",
                                                     "rl.prompts_per_step": 8}
  # A batch shape is a cell of its arm's tuning grid, not an arm of its own.
  assert efficiency.arm_family("S+P8") == "S" and efficiency.arm_family("P8") == "B0"
  ttt = {"B0": [10, 12], "P8": [5, 6], "S": [9, 9], "S+P8": [20, 20]}
  assert efficiency.best_cells(ttt) == {"B0": "P8", "S": "S"}
  with pytest.raises(ValueError, match="unknown part"):
    efficiency.arm_overrides("P", "band")
  with pytest.raises(ValueError, match="S and E are each a prompt-selection rule"):
    efficiency.arm_overrides("S+E+R", "band")
  assert efficiency.arm_overrides("E+C+P2", "band") == {
      "selection.mode": "probe", "selection.probe_score": "mixed_per_token",
      "rl.prompts_per_step": 2}
  with pytest.raises(ValueError, match="C ranks the candidates of the probe or the oracle"):
    efficiency.arm_overrides("S+C", "band")


def test_area_under_curve_steps_and_compute_at_target():
  c = curve([0.2, 0.4, 0.8, 0.8])  # evals at 0, 1000, 2000, 3000 tokens
  # 0.2 over [0, 1000), 0.4 over [1000, 2000), 0.8 over [2000, 3000]
  assert efficiency.area_under_curve(c, 3000) == pytest.approx((0.2 + 0.4 + 0.8) / 3)
  assert efficiency.area_under_curve(c, 1500) == pytest.approx((0.2 * 1000 + 0.4 * 500) / 1500)
  run = {"curve": c, "extra": [(0, 0.0, 0.0), (5, 1.5, 100.0), (10, 3.0, 250.0),
                                (15, 4.0, 300.0)]}
  assert efficiency.at_target(run, 0.8, "steps") == 10
  assert efficiency.at_target(run, 0.8, "wall") == 3.0
  assert efficiency.at_target(run, 0.8, "flops") == 250.0
  assert math.isinf(efficiency.at_target(run, 0.9, "steps"))
  line = {"ledger/prompt_tokens": 10.0, "ledger/tokens_generated": 20.0,
          "ledger/tokens_trained": 5.0, "ledger/probe_tokens": 7.0}
  assert efficiency.compute_units(line) == 10 + 20 + 15 + 7


def test_band_moves_counts_changes_of_the_most_mixed_level():
  per_step = {"1": [0] * 60, "2": [3] * 20 + [0] * 40, "3": [1] * 20 + [2] * 20 + [0] * 20,
              "4": [0] * 40 + [1] * 20, "zero_var": [0.9] * 60}
  leaders, changes = efficiency.band_moves(per_step, 60, window=20)
  assert leaders == [2, 3, 4] and changes == 2
  assert efficiency.band_moves(per_step, 20, window=20) == ([2], 0)


def test_shadow_share_sums_up_to_the_target_and_the_report_applies_the_30_percent_rule():
  # Two probe steps before the target (step 20) and one after it that must not count.
  per = {"select/shadow_probed": [128, 0, 128, 128],
         "select/shadow_mixed_sum": [40.0, 0, 24.0, 90.0],
         "select/shadow_excluded": [10, 0, 30, 50],
         "select/shadow_excluded_mixed_sum": [1.0, 0, 3.0, 40.0],
         "select/shadow_down": [0, 0, 4, 0],
         "select/shadow_down_mixed_sum": [0.0, 0, 2.0, 0.0]}
  run = {"curve": [(0, 0, 0.1), (3, 100, 0.3), (4, 200, 0.31)],
         "extra": [(0, 0, 0), (3, 1.0, 10), (4, 2.0, 20)], "per_step": per}
  sh = efficiency.shadow_share(run, 3)
  assert sh["excluded_frac"] == pytest.approx(40 / 256)
  assert sh["excluded_mixed"] == pytest.approx(4 / 40)
  assert sh["down_mixed"] == pytest.approx(0.5)
  assert sh["all_mixed"] == pytest.approx(64 / 256)
  assert efficiency.shadow_share({"per_step": {}}, None) is None
  lines = efficiency.shadow_report({"H": [run]}, target=0.3)
  assert lines[-1].startswith("| H | 16% | 10.0% | 50.0% | 25.0% | holds |")
  # Whole run (the target never reached): 44 of 90 excluded would have mixed: falsified.
  lines = efficiency.shadow_report({"H": [run]}, target=0.9)
  assert lines[-1].endswith("| falsified |")


_OWN_TASK = '''
from rlx import configs
from rlx.data import registry


def _load(task, data_dir):
  ex = [{"prompt": f"{i}=", "answer": str(i % 7), "difficulty": 1 + i % 2,
         "teacher_answer": str(i % 7)} for i in range(20)]
  return ex, ex


registry.register_task("eff_own_task", registry.TaskDef(load=_load))


def get_config(arg=""):
  c = configs.defaults()
  c.task.name = "eff_own_task"
  c.task.levels = (1, 2)
  c.task.band = (2,)
  c.task.rl_levels = (1, 2)
  return c
'''


def test_a_task_of_ones_own_runs_from_its_experiment_file(tmp_path):
  """--task=<experiment file>: the unseen-family check needs no edit of the benchmark; the
  config's own levels are kept (arith's (3, 4) and its rl_levels are not forced on it)."""
  from absl import app, flags
  path = tmp_path / "own_task.py"
  path.write_text(_OWN_TASK)
  try:
    flags.FLAGS(["efficiency", f"--task={path}"])
    assert efficiency.task_kind() == "file"
    cfg = efficiency.make_config(50, 10, 3, "/base", "/data", {"optim.lr": 1e-4})
    assert cfg.task.name == "eff_own_task"
    assert tuple(cfg.task.band) == (2,) and tuple(cfg.task.eval_levels) == ()
    assert tuple(cfg.task.rl_levels) == (1, 2)
    assert (cfg.seed, cfg.total_steps, cfg.optim.lr) == (3, 50, 1e-4)
    assert cfg.warm_start.dir == "/base"
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["efficiency", f"--task={path}", "--set=model.path=/ckpt/mine"])
    cfg = efficiency.make_config(50, 10, 3, "/base", "/data", {})
    assert (cfg.model.path, cfg.warm_start.dir) == ("/ckpt/mine", "")  # its own checkpoint
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["efficiency", "--task=chains"])
    assert efficiency.task_kind() == "chains"
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["efficiency", f"--task={tmp_path / 'missing.py'}"])
    with pytest.raises(app.UsageError, match="missing.py"):
      efficiency.task_config()
  finally:
    flags.FLAGS.unparse_flags()


def test_mixture_arm_gives_the_band_its_share_of_the_pool():
  """M<k>: B0 with a static mixture, the band levels k% of the RL pool (issue 36's B0 +
  mixture baseline), split as the task's own weights split each side."""
  from absl import flags
  from rlx import configs
  o = efficiency.arm_overrides("M50+P8", "band")
  assert o == {"_band_share": 0.5, "rl.prompts_per_step": 8}
  assert efficiency.arm_family("M50+P8") == "M"
  assert efficiency.best_cells({"M25": [9, 9], "M75": [5, 5]}) == {"M": "M75"}
  with pytest.raises(ValueError, match="M0; expected M<band share"):
    efficiency.arm_overrides("M0", "band")
  task = configs.defaults().task
  task.rl_levels, task.band = (1, 2, 3, 4), (2, 3, 4)
  task.rl_level_weights = {"1": 0.75, "2": 0.1, "3": 0.1, "4": 0.05}
  np.testing.assert_allclose(
      [efficiency.band_mixture(task, 0.5)[k] for k in "1234"], [0.5, 0.2, 0.2, 0.1])
  task.rl_level_weights = {}
  np.testing.assert_allclose(
      [efficiency.band_mixture(task, 0.9)[k] for k in "1234"], [0.1, 0.3, 0.3, 0.3])
  task.band = ()
  with pytest.raises(ValueError, match="levels both in and out of task.band"):
    efficiency.band_mixture(task, 0.5)
  try:  # make_config applies it to the task's own config
    flags.FLAGS(["efficiency", "--task=chains"])
    cfg = efficiency.make_config(50, 10, 0, "/base", "/data", o)
    got = dict(cfg.task.rl_level_weights)
    np.testing.assert_allclose([got[k] for k in "1234"], [0.5, 1 / 6, 1 / 6, 1 / 6])
    assert cfg.rl.prompts_per_step == 8 and "_band_share" in o  # the caller's dict kept
  finally:
    flags.FLAGS.unparse_flags()


def test_a_base_dir_the_arms_would_not_use_is_refused(tmp_path):
  """--base_dir made with other task settings (rlx.main's reasoning run: 128 held-out problems
  per level; the benchmark: 200) used to be skipped silently, each run training its own warm
  start at its seed; now the benchmark stops first, naming the difference."""
  import json
  from absl import app, flags
  from rlx import configs, warm_start
  from rlx.data import registry
  try:
    flags.FLAGS(["efficiency", "--task=reasoning"])
    cfg = efficiency.make_config(1, 1, 0, "", str(tmp_path / "data"), {})
    spec = configs.resolve(cfg)
    meta = {"task": spec.task.name, "task_spec": registry.cache_key(spec.task),
            "model_overrides": spec.model.arch, "seed": 0}
    (tmp_path / warm_start.BASE_META).write_text(json.dumps(meta))
    efficiency.check_base(str(tmp_path), cfg)  # made for these settings: used
    meta["task_spec"] = {**meta["task_spec"], "num_eval_per_level": 128}
    (tmp_path / warm_start.BASE_META).write_text(json.dumps(meta))
    with pytest.raises(app.UsageError, match=r"--base_dir=.*num_eval_per_level.*128"):
      efficiency.check_base(str(tmp_path), cfg)
    with pytest.raises(app.UsageError, match="is not a directory"):
      efficiency.check_base(str(tmp_path / "missing"), cfg)
  finally:
    flags.FLAGS.unparse_flags()
