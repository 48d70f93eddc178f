"""Nothing lost, nothing silently wrong: one run per workdir, checkpoint retention and failed
saves, config changes on resume, host rewards that hang or exit, signals before the RL loop."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import pytest

from rlx import checkpoint, configs, trainer
from rlx.workdir import WorkdirBusy, WorkdirLock
from test_main import ARITH, REPO, runlocal_config

ONE = dict(devices=jax.devices()[:1])
QUIET = dict(log=lambda s: None, show_progress=False, **ONE)


def _env(**extra):
  return {**os.environ, "PYTHONPATH": os.pathsep.join(
      [REPO, *extra.pop("path", []), os.environ.get("PYTHONPATH", "")]), **extra}


class _Run:
  """`python -m rlx.main` in the background, stderr to a file (a pipe could fill and block it)."""

  def __init__(self, args, log, env):
    self.log = log
    with open(log, "w") as f:
      self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=f, text=True,
                                   cwd=REPO, env=env)

  def stderr(self) -> str:
    return self.log.read_text()

  def wait_for(self, ready, timeout=300):
    deadline = time.time() + timeout
    while not ready():
      assert self.proc.poll() is None, self.stderr()[-2000:]
      assert time.time() < deadline, "timed out"
      time.sleep(0.1)

  def stop(self, sig=signal.SIGTERM, timeout=120) -> int:
    try:
      self.proc.send_signal(sig)
      return self.proc.wait(timeout=timeout)
    finally:
      self.proc.kill()


def _cli(workdir, *flags):
  return [sys.executable, "-m", "rlx.main", f"--config={ARITH}:runlocal",
          f"--workdir={workdir}", "--config.mesh.data=1", *flags]


def test_keep_checkpoints_zero_keeps_every_checkpoint(tmp_path):
  trainer.run(runlocal_config(**{"total_steps": 3, "checkpoint_every": 1, "eval_every": 3,
                                 "keep_checkpoints": 0, "mesh.data": 1}), str(tmp_path), **QUIET)
  assert sorted(os.listdir(tmp_path / "checkpoints"), key=int) == ["1", "2", "3"]


def test_negative_keep_checkpoints_is_refused(tmp_path):
  with pytest.raises(configs.ConfigError, match=r"config.keep_checkpoints=-1; expected an "
                     r"integer >= 0"):
    trainer.run(runlocal_config(**{"keep_checkpoints": -1, "mesh.data": 1}), str(tmp_path),
                **QUIET)
  assert not os.listdir(tmp_path)


def test_a_held_workdir_is_refused_naming_the_holder(tmp_path):
  wd = tmp_path / "wd"
  with WorkdirLock(str(wd)):
    out = subprocess.run(_cli(wd), capture_output=True, text=True, timeout=300, cwd=REPO,
                         env=_env())
  assert out.returncode == 2, out.stderr[-2000:]
  line = [l for l in out.stderr.splitlines() if l.startswith("rlx: error:")]
  assert len(line) == 1 and f"pid {os.getpid()}" in line[0] and "in use by another rlx run" in (
      line[0]), out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  assert sorted(os.listdir(wd)) == [".rlx.lock"]  # nothing else was written


def test_two_processes_cannot_both_run(tmp_path):
  wd = tmp_path / "wd"
  first = _Run(_cli(wd, "--config.total_steps=400", "--config.eval_every=400"),
               tmp_path / "first.log", _env())
  try:
    first.wait_for((wd / "base" / "rlx_base.json").exists)  # the first run is past set-up
    second = subprocess.run(_cli(wd, "--config.seed=7"), capture_output=True, text=True,
                            timeout=300, cwd=REPO, env=_env())
    assert second.returncode == 2
    assert f"in use by another rlx run (pid {first.proc.pid}" in second.stderr
    assert first.proc.poll() is None  # the first run goes on
  finally:
    rc = first.stop(timeout=300)
  assert rc == 75, first.stderr()[-2000:]


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
  (tmp_path / ".rlx.lock").write_text(json.dumps({"host": "h", "pid": 2 ** 22 + 12345,
                                                  "started": 0}))
  with WorkdirLock(str(tmp_path)):
    with pytest.raises(WorkdirBusy, match=f"pid {os.getpid()}"):
      WorkdirLock(str(tmp_path)).acquire()


def test_an_unwritable_checkpoint_directory_fails_before_training(tmp_path):
  (tmp_path / "checkpoints").write_text("a file where the checkpoints would go")
  with pytest.raises(configs.ConfigError, match=r"checkpoint directory '.*checkpoints' is not "
                     r"writable"):
    trainer.run(runlocal_config(**{"mesh.data": 1}), str(tmp_path), **QUIET)
  assert sorted(os.listdir(tmp_path)) == [".rlx.lock", "checkpoints"]


def test_a_failed_save_stops_with_one_line_and_keeps_the_previous_checkpoint(tmp_path,
                                                                             monkeypatch):
  real_save = checkpoint.Checkpointer.save

  def save(self, step, state, meta, *, force=False):
    if step >= 2:
      raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "checkpoints"))
    return real_save(self, step, state, meta, force=force)

  monkeypatch.setattr(checkpoint.Checkpointer, "save", save)
  with pytest.raises(checkpoint.CheckpointError) as info:
    trainer.run(runlocal_config(**{"total_steps": 3, "checkpoint_every": 1, "mesh.data": 1}),
                str(tmp_path), **QUIET)
  msg = str(info.value)
  assert "\n" not in msg
  assert f"could not save the checkpoint of step 2 to {tmp_path / 'checkpoints'}" in msg
  assert "No space left on device" in msg and "the checkpoint of step 1 is kept" in msg
  assert checkpoint.Checkpointer(str(tmp_path)).latest_step() == 1


def _reward_module(tmp_path, body):
  (tmp_path / "mods").mkdir(exist_ok=True)
  (tmp_path / "mods" / "user_rewards.py").write_text(textwrap.dedent(body))
  sys.path.insert(0, str(tmp_path / "mods"))
  sys.modules.pop("user_rewards", None)


def test_a_hung_reward_times_out_with_one_line(tmp_path):
  _reward_module(tmp_path, """
      import time
      def slow(prompts, completions, **unused):
        time.sleep(5)
        return [0.0] * len(prompts)
  """)
  with pytest.raises(trainer.RewardError, match=r"reward function 'user_rewards:slow' did not "
                     r"return within 0.5 s \(config.task.reward_timeout_s\)"):
    trainer.run(runlocal_config(**{"task.reward": "user_rewards:slow", "mesh.data": 1,
                                   "task.reward_timeout_s": 0.5, "eval_every": 100}),
                str(tmp_path / "wd"), **QUIET)


def test_a_reward_calling_sys_exit_is_an_error_not_a_clean_exit(tmp_path):
  _reward_module(tmp_path, """
      import sys
      def quits(prompts, completions, **unused):
        sys.exit(0)
  """)
  with pytest.raises(trainer.RewardError, match=r"reward function 'user_rewards:quits' called "
                     r"sys.exit\(0\); a reward must return one float per completion"):
    trainer.run(runlocal_config(**{"task.reward": "user_rewards:quits", "mesh.data": 1,
                                   "eval_every": 100}), str(tmp_path / "wd"), **QUIET)


def test_sigterm_during_a_hung_reward_checkpoints_and_exits_75(tmp_path):
  mods = tmp_path / "mods"
  mods.mkdir()
  (mods / "hang_reward.py").write_text(textwrap.dedent("""
      import os, time
      calls = 0
      def reward(prompts, completions, *, answer, **unused):
        global calls
        calls += 1
        if calls > int(os.environ["HANG_AFTER"]):  # eval scores 1 call, each step 1 more
          open(os.environ["HANG_MARKER"], "w").close()
          time.sleep(3600)
        return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]
  """))
  wd, marker = tmp_path / "wd", tmp_path / "hanging"
  run = _Run(_cli(wd, "--config.task.reward=hang_reward:reward", "--config.eval_every=100",
                  "--config.total_steps=100", "--config.checkpoint_every=100"),
             tmp_path / "run.log",
             _env(path=[str(mods)], HANG_AFTER="3", HANG_MARKER=str(marker)))
  run.wait_for(marker.exists)
  rc = run.stop()
  err = run.stderr()
  assert rc == 75, err[-2000:]
  assert "stopped by SIGTERM after step 2" in err and "Traceback" not in err
  assert checkpoint.Checkpointer(str(wd)).latest_step() == 2


def test_sigterm_before_the_rl_loop_exits_75(tmp_path):
  wd = tmp_path / "wd"
  run = _Run(_cli(wd), tmp_path / "run.log", _env())
  run.wait_for((wd / "data").exists)  # set-up has begun (data preparation, then warm start)
  rc = run.stop()
  err = run.stderr()
  assert rc == 75, err[-2000:]
  assert "stopped by SIGTERM before the first RL step" in err and "Traceback" not in err
