"""rlx.report on a synthetic 20-step run with the trainer's metric keys: every PNG is written and
readable, the summary states the numbers, and missing keys are skipped with a note."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rlx import report
from rlx.metrics import MetricsWarning

# synthetic_run ends with a torn line, as after a crash; its warning is checked where it matters.
pytestmark = pytest.mark.filterwarnings("ignore::rlx.metrics.MetricsWarning")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LEVELS = (2, 3, 4)
BAND = (3, 4)


def synthetic_run(workdir, steps=20, *, selection=True, replay=True, eval_every=5):
  """metrics.jsonl, eval_base.json and config.json as rlx.trainer writes them."""
  rng = np.random.default_rng(0)
  os.makedirs(workdir, exist_ok=True)
  base = {"eval/accuracy": 0.4, "eval/accuracy_d2": 0.9, "eval/accuracy_d3": 0.3,
          "eval/accuracy_d4": 0.1, "eval/band_accuracy": 0.2}
  lines = [{"step": 0, **base}]
  for step in range(1, steps + 1):
    frac = step / steps
    gen = 161.0 + rng.integers(-10, 10)
    zero_adv = float(np.clip(0.8 - 0.5 * frac + rng.normal(0, 0.05), 0, 1))
    m = {"step": step, "grad_norm": 0.3, "reward/mean": 0.2 + 0.5 * frac + rng.normal(0, 0.05),
         "reward/pass_at_group": 0.5 + 0.4 * frac,
         "ledger/tokens_generated": gen, "ledger/tokens_trained": gen * (1 - zero_adv),
         "ledger/tokens_zero_adv": gen * zero_adv, "ledger/zero_adv_group_frac": zero_adv,
         "ledger/response_len_mean": 6.7 - 1.5 * frac, "ledger/truncated_frac": 0.7 * (1 - frac),
         "loss/policy": 0.01, "time/generate_s": 10.9 if step == 1 else 0.02 + 0.002 * frac,
         "time/update_s": 6.6 if step == 1 else 0.01, "ledger/generated_tokens_per_s": 9000.0}
    m["time/step_s"] = m["time/generate_s"] + m["time/update_s"]
    if replay:
      m["ledger/tokens_replayed"] = 0.0 if step < 3 else 80.0
    if selection:
      centre = 2 + round(2 * frac)
      for b, label in enumerate(("0.0-0.2", "0.2-0.4", "0.4-0.6", "0.6-0.8", "0.8-1.0")):
        m[f"select/pass_rate_hist_{label}"] = float(max(0, 4 - 2 * abs(b - centre)))
    if step % eval_every == 0:
      for level, b in zip(LEVELS, (0.9, 0.3, 0.1)):
        m[f"eval/accuracy_d{level}"] = min(1.0, b + 0.4 * frac)
      m["eval/band_accuracy"] = float(np.mean([m[f"eval/accuracy_d{l}"] for l in BAND]))
    lines.append(m)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for m in lines:
      f.write(json.dumps(m) + "\n")
    f.write('{"step": 21, "reward/me')  # a torn last line, as after a crash
  with open(os.path.join(workdir, "eval_base.json"), "w") as f:
    json.dump(base, f)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"task": {"name": "arithmetic", "band": list(BAND)},
               "rl": {"prompts_per_step": 4, "group_size": 4, "advantage": "grpo"},
               "sampler": {"max_new_tokens": 8}}, f)
  return lines


def check_png(path):
  from PIL import Image
  with open(path, "rb") as f:
    assert f.read(8) == PNG_SIGNATURE, path
  with Image.open(path) as im:
    im.load()
    width, height = im.size
    assert width > 100 and height > 100, (path, im.size)
    # Not blank: a plot has many distinct colours.
    assert len(set(im.convert("RGB").getdata())) > 20, path


@pytest.fixture(scope="module")
def full_report(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("run"))
  synthetic_run(workdir)
  with pytest.warns(MetricsWarning, match=r"skipped 1 unreadable line \(line 22\)"):
    return workdir, report.make_report(workdir)  # the torn last line is skipped


def test_every_plot_is_a_valid_png(full_report):
  _, rep = full_report
  assert sorted(rep.plots) == sorted(report.PLOTS)
  assert rep.notes == []
  for path in rep.plots.values():
    check_png(path)


def test_summary_states_the_headline_numbers(full_report):
  workdir, rep = full_report
  text = open(os.path.join(workdir, "report", "summary.txt")).read()
  assert text == rep.summary
  assert "steps: 20" in text
  # Band: before 20% (eval_base.json), after mean(0.3+0.4, 0.1+0.4) = 60% at step 20.
  assert "held-out accuracy on the band (levels 3, 4): 20.0% before RL -> 60.0% at step 20 " \
         "(+40.0 points)" in text
  with pytest.warns(MetricsWarning):
    s = report.summarize(report.load_run(workdir))
  lines = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))
           if l.rstrip().endswith("}")]
  assert s["tokens_generated"] == sum(l.get("ledger/tokens_generated", 0) for l in lines)
  assert s["median_step_s"] == pytest.approx(np.median(
      [l["time/generate_s"] + l["time/update_s"] for l in lines[2:]]))  # step 1 left out
  assert 0.6 < s["generation_share"] < 0.75
  assert f"tokens generated: {s['tokens_generated'] / 1e3:.1f}k" in text
  assert "replayed: 1.4k" in text


def test_missing_keys_skip_plots_with_a_note(tmp_path):
  synthetic_run(str(tmp_path), steps=6, selection=False, replay=False, eval_every=3)
  rep = report.make_report(str(tmp_path), str(tmp_path / "out"))
  assert "pass_rate" not in rep.plots and "tokens" in rep.plots
  assert any("pass_rate.png skipped: no select/pass_rate_hist_*" in n for n in rep.notes)
  assert "note: pass_rate.png skipped" in rep.summary
  assert "replayed" not in rep.summary


def test_cli_prints_summary_and_fails_clearly_without_metrics(tmp_path):
  synthetic_run(str(tmp_path / "run"), steps=3, selection=False, eval_every=3)
  env = {**os.environ, "MPLBACKEND": "Agg"}
  out = subprocess.run([sys.executable, "-m", "rlx.report", str(tmp_path / "run"), "--out",
                        str(tmp_path / "plots")], capture_output=True, text=True, timeout=60,
                       env=env)
  assert out.returncode == 0, out.stderr
  assert "held-out accuracy on the band" in out.stdout
  assert os.path.exists(tmp_path / "plots" / "reward.png")
  out = subprocess.run([sys.executable, "-m", "rlx.report", str(tmp_path / "nothing")],
                       capture_output=True, text=True, timeout=60, env=env)
  assert out.returncode == 2
  assert "metrics.jsonl does not exist; expected the WORKDIR of an rlx run" in out.stderr
  (tmp_path / "odd" / "metrics.jsonl").mkdir(parents=True)
  out = subprocess.run([sys.executable, "-m", "rlx.report", str(tmp_path / "odd")],
                       capture_output=True, text=True, timeout=60, env=env)
  assert out.returncode == 2
  assert out.stderr == (f"rlx.report: error: {tmp_path / 'odd' / 'metrics.jsonl'} is a directory; "
                        f"expected the metrics.jsonl file of an rlx run (move the directory "
                        f"away).\n")


def test_a_corrupt_line_in_the_middle_loses_only_itself(tmp_path):
  lines = synthetic_run(str(tmp_path), steps=6, eval_every=3)
  path = tmp_path / "metrics.jsonl"
  text = path.read_text().splitlines(keepends=True)
  path.write_text("".join(text[:2] + ["\x00\x00garbage\n"] + text[2:]))
  with pytest.warns(MetricsWarning, match=r"skipped 2 unreadable lines \(lines 3, 9\)"):
    run = report.load_run(str(tmp_path))
  assert [l["step"] for l in run.lines] == [l["step"] for l in lines] == list(range(7))


def test_fused_step_runs_do_not_claim_a_generation_share(tmp_path):
  synthetic_run(str(tmp_path), steps=4, eval_every=2)
  cfg = json.load(open(tmp_path / "config.json"))
  json.dump({**cfg, "fused_step": True}, open(tmp_path / "config.json", "w"))
  rep = report.make_report(str(tmp_path))
  assert "(fused step: generation and update not timed apart)" in rep.summary
  assert report.summarize(report.load_run(str(tmp_path)))["generation_share"] is None
