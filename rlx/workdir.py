"""One run per workdir: an exclusive lock held for the whole run.

WORKDIR/.rlx.lock holds the holder's host, pid and start time. The lock itself is an
`fcntl.flock` on that file, which the kernel releases when the process dies (kill -9
included), so a lock left by a dead run is never in the way; where flock is not available
(some network file systems) the pid recorded in the file is checked instead.

The lock file is opened without following a symbolic link (O_NOFOLLOW) and must be a regular
file with no other hard link: rlx truncates and rewrites it, so a link planted at
WORKDIR/.rlx.lock would otherwise make rlx overwrite its target, which may lie outside the
workdir. Such a lock file is refused with one line naming it.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import time

from rlx.checkpoint import CheckpointError

LOCK_NAME = ".rlx.lock"


class WorkdirBusy(CheckpointError):
  """Another live process holds the workdir."""


class UnsafeLockFile(CheckpointError):
  """WORKDIR/.rlx.lock is a symbolic link, a hard link or not a regular file."""


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

  def _holder(self, fd: int) -> dict:
    try:  # through our descriptor: the path is never opened a second time
      return json.loads(os.pread(fd, 1 << 16, 0).decode("utf-8") or "{}")
    except (OSError, ValueError):
      return {}

  def _unsafe(self, what: str) -> UnsafeLockFile:
    return UnsafeLockFile(
        f"the lock file {self.path} {what}; rlx truncates and rewrites its lock file, so it "
        f"never follows a link there. Remove {self.path} and rerun.")

  def _open(self) -> int:
    """The lock file's descriptor; refuses anything but a regular file of the workdir's own."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
      fd = os.open(self.path, flags, 0o644)
    except OSError as e:
      if os.path.islink(self.path):  # ELOOP (Linux) or EMLINK (FreeBSD) from O_NOFOLLOW
        try:
          target = os.readlink(self.path)
        except OSError:
          target = "?"
        raise self._unsafe(f"is a symbolic link (to {target})") from None
      raise UnsafeLockFile(f"cannot open the lock file {self.path} ({e.strerror}); it must be "
                           f"a regular file rlx can write.") from None
    try:
      st = os.fstat(fd)
      if not stat.S_ISREG(st.st_mode):
        raise self._unsafe("is not a regular file")
      if st.st_nlink > 1:
        raise self._unsafe(f"is a hard link ({st.st_nlink} names for one file)")
    except BaseException:
      os.close(fd)
      raise
    return fd

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
    fd = self._open()
    try:
      import fcntl  # pylint: disable=g-import-not-at-top
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
          raise self._busy(self._holder(fd)) from None
        # No flock here (e.g. some NFS): fall back to the recorded pid.
        holder = self._holder(fd)
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
