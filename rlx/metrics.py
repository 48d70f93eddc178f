"""Metric writers (JSONL), the progress display and the per-step compute ledger summary."""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import warnings
from typing import Any, Mapping

import numpy as np


def _plain(v):
  if isinstance(v, (np.generic,)):
    v = v.item()
  if isinstance(v, np.ndarray):
    return v.tolist()
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)
  return v


class MetricsWarning(UserWarning):
  """A metrics.jsonl had unreadable lines (skipped, and quarantined when rewritten)."""


class WriteError(OSError):
  """A metrics file (metrics.jsonl, a TensorBoard events file) could not be written: a full
  disk, a quota, an I/O error. str() is one line naming the file and the OS error; the run's
  checkpoints are written apart, so the last one is kept and a rerun resumes from it."""

  def __init__(self, path: str, error: OSError):
    super().__init__(error.errno, error.strerror or str(error), os.fspath(path))

  def __str__(self) -> str:
    code = f" [Errno {self.errno}]" if self.errno else ""
    fix = ("free space" if self.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))
           else "fix the file or its file system")
    return (f"could not write {self.filename} ({self.strerror}{code}); the last checkpoint is "
            f"kept: {fix}, then rerun the same command to resume from it.")


class JsonlWriter:
  """Appends one JSON object per line to WORKDIR/metrics.jsonl.

  On resume from step k, lines with step > k are dropped first: the resumed run writes them
  again, so the file always reads as one uninterrupted run. Unreadable lines (a torn last line
  after a crash, or damage in the middle) are moved to metrics.jsonl.corrupt with a warning;
  every readable line is kept.
  """

  def __init__(self, path: str, resume_step: int | None = None, enabled: bool = True):
    self.path = os.fspath(path)
    self.enabled = enabled
    if not enabled:  # non-zero processes of a multi-process run write nothing
      self._f = None
      return
    path = self.path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _check_not_dir(path)
    try:
      if os.path.exists(path):
        kept = []
        if resume_step is not None:
          rows, bad = _parse(path)
          kept = [r for r in rows if r["step"] <= resume_step]
          if bad:
            _warn_unreadable(path, bad, moved_to=_quarantine(path, bad))
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
          for r in kept:
            f.write(json.dumps(r) + "\n")
        os.replace(tmp, path)
      self._f = open(path, "a", buffering=1, encoding="utf-8")
    except (IsADirectoryError, PermissionError):
      raise
    except OSError as e:
      raise ValueError(f"Cannot write metrics to {path} ({e.strerror or e}); expected a "
                       f"writable file in the workdir.") from None

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    if self._f is None:
      return
    line = json.dumps({"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}) + "\n"
    try:
      self._f.write(line)  # line-buffered: the line reaches the OS here
    except OSError as e:  # a full disk: say which file (the OS error names none)
      raise WriteError(self.path, e) from e

  def close(self) -> None:
    f, self._f = self._f, None
    if f is not None:
      try:
        f.close()
      except OSError as e:
        raise WriteError(self.path, e) from e


def _check_not_dir(path: str) -> None:
  if os.path.isdir(path):
    raise IsADirectoryError(f"{path} is a directory; expected the metrics.jsonl file of an rlx "
                            f"run (move the directory away).")


def _step_of(row: Any) -> int | None:
  if not isinstance(row, dict):
    return None
  s = row.get("step")
  if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
    return None
  return int(s)


def _parse(path: str) -> tuple[list[dict], list[tuple[int, bytes]]]:
  """(rows in file order, [(line number, raw line)] of unreadable ones) of a metrics.jsonl.

  A line is unreadable if it is not a JSON object with a numeric "step".
  """
  rows, bad = [], []
  with open(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      if not raw.strip():
        continue
      try:
        row = json.loads(raw)
      except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        row = None
      step = _step_of(row)
      if step is None:
        bad.append((number, raw if raw.endswith(b"\n") else raw + b"\n"))
      else:
        rows.append({**row, "step": step})
  return rows, bad


def _warn_unreadable(path: str, bad: list[tuple[int, bytes]], moved_to: str | None = None):
  numbers = [n for n, _ in bad]
  shown = ", ".join(map(str, numbers[:10])) + (", ..." if len(numbers) > 10 else "")
  s = "s" if len(bad) > 1 else ""
  where = f"; moved to {moved_to}" if moved_to else ""
  warnings.warn(f"{path}: skipped {len(bad)} unreadable line{s} (line{s} {shown}){where}; the "
                f"other lines are kept.", MetricsWarning, stacklevel=3)


def _quarantine(path: str, bad: list[tuple[int, bytes]]) -> str:
  """Appends unreadable lines to PATH.corrupt, so rewriting PATH loses nothing."""
  with open(path + ".corrupt", "ab") as f:
    for _, raw in bad:
      f.write(raw)
  return path + ".corrupt"


def read_metrics(path: str | os.PathLike) -> list[dict]:
  """A run's metrics.jsonl as one dict per step, in step order.

  path: the run's workdir or its metrics.jsonl. A later line for a step updates the earlier
  one; unreadable lines (e.g. a torn last line after a crash) are skipped with one warning.
  """
  path = os.fspath(path)
  if os.path.isdir(path) and os.path.basename(os.path.normpath(path)) != "metrics.jsonl":
    path = os.path.join(path, "metrics.jsonl")
  _check_not_dir(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist; expected the WORKDIR of an rlx run "
                            f"(python -m rlx.main ... --workdir=WORKDIR) or its metrics.jsonl.")
  rows, bad = _parse(path)
  if bad:
    _warn_unreadable(path, bad)
  by_step: dict[int, dict] = {}
  for row in rows:
    by_step[row["step"]] = {**by_step.get(row["step"], {}), **row}
  return [by_step[s] for s in sorted(by_step)]


# Older name, kept for callers that pass the file.
read_jsonl = read_metrics


def show_warnings_as(prog: str) -> None:
  """For command lines: a MetricsWarning prints as one line `PROG: warning: ...`."""
  default = warnings.formatwarning

  def format_warning(message, category, filename, lineno, line=None):
    if issubclass(category, MetricsWarning):
      return f"{prog}: warning: {message}\n"
    return default(message, category, filename, lineno, line)

  warnings.formatwarning = format_warning


def progress(total: int, initial: int = 0, disable: bool = False):
  """The RL steps' progress (rlx.progress: says when the first step compiles, estimates from
  steady steps, plain lines where stderr is not a terminal)."""
  from rlx.progress import Progress  # pylint: disable=g-import-not-at-top
  return Progress(total, desc="rl", unit="step", initial=initial, disable=disable)


def postfix(m: Mapping[str, Any]) -> dict[str, str]:
  """The few numbers shown on the progress bar."""
  out = {}
  if "reward/mean" in m:
    out["reward"] = f"{m['reward/mean']:.3f}"
  if "eval/band_accuracy" in m:
    out["eval"] = f"{m['eval/band_accuracy']:.3f}"
  if "time/generate_s" in m:
    out["gen"] = f"{m['time/generate_s']:.2f}s"
    out["upd"] = f"{m['time/update_s']:.2f}s"
  if "ledger/zero_adv_group_frac" in m:
    out["zero_adv"] = f"{m['ledger/zero_adv_group_frac']:.2f}"
  return out
