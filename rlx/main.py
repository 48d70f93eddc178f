r"""rlx command line: train an experiment config.

  python -m rlx.main --config=experiments/arith.py --workdir=/tmp/rlx_arith
  python -m rlx.main --config=experiments/arith.py:runlocal --workdir=/tmp/rlx_local \
      --config.rl.group_size=8
  python -m rlx.main --config=arith:runlocal --workdir=/tmp/rlx_local   # a shipped experiment

--config takes a config file or the name of an experiment shipped with rlx (rlx.experiments),
which works from any directory. A mistake in a config or a flag exits at once with one line
`rlx: error: ...` (status 2); SIGTERM / SIGINT checkpoint the current step and exit with status
75 (rerun to resume); a Ctrl-C before the first step (or a second one) exits with status 130.
"""

import logging
import os
import re
import signal
import sys
import threading

# Exit status after a Ctrl-C that stopped the run without a checkpoint (128 + SIGINT).
INTERRUPTED_EXIT = 130


def _interrupted_while_loading(signum, frame):
  del signum, frame
  print("rlx: interrupted (Ctrl-C) while loading.", file=sys.stderr, flush=True)
  os._exit(INTERRUPTED_EXIT)  # pylint: disable=protected-access


if __name__ == "__main__":  # a Ctrl-C while JAX loads (seconds) is not a traceback either
  signal.signal(signal.SIGINT, _interrupted_while_loading)

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app, flags
from ml_collections import config_flags

from rlx import checkpoint, config_file, configs, distributed, metrics, trainer
# pylint: enable=g-import-not-at-top,wrong-import-position

# JAX logs each accelerator platform it probes and does not find ("Unable to initialize backend
# 'tpu'") at INFO, which absl prints and which reads like an error on every CPU run. Its
# warnings (e.g. "a GPU may be present, but ... falling back to cpu") and errors still show.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)


class _ConfigFileParser(flags.ArgumentParser):
  """--config=path[:arg] loaded by rlx.config_file.load, as rlx.load_config loads it."""

  def flag_type(self):
    return "config object"

  def parse(self, path):
    path, _, arg = path.partition(":")
    config = config_file.load(path, arg, "config_config")
    if callable(getattr(config, "lock", None)):  # an override of a missing key is an error
      config.lock()
    return config


flags.FLAGS["config"].parser = _ConfigFileParser()
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints and metrics go.")
flags.mark_flags_as_required(["config", "workdir"])
# Multi-process runs (one process per host): explicit values or RLX_COORDINATOR_ADDRESS /
# RLX_NUM_PROCESSES / RLX_PROCESS_ID; --distributed uses JAX's cluster auto-detection.
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "jax.distributed auto-detection.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "Fake CPU devices per process (tests).",
                                    lower_bound=0)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the per-device memory plan and exit.")

# Exit status after SIGTERM / SIGINT with a checkpoint saved (EX_TEMPFAIL: "try again"), so a
# scheduler can tell a preempted run from a finished (0) or failed (2) one.
PREEMPTED_EXIT = 75

# Raised for bad configs, data, checkpoints or paths; each carries a one-line explanation.
# OSError: what the machine refused (a full disk while writing metrics: rlx.metrics.WriteError
# names the file; any other names the error and, where the OS gives one, the path).
USER_ERRORS = (configs.ConfigError, checkpoint.CheckpointError, OSError, ValueError)


def fail(message: str):
  print(f"rlx: error: {message}", file=sys.stderr)
  sys.exit(2)


def _config_flag(argv: list[str]) -> tuple[int, str] | None:
  """(index in argv, value) of --config=VALUE or --config VALUE (the last one wins)."""
  found = None
  for i, a in enumerate(argv[1:], start=1):
    if a == "--":
      break
    if a.startswith(("--config=", "-config=")):
      found = (i, a.split("=", 1)[1])
    elif a in ("--config", "-config") and i + 1 < len(argv):
      found = (i + 1, argv[i + 1])
  return found


def resolve_config(argv: list[str]) -> list[str]:
  """argv with --config=NAME[:arg] of a shipped experiment rewritten to its file path.

  Exits with one line if the config file does not exist or fails to load.
  """
  found = _config_flag(argv)
  if found is None:
    return argv  # absl reports the missing required flag
  i, value = found
  given, sep, arg = value.partition(":")
  try:
    path = config_file.find(given)  # the rule rlx.sweep and rlx.load_config follow too
  except FileNotFoundError as e:
    fail(str(e))
  if path != given:  # absl's config flag takes a file: a shipped name becomes its path
    argv = list(argv)
    argv[i] = argv[i][:len(argv[i]) - len(value)] + path + sep + arg
  _check_config_loads(path, arg, given)
  return argv


def _check_config_loads(path: str, arg: str, given: str) -> None:
  """Runs the config file's get_config(arg) once, so any failure is one line, not a traceback."""
  try:
    config_file.load(given, arg, "rlx_config_check")  # `given` finds `path`: named as given
  except Exception as e:  # pylint: disable=broad-except
    if os.environ.get("RLX_TRACEBACK"):
      raise
    if isinstance(e, config_file.NoGetConfig):
      fail(str(e))
    if isinstance(e, (configs.ConfigError, ValueError)):
      fail(f"config {given!r}: {e}")
    fail(f"config file {given!r} failed to load: {type(e).__name__}: {e} (set RLX_TRACEBACK=1 "
         f"for the traceback)")


def _redeliver_lost_signals(unraisable):
  """A Ctrl-C (or the trainer's stop on a signal) raised inside a garbage-collector callback,
  e.g. JAX's, cannot propagate: Python would print a traceback and drop it. Send the signal
  again instead, so it stops the run as it should."""
  exc = unraisable.exc_value
  if isinstance(exc, KeyboardInterrupt):
    signum = signal.SIGINT
  elif not isinstance(exc, Exception) and isinstance(getattr(exc, "signum", None), int):
    signum = exc.signum
  else:
    sys.__unraisablehook__(unraisable)
    return
  # A moment later, so that the handler runs once this hook and the callback have returned.
  timer = threading.Timer(0.05, os.kill, args=(os.getpid(), signum))
  timer.daemon = True
  timer.start()


def parse_flags(argv):
  argv = resolve_config(argv)
  try:
    return flags.FLAGS(argv)
  except AttributeError as e:  # ml_collections: an unknown key, often with "Did you mean"
    text = str(e)
    overrides = [a.split("=")[0] for a in argv if a.startswith("--config.")]
    moved = [configs.moved_key_error(o[2:]) for o in overrides]
    if any(moved):
      fail(str(next(m for m in moved if m)))
    hint = re.search(r'Did you mean "(\w+)" instead of "(\w+)"', text)
    if hint:
      bad = next((o for o in overrides if o.endswith("." + hint.group(2))), hint.group(2))
      fail(f"unknown config key {bad}; did you mean "
           f"{bad[:-len(hint.group(2))] + hint.group(1)}?")
    name = text.strip().strip("'\"")
    bad = [o for o in overrides if o.endswith("." + name)] or overrides
    fail(f"unknown config key {', '.join(bad)}; see the experiment file for valid keys.")
  except flags.Error as e:
    fail(str(e))


class _HeldOrbaxErrors(logging.Filter):
  """Holds back the ERROR records orbax logs from its background save threads.

  A save that fails there (a full disk) is logged by each thread involved, with a traceback
  each (hundreds of lines), and then raised where rlx waits for the save, which reports it in
  one line naming the directory and the OS error. The held records are dropped when the run
  ends with that line and printed otherwise (the run went on, or ended in another way).
  RLX_TRACEBACK=1 holds nothing.
  """

  def __init__(self):
    super().__init__()
    self.held: list[logging.LogRecord] = []
    self._releasing = False

  def filter(self, record: logging.LogRecord) -> bool:
    if (self._releasing or record.levelno < logging.ERROR
        or f"{os.sep}orbax{os.sep}" not in (record.pathname or "")):
      return True
    self.held.append(record)
    return False

  def release(self) -> None:
    held, self.held = self.held, []
    self._releasing = True
    try:
      for record in held:
        logging.getLogger(record.name).handle(record)
    finally:
      self._releasing = False


def main(argv):
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}; configs are set with --config.key=value.")
  orbax_errors = _HeldOrbaxErrors()
  if not os.environ.get("RLX_TRACEBACK"):
    logging.getLogger("absl").addFilter(orbax_errors)  # orbax logs through absl.logging
  try:
    if _CPU_DEVICES.value:
      import jax  # pylint: disable=g-import-not-at-top
      jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                           auto=_DISTRIBUTED.value)
    if _DRY_RUN.value:
      plan, text = trainer.dry_run(_CONFIG.value, _WORKDIR.value)
      print(text)
      sys.exit(0 if plan.fits else 3)
    trainer.run(_CONFIG.value, _WORKDIR.value)
  except trainer.Preempted as e:
    orbax_errors.release()
    print(f"rlx: {e}", file=sys.stderr)
    exit_now(PREEMPTED_EXIT)
  except trainer.NumericError as e:
    orbax_errors.release()
    fail(str(e))
  except USER_ERRORS as e:
    if os.environ.get("RLX_TRACEBACK"):
      raise
    orbax_errors.held.clear()  # e.g. a failed save: the one line below says it
    print(f"rlx: error: {e} (set RLX_TRACEBACK=1 for the traceback)", file=sys.stderr,
          flush=True)
    _quiet_stderr()
    sys.exit(2)
  except KeyboardInterrupt:
    orbax_errors.release()
    interrupted()
  finally:
    orbax_errors.release()


def _quiet_stderr():
  """Sends what is written to stderr after the error line to /dev/null: after a failed save
  (a full disk) tensorstore's threads finish their writes while Python shuts down and print
  a traceback each ("Event loop is closed", dozens of them) after the line that explains."""
  try:
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
  except OSError:
    pass


def interrupted():
  print("rlx: interrupted (Ctrl-C); rerun the same command to resume from the last checkpoint, "
        "if one was saved.", file=sys.stderr)
  exit_now(INTERRUPTED_EXIT)


def exit_now(status: int):
  """sys.exit(status); another Ctrl-C while Python shuts down exits at once, without a trace."""

  def _quit(signum, frame):
    del signum, frame
    sys.stderr.flush()
    os._exit(status)  # pylint: disable=protected-access

  signal.signal(signal.SIGINT, _quit)
  sys.exit(status)


if __name__ == "__main__":
  signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt from here on
  metrics.show_warnings_as("rlx")
  sys.unraisablehook = _redeliver_lost_signals
  try:
    app.run(main, flags_parser=parse_flags)
  except KeyboardInterrupt:  # during flag parsing or absl's setup
    interrupted()
