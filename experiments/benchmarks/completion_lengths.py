r"""Completion lengths at the start of RL: what the policy samples on the RL prompt mix.

Runs the experiment's own rollout half (prompt selection, sampler, verifier; no update) from
the workdir's base model, or from a checkpoint with --step, and prints the distribution of
completion lengths in tokens (median, 90th percentile and their ratio, overall and by level)
with the pass rate. The workdir must hold the base already (run the experiment, or its warm
start, first).

  python experiments/benchmarks/completion_lengths.py --config=experiments/reasoning.py \
      --workdir=/tmp/rlx_reasoning
  python experiments/benchmarks/completion_lengths.py --config=experiments/reasoning.py \
      --workdir=/tmp/rlx_reasoning --step=100
"""

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

import rlx
from rlx import sharding as shd
from rlx import trainer

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/reasoning.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/rlx_reasoning", "Workdir with the base model.")
_ROLLOUTS = flags.DEFINE_integer("rollout_steps", 8, "Rollout halves to sample (each one "
                                 "step's prompts_per_step x group_size completions).")
_STEP = flags.DEFINE_integer("step", -1, "Checkpoint to sample from (-1: the base model).")


def main(argv):
  del argv
  setup = trainer.build(_CONFIG.value, _WORKDIR.value, log=lambda s: None)
  state, fns = setup.state, setup.fns
  if _STEP.value >= 0:
    saved = rlx.read_checkpoint(_WORKDIR.value, _STEP.value)
    params = jax.tree.map(lambda a, b: np.asarray(a).astype(b.dtype), saved["params"],
                          state.params)
    state = state.replace(params=shd.put(params, fns.state_sharding.params))
  pool = shd.put(setup.exp.train_pool, fns.pool_sharding)
  lengths, levels, rewards = [], [], []
  for _ in range(_ROLLOUTS.value):
    state, ro = fns.rollout(state, pool)
    b = jax.device_get(ro.batch)
    lengths.append(b.lengths)
    levels.append(b.difficulty)
    rewards.append(b.rewards)
  lengths, levels, rewards = map(np.concatenate, (lengths, levels, rewards))

  def row(name, sel):
    x = lengths[sel]
    med, p90 = np.median(x), np.percentile(x, 90)
    print(f"{name:>8} {sel.sum():>6} {med:>7.0f} {p90:>6.0f} {p90 / med:>6.2f} {x.mean():>6.1f} "
          f"{x.max():>5} {rewards[sel].mean():>6.2f}")

  print(f"{'level':>8} {'n':>6} {'median':>7} {'p90':>6} {'ratio':>6} {'mean':>6} {'max':>5} "
        f"{'pass':>6}")
  row("all", np.ones_like(lengths, bool))
  for level in np.unique(levels):
    row(str(level), levels == level)


if __name__ == "__main__":
  app.run(main)
