r"""Training-step benchmark: time split into generation and update, generated tokens/s.

Runs the experiment's own step (same config, same base model) for a few steps after
compilation and prints medians. The base model is the one cached in --workdir (a previous
`python -m rlx.main` run) or a fresh warm start.

  python experiments/bench_step.py --config=experiments/arith.py --workdir=/tmp/rlx_arith
  python experiments/bench_step.py --config=experiments/arith.py:runlocal --workdir=/tmp/b \
      --steps=5
"""

import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from rlx import trainer

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/arith.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/rlx_arith", "Workdir (its base model is used).")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps after the compile step.")


def main(_):
  setup = trainer.build(_CONFIG.value, _WORKDIR.value, log=print)
  fns, state = setup.fns, setup.state
  pool = jax.device_put(setup.exp.train_pool, fns.pool_sharding)
  rows = []
  for i in range(_STEPS.value + 1):
    t0 = time.perf_counter()
    state, batch = fns.rollout(state, pool)
    jax.block_until_ready(batch)
    t1 = time.perf_counter()
    state, m = fns.update(state, batch)
    m = jax.device_get(m)
    t2 = time.perf_counter()
    if i:  # step 0 compiles
      rows.append((t1 - t0, t2 - t1, float(m["ledger/tokens_generated"])))
  gen, upd, toks = map(np.asarray, zip(*rows))
  cfg = setup.step_cfg
  print(f"\nconfig: {cfg.prompts_per_step} prompts x G={cfg.group_size}, "
        f"max_new_tokens={cfg.sampling.max_new_tokens}, sampler={cfg.sampler_impl}, "
        f"{setup.exp.model_cfg.num_params() / 1e6:.2f}M params, devices={jax.device_count()}")
  print(f"{'':24s}{'median':>10s}{'min':>10s}{'max':>10s}")
  for name, x in (("generation s", gen), ("update s", upd), ("step s", gen + upd),
                  ("generated tokens/step", toks), ("generated tokens/s", toks / gen)):
    print(f"{name:24s}{np.median(x):10.3f}{x.min():10.3f}{x.max():10.3f}")
  print(f"generation share of step time: {np.median(gen / (gen + upd)):.0%}")


if __name__ == "__main__":
  app.run(main)
