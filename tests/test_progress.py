"""Progress output: "compiling" while the first step compiles, estimates from steady steps only,
plain lines (no carriage returns, no cursor movement) where stderr is not a terminal."""

import io
import re

import jax
import numpy as np
import pytest

from rlx import configs, progress, sft, trainer
from rlx.data.tokenizer import train_sentencepiece
from rlx.model.config import ModelConfig
from test_main import runlocal_config

ESCAPES = re.compile(r"\r|\x1b\[")  # what a terminal bar writes: carriage returns, [A, [K ...


class FakeClock:
  """time.perf_counter for rlx.progress: the first step compiles for 100 s, then 1 s a step."""

  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


@pytest.fixture
def clock(monkeypatch):
  c = FakeClock()
  monkeypatch.setattr(progress.time, "perf_counter", c)
  return c


def test_plain_lines_say_compiling_and_estimate_from_steady_steps(clock):
  out = io.StringIO()  # not a terminal
  bar = progress.Progress(10, desc="rl", file=out, interval_s=0)
  first = out.getvalue()
  assert first == "[rlx] rl: 0/10 steps; compiling the first step ...\n"  # before any step
  clock.t += 100.0  # compilation
  bar.update(1)
  for _ in range(3):
    clock.t += 1.0
    bar.update(1)
    bar.set_postfix({"reward": "0.500"})
  clock.t += 1.0
  bar.update(1)
  bar.close()
  lines = out.getvalue().splitlines()
  assert lines == [
      "[rlx] rl: 0/10 steps; compiling the first step ...",
      "[rlx] rl: 1/10 steps; the first took 100.0 s (compilation included)",
      "[rlx] rl: 2/10 steps (20%), 1.00 s/step, about 8.0 s left",  # not 8 x 50 s
      "[rlx] rl: 3/10 steps (30%), 1.00 s/step, about 7.0 s left; reward=0.500",
      "[rlx] rl: 4/10 steps (40%), 1.00 s/step, about 6.0 s left; reward=0.500",
      "[rlx] rl: 5/10 steps (50%), 1.00 s/step, about 5.0 s left; reward=0.500"]
  # Stopped early (a preemption), the last line says where; a line is never repeated.
  bar = progress.Progress(10, desc="rl", file=out, interval_s=30)
  clock.t += 100.0
  bar.update(1)
  clock.t += 1.0
  bar.update(1)
  bar.close()
  assert out.getvalue().splitlines()[-1] == (
      "[rlx] rl: 2/10 steps (20%), 1.00 s/step, 1 min 41 s in all")


def test_plain_lines_are_throttled_and_nested_loops_stay_quiet(clock):
  out = io.StringIO()
  bar = progress.Progress(1000, desc="warm start", file=out, interval_s=30)
  clock.t += 5.0
  bar.update(1)
  for _ in range(999):
    clock.t += 0.1
    bar.update(1)
  bar.close()
  lines = out.getvalue().splitlines()
  assert len(lines) == 2 + 3 + 1  # start, first step, one every 30 s of 100 s, the end
  assert lines[-1] == "[rlx] warm start: 1000/1000 steps (100%), 10.0 steps/s, 1 min 45 s in all"
  assert "about 1 min 10 s left" in lines[2]  # (1000 - 301) steps at 0.1 s, from steady steps
  # A quick evaluation whose programs are compiled prints nothing; a long one does.
  out = io.StringIO()
  with progress.Progress(3, desc="eval", unit="batch", leave=False, announce=False,
                         file=out, interval_s=30) as ev:
    for _ in range(3):
      clock.t += 1.0
      ev.update(1)
  assert out.getvalue() == ""
  with progress.Progress(3, desc="eval", unit="batch", leave=False, announce=False,
                         file=out, interval_s=30) as ev:
    for _ in range(3):
      clock.t += 20.0
      ev.update(1)
  assert out.getvalue().splitlines() == [
      "[rlx] eval: 2/3 batches (67%), 20.00 s/batch, about 20 s left",
      "[rlx] eval: 3/3 batches (100%), 20.00 s/batch, 1 min 0 s in all"]


class _Terminal(io.StringIO):

  def isatty(self):
    return True


def test_terminal_bar_says_compiling_then_times_steady_steps(clock, monkeypatch):
  import tqdm.std  # pylint: disable=g-import-not-at-top
  now = [1e9]
  monkeypatch.setattr(tqdm.std, "time", lambda: now[0])
  out = _Terminal()
  bar = progress.Progress(100, desc="rl", file=out)
  assert "rl (compiling the first step):   0%" in out.getvalue()
  now[0] += 3600.0  # an hour of compilation
  clock.t += 3600.0
  bar.update(1)
  for _ in range(9):
    now[0] += 2.0
    bar.update(1)
  bar.close()
  last = out.getvalue().rsplit("\r", 1)[-1]
  assert re.search(r"rl:  10%.*10/100 \[00:18<03:00,  2\.00s/step\]", last), last


def test_warm_start_writes_plain_lines_when_not_a_terminal(capsys, monkeypatch):
  """sft.train, as rlx.main runs it with stderr in a log file."""
  monkeypatch.setenv("RLX_PROGRESS_INTERVAL_S", "0")
  examples = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "teacher_answer": str(a + b),
               "difficulty": 1} for a, b in np.random.RandomState(0).randint(0, 99, (16, 2))]
  tok = train_sentencepiece([e["prompt"] + e["answer"] for e in examples], 24)
  cfg = ModelConfig(vocab_size=tok.vocab_size, num_layers=1, d_model=16, num_heads=2,
                    num_kv_heads=1, head_dim=8, mlp_dim=32)
  spec = configs.SFTSpec(steps=4, batch_size=4, lr=1e-3, warmup_steps=1, max_len=16,
                         level_weights=((1, 1.0),), batch_by_level=False)
  sft.train(spec, 0, cfg, tok, examples, show_progress=True)
  err = capsys.readouterr().err
  assert not ESCAPES.search(err), repr(err)
  lines = err.splitlines()
  assert lines[0] == "[rlx] warm start: 0/4 steps; compiling the first step ..."
  assert re.fullmatch(r"\[rlx\] warm start: 1/4 steps; the first took [\d.]+ s \(compilation "
                      r"included\)", lines[1]), lines
  assert re.fullmatch(r"\[rlx\] warm start: 4/4 steps \(100%\), .* in all; loss=[\d.]+",
                      lines[-1]), lines


def test_run_writes_plain_lines_when_not_a_terminal(tmp_path, capfd, monkeypatch):
  """A short RL run with stderr captured (not a terminal): the warm start, the first
  evaluation and the RL steps each say that they compile before they do, with no carriage
  returns or cursor movement (the nested evaluation bar's `[A`) anywhere."""
  monkeypatch.setenv("RLX_PROGRESS_INTERVAL_S", "0")
  config = runlocal_config(**{"total_steps": 2, "eval_every": 2, "checkpoint_every": 2,
                              "sft.steps": 2, "mesh.data": 1})
  trainer.run(config, str(tmp_path / "run"), show_progress=True, devices=jax.devices()[:1])
  out, err = capfd.readouterr()
  assert not ESCAPES.search(err) and not ESCAPES.search(out), repr(err)
  assert out.splitlines()[0].startswith("[rlx] task arithmetic: preparing its data in ")
  lines = err.splitlines()
  for desc, unit in (("warm start", "step"), ("eval", "batch"), ("rl", "step")):
    start = next(i for i, l in enumerate(lines) if l.startswith(f"[rlx] {desc}: "))
    assert re.fullmatch(rf"\[rlx\] {desc}: 0/\d+ {unit}e?s; compiling the first {unit} \.\.\.",
                        lines[start]), lines
  rl = [l for l in lines if l.startswith("[rlx] rl: ")]
  assert rl[0] == "[rlx] rl: 0/2 steps; compiling the first step ..."
  assert re.fullmatch(r"\[rlx\] rl: 1/2 steps; the first took [\d.]+ s \(compilation "
                      r"included\)", rl[1]), rl
  assert re.fullmatch(r"\[rlx\] rl: 2/2 steps \(100%\), .* in all; .*eval=[\d.]+.*", rl[-1]), rl
