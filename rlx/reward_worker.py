"""Host Python rewards run in a worker process, so a timeout or a signal can always end them.

A reward runs arbitrary Python, and some of it never gives the interpreter back: a regex that
backtracks catastrophically (`re.match(r'(a+)+$', 'a' * 40 + 'b')`) holds the GIL inside C
code for hours, and a reward thread in the trainer's process would then block the SIGTERM
handler and the timeout check alike. So the trainer keeps one worker process per run, forked on
the first call (it inherits the reward, its module state and the registry as they are; nothing
is imported or pickled but the arguments and the result), and sends each batch over a pipe.
The trainer's main thread stays free: on `timeout_s` or a stop signal it SIGKILLs the worker
(the next call forks a fresh one) and carries on with its own exit path.

What the worker's death means:
  * killed by SIGTERM (the reward signalled its own process, or a signal went to the whole
    process group): a stop request, handled like a SIGTERM to the trainer (checkpoint, exit 75);
  * anything else (os._exit, a crash, the OOM killer): a RewardError naming the exit status.

The worker ignores SIGINT (a Ctrl-C reaches the trainer, which stops it) and dies with the
trainer (PR_SET_PDEATHSIG on Linux), so a reward stuck in C code never outlives the run. It must
not use JAX: the forked copy of JAX's runtime has no threads. Where fork is not available the
reward runs in a thread (the earlier behaviour: a reward holding the GIL then blocks both).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import warnings
from typing import Any, Callable

# How often the waiting trainer checks for a stop signal (a result wakes it at once).
_POLL_S = 0.05
LOCK_NAME = ".rlx.lock"  # rlx.workdir.LOCK_NAME (not imported: that pulls in orbax)


class RewardError(ValueError):
  """A host reward hung past its timeout or ended its process from inside."""


def _describe_exit(code: int | None) -> str:
  if code is None:
    return "an unknown status"
  if code < 0:
    try:
      return f"killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  return f"exit status {code}"


def _die_with_parent(parent_pid: int) -> None:
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass
  if os.getppid() != parent_pid:  # the trainer died before prctl took effect
    os._exit(0)  # pylint: disable=protected-access


def _close_workdir_locks() -> None:
  """Closes inherited descriptors of a workdir lock: the flock belongs to the open file, so a
  worker holding a copy would keep the workdir locked after the trainer released it."""
  try:
    fds = os.listdir("/proc/self/fd")
  except OSError:
    return
  for fd in fds:
    try:
      if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == LOCK_NAME:
        os.close(int(fd))
    except (OSError, ValueError):
      pass


def _reply(conn, kind: str, payload: Any) -> None:
  if kind == "error":
    try:
      data = pickle.dumps((kind, payload))
      pickle.loads(data)  # an exception that pickles but cannot be rebuilt fails here
    except Exception:  # pylint: disable=broad-except
      e = payload
      data = pickle.dumps(("text", f"raised {type(e).__name__}: "
                                   f"{' '.join(str(e).split())[:300]}"))
  else:
    data = pickle.dumps((kind, payload))
  conn.send_bytes(data)


def _serve(fn: Callable[..., Any], conn, other_end, parent_pid: int) -> None:
  """The worker's loop: (args, kwargs) in, ('ok', value) | ('error', exception) |
  ('text', what happened) out; None or a closed pipe ends it."""
  other_end.close()
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_DFL)
  _die_with_parent(parent_pid)
  _close_workdir_locks()
  try:
    while True:
      job = conn.recv()
      if job is None:
        return
      args, kwargs = job
      try:
        value = fn(*args, **kwargs)
      except Exception as e:  # pylint: disable=broad-except
        _reply(conn, "error", e)
      except SystemExit as e:
        _reply(conn, "text", f"called sys.exit({e.code!r})")
      except BaseException as e:  # pylint: disable=broad-except
        _reply(conn, "text", f"raised {type(e).__name__}")
      else:
        try:
          _reply(conn, "ok", value)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
          _reply(conn, "text", f"returned {type(value).__name__}, which cannot be sent back "
                               f"({type(e).__name__}: {e})")
  except (EOFError, OSError):  # the trainer closed the pipe or is gone
    return


class RewardWorker:
  """Calls `fn` (a checked reward, see rlx.rewards.wrap_reward) in a persistent worker process.

  `call(args, kwargs, timeout_s=..., stop=...)` returns fn's result, re-raises the Exception
  fn raised, raises RewardError when fn hangs past `timeout_s`, exits or kills its process, and
  returns None when a stop signal arrived meanwhile (`stop.signum` set, by the trainer's handler
  or here when the worker was SIGTERMed). `close()` ends the worker.
  """

  def __init__(self, fn: Callable[..., Any], *, name: str, use_process: bool | None = None):
    self.fn = fn
    self.name = name
    if use_process is None:
      use_process = "fork" in multiprocessing.get_all_start_methods()
    self.use_process = use_process
    self._proc = None
    self._conn = None
    self.starts = 0  # workers forked so far (a kill or a death forks a new one next call)

  # -- process management ---------------------------------------------------------------------

  def _start(self) -> None:
    ctx = multiprocessing.get_context("fork")
    conn, child_conn = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_serve, args=(self.fn, child_conn, conn, os.getpid()),
                       name="rlx-reward-worker", daemon=True)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # JAX warns on any fork; the worker never touches JAX
      proc.start()
    child_conn.close()
    self._proc, self._conn = proc, conn
    self.starts += 1

  def kill(self) -> None:
    """SIGKILLs the worker (whatever it is doing); the next call forks a new one."""
    proc, conn = self._proc, self._conn
    self._proc = self._conn = None
    if proc is not None:
      if proc.is_alive():
        proc.kill()
      proc.join(5)
    if conn is not None:
      conn.close()

  def close(self) -> None:
    """Asks the worker to exit (kills it if it does not within a second)."""
    proc, conn = self._proc, self._conn
    if proc is None:
      return
    try:
      conn.send(None)
    except (OSError, ValueError):
      pass
    proc.join(1)
    self.kill()

  @property
  def pid(self) -> int | None:
    return self._proc.pid if self._proc is not None else None

  # -- calls ----------------------------------------------------------------------------------

  def _timeout(self, timeout_s: float) -> RewardError:
    return RewardError(
        f"reward function {self.name} did not return within {timeout_s:g} s "
        f"(config.task.reward_timeout_s); the last checkpoint is kept. Fix the reward or "
        f"raise the timeout, then rerun the same command to resume.")

  def _bad_exit(self, what: str) -> RewardError:
    return RewardError(f"reward function {self.name} {what}; a reward must return one float "
                       f"per completion. The last checkpoint is kept.")

  def call(self, args: tuple, kwargs: dict, *, timeout_s: float, stop=None) -> Any:
    if not self.use_process:
      return self._call_in_thread(args, kwargs, timeout_s=timeout_s, stop=stop)
    if stop is not None and stop.signum is not None:  # already stopping: start nothing
      return None
    if self._proc is None or not self._proc.is_alive():
      self.kill()
      self._start()
    deadline = time.monotonic() + timeout_s
    try:
      self._conn.send((args, kwargs))
    except (OSError, ValueError):  # it died between calls: say how
      return self._died(stop)
    while True:
      if stop is not None and stop.signum is not None:
        self.kill()
        return None
      ready = multiprocessing.connection.wait([self._conn, self._proc.sentinel], _POLL_S)
      if self._conn in ready:
        try:
          kind, payload = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
          return self._died(stop)
        if kind == "ok":
          return payload
        if kind == "error":
          raise payload
        raise self._bad_exit(payload)
      if ready:  # the sentinel alone: the worker ended without answering
        return self._died(stop)
      if time.monotonic() > deadline:
        self.kill()
        raise self._timeout(timeout_s)

  def _died(self, stop) -> None:
    proc = self._proc
    proc.join(5)
    code = proc.exitcode
    self.kill()
    if code == -signal.SIGTERM and stop is not None:
      # The reward's own process got SIGTERM (from the reward, or a signal to the whole
      # process group): a request to stop, as if the trainer had received it.
      if stop.signum is None:
        stop.signum = signal.SIGTERM
      return None
    raise self._bad_exit(f"ended its worker process ({_describe_exit(code)}, e.g. os._exit or "
                         f"a crash) instead of returning")

  def _call_in_thread(self, args, kwargs, *, timeout_s, stop) -> Any:
    """The fallback without fork: a daemon thread (a reward holding the GIL blocks the wait)."""
    box: dict[str, Any] = {}

    def target():
      try:
        box["value"] = self.fn(*args, **kwargs)
      except BaseException as e:  # pylint: disable=broad-except
        box["error"] = e

    worker = threading.Thread(target=target, name="rlx-host-reward", daemon=True)
    worker.start()
    deadline = time.monotonic() + timeout_s
    while worker.is_alive():
      worker.join(_POLL_S)
      if stop is not None and stop.signum is not None:
        return None
      if time.monotonic() > deadline and worker.is_alive():
        raise self._timeout(timeout_s)
    if "error" in box:
      e = box["error"]
      if isinstance(e, Exception):
        raise e
      raise self._bad_exit(f"called sys.exit({e.code!r})" if isinstance(e, SystemExit)
                           else f"raised {type(e).__name__}")
    return box["value"]
