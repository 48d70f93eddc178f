"""Metric writers (JSONL), the progress display and the per-step compute ledger summary."""

from __future__ import annotations

import json
import math
import os
import sys
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


class JsonlWriter:
  """Appends one JSON object per line to WORKDIR/metrics.jsonl.

  On resume from step k, lines with step > k are dropped first: the resumed run writes them
  again, so the file always reads as one uninterrupted run.
  """

  def __init__(self, path: str, resume_step: int | None = None, enabled: bool = True):
    self.path = path
    self.enabled = enabled
    if not enabled:  # non-zero processes of a multi-process run write nothing
      self._f = None
      return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if os.path.exists(path):
      if resume_step is None:
        kept = []
      else:
        kept = [l for l in self._read_lines() if l.get("step", 0) <= resume_step]
      tmp = path + ".tmp"
      with open(tmp, "w") as f:
        for l in kept:
          f.write(json.dumps(l) + "\n")
      os.replace(tmp, path)
    self._f = open(path, "a", buffering=1)

  def _read_lines(self) -> list[dict]:
    out = []
    with open(self.path) as f:
      for line in f:
        line = line.strip()
        if not line:
          continue
        try:
          out.append(json.loads(line))
        except json.JSONDecodeError:
          break  # a torn last line from a crash
    return out

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    if self._f is None:
      return
    self._f.write(json.dumps({"step": int(step), **{k: _plain(v) for k, v in metrics.items()}})
                  + "\n")

  def close(self) -> None:
    if self._f is not None:
      self._f.close()


def read_jsonl(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(l) for l in f if l.strip()]


def progress(total: int, initial: int = 0, disable: bool = False):
  from tqdm.auto import tqdm
  return tqdm(total=total, initial=initial, disable=disable, dynamic_ncols=True,
              file=sys.stderr, desc="rl", unit="step")


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


def read_jsonl_workdir(workdir: str) -> list[dict]:
  """WORKDIR/metrics.jsonl as a list of dicts (one per logged step)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist; expected the workdir of an rlx run.")
  return read_jsonl(path)
