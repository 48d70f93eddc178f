r"""rlx command line: train an experiment config.

  python -m rlx.main --config=experiments/arith.py --workdir=/tmp/rlx_arith
  python -m rlx.main --config=experiments/arith.py:runlocal --workdir=/tmp/rlx_local \
      --config.rl.group_size=8

A mistake in a config or a flag exits at once with one line `rlx: error: ...` (status 2);
SIGTERM / SIGINT checkpoint the current step and exit with status 75 (rerun to resume).
"""

import os
import re
import sys

from absl import app, flags
from ml_collections import config_flags

from rlx import checkpoint, configs, distributed, trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints and metrics go.")
flags.mark_flags_as_required(["config", "workdir"])
# Multi-process runs (one process per host): explicit values or RLX_COORDINATOR_ADDRESS /
# RLX_NUM_PROCESSES / RLX_PROCESS_ID; --distributed uses JAX's cluster auto-detection.
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "jax.distributed auto-detection.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "Fake CPU devices per process (tests).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the per-device memory plan and exit.")

# Exit status after SIGTERM / SIGINT with a checkpoint saved (EX_TEMPFAIL: "try again"), so a
# scheduler can tell a preempted run from a finished (0) or failed (2) one.
PREEMPTED_EXIT = 75

# Raised for bad configs, data, checkpoints or paths; each carries a one-line explanation.
USER_ERRORS = (configs.ConfigError, checkpoint.CheckpointError, FileNotFoundError,
               PermissionError, ValueError)


def fail(message: str):
  print(f"rlx: error: {message}", file=sys.stderr)
  sys.exit(2)


def parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except AttributeError as e:  # ml_collections: an unknown key, often with "Did you mean"
    text = str(e)
    overrides = [a.split("=")[0] for a in argv if a.startswith("--config.")]
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


def main(argv):
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}; configs are set with --config.key=value.")
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
    print(f"rlx: {e}", file=sys.stderr)
    sys.exit(PREEMPTED_EXIT)
  except trainer.NumericError as e:
    fail(str(e))
  except USER_ERRORS as e:
    if os.environ.get("RLX_TRACEBACK"):
      raise
    fail(f"{e} (set RLX_TRACEBACK=1 for the traceback)")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
