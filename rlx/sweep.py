r"""Ablation sweeps: run each override set of an experiment's `get_sweep(arg)`, then compare.

  python -m rlx.sweep --config=experiments/arith.py --workdir_root=/tmp/rlx_sweep
  python -m rlx.sweep --config=arith:runlocal --workdir_root=/tmp/rlx_sweep_local  # any directory
  python -m rlx.sweep --config=experiments/arith.py:runlocal --workdir_root=/tmp/rlx_sweep_local
  python -m rlx.sweep --config=experiments/arith.py --workdir_root=DIR --print_only  # commands
  python -m rlx.sweep --config=experiments/arith.py --workdir_root=DIR --max_runs=2 \
      --config.total_steps=50          # --config.* flags apply to every run

--config takes a config file or the name of an experiment shipped with rlx, found as rlx.main
finds it (rlx.config_file). An experiment file opts in by defining

  def get_sweep(arg: str = "") -> list[dict]:
    return [{"rl.group_size": 4}, {"rl.group_size": 8, "_name": "big_groups"}]

Each dict holds config overrides (dotted keys, as on the command line); the optional "_name"
names the run, otherwise the name is made from the overrides that differ between runs
(`group_size-4_advantage-grpo`). Runs go one
after another as `python -m rlx.main --config=... --workdir=DIR/<name> --config.key=value`
(their output in DIR/<name>/sweep.log); a failing run is reported in the table and the sweep
goes on (the exit status is then 1). Rerunning the
same sweep resumes unfinished runs from their checkpoints. With --print_only the commands are
printed, one line per run, for a cluster launcher.

Runs of one sweep share a JAX compilation cache (DIR/.jax_cache), and when no run changes the
warm-start inputs (task, model, tokenizer, sft, seed), runs after the first start from the
first run's warm-start model instead of training the same one again (--noshare_warm_start to
turn off).

Results: a table of each run's final numbers (printed, DIR/sweep_results.csv and .md) and
DIR/sweep.png (final held-out band accuracy per run; accuracy vs generated tokens).
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Any, Sequence

import numpy as np

from rlx import config_file, report

# Config keys whose values decide the warm-start model (see rlx.experiment.setup).
_WARM_START_PREFIXES = ("task.", "model.", "tokenizer.", "sft.", "warm_start.")
_WARM_START_KEYS = ("seed",)


class SweepError(ValueError):
  """A bad sweep definition or flag (one clear sentence)."""


def _split_config_arg(config: str) -> tuple[str, str]:
  path, _, arg = config.partition(":")
  return path, arg


def load_config_module(path: str):
  """The module of a config file or shipped experiment name, as rlx.main finds it."""
  try:
    file = config_file.find(path)
  except FileNotFoundError as e:
    raise SweepError(str(e)) from None
  return config_file.load_module(file, "rlx_sweep_config")


def _has_key(config, key: str) -> bool:
  node = config
  for part in key.split("."):
    try:
      if part not in node:
        return False
      node = node[part]
    except TypeError:
      return False
  return True


def load_sweep(config: str) -> tuple[list[dict], Any]:
  """(override sets, base config) from the config file's get_sweep(arg) / get_config(arg)."""
  path, arg = _split_config_arg(config)
  module = load_config_module(path)
  if not hasattr(module, "get_sweep"):
    raise SweepError(f"{path} defines no get_sweep(arg); add one returning a list of override "
                     f"dicts, e.g. [{{'rl.group_size': 4}}, {{'rl.group_size': 8}}].")
  sweep = module.get_sweep(arg)
  base = module.get_config(arg) if hasattr(module, "get_config") else None
  if not isinstance(sweep, (list, tuple)) or not sweep:
    raise SweepError(f"{path}: get_sweep({arg!r}) returned {sweep!r}; expected a non-empty list "
                     f"of override dicts.")
  for i, overrides in enumerate(sweep):
    if not isinstance(overrides, dict):
      raise SweepError(f"{path}: get_sweep({arg!r}) entry {i} is {overrides!r}; expected a dict "
                       f"of config overrides such as {{'rl.group_size': 8}}.")
    for key in overrides:
      if key == "_name":
        continue
      from rlx import configs  # pylint: disable=g-import-not-at-top
      moved = configs.moved_key_error(key)
      if moved:
        raise SweepError(f"{path}: get_sweep({arg!r}) entry {i}: {moved}")
      if base is not None and not _has_key(base, key):
        raise SweepError(f"{path}: get_sweep({arg!r}) entry {i} overrides {key!r}, which is not "
                         f"a key of get_config({arg!r}).")
  return [dict(o) for o in sweep], base


def format_value(value: Any) -> str:
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, str):
    return value
  if isinstance(value, (list, tuple)):
    return "(" + ",".join(format_value(v) if not isinstance(v, str) else repr(v)
                          for v in value) + ("," if len(value) == 1 else "") + ")"
  return repr(value)


def _varying_keys(sweep: Sequence[dict]) -> list[str]:
  """Override keys whose value is not the same in every run (in first-seen order)."""
  keys = list(dict.fromkeys(k for o in sweep for k in o if k != "_name"))
  missing = object()
  return [k for k in keys if len({repr(o.get(k, missing)) for o in sweep}) > 1]


def run_name(overrides: dict, keys: Sequence[str] | None = None) -> str:
  """'_name' if given, else `<key>-<value>` for `keys` (default: all overrides) joined by '_'."""
  if "_name" in overrides:
    name = str(overrides["_name"])
  else:
    keys = [k for k in overrides if k != "_name"] if keys is None else keys
    short = [k.split(".")[-1] for k in keys]
    parts = [f"{(k if short.count(k.split('.')[-1]) > 1 else k.split('.')[-1])}-"
             f"{_name_value(overrides[k])}" for k in keys if k in overrides]
    name = "_".join(parts) or "base"
  return re.sub(r"[^A-Za-z0-9._=-]+", "", name) or "run"


def _name_value(value: Any) -> str:
  if isinstance(value, (list, tuple)):
    return "-".join(_name_value(v) for v in value)
  return format_value(value)


def unique_names(sweep: Sequence[dict]) -> list[str]:
  """Run names from the overrides that tell the runs apart (suffix _1, _2 on clashes)."""
  keys = _varying_keys(sweep) if len(sweep) > 1 else None
  names, seen = [], {}
  for overrides in sweep:
    name = run_name(overrides, keys)
    if name in seen:
      seen[name] += 1
      name = f"{name}_{seen[name]}"
    else:
      seen[name] = 0
    names.append(name)
  return names


def override_flags(overrides: dict) -> list[str]:
  return [f"--config.{k}={format_value(v)}" for k, v in overrides.items() if k != "_name"]


def command(config: str, workdir: str, overrides: dict, extra: Sequence[str],
            python: str = "python") -> list[str]:
  return [python, "-m", "rlx.main", f"--config={config}", f"--workdir={workdir}",
          *override_flags(overrides), *extra]


def _warm_start_inputs(overrides: dict) -> dict:
  return {k: v for k, v in overrides.items()
          if k in _WARM_START_KEYS or k.startswith(_WARM_START_PREFIXES)}


def can_share_warm_start(sweep: Sequence[dict], base, extra: Sequence[str]) -> tuple[bool, str]:
  if base is None or not _has_key(base, "warm_start.dir"):
    return False, "the config has no warm_start.dir"
  if base.warm_start.dir:
    return False, "the config already names a warm start"
  if any(a.startswith("--config.warm_start.") for a in extra):
    return False, "--config.warm_start.* is set"
  inputs = [_warm_start_inputs(o) for o in sweep]
  if any(i != inputs[0] for i in inputs[1:]):
    return False, "runs differ in task/model/tokenizer/sft/seed"
  if any("warm_start.dir" in o for o in sweep):
    return False, "a run sets warm_start.dir"
  return True, ""


# ---- running ---------------------------------------------------------------------------------


def _tail(path: str, n: int = 5) -> list[str]:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      lines = [l.rstrip() for l in f if l.strip()]
  except OSError:
    return []
  return lines[-n:]


def _error_line(log_path: str) -> str:
  lines = _tail(log_path, 200)
  for line in reversed(lines):
    if line.startswith("rlx: error:") or re.match(r"^\w*(Error|Exception)\b", line):
      return line
  return lines[-1] if lines else ""


def run_all(config: str, root: str, sweep: Sequence[dict], names: Sequence[str],
            extra: Sequence[str], *, share_warm_start: bool, base, compilation_cache: str,
            timeout_s: float | None, log=print) -> list[dict]:
  """Runs each override set; returns one status dict per run."""
  env = dict(os.environ)
  if compilation_cache:
    env.setdefault("JAX_COMPILATION_CACHE_DIR", compilation_cache)
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  share, why_not = (can_share_warm_start(sweep, base, extra) if share_warm_start
                    else (False, "--noshare_warm_start"))
  shared_base = None
  statuses = []
  for i, (overrides, name) in enumerate(zip(sweep, names)):
    workdir = os.path.join(root, name)
    os.makedirs(workdir, exist_ok=True)
    more = list(extra)
    if share and shared_base:
      more.append(f"--config.warm_start.dir={shared_base}")
    cmd = command(config, workdir, overrides, more, python=sys.executable)
    log_path = os.path.join(workdir, "sweep.log")
    flags = " ".join(override_flags(overrides)) or "(defaults)"
    log(f"[sweep] run {i + 1}/{len(sweep)} {name}: {flags} -> {workdir}")
    t0 = time.time()
    with open(log_path, "w", encoding="utf-8") as out:
      out.write("$ " + shlex.join(cmd) + "\n")
      out.flush()
      try:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                            timeout=timeout_s).returncode
      except subprocess.TimeoutExpired:
        rc = None
    wall = time.time() - t0
    if rc == 0:
      status = "ok"
      if share and shared_base is None and os.path.isdir(os.path.join(workdir, "base")):
        shared_base = os.path.join(workdir, "base")
        if i + 1 < len(sweep):
          log(f"[sweep] the next runs start from this run's warm-start model {shared_base}")
    elif rc is None:
      status = f"timed out after {timeout_s:.0f} s"
    else:
      status = f"failed (exit {rc}): {_error_line(log_path)}"
    log(f"[sweep]   {status.splitlines()[0]} in {wall:.0f} s (log: {log_path})")
    statuses.append({"run": name, "status": status, "wall_s": wall, "workdir": workdir,
                     "overrides": overrides})
  if share_warm_start and not share and len(sweep) > 1:
    log(f"[sweep] each run trained its own warm start ({why_not})")
  return statuses


# ---- gathering -------------------------------------------------------------------------------

COLUMNS = ("run", "status", "overrides", "steps", "band_acc_before", "band_acc_after",
           "gain_points", "tokens_generated", "median_step_s", "generation_share", "wall_s")


def gather(statuses: Sequence[dict]) -> list[dict]:
  """One row per run with its final metrics (blank where a run left none)."""
  rows = []
  for st in statuses:
    row = {c: "" for c in COLUMNS}
    row.update(run=st["run"], status=st["status"],
               overrides=" ".join(override_flags(st["overrides"])),
               wall_s=(f"{st['wall_s']:.0f}" if st.get("wall_s") is not None else ""))
    try:
      run = report.load_run(st["workdir"])
    except FileNotFoundError:
      run = None
    if run is not None and run.lines:
      s = report.summarize(run)
      fmt = lambda x, f: "" if x is None else f.format(x)  # noqa: E731
      row.update(
          steps=str(s["steps"]),
          band_acc_before=fmt(s["band_accuracy_before"], "{:.4f}"),
          band_acc_after=fmt(s["band_accuracy_after"], "{:.4f}"),
          gain_points=fmt(s["gain_points"], "{:+.1f}"),
          tokens_generated=fmt(s["tokens_generated"], "{:.0f}"),
          median_step_s=fmt(s["median_step_s"], "{:.4f}"),
          generation_share=fmt(s["generation_share"], "{:.3f}"))
    rows.append(row)
  return rows


def markdown_table(rows: Sequence[dict]) -> str:
  def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")
  out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  for r in rows:
    out.append("| " + " | ".join(cell(r[c]) for c in COLUMNS) + " |")
  return "\n".join(out) + "\n"


def write_results(root: str, rows: Sequence[dict]) -> tuple[str, str]:
  csv_path = os.path.join(root, "sweep_results.csv")
  with open(csv_path, "w", newline="", encoding="utf-8") as f:
    w = csv.DictWriter(f, fieldnames=COLUMNS)
    w.writeheader()
    w.writerows(rows)
  md_path = os.path.join(root, "sweep_results.md")
  with open(md_path, "w", encoding="utf-8") as f:
    f.write(markdown_table(rows))
  return csv_path, md_path


def plot_sweep(statuses: Sequence[dict], path: str) -> str:
  """Final band accuracy per run (bars, with the base model) and accuracy vs generated tokens."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(12, 4.6), dpi=110, layout="constrained")
  FigureCanvasAgg(fig)
  ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.3]})
  names = [st["run"] for st in statuses]
  colors = [f"C{i % 10}" for i in range(len(statuses))]
  x = np.arange(len(statuses))
  curves = 0
  for i, st in enumerate(statuses):
    try:
      run = report.load_run(st["workdir"])
    except FileNotFoundError:
      run = None
    before, after, _ = report.band_accuracy_before_after(run) if run else (None, None, None)
    if after is not None:
      ax1.bar(i, 100 * after, color=colors[i], width=0.6)
      ax1.annotate(f"{100 * after:.1f}%", (i, 100 * after), xytext=(0, 3),
                   textcoords="offset points", ha="center", fontsize=8)
    else:
      ax1.annotate("failed" if st["status"] != "ok" else "no eval", (i, 4), ha="center",
                   va="bottom", fontsize=9, color="red",
                   bbox=dict(boxstyle="round", fc="white", ec="red"))
    if before is not None:
      ax1.plot([i - 0.35, i + 0.35], [100 * before] * 2, color="black", lw=2,
               label="before RL (base model)" if i == 0 else None)
    if run is None:
      continue
    steps, acc = run.series("eval/band_accuracy")
    if not len(steps):
      continue
    tok_steps, tok = run.series("ledger/tokens_generated", train_only=True)
    cum = dict(zip(tok_steps.tolist(), np.cumsum(tok).tolist()))
    xs = [0.0 if s == 0 else cum.get(int(s)) for s in steps]
    pts = [(a, 100 * b) for a, b in zip(xs, acc) if a is not None]
    if before is not None and (not len(steps) or steps[0] != 0):
      pts.insert(0, (0.0, 100 * before))
    if pts:
      ax2.plot(*zip(*pts), marker="o", ms=4, color=colors[i], label=names[i])
      curves += 1
  ax1.set_xticks(x, names, rotation=20 if len(names) > 3 else 0, ha="right" if len(names) > 3
                 else "center", fontsize=8)
  ax1.set_xlim(-0.6, len(statuses) - 0.4)
  ax1.set_ylim(0, 105)
  ax1.set_ylabel("held-out band accuracy (%)")
  ax1.set_xlabel("run")
  ax1.set_title("Final held-out band accuracy per run")
  ax1.grid(True, axis="y", alpha=0.3)
  if ax1.get_legend_handles_labels()[0]:
    ax1.legend(fontsize=8, loc="upper left")
  ax2.set_title("Band accuracy vs generation spent")
  ax2.set_xlabel("generated tokens (cumulative)")
  ax2.set_ylabel("held-out band accuracy (%)")
  ax2.set_ylim(-3, 103)
  ax2.grid(True, alpha=0.3)
  ax2.ticklabel_format(axis="x", style="sci", scilimits=(-3, 4))
  if curves:
    ax2.legend(fontsize=8, loc="best")
  fig.savefig(path)
  return path


# ---- command line ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  parser = argparse.ArgumentParser(prog="python -m rlx.sweep", description=__doc__.split(
      "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Any --config.key=value flag is passed to every run.")
  parser.add_argument("--config", required=True,
                      help="experiments/X.py[:arg] or a shipped name (arith[:arg]) with get_sweep")
  parser.add_argument("--workdir_root", required=True, help="each run goes to DIR/<run name>")
  parser.add_argument("--print_only", action="store_true",
                      help="print one command per run and exit")
  parser.add_argument("--max_runs", type=int, default=None, help="only the first N runs")
  parser.add_argument("--share_warm_start", action=argparse.BooleanOptionalAction, default=True,
                      help="later runs reuse the first run's warm-start model when possible")
  parser.add_argument("--noshare_warm_start", dest="share_warm_start", action="store_false",
                      help=argparse.SUPPRESS)
  parser.add_argument("--compilation_cache", default=None,
                      help="JAX compilation cache shared by the runs (default "
                           "DIR/.jax_cache; empty: none)")
  parser.add_argument("--timeout_s", type=float, default=None, help="per-run time limit")
  args, rest = parser.parse_known_args(argv)
  bad = [a for a in rest if not a.startswith("--config.")]
  if bad:
    parser.error(f"unrecognized arguments {bad}; config overrides look like "
                 f"--config.rl.group_size=8")
  if args.max_runs is not None and args.max_runs < 1:
    parser.error(f"--max_runs={args.max_runs}; expected at least 1")
  return args, rest


def main(argv: Sequence[str] | None = None) -> int:
  args, extra = parse_args(sys.argv[1:] if argv is None else argv)
  try:
    sweep, base = load_sweep(args.config)
  except SweepError as e:
    print(f"rlx.sweep: error: {e}", file=sys.stderr)
    return 2
  names = unique_names(sweep)  # from the whole sweep: --max_runs must not rename runs
  if args.max_runs is not None:
    sweep, names = sweep[:args.max_runs], names[:args.max_runs]
  root = os.path.abspath(os.path.expanduser(args.workdir_root))
  if args.print_only:
    for overrides, name in zip(sweep, names):
      print(shlex.join(command(args.config, os.path.join(root, name), overrides, extra)))
    return 0
  os.makedirs(root, exist_ok=True)
  cache = (os.path.join(root, ".jax_cache") if args.compilation_cache is None
           else args.compilation_cache)
  statuses = run_all(args.config, root, sweep, names, extra,
                     share_warm_start=args.share_warm_start, base=base,
                     compilation_cache=cache, timeout_s=args.timeout_s)
  rows = gather(statuses)
  csv_path, md_path = write_results(root, rows)
  png = plot_sweep(statuses, os.path.join(root, "sweep.png"))
  print(markdown_table(rows), end="")
  failed = sum(1 for st in statuses if st["status"] != "ok")
  print(f"[sweep] {len(statuses) - failed}/{len(statuses)} runs ok; wrote {csv_path}, {md_path}, "
        f"{png}")
  return 0 if not failed else 1


if __name__ == "__main__":
  sys.exit(main())
