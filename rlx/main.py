r"""rlx command line: train an experiment config.

  python -m rlx.main --config=experiments/arith.py --workdir=/tmp/rlx_arith
  python -m rlx.main --config=experiments/arith.py:runlocal --workdir=/tmp/rlx_local \
      --config.rl.group_size=8
"""

from absl import app, flags
from ml_collections import config_flags

from rlx import trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints and metrics go.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments {argv[1:]}; configs are set with "
                         f"--config.key=value.")
  trainer.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
