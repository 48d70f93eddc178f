"""Progress of the warm start, the RL steps and evaluations, on stderr.

  bar = Progress(100, desc="rl", initial=start, disable=not show_progress)
  for step in ...:
    ...
    bar.update(1)
    bar.set_postfix({"reward": "0.500"})
  bar.close()

The first step of a loop compiles, which can take longer than a hundred steady ones: until it
is done the display says "compiling the first step", and the rate and time left come only from
the steps after it (their average), never from the compilation. Where the output goes decides
its form:

  * a terminal: a tqdm bar, redrawn in place (an evaluation's bar nests under the RL bar);
  * a Jupyter notebook: tqdm's widget;
  * anything else (a log file, a pipe, CI): plain lines, no carriage returns or cursor
    movement (which leave `[A` and blank lines in logs): one as the loop starts (so something
    is printed before a long compilation), one when the first step is done, then one every
    `interval_s` (RLX_PROGRESS_INTERVAL_S, default 30) with the rate and the time left, and one
    at the end. A nested loop (`leave=False`, an evaluation during RL) prints only when it
    announces its compilation or runs longer than interval_s.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Mapping, TextIO

DEFAULT_INTERVAL_S = 30.0


def _in_notebook() -> bool:
  shell = sys.modules.get("IPython")
  try:
    ip = shell.get_ipython() if shell is not None else None
  except Exception:  # pylint: disable=broad-except
    return False
  return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def _isatty(file) -> bool:
  try:
    return bool(file.isatty())
  except (AttributeError, ValueError, OSError):  # closed, or not a real stream
    return False


def duration(seconds: float) -> str:
  """'4.2 s', '45 s', '3 min 20 s', '1 h 41 min'."""
  if seconds < 9.95:
    return f"{max(seconds, 0.0):.1f} s"
  s = int(round(seconds))
  if s < 60:
    return f"{s} s"
  if s < 3600:
    return f"{s // 60} min {s % 60} s"
  return f"{s // 3600} h {s % 3600 // 60} min"


def _plural(unit: str) -> str:
  return unit + ("es" if unit.endswith(("s", "x", "ch", "sh")) else "s")


def _interval() -> float:
  try:
    return max(0.0, float(os.environ.get("RLX_PROGRESS_INTERVAL_S", DEFAULT_INTERVAL_S)))
  except ValueError:
    return DEFAULT_INTERVAL_S


class Progress:
  """Progress over `total` steps (tqdm's update / set_postfix / close interface).

  desc / unit: names in the display ("rl", "step"). initial: steps already done (a resume).
  leave: keep the final state (False for a nested loop such as an evaluation). announce:
  the first step compiles: say so, and time the rate from the steps after it (False for a
  loop whose programs are compiled already). file: default sys.stderr (read at creation).
  interval_s: seconds between plain lines (default RLX_PROGRESS_INTERVAL_S or 30).
  """

  def __init__(self, total: int, *, desc: str, unit: str = "step", initial: int = 0,
               disable: bool = False, leave: bool = True, announce: bool = True,
               file: TextIO | None = None, interval_s: float | None = None):
    self.total, self.desc, self.unit, self.leave = total, desc, unit, leave
    self.units = _plural(unit)
    self.n = self.initial = initial
    self.file = sys.stderr if file is None else file
    self.interval_s = _interval() if interval_s is None else interval_s
    self.postfix: dict[str, str] = {}
    self._bar = None
    self._steady_n = self._steady_t = None  # where the steady (compiled) steps begin
    self._first_s = None  # the first step's seconds (compilation included)
    self._printed_n = None  # n at the last plain line
    self._t0 = self._last_line_t = time.perf_counter()
    if disable or total <= initial:
      self.mode = "off"
    elif _in_notebook():
      self.mode = "notebook"
    elif _isatty(self.file):
      self.mode = "tty"
    else:
      self.mode = "lines"
    self._compiling = announce and self.mode != "off"
    if not self._compiling:
      self._steady_n, self._steady_t = self.n, self._t0
    if self.mode == "lines":
      if self._compiling:
        self._line(f"{self.n}/{self.total} {self.units}; compiling the first {unit} ...")
    elif self.mode != "off":
      self._bar = self._tqdm(f"{desc} (compiling the first {unit})" if self._compiling
                             else desc, leave=leave and not self._compiling)

  # ---------------------------------------------------------------------------- tqdm

  def _tqdm(self, desc: str, leave: bool):
    if self.mode == "notebook":
      from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
    else:
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    # smoothing=0: the rate is the average since this bar started, i.e. over steady steps.
    return tqdm(total=self.total, initial=self.n, desc=desc, unit=self.unit, leave=leave,
                dynamic_ncols=True, file=self.file, smoothing=0,
                postfix=dict(self.postfix) or None)

  # ---------------------------------------------------------------------------- the interface

  def update(self, n: int = 1) -> None:
    if self.mode == "off":
      return
    now = time.perf_counter()
    self.n += n
    if self._compiling:  # the first step is done: steady steps start now
      self._compiling = False
      self._first_s = now - self._t0
      self._steady_n, self._steady_t = self.n, now
      if self.mode == "lines":
        self._line(f"{self.n}/{self.total} {self.units}; the first took "
                   f"{self._first_s:.1f} s (compilation included)")
      else:
        self._bar.close()
        self._bar = self._tqdm(self.desc, leave=self.leave)
      return
    if self.mode != "lines":
      self._bar.update(n)
    elif now - self._last_line_t >= self.interval_s and self.n < self.total:
      self._line(self._status(now))

  def set_postfix(self, postfix: Mapping[str, Any] | None = None, **kwargs) -> None:
    self.postfix = {k: str(v) for k, v in {**(postfix or {}), **kwargs}.items()}
    if self._bar is not None:
      self._bar.set_postfix(self.postfix)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None
    if self.mode == "lines" and self._printed_n != self.n and (
        self.leave or self._printed_n is not None):
      self._line(self._status(time.perf_counter(), final=True))
    self.mode = "off"

  def __enter__(self) -> "Progress":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---------------------------------------------------------------------------- plain lines

  def _rate(self, now: float) -> float | None:
    """Seconds per steady step (None: none done yet)."""
    if self._steady_t is None or self.n <= self._steady_n:
      return None
    return (now - self._steady_t) / (self.n - self._steady_n)

  def _status(self, now: float, final: bool = False) -> str:
    text = f"{self.n}/{self.total} {self.units}"
    if self.total:
      text += f" ({100 * self.n / self.total:.0f}%)"
    per = self._rate(now)
    if per is not None:
      text += (f", {per:.2f} s/{self.unit}" if per >= 1 or per <= 0
               else f", {1 / per:.1f} {self.units}/s")
    if final:
      text += f", {duration(now - self._t0)} in all"
    elif per is not None:
      text += f", about {duration(per * (self.total - self.n))} left"
    if self.postfix:
      text += "; " + ", ".join(f"{k}={v}" for k, v in self.postfix.items())
    return text

  def _line(self, text: str) -> None:
    self._printed_n = self.n
    self._last_line_t = time.perf_counter()
    print(f"[rlx] {self.desc}: {text}", file=self.file, flush=True)
