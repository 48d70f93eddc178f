r"""Plots and a text summary of one run, from its WORKDIR.

  python -m rlx.report WORKDIR [--out DIR]      # default DIR: WORKDIR/report

Reads WORKDIR/metrics.jsonl (and WORKDIR/eval_base.json, WORKDIR/config.json when present) and
writes PNGs (matplotlib, Agg; no display needed):

  reward.png          mean reward per step, raw and smoothed
  accuracy.png        held-out greedy accuracy by difficulty (eval/accuracy_d*) and on the band
  response_length.png mean response length (tokens) and the share of truncated responses
  time.png            seconds per step in generation and update (stacked)
  tokens.png          cumulative tokens: generated, trained, in zero-advantage rows, replayed
  pass_rate.png       pass-rate histogram of the chosen prompts (select/pass_rate_hist_<bin>)
  timeline.png        overlap mode (config.pipeline) only: when each sub-mesh computed
                      (generator and learner busy intervals from the pipeline's dispatch and
                      ready timestamps) over the last steps, each sub-mesh's idle share, and
                      the staleness of the rows trained on
  summary.txt         steps, band accuracy before/after, tokens, median step time, generation
                      share (also printed)

A plot whose metrics are missing is skipped with a note in the summary (older runs, or features
turned off); the report never fails on a missing key.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from typing import Any, Sequence

import numpy as np

from rlx.metrics import read_metrics, show_warnings_as

PLOTS = ("reward", "accuracy", "response_length", "time", "tokens", "pass_rate")
OPTIONAL_PLOTS = ("timeline",)  # drawn when the run has what they show (no note otherwise)
_ACC_KEY = re.compile(r"^eval/accuracy_d(\d+)$")
_HIST_KEY = re.compile(r"^select/pass_rate_hist_(.+)$")


# ---- reading a run ---------------------------------------------------------------------------


def _number(v: Any) -> float | None:
  if isinstance(v, bool):
    return float(v)
  if isinstance(v, (int, float)):
    return float(v)
  if isinstance(v, str) and v.strip().lower() in ("nan", "inf", "-inf", "infinity",
                                                  "-infinity"):
    return float(v)  # metrics.jsonl writes non-finite floats as strings
  return None


def _read_json(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    return data if isinstance(data, dict) else None
  except (OSError, json.JSONDecodeError):
    return None


@dataclasses.dataclass
class Run:
  workdir: str
  lines: list[dict]
  base_eval: dict | None
  config: dict | None

  def series(self, key: str, *, train_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the lines that have a numeric `key`."""
    steps, values = [], []
    for line in self.lines:
      if train_only and line["step"] == 0:
        continue
      v = _number(line.get(key))
      if v is not None:
        steps.append(line["step"])
        values.append(v)
    return np.asarray(steps, np.int64), np.asarray(values, np.float64)

  def keys(self) -> set[str]:
    return set().union(*(l.keys() for l in self.lines)) if self.lines else set()

  @property
  def band(self) -> tuple[int, ...]:
    try:
      return tuple(int(l) for l in self.config["task"]["band"])
    except (TypeError, KeyError, ValueError):
      return ()


def load_run(workdir: str) -> Run:
  return Run(workdir=workdir, lines=read_metrics(os.path.join(workdir, "metrics.jsonl")),
             base_eval=_read_json(os.path.join(workdir, "eval_base.json")),
             config=_read_json(os.path.join(workdir, "config.json")))


# ---- numbers for the summary (also used by rlx.sweep) ----------------------------------------


def band_accuracy_before_after(run: Run) -> tuple[float | None, float | None, int | None]:
  """(before, after, step of after) of eval/band_accuracy; None where unknown."""
  steps, acc = run.series("eval/band_accuracy")
  before = _number((run.base_eval or {}).get("eval/band_accuracy"))
  if before is None and len(steps) and steps[0] == 0:
    before = float(acc[0])
  after_mask = steps > 0
  if not after_mask.any():
    return before, None, None
  return before, float(acc[after_mask][-1]), int(steps[after_mask][-1])


def _overlap(run: Run) -> bool:
  """config.pipeline.mode == 'overlap': the step's wall time is time/step_s (generation and
  update ran at once)."""
  return "pipeline/gen_start" in run.keys()


def _fused(run: Run) -> bool:
  """config.fused_step: one jitted step, timed whole (logged as generation, update 0)."""
  return bool((run.config or {}).get("fused_step"))


def summarize(run: Run) -> dict[str, Any]:
  """The headline numbers of a run (None where the metrics are missing)."""
  train_steps = [l["step"] for l in run.lines if l["step"] > 0]
  before, after, after_step = band_accuracy_before_after(run)
  _, gen_tok = run.series("ledger/tokens_generated", train_only=True)
  _, gen_s = run.series("time/generate_s", train_only=True)
  _, upd_s = run.series("time/update_s", train_only=True)
  _, reward = run.series("reward/mean", train_only=True)
  out: dict[str, Any] = {
      "steps": max(train_steps) if train_steps else 0,
      "band_accuracy_before": before, "band_accuracy_after": after,
      "band_accuracy_after_step": after_step,
      "gain_points": (100 * (after - before) if before is not None and after is not None
                      else None),
      "tokens_generated": float(gen_tok.sum()) if len(gen_tok) else None,
      "reward_first": float(reward[0]) if len(reward) else None,
      "reward_last": float(reward[-1]) if len(reward) else None,
      "median_step_s": None, "generation_share": None,
  }
  for key, name in (("ledger/tokens_trained", "tokens_trained"),
                    ("ledger/tokens_zero_adv", "tokens_zero_adv"),
                    ("ledger/tokens_discarded", "tokens_discarded"),
                    ("ledger/tokens_replayed", "tokens_replayed")):
    _, v = run.series(key, train_only=True)
    out[name] = float(v.sum()) if len(v) else None
  n = min(len(gen_s), len(upd_s))
  _, step_s = run.series("time/step_s", train_only=True)
  if n and _overlap(run) and len(step_s):
    out["median_step_s"] = float(np.median(step_s[1:] if len(step_s) > 1 else step_s))
    _, gi = run.series("pipeline/gen_idle_s", train_only=True)
    _, li = run.series("pipeline/learn_idle_s", train_only=True)
    _, ov = run.series("pipeline/overlap_frac", train_only=True)
    k = slice(2, None) if len(gi) > 3 else slice(None)  # two compiling steps left out
    out["generator_idle_share"] = float(gi[k].sum() / max((gi[k] + gen_s[:len(gi)][k]).sum(),
                                                          1e-12))
    out["learner_idle_share"] = float(li[k].sum() / max((li[k] + upd_s[:len(li)][k]).sum(),
                                                        1e-12))
    out["overlap_frac"] = float(np.median(ov[k])) if len(ov) else None
  elif n:
    # The first step of a process includes compilation: leave it out when there are others.
    gen_s, upd_s = gen_s[:n], upd_s[:n]
    if n > 1:
      gen_s, upd_s = gen_s[1:], upd_s[1:]
    total = gen_s + upd_s
    out["median_step_s"] = float(np.median(total))
    if total.sum() > 0 and not _fused(run):
      out["generation_share"] = float(gen_s.sum() / total.sum())
  return out


def _pct(x: float | None) -> str:
  return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _tokens(x: float | None) -> str:
  if x is None:
    return "n/a"
  return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def summary_text(run: Run, notes: Sequence[str] = ()) -> str:
  s = summarize(run)
  cfg = run.config or {}
  lines = [f"rlx run {run.workdir}"]
  rl = cfg.get("rl", {}) if isinstance(cfg.get("rl"), dict) else {}
  if rl:
    lines.append(f"  config: task {cfg.get('task', {}).get('name', '?')}, "
                 f"{rl.get('prompts_per_step', '?')} prompts x {rl.get('group_size', '?')} "
                 f"samples per step, advantage {rl.get('advantage', '?')}")
  lines.append(f"  steps: {s['steps']}")
  band = f" (levels {', '.join(map(str, run.band))})" if run.band else ""
  gain = f" ({s['gain_points']:+.1f} points)" if s["gain_points"] is not None else ""
  at = f" at step {s['band_accuracy_after_step']}" if s["band_accuracy_after_step"] else ""
  lines.append(f"  held-out accuracy on the band{band}: {_pct(s['band_accuracy_before'])} "
               f"before RL -> {_pct(s['band_accuracy_after'])}{at}{gain}")
  if s["reward_first"] is not None:
    lines.append(f"  mean reward: {s['reward_first']:.3f} (first step) -> "
                 f"{s['reward_last']:.3f} (last step)")
  tok = f"  tokens generated: {_tokens(s['tokens_generated'])}"
  if s["tokens_trained"] is not None:
    tok += f"; trained on: {_tokens(s['tokens_trained'])}"
  if s["tokens_zero_adv"] is not None and s["tokens_generated"]:
    tok += (f"; with zero advantage: {_tokens(s['tokens_zero_adv'])} "
            f"({_pct(s['tokens_zero_adv'] / s['tokens_generated'])})")
  if s["tokens_discarded"]:
    tok += f"; discarded by dynamic filtering: {_tokens(s['tokens_discarded'])}"
  if s["tokens_replayed"]:
    tok += f"; replayed: {_tokens(s['tokens_replayed'])}"
  lines.append(tok)
  if s.get("generator_idle_share") is not None:
    lines.append(f"  median step: {s['median_step_s']:.3f} s wall with generation and update "
                 f"overlapped (median overlap {_pct(s['overlap_frac'])} of each generation); "
                 f"idle: generator sub-mesh {_pct(s['generator_idle_share'])}, learner "
                 f"{_pct(s['learner_idle_share'])} (compiling steps left out)")
  elif s["median_step_s"] is not None:
    split = (f", of which generation {_pct(s['generation_share'])} of the time"
             if s["generation_share"] is not None else
             " (fused step: generation and update not timed apart)" if _fused(run) else "")
    lines.append(f"  median step: {s['median_step_s']:.3f} s{split} (first step, with "
                 f"compilation, left out)")
  else:
    lines.append("  step times: n/a (no time/generate_s, time/update_s)")
  for note in notes:
    lines.append(f"  note: {note}")
  return "\n".join(lines) + "\n"


# ---- plots -----------------------------------------------------------------------------------


def _figure(nrows: int = 1, height: float = 4.0, sharex: bool = True):
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(7.5, height * nrows), dpi=110, layout="constrained")
  axes = fig.subplots(nrows, 1, sharex=sharex, squeeze=False)[:, 0]
  for ax in axes:
    ax.grid(True, alpha=0.3)
  return fig, axes


def _save(fig, path: str) -> str:
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  FigureCanvasAgg(fig)
  fig.savefig(path)
  return path


def ema(values: np.ndarray, span: int) -> np.ndarray:
  """Debiased exponential moving average (as TensorBoard's smoothing), ~`span` steps."""
  w = 1 - 2 / (span + 1)
  out, acc, norm = np.empty_like(values), 0.0, 0.0
  for i, v in enumerate(values):
    acc = w * acc + (1 - w) * v
    norm = w * norm + (1 - w)
    out[i] = acc / norm
  return out


def _integer_steps(ax) -> None:
  from matplotlib.ticker import MaxNLocator  # pylint: disable=g-import-not-at-top
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_reward(run: Run, path: str) -> str | None:
  steps, reward = run.series("reward/mean", train_only=True)
  if not len(steps):
    return None
  fig, (ax,) = _figure()
  span = max(3, len(steps) // 10)
  ax.plot(steps, reward, color="tab:blue", alpha=0.35, lw=1, marker="." if len(steps) <= 50
          else None, label="mean reward (per step)")
  ax.plot(steps, ema(reward, span), color="tab:blue", lw=2.2,
          label=f"smoothed (EMA over ~{span} steps)")
  p_steps, pass_group = run.series("reward/pass_at_group", train_only=True)
  if len(p_steps):
    ax.plot(p_steps, ema(pass_group, span), color="tab:green", lw=1.5, ls="--",
            label="share of groups with a positive reward (smoothed)")
  ax.set_title("Reward during RL")
  ax.set_xlabel("RL step")
  ax.set_ylabel("reward (mean over the step's rollouts)")
  _integer_steps(ax)
  ax.legend(loc="best", fontsize=8)
  return _save(fig, path)


def plot_accuracy(run: Run, path: str) -> str | None:
  levels = sorted({int(m.group(1)) for k in run.keys() if (m := _ACC_KEY.match(k))})
  if not levels:
    return None
  base = run.base_eval or {}
  fig, (ax,) = _figure()
  cmap_colors = ["tab:green", "tab:orange", "tab:red", "tab:purple", "tab:brown", "tab:pink",
                 "tab:olive", "tab:cyan", "tab:blue", "tab:gray"]
  band = set(run.band)
  for i, level in enumerate(levels):
    steps, acc = run.series(f"eval/accuracy_d{level}")
    b = _number(base.get(f"eval/accuracy_d{level}"))
    if b is not None and (not len(steps) or steps[0] != 0):
      steps, acc = np.concatenate([[0], steps]), np.concatenate([[b], acc])
    in_band = level in band
    ax.plot(steps, 100 * acc, marker="o", ms=4, lw=1.8 if in_band else 1.2,
            ls="-" if in_band else ":", color=cmap_colors[i % len(cmap_colors)],
            label=f"difficulty {level}" + (" (band)" if in_band else ""))
  steps, acc = run.series("eval/band_accuracy")
  if len(steps):
    label = f"band mean (difficulty {', '.join(map(str, sorted(band)))})" if band else \
        "band mean"
    ax.plot(steps, 100 * acc, color="black", lw=2.5, marker="s", ms=5, label=label)
  ax.axvline(0, color="gray", lw=0.8)
  ax.annotate("before RL", (0, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12),
              textcoords="offset points", fontsize=8, color="gray")
  ax.set_ylim(-3, 103)
  ax.set_title("Held-out greedy accuracy by difficulty")
  ax.set_xlabel("RL step (0 = base model)")
  ax.set_ylabel("accuracy (%)")
  _integer_steps(ax)
  ax.legend(loc="best", fontsize=8)
  return _save(fig, path)


def plot_response_length(run: Run, path: str) -> str | None:
  steps, length = run.series("ledger/response_len_mean", train_only=True)
  t_steps, trunc = run.series("ledger/truncated_frac", train_only=True)
  if not len(steps) and not len(t_steps):
    return None
  fig, (ax1, ax2) = _figure(2, height=2.6)
  if len(steps):
    ax1.plot(steps, length, color="tab:purple", marker="." if len(steps) <= 50 else None,
             label="mean response length")
    cfg_max = ((run.config or {}).get("sampler") or {}).get("max_new_tokens")
    if cfg_max:
      ax1.axhline(cfg_max, color="gray", ls="--", lw=1,
                  label=f"maximum (sampler.max_new_tokens = {cfg_max})")
    ax1.legend(loc="best", fontsize=8)
  ax1.set_ylabel("length (tokens)")
  ax1.set_title("Response length")
  if len(t_steps):
    ax2.plot(t_steps, 100 * trunc, color="tab:red", marker="." if len(t_steps) <= 50 else None,
             label="responses cut at the maximum length")
    ax2.legend(loc="best", fontsize=8)
  ax2.set_ylim(-3, 103)
  ax2.set_ylabel("truncated (%)")
  ax2.set_xlabel("RL step")
  _integer_steps(ax2)
  return _save(fig, path)


def plot_time(run: Run, path: str) -> str | None:
  g_steps, gen = run.series("time/generate_s", train_only=True)
  u_steps, upd = run.series("time/update_s", train_only=True)
  if not len(g_steps) or not len(u_steps):
    return None
  upd_by_step = dict(zip(u_steps.tolist(), upd.tolist()))
  steps = g_steps
  upd = np.asarray([upd_by_step.get(s, 0.0) for s in steps.tolist()])
  total = gen + upd
  typical = float(np.percentile(total[1:] if len(total) > 2 else total, 95))
  # Steps of a few milliseconds read better in ms.
  scale, unit = (1000.0, "ms") if 0 < typical < 0.5 else (1.0, "s")
  gen, upd, total = gen * scale, upd * scale, total * scale
  typical *= scale
  fig, (ax,) = _figure()
  width = 0.8 if len(steps) < 2 else 0.8 * float(np.min(np.diff(steps)))
  ax.bar(steps, gen, width=width, color="tab:orange",
         label="whole step (fused: not split)" if _fused(run) else "generation (rollouts)")
  ax.bar(steps, upd, width=width, bottom=gen, color="tab:blue", label="update (gradient steps)")
  # The first step includes compilation; do not let it squash the others.
  if len(total) > 2 and total[0] > 3 * typical > 0:
    top = 1.6 * typical
    ax.set_ylim(0, top)
    ax.annotate(f"step {steps[0]}: {total[0] / scale:.1f} s in all (includes compilation;\n"
                f"generation {gen[0] / scale:.1f} s, update {upd[0] / scale:.1f} s; bar cut "
                f"off)", (steps[0], top), xytext=(30, -10), textcoords="offset points",
                fontsize=8, va="top",
                bbox=dict(boxstyle="round", fc="white", ec="gray", alpha=0.9),
                arrowprops=dict(arrowstyle="->", color="gray"))
  share = summarize(run)["generation_share"]
  title = "Time per step"
  if share is not None:
    title += f" (generation {100 * share:.0f}% of the time after step {steps[0]})"
  ax.set_title(title)
  ax.set_xlabel("RL step")
  ax.set_ylabel(f"wall-clock time ({unit})")
  _integer_steps(ax)
  ax.legend(loc="upper right", fontsize=8)
  return _save(fig, path)


def plot_tokens(run: Run, path: str) -> str | None:
  curves = [("ledger/tokens_generated", "generated", "tab:orange", "-"),
            ("ledger/tokens_trained", "trained on (fresh + replayed)", "tab:blue", "-"),
            ("ledger/tokens_zero_adv", "in zero-advantage rows (no gradient signal)",
             "tab:red", "--"),
            ("ledger/tokens_discarded", "discarded by dynamic filtering", "tab:brown", ":"),
            ("ledger/tokens_replayed", "replayed from the buffer", "tab:green", "-.")]
  present = []
  for key, label, color, ls in curves:
    steps, v = run.series(key, train_only=True)
    # Features that were off log zeros (replay, dynamic filtering): leave them out.
    if len(steps) and (key in ("ledger/tokens_generated", "ledger/tokens_trained") or
                       np.any(v != 0)):
      present.append((steps, np.cumsum(v), label, color, ls))
  if not present:
    return None
  fig, (ax,) = _figure()
  for steps, cum, label, color, ls in present:
    ax.plot(steps, cum, color=color, ls=ls, lw=2, label=f"{label}: {_tokens(cum[-1])}")
  ax.set_title("Token ledger (cumulative over the run)")
  ax.set_xlabel("RL step")
  ax.set_ylabel("tokens (cumulative)")
  ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
  _integer_steps(ax)
  ax.legend(loc="upper left", fontsize=8)
  return _save(fig, path)


def _bin_value(label: str) -> float:
  try:
    return float(label.split("_")[0].split("-")[0])
  except ValueError:
    return math.inf


def plot_pass_rate(run: Run, path: str) -> str | None:
  bins = sorted({m.group(1) for k in run.keys() if (m := _HIST_KEY.match(k))}, key=_bin_value)
  if not bins:
    return None
  train = [l for l in run.lines if l["step"] > 0 and
           any(f"select/pass_rate_hist_{b}" in l for b in bins)]
  counts = np.asarray([[_number(l.get(f"select/pass_rate_hist_{b}")) or 0.0 for b in bins]
                       for l in train])
  steps = [l["step"] for l in train]
  fig, (ax1, ax2) = _figure(2, height=3.0, sharex=False)
  x = np.arange(len(bins))
  total = counts.sum(axis=0)
  quarter = counts[-max(1, len(counts) // 4):].sum(axis=0)
  ax1.bar(x - 0.2, total / max(total.sum(), 1e-9) * 100, width=0.4, color="tab:blue",
          label=f"all steps ({int(total.sum())} prompts)")
  ax1.bar(x + 0.2, quarter / max(quarter.sum(), 1e-9) * 100, width=0.4, color="tab:orange",
          label=f"last quarter of the run ({int(quarter.sum())} prompts)")
  ax1.set_xticks(x, bins, fontsize=8)
  ax1.set_xlabel("estimated pass rate of the chosen prompt (bin)")
  ax1.set_ylabel("share of chosen prompts (%)")
  ax1.set_title("Pass rate of the prompts chosen for training")
  ax1.legend(fontsize=8)
  image = ax2.imshow(counts.T, aspect="auto", origin="lower", cmap="viridis",
                     extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, len(bins) - 0.5),
                     interpolation="nearest")
  ax2.set_yticks(x, bins, fontsize=7)
  ax2.set_xlabel("RL step")
  ax2.set_ylabel("pass-rate bin")
  ax2.set_title("Chosen prompts per pass-rate bin over the run", fontsize=10)
  ax2.grid(False)
  from matplotlib.ticker import MaxNLocator  # pylint: disable=g-import-not-at-top
  fig.colorbar(image, ax=ax2, label="prompts chosen in the step",
               ticks=MaxNLocator(integer=True))
  _integer_steps(ax2)
  return _save(fig, path)


def plot_timeline(run: Run, path: str, last: int = 10) -> str | None:
  """Gantt chart of the two sub-meshes over the last `last` steps, staleness below."""
  keys = ("pipeline/gen_start", "pipeline/gen_ready", "pipeline/learn_start",
          "pipeline/learn_ready")
  rows = [l for l in run.lines if l["step"] > 0 and all(_number(l.get(k)) is not None
                                                        for k in keys)]
  if not rows:
    return None
  # The first two steps include compilation (generator and learner programs); they would
  # squash the others.
  shown = (rows[2:] if len(rows) > 4 else rows)[-last:]
  t0 = min(min(l["pipeline/gen_start"], l["pipeline/learn_start"]) for l in shown)
  fig, (ax, ax2) = _figure(2, height=3.2, sharex=False)
  colors = ["tab:orange", "tab:blue"]
  for i, l in enumerate(shown):
    c = "0.35" if i % 2 else "0.6"
    for y, (a, b), role in ((1, ("pipeline/gen_start", "pipeline/gen_ready"), 0),
                            (0, ("pipeline/learn_start", "pipeline/learn_ready"), 1)):
      ax.broken_barh([(l[a] - t0, max(l[b] - l[a], 1e-6))], (y - 0.35, 0.7),
                     facecolors=colors[role], edgecolors=c)
      ax.text(l[a] - t0, y, str(l["step"]), fontsize=7, va="center")
  s = summarize(run)
  ax.set_yticks([0, 1])
  ax.set_yticklabels([f"learner (idle {_pct(s.get('learner_idle_share'))})",
                      f"generator (idle {_pct(s.get('generator_idle_share'))})"])
  ax.set_xlabel("seconds (bars: the batch each program generated / trained, by step)")
  ax.set_title(f"Sub-meshes over steps {shown[0]['step']}-{shown[-1]['step']} (median "
               f"overlap {_pct(s.get('overlap_frac'))} of a generation)", fontsize=10)
  steps, stale = run.series("ledger/staleness_mean", train_only=True)
  _, stale_max = run.series("ledger/staleness_max", train_only=True)
  if len(steps):
    ax2.step(steps, stale, where="mid", label="mean", color="tab:green")
    if len(stale_max) == len(steps):
      ax2.step(steps, stale_max, where="mid", label="max", color="tab:red", ls="--")
    ax2.set_xlabel("RL step")
    ax2.set_ylabel("staleness (updates)")
    ax2.set_title("Policy updates between generating a row and training on it")
    ax2.legend(fontsize=8)
    _integer_steps(ax2)
  return _save(fig, path)


_PLOTTERS = {
    "reward": (plot_reward, "no reward/mean in metrics.jsonl"),
    "accuracy": (plot_accuracy, "no eval/accuracy_d* in metrics.jsonl"),
    "response_length": (plot_response_length,
                        "no ledger/response_len_mean or ledger/truncated_frac"),
    "time": (plot_time, "no time/generate_s and time/update_s"),
    "tokens": (plot_tokens, "no ledger/tokens_* in metrics.jsonl"),
    "pass_rate": (plot_pass_rate, "no select/pass_rate_hist_* in metrics.jsonl (prompt "
                                  "selection by pass rate was off)"),
    "timeline": (plot_timeline, "no pipeline/* timestamps (sync mode)"),
}


@dataclasses.dataclass
class Report:
  plots: dict[str, str]  # name -> PNG path
  notes: list[str]  # why a plot was skipped
  summary: str
  out_dir: str


def make_report(workdir: str, out_dir: str | None = None) -> Report:
  """Writes the PNGs and summary.txt for the run in `workdir` (default out: WORKDIR/report)."""
  run = load_run(workdir)
  out_dir = out_dir or os.path.join(workdir, "report")
  os.makedirs(out_dir, exist_ok=True)
  plots, notes = {}, []
  if not run.lines:
    notes.append("metrics.jsonl has no complete line yet")
  for name in PLOTS + OPTIONAL_PLOTS:
    fn, why = _PLOTTERS[name]
    got = fn(run, os.path.join(out_dir, f"{name}.png")) if run.lines else None
    if got:
      plots[name] = got
    elif run.lines and name not in OPTIONAL_PLOTS:
      notes.append(f"{name}.png skipped: {why}")
  text = summary_text(run, notes)
  with open(os.path.join(out_dir, "summary.txt"), "w", encoding="utf-8") as f:
    f.write(text)
  return Report(plots=plots, notes=notes, summary=text, out_dir=out_dir)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m rlx.report", description=__doc__.split(
      "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdir", help="the --workdir of an rlx run")
  parser.add_argument("--out", default=None, help="where the PNGs go (default WORKDIR/report)")
  args = parser.parse_args(argv)
  show_warnings_as("rlx.report")
  try:
    report = make_report(args.workdir, args.out)
  except OSError as e:  # a missing metrics.jsonl, or a directory in its place
    print(f"rlx.report: error: {e}", file=sys.stderr)
    return 2
  print(report.summary, end="")
  print(f"wrote {len(report.plots)} plots and summary.txt to {report.out_dir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
