"""One run per workdir: an exclusive lock held for the whole run.

WORKDIR/.rlx.lock holds the holder's host, pid and start time. The lock itself is an
`fcntl.flock` on that file, which the kernel releases when the process dies (kill -9
included), so a lock left by a dead run is never in the way; where flock is not available
(some network file systems) the pid recorded in the file is checked instead.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time

from rlx.checkpoint import CheckpointError

LOCK_NAME = ".rlx.lock"


class WorkdirBusy(CheckpointError):
  """Another live process holds the workdir."""


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


class WorkdirLock:
  """`with WorkdirLock(workdir):` — raises WorkdirBusy naming the holder if taken."""

  def __init__(self, workdir: str):
    self.workdir = os.path.abspath(workdir)
    self.path = os.path.join(self.workdir, LOCK_NAME)
    self._fd = None

  def _holder(self) -> dict:
    try:
      with open(self.path, encoding="utf-8") as f:
        return json.loads(f.read() or "{}")
    except (OSError, ValueError):
      return {}

  def _busy(self, holder: dict) -> WorkdirBusy:
    since = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
    return WorkdirBusy(
        f"--workdir={self.workdir} is in use by another rlx run (pid {holder.get('pid', '?')} "
        f"on host {holder.get('host', '?')}, since {when}); wait for it to end, stop it, or "
        f"use another --workdir. Two runs on one workdir would overwrite each other's "
        f"checkpoints and metrics.")

  def acquire(self) -> "WorkdirLock":
    os.makedirs(self.workdir, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      import fcntl  # pylint: disable=g-import-not-at-top
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
          raise self._busy(self._holder()) from None
        # No flock here (e.g. some NFS): fall back to the recorded pid.
        holder = self._holder()
        if (holder.get("host") == socket.gethostname() and holder.get("pid") != os.getpid()
            and _alive(int(holder.get("pid", 0)))):
          raise self._busy(holder) from None
    except BaseException:
      os.close(fd)
      raise
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      os.ftruncate(self._fd, 0)
    except OSError:
      pass
    os.close(self._fd)  # closing drops the flock
    self._fd = None

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()
