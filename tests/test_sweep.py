"""rlx.sweep: override sets from get_sweep(arg) become runs, commands, a results table and a plot.

The one slow test runs the runlocal sweep of experiments/arith.py (2 tiny runs, ~35 s on 2
cores); the rest is pure Python or fails within seconds.
"""

import csv
import os
import shlex
import subprocess
import sys

import pytest

from rlx import sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARITH = os.path.join("experiments", "arith.py")


def run_sweep(args, timeout):
  return subprocess.run([sys.executable, "-m", "rlx.sweep", *args], capture_output=True,
                        text=True, timeout=timeout, cwd=REPO)


def test_print_only_prints_one_command_per_run(capsys, tmp_path):
  assert sweep.main([f"--config={ARITH}", f"--workdir_root={tmp_path}", "--print_only",
                     "--config.total_steps=50"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 4
  first = shlex.split(lines[0])
  assert first[:4] == ["python", "-m", "rlx.main", f"--config={ARITH}"]
  assert first[4] == f"--workdir={tmp_path}/group_size-4_advantage-grpo"
  assert first[5:] == ["--config.rl.group_size=4", "--config.rl.advantage=grpo",
                       "--config.total_steps=50"]
  assert [shlex.split(l)[4].rsplit("/", 1)[1] for l in lines] == [
      "group_size-4_advantage-grpo", "group_size-4_advantage-dr_grpo",
      "group_size-8_advantage-grpo", "group_size-8_advantage-dr_grpo"]
  assert not os.listdir(tmp_path)  # nothing ran


def test_a_shipped_experiment_is_found_by_name_from_any_directory(capsys, tmp_path,
                                                                  monkeypatch):
  # Regression (issue 37): `--config=arith:runlocal` failed ("is not a file") outside the repo
  # root although rlx.main accepts it; a directory named like the experiment (a workdir called
  # arith) does not hide it either.
  monkeypatch.chdir(tmp_path)
  (tmp_path / "arith").mkdir()
  assert sweep.main(["--config=arith:runlocal", f"--workdir_root={tmp_path / 'sw'}",
                     "--print_only"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert [shlex.split(l)[3:5] for l in lines] == [
      ["--config=arith:runlocal", f"--workdir={tmp_path}/sw/seed-0"],
      ["--config=arith:runlocal", f"--workdir={tmp_path}/sw/seed-1"]]
  assert sweep.main(["--config=nope", f"--workdir_root={tmp_path / 'sw'}", "--print_only"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("rlx.sweep: error: config file 'nope' does not exist; pass a path or a "
                        "shipped experiment name (") and "arith" in err and "\n" not in err


def test_one_rule_finds_configs_for_main_sweep_and_load_config(tmp_path, monkeypatch):
  import rlx
  import subprocess
  import sys
  from rlx import config_file
  monkeypatch.chdir(tmp_path)
  (tmp_path / "arith").mkdir()
  shipped = config_file.find("arith")
  assert shipped.endswith(os.path.join("experiments", "arith.py")) and os.path.isfile(shipped)
  # rlx.main defines absl flags at import: asked in a process of its own, so that no flag of
  # another module imported by this test worker (e.g. experiments/benchmarks/efficiency.py)
  # collides.
  out = subprocess.run(
      [sys.executable, "-c", "from rlx import main; "
       "print(main.resolve_config(['rlx', '--config=arith:runlocal'])[1])"],
      cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True).stdout
  assert out.strip().splitlines()[-1] == f"--config={shipped}:runlocal"
  assert sweep.load_sweep("arith:runlocal")[1] == rlx.load_config("arith", "runlocal")
  (tmp_path / "mine").write_text("def get_config(arg=''):\n  return arg\n")  # a file wins
  assert config_file.find("mine") == "mine" and rlx.load_config("mine", "x") == "x"
  with pytest.raises(FileNotFoundError, match=r"config file 'nope.py' does not exist; pass a "
                     r"path or a shipped experiment name \(.*arith"):
    rlx.load_config("nope.py")


def test_max_runs_keeps_the_names_of_the_full_sweep(capsys, tmp_path):
  assert sweep.main([f"--config={ARITH}", f"--workdir_root={tmp_path}", "--print_only",
                     "--max_runs", "1"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 1 and "/group_size-4_advantage-grpo " in lines[0]


def test_run_names_come_from_the_overrides_that_differ():
  runs = [{"total_steps": 2, "rl.advantage": "grpo", "task.levels": (3, 4)},
          {"total_steps": 2, "rl.advantage": "dr_grpo", "task.levels": (5,)},
          {"total_steps": 2, "rl.advantage": "dr_grpo", "task.levels": (5,)},
          {"_name": "my run!"}]
  assert sweep.unique_names(runs) == [
      "total_steps-2_advantage-grpo_levels-3-4", "total_steps-2_advantage-dr_grpo_levels-5",
      "total_steps-2_advantage-dr_grpo_levels-5_1", "myrun"]
  assert sweep.override_flags(runs[1]) == [
      "--config.total_steps=2", "--config.rl.advantage=dr_grpo", "--config.task.levels=(5,)"]
  assert sweep.format_value(True) == "true" and sweep.format_value(3e-4) == "0.0003"


def test_warm_start_is_shared_only_when_runs_agree_on_it():
  import ml_collections as mlc
  base = mlc.ConfigDict({"seed": 0, "warm_start": {"dir": ""}, "rl": {"group_size": 4}})
  assert sweep.can_share_warm_start([{"rl.group_size": 4}, {"rl.group_size": 8}], base, [])[0]
  assert sweep.can_share_warm_start([{"sft.steps": 2}, {"sft.steps": 2, "seed": 0}], base,
                                    [])[1] == "runs differ in task/model/tokenizer/sft/seed"
  assert not sweep.can_share_warm_start([{"seed": 0}, {"seed": 1}], base, [])[0]
  assert not sweep.can_share_warm_start([{}], base, ["--config.warm_start.dir=x"])[0]


@pytest.mark.parametrize("body, message", [
    ("def get_config(arg=''):\n  return None\n", r"defines no get_sweep\(arg\); add one"),
    ("import ml_collections as mlc\ndef get_config(arg=''):\n  return mlc.ConfigDict({'rl': "
     "{'group_size': 4}})\ndef get_sweep(arg=''):\n  return [{'rl.grup_size': 8}]\n",
     r"entry 0 overrides 'rl.grup_size', which is not a key of get_config\(''\)"),
    ("def get_sweep(arg=''):\n  return []\n", r"returned \[\]; expected a non-empty list"),
])
def test_bad_sweep_definitions(body, message, tmp_path):
  path = tmp_path / "exp.py"
  path.write_text(body)
  with pytest.raises(sweep.SweepError, match=message):
    sweep.load_sweep(str(path))


def test_a_failing_run_is_reported_not_fatal(tmp_path):
  # Two runs that fail at config validation (a second or two each): the sweep still writes
  # its table and plot, and exits with status 1.
  exp = tmp_path / "exp.py"
  exp.write_text(
      "import importlib.util\n"
      f"spec = importlib.util.spec_from_file_location('arith', {os.path.join(REPO, ARITH)!r})\n"
      "arith = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(arith)\n"
      "get_config = arith.get_config\n"
      "def get_sweep(arg=''):\n"
      "  return [{'rl.group_size': 1, '_name': 'bad'}, {'sampler.top_p': 1.5, '_name': 'worse'}]\n")
  root = tmp_path / "sweep"
  out = run_sweep([f"--config={exp}:runlocal", f"--workdir_root={root}"], timeout=120)
  assert out.returncode == 1, out.stderr
  rows = list(csv.DictReader(open(root / "sweep_results.csv")))
  assert [r["run"] for r in rows] == ["bad", "worse"]
  assert rows[0]["status"].startswith("failed (exit 2): rlx: error: config.rl.group_size=1")
  assert "top_p=1.5" in rows[1]["status"]
  assert "0/2 runs ok" in out.stdout
  assert (root / "sweep.png").stat().st_size > 0


def check_png(path):
  from PIL import Image
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  with Image.open(path) as im:
    assert im.size[0] > 100 and im.size[1] > 100


def test_runlocal_sweep_runs_and_gathers(tmp_path):
  root = tmp_path / "sweep"
  out = run_sweep([f"--config={ARITH}:runlocal", f"--workdir_root={root}"], timeout=170)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  rows = list(csv.DictReader(open(root / "sweep_results.csv")))
  assert [r["run"] for r in rows] == ["seed-0", "seed-1"]
  for r in rows:
    assert r["status"] == "ok" and r["steps"] == "2"
    assert 0.0 <= float(r["band_acc_before"]) <= 1.0
    assert 0.0 <= float(r["band_acc_after"]) <= 1.0
    assert float(r["tokens_generated"]) > 0
    assert "--config.total_steps=2" in r["overrides"]
  assert "| seed-0 | ok |" in open(root / "sweep_results.md").read()
  assert "| seed-1 | ok |" in out.stdout
  check_png(str(root / "sweep.png"))
  for name in ("seed-0", "seed-1"):
    assert os.path.exists(root / name / "metrics.jsonl")
    assert "rlx.main" in open(root / name / "sweep.log").readline()
