"""Never lose a run: exact resume after SIGKILL (mid-step, mid-save), SIGTERM preemption,
numeric guards, and a 2-process run equal to one process with 8 devices."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import trainer
from rlx import update as update_lib
from rlx.checkpoint import read_arrays
from rlx.metrics import read_jsonl
from test_main import ARITH, REPO, runlocal_config

TIMING = ("time/", "ledger/generated_tokens_per_s")


def cli(workdir, *flags, env=None, **kw):
  cmd = [sys.executable, "-m", "rlx.main", f"--config={ARITH}:runlocal", f"--workdir={workdir}",
         *flags]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                        env={**os.environ, **(env or {})}, **kw)


def comparable(lines):
  return [{k: v for k, v in l.items() if not k.startswith(TIMING)} for l in lines]


def test_sigkill_mid_step_and_mid_save_then_resume_equals_uninterrupted(tmp_path):
  # Replay ring and prompt selector on: their device state must come back bitwise too. 400
  # warm-start steps give the tiny model some correct answers, so updates really change it.
  flags = ["--config.total_steps=6", "--config.checkpoint_every=1", "--config.keep_checkpoints=3",
           "--config.eval_every=3", "--cpu_devices=1", "--config.sft.steps=400",
           "--config.replay.enabled=True", "--config.replay.num_samples=8",
           "--config.selection.mode=band"]
  ref, run = tmp_path / "ref", tmp_path / "killed"
  assert cli(ref, *flags).returncode == 0
  flags.append(f"--config.warm_start.dir={ref / 'base'}")
  # Killed while step 2 is between its rollout and its update ...
  out = cli(run, *flags, env={"RLX_FAULT": "kill_after_rollout:2"})
  assert out.returncode == -signal.SIGKILL
  # ... then, after resuming, right after the save of step 4 started.
  out = cli(run, *flags, env={"RLX_FAULT": "kill_in_save:4"})
  assert out.returncode == -signal.SIGKILL
  out = cli(run, *flags)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "resumed from" in out.stdout
  a, b = read_arrays(str(ref), 6), read_arrays(str(run), 6)
  assert int(np.asarray(a["replay"]["valid"]).sum()) > 0 and int(
      np.asarray(a["selector"]["visits"]).sum()) > 0
  assert sum(l.get("grad_norm", 0.0) > 0 for l in read_jsonl(ref / "metrics.jsonl")) >= 3
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  assert comparable(read_jsonl(run / "metrics.jsonl")) == comparable(
      read_jsonl(ref / "metrics.jsonl"))


def test_sigterm_saves_a_checkpoint_and_says_how_to_resume(tmp_path):
  wd = tmp_path / "run"
  proc = subprocess.Popen(
      [sys.executable, "-m", "rlx.main", f"--config={ARITH}:runlocal", f"--workdir={wd}",
       "--config.total_steps=1000", "--config.checkpoint_every=500", "--cpu_devices=1"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
  metrics = wd / "metrics.jsonl"
  deadline = time.time() + 240
  while time.time() < deadline and not (metrics.exists() and len(metrics.read_text()
                                                                  .splitlines()) >= 4):
    time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 75, err[-2000:]
  step = read_jsonl(metrics)[-1]["step"]
  assert f"stopped by SIGTERM after step {step}; checkpoint saved to" in err
  assert "Rerun the same command to resume." in err
  assert (wd / "checkpoints" / str(step)).is_dir()
  assert "Traceback" not in err


def test_nonfinite_updates_are_skipped_and_stop_the_run(tmp_path, monkeypatch):
  # A loss term that is 0 in the forward pass but has a NaN gradient (the where-sqrt trap)
  # makes every gradient non-finite while the loss stays finite: each update is skipped
  # (params unchanged) and after guard.max_consecutive_skips steps the run stops with a
  # clear error.
  real = update_lib.policy_loss

  def nan_gradient_loss(logp, *args, **kwargs):
    loss, metrics = real(logp, *args, **kwargs)
    trap = jnp.where(logp > 1e30, jnp.sqrt(-1.0 - jnp.abs(logp)), 0.0)  # log-probs are <= 0
    return loss + trap.sum(), metrics
  monkeypatch.setattr(update_lib, "policy_loss", nan_gradient_loss)  # the update's loss
  with pytest.raises(trainer.NumericError, match=r"3 consecutive steps \(up to step 3\) had a "
                     r"non-finite loss or gradient"):
    trainer.run(runlocal_config(**{"mesh.data": 1}), str(tmp_path),
                log=lambda s: None, show_progress=False, devices=jax.devices()[:1])
  lines = read_jsonl(tmp_path / "metrics.jsonl")
  assert [l["guard/skipped_updates"] for l in lines[1:]] == [1.0, 1.0, 1.0]
  assert all(math.isfinite(l["loss/policy"]) for l in lines[1:])  # the gradient tripped it


def test_out_of_range_rewards_name_the_task_and_example(tmp_path):
  with pytest.raises(trainer.NumericError, match=r"task 'arithmetic': reward 0.0 for train "
                     r"example \d+ \(prompt '\d+\+\d+='\) is non-finite or outside \[2.0, 3.0\]"):
    trainer.run(runlocal_config(**{"guard.reward_range": (2.0, 3.0), "mesh.data": 1}),
                str(tmp_path), log=lambda s: None, show_progress=False,
                devices=jax.devices()[:1])


def test_two_processes_equal_one_process_with_eight_devices(tmp_path):
  # 400 warm-start steps: the tiny model answers some prompts, so the updates are not zero.
  flags = ["--config.total_steps=3", "--config.eval_every=3", "--config.checkpoint_every=3",
           "--config.sft.steps=400"]
  one = cli(tmp_path / "one", *flags, "--cpu_devices=8")
  assert one.returncode == 0, one.stderr[-2000:]
  # The same warm start for both (400 SFT steps amplify reduction-order differences to ~3e-6),
  # so the comparison is of the RL steps across processes.
  flags.append(f"--config.warm_start.dir={tmp_path / 'one' / 'base'}")
  port = 20000 + os.getpid() % 20000
  procs = [subprocess.Popen(
      [sys.executable, "-m", "rlx.main", f"--config={ARITH}:runlocal",
       f"--workdir={tmp_path / 'two'}", *flags, "--cpu_devices=4",
       f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO) for i in range(2)]
  for p in procs:
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
  a, b = read_arrays(str(tmp_path / "one"), 3), read_arrays(str(tmp_path / "two"), 3)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  la, lb = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(
      tmp_path / "two" / "metrics.jsonl")
  assert [l["step"] for l in lb] == [0, 1, 2, 3]
  assert any(l.get("grad_norm", 0.0) > 0 for l in la)
  for x, y in zip(la, lb):
    for k in ("reward/mean", "ledger/tokens_generated", "eval/band_accuracy"):
      if k in x:
        assert x[k] == y[k], k
  # Only process 0 wrote metrics; the checkpoint holds every process's shards.
  assert json.loads((tmp_path / "two" / "config.json").read_text())["total_steps"] == 3
