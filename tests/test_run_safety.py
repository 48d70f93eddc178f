"""Nothing lost, nothing silently wrong: one run per workdir, checkpoint retention and failed
saves, config changes on resume, host rewards that hang or exit, signals before the RL loop."""

import errno
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import pytest

from rlx import checkpoint, configs, trainer
from rlx.workdir import UnsafeLockFile, WorkdirBusy, WorkdirLock
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


def _plant_symlink(wd, target):
  os.symlink(target, wd / ".rlx.lock")


def _plant_dangling_symlink(wd, target):
  os.symlink(target.parent / "created_by_rlx", wd / ".rlx.lock")


def _plant_hard_link(wd, target):
  os.link(target, wd / ".rlx.lock")


@pytest.mark.parametrize("plant", [_plant_symlink, _plant_dangling_symlink, _plant_hard_link])
def test_a_linked_lock_file_is_refused_and_its_target_untouched(tmp_path, plant):
  # Regression (issue 37, N3): rlx opened WORKDIR/.rlx.lock following a symlink and truncated
  # the target, which may lie outside the workdir.
  outside = tmp_path / "outside"
  outside.mkdir()
  target = outside / "precious.txt"
  target.write_text("do not truncate me\n")
  wd = tmp_path / "wd"
  wd.mkdir()
  plant(wd, target)
  with pytest.raises(UnsafeLockFile) as info:
    trainer.run(runlocal_config(**{"mesh.data": 1}), str(wd), **QUIET)
  msg = str(info.value)
  assert "\n" not in msg
  assert f"the lock file {wd / '.rlx.lock'} is a " in msg and "never follows a link" in msg
  assert target.read_text() == "do not truncate me\n"
  assert sorted(os.listdir(outside)) == ["precious.txt"]  # a dangling link created nothing
  assert sorted(os.listdir(wd)) == [".rlx.lock"]  # nothing else was written


def test_a_symlinked_lock_file_is_one_line_from_the_cli(tmp_path):
  target = tmp_path / "precious.txt"
  target.write_text("keep\n")
  wd = tmp_path / "wd"
  wd.mkdir()
  os.symlink(target, wd / ".rlx.lock")
  out = subprocess.run(_cli(wd), capture_output=True, text=True, timeout=300, cwd=REPO,
                       env=_env())
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1].startswith(
      f"rlx: error: the lock file {wd / '.rlx.lock'} is a symbolic link (to {target})")
  assert "Traceback" not in out.stderr
  assert target.read_text() == "keep\n"


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


def _backtracking_length(seconds: float) -> int:
  """n such that re.match(r'(a+)+$', 'a' * n + 'b') holds the GIL for about `seconds` or more
  on this machine (each extra 'a' doubles the time): a stall that is long, but finite."""
  t0 = time.perf_counter()
  re.match(r"(a+)+$", "a" * 18 + "b")
  t = max(time.perf_counter() - t0, 1e-4)
  return min(40, 18 + max(1, math.ceil(math.log2(seconds / t))))


def test_a_reward_holding_the_gil_times_out_with_one_line(tmp_path):
  # A catastrophic regex runs in C holding the GIL: a reward thread in the trainer's process
  # would block the timeout check until it returned (here ~30 s, then the run went on).
  started = tmp_path / "started"
  _reward_module(tmp_path, f"""
      import os, re, time
      def slow(prompts, completions, **unused):
        if not os.path.exists({str(started)!r}):  # the first call only (the base evaluation)
          with open({str(started)!r}, "w") as f:
            f.write(repr(time.time()))
          re.match(r"(a+)+$", "a" * {_backtracking_length(30.0)} + "b")
        return [0.0] * len(prompts)
  """)
  with pytest.raises(trainer.RewardError, match=r"reward function 'user_rewards:slow' did not "
                     r"return within 1 s \(config.task.reward_timeout_s\)"):
    trainer.run(runlocal_config(**{"task.reward": "user_rewards:slow", "mesh.data": 1,
                                   "task.reward_timeout_s": 1.0, "eval_every": 100}),
                str(tmp_path / "wd"), **QUIET)
  assert time.time() - float(started.read_text()) < 10


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
  # The reward hangs in C code holding the GIL (catastrophic backtracking, hours): SIGTERM
  # still checkpoints and exits 75 at once.
  mods = tmp_path / "mods"
  mods.mkdir()
  (mods / "hang_reward.py").write_text(textwrap.dedent("""
      import os, re
      calls = 0
      def reward(prompts, completions, *, answer, **unused):
        global calls
        calls += 1
        if calls > int(os.environ["HANG_AFTER"]):  # eval scores 1 call, each step 1 more
          open(os.environ["HANG_MARKER"], "w").close()
          re.match(r"(a+)+$", "a" * 40 + "b")
        return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]
  """))
  wd, marker = tmp_path / "wd", tmp_path / "hanging"
  run = _Run(_cli(wd, "--config.task.reward=hang_reward:reward", "--config.eval_every=100",
                  "--config.total_steps=100", "--config.checkpoint_every=100"),
             tmp_path / "run.log",
             _env(path=[str(mods)], HANG_AFTER="3", HANG_MARKER=str(marker)))
  run.wait_for(marker.exists)
  rc = run.stop(timeout=60)
  err = run.stderr()
  assert rc == 75, err[-2000:]
  assert "stopped by SIGTERM after step 2" in err and "Traceback" not in err
  assert checkpoint.Checkpointer(str(wd)).latest_step() == 2


_SCRIPTED_REWARD = """
    import os, re, signal, time
    def scripted(prompts, completions, *, answer, **unused):
      # Call n (counted in a file, so across runs and processes) does $REWARD_CALL_<n>.
      log = os.environ["REWARD_LOG"]
      with open(log, "a") as f:
        f.write("call\\n")
      with open(log) as f:
        n = len(f.read().splitlines())
      action = os.environ.get(f"REWARD_CALL_{n}", "")
      if action == "sigterm_self":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
      if action == "hang":  # in C code holding the GIL, for hours
        open(log + ".hanging", "w").close()
        re.match(r"(a+)+$", "a" * 40 + "b")
      return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]
"""


def test_sigterm_during_a_reward_after_a_saved_step_exits_75(tmp_path, monkeypatch):
  # When the last finished step is already checkpointed (checkpoint_every=1, or the step a
  # run resumed from), a SIGTERM while the reward runs has nothing new to save: it used to
  # try to save that step again and exit 2 with a false "could not save the checkpoint".
  _reward_module(tmp_path, _SCRIPTED_REWARD)
  log = tmp_path / "reward_calls"
  monkeypatch.setenv("REWARD_LOG", str(log))
  monkeypatch.setenv("REWARD_CALL_4", "sigterm_self")  # calls: base eval, steps 1, 2, 3
  monkeypatch.setenv("REWARD_CALL_5", "hang")  # the first step after the resume
  wd = str(tmp_path / "wd")
  cfg = runlocal_config(**{"task.reward": "user_rewards:scripted", "mesh.data": 1,
                           "checkpoint_every": 1, "eval_every": 100, "total_steps": 100})
  already = (r"stopped by SIGTERM after step 2; checkpoint saved to .*checkpoints/2 \(already "
             r"saved before the signal\). Rerun the same command to resume.")
  finished = threading.Event()

  def sigterm_when_hanging():
    while not finished.wait(0.05):
      if os.path.exists(f"{log}.hanging"):
        os.kill(os.getpid(), signal.SIGTERM)
        return

  keep = signal.signal(signal.SIGTERM, lambda *a: None)  # a late signal must not end pytest
  sender = threading.Thread(target=sigterm_when_hanging, daemon=True)
  try:
    # The reward SIGTERMs its own process while scoring step 3 ...
    with pytest.raises(trainer.Preempted, match=already):
      trainer.run(cfg, wd, **QUIET)
    assert checkpoint.Checkpointer(wd).latest_step() == 2
    # ... and, resumed, an outside SIGTERM arrives while the reward scores the next step.
    sender.start()
    with pytest.raises(trainer.Preempted, match=already):
      trainer.run(cfg, wd, **QUIET)
    assert time.time() - os.path.getmtime(f"{log}.hanging") < 30
    assert checkpoint.Checkpointer(wd).latest_step() == 2
  finally:
    finished.set()
    signal.signal(signal.SIGTERM, keep)
  assert len(log.read_text().splitlines()) == 5


def test_a_reward_calling_os_exit_is_one_error_line_not_a_clean_exit(tmp_path):
  # os._exit(0) from a reward used to end the whole run with status 0 and no message.
  mods = tmp_path / "mods"
  mods.mkdir()
  (mods / "exit_reward.py").write_text(textwrap.dedent("""
      import os
      def quits(prompts, completions, **unused):
        os._exit(0)
  """))
  out = subprocess.run(_cli(tmp_path / "wd", "--config.task.reward=exit_reward:quits",
                            "--config.eval_every=100"),
                       capture_output=True, text=True, timeout=300, cwd=REPO,
                       env=_env(path=[str(mods)]))
  assert out.returncode == 2, out.stderr[-2000:]
  lines = [l for l in out.stderr.splitlines() if l.startswith("rlx: error:")]
  assert len(lines) == 1 and ("reward function 'exit_reward:quits' ended its worker process "
                              "(exit status 0" in lines[0]), out.stderr[-2000:]
  assert "Traceback" not in out.stderr


def test_sigterm_before_the_rl_loop_exits_75(tmp_path):
  wd = tmp_path / "wd"
  run = _Run(_cli(wd), tmp_path / "run.log", _env())
  run.wait_for((wd / "data").exists)  # set-up has begun (data preparation, then warm start)
  rc = run.stop()
  err = run.stderr()
  assert rc == 75, err[-2000:]
  assert "stopped by SIGTERM before the first RL step" in err and "Traceback" not in err
