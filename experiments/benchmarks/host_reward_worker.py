r"""What running a host Python reward in a worker process costs per training step.

The trainer scores rollouts with a Python reward (config.task.reward) in a persistent worker
process (rlx.reward_worker), so a timeout or SIGTERM can end a reward that holds the GIL. This
builds a run (the default arithmetic experiment with the "exact" host reward unless told
otherwise), trains it step by step as the trainer does (generate, decode, reward, score +
update), and on every step's real batch times the reward call three ways, in turn and in a
rotating order so that the machine's load falls on all three alike:

  direct   fn(prompts, completions, ...) in this process (no timeout, no signal handling)
  thread   a daemon thread polled by this thread (the trainer before the worker process)
  process  the forked worker process (the trainer now)

Prints the median (and 90th percentile) time per step of each, the worker's overhead over the
thread, the median step time for scale, and the one-off cost of forking the worker.

  python experiments/benchmarks/host_reward_worker.py --steps=40 --workdir=/tmp/rlx_hrw
  python experiments/benchmarks/host_reward_worker.py --config=experiments/arith.py:runlocal \
      --steps=20
"""

import os
import statistics
import time

import jax
import numpy as np
from absl import app, flags

import rlx
from rlx import reward_worker, train, trainer
from rlx import sharding as shd


def _q(xs, q):
  return float(np.quantile(np.asarray(xs), q))


_CONFIG = flags.DEFINE_string("config", "experiments/arith.py",
                              "Config file or shipped name, optionally :arg.")
_REWARD = flags.DEFINE_string("reward", "exact", "config.task.reward (a host reward).")
_STEPS = flags.DEFINE_integer("steps", 40, "Training steps.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Reward calls per way per step.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/rlx_host_reward_worker", "Workdir.")


def main(argv):
  del argv
  path, _, arg = _CONFIG.value.partition(":")
  cfg = rlx.with_overrides(rlx.load_config(path, arg), {"task.reward": _REWARD.value})
  setup = trainer.build(cfg, _WORKDIR.value, log=print)
  exp, fns, mesh, step_cfg = setup.exp, setup.fns, setup.mesh, setup.step_cfg
  fn = trainer.host_reward_fn(setup.spec)
  assert fn is not None, f"task.reward={_REWARD.value!r} is not a host reward"
  name = repr(_REWARD.value)
  thread = reward_worker.RewardWorker(fn, name=name, use_process=False)
  worker = reward_worker.RewardWorker(fn, name=name, use_process=True)
  calls = {"direct": lambda a, k: fn(*a, **k),
           "thread": lambda a, k: thread.call(a, k, timeout_s=600.0),
           "process": lambda a, k: worker.call(a, k, timeout_s=600.0)}

  state = setup.state
  pool = shd.put(exp.train_pool, fns.pool_sharding)
  per_step = {w: [] for w in calls}
  step_s, batch_sizes, chars = [], [], []
  fork_s = None
  try:
    for step in range(_STEPS.value + 1):
      t0 = time.perf_counter()
      state, batch, _ = fns.generate(state, pool)
      a, k = trainer._reward_args(batch.batch, exp)  # pylint: disable=protected-access
      t_args = time.perf_counter()
      if step == 0:  # the first call forks the worker: time it on its own
        t = time.perf_counter()
        calls["process"](a, k)
        fork_s = time.perf_counter() - t
      order = list(calls)[step % 3:] + list(calls)[:step % 3]
      results = {}
      for w in order:
        ts = []
        for _ in range(_REPEATS.value):
          t = time.perf_counter()
          results[w] = np.asarray(calls[w](a, k), np.float32)
          ts.append(time.perf_counter() - t)
        if step > 0:
          per_step[w].append(statistics.median(ts))
      assert all(np.array_equal(results["direct"], v) for v in results.values())
      t_rew = time.perf_counter()
      rewards = shd.put(results["process"], shd.batch_sharding(mesh, 1))
      state, m = fns.score_update(state, batch, rewards, **train.update_shape(
          batch, step_cfg, shd.batch_size_of(mesh), scored=False))
      jax.device_get(m)
      t_end = time.perf_counter()
      if step > 0:  # step 0 compiles
        # The step as the trainer runs it: generate + decode + one (process) reward + update.
        step_s.append((t_args - t0) + per_step["process"][-1] + (t_end - t_rew))
        batch_sizes.append(len(a[1]))
        chars.append(sum(map(len, a[1])))
  finally:
    worker.close()

  n = len(step_s)
  print(f"\n{n} steps of {_CONFIG.value} with task.reward={_REWARD.value!r}: {batch_sizes[0]} "
        f"completions per step ({statistics.median(chars) / batch_sizes[0]:.1f} characters "
        f"each, median); each way called {_REPEATS.value} times per step, median per step")
  print(f"| way | median ms per step | p90 ms |")
  print(f"|---|---|---|")
  for w in calls:
    print(f"| {w} | {1e3 * statistics.median(per_step[w]):.3f} | "
          f"{1e3 * _q(per_step[w], 0.9):.3f} |")
  over = [p - t for p, t in zip(per_step["process"], per_step["thread"])]
  print(f"\nprocess - thread, per step: median {1e3 * statistics.median(over):.3f} ms "
        f"(p90 {1e3 * _q(over, 0.9):.3f} ms); median step {statistics.median(step_s):.3f} s, "
        f"so {100 * statistics.median(over) / statistics.median(step_s):.3f}% of a step")
  print(f"first call (forks the worker, pid {os.getpid()} RSS "
        f"{_rss_mb():.0f} MB): {1e3 * fork_s:.1f} ms")


def _rss_mb() -> float:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return float("nan")


if __name__ == "__main__":
  app.run(main)
