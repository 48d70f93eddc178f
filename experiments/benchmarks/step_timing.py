"""One training step timed as the trainer runs it: the helper bench_step.py and ab_step_time.py
(in this folder, experiments/benchmarks/) share (no absl flags, so both can import it;
ab_step_time's workers run it against an older checkout's rlx, so it uses only long-standing
APIs)."""

import time

import jax

from rlx import train, trainer


def host_scorer(setup):
  """The run's Python reward (task.reward, e.g. bench_peers' even_reward) as the trainer calls
  it between the generate and update halves: ro -> rewards, or None where the task's jnp
  verifier scores in the jitted rollout. Without it a Python-reward config would be timed on
  the verifier's rewards: all zero on a task it does not match, so every row would be dropped
  as signal-free and the update would time next to nothing."""
  fn = trainer.host_reward_fn(setup.spec)
  if fn is None:
    return None
  return lambda ro: trainer._host_rewards(ro.batch, setup.exp, fn, setup.mesh)  # pylint: disable=protected-access


def timed_step(fns, cfg, state, pool, host=None):
  """One step: (state, rollouts, host rewards or None, metrics, generation s, update s).
  `host` (see `host_scorer`): generate, the Python reward on the host (timed as generation,
  as the trainer counts it), then score + update in one call; the rollouts returned are then
  unscored (train.score(state, ro, rewards) gives the batch the update saw)."""
  t0 = time.perf_counter()
  rewards = None
  if host is None:
    state, ro = fns.rollout(state, pool)
    shape = train.update_shape(ro, cfg, jax.device_count())  # waits for the rollout
    t1 = time.perf_counter()
    state, m = fns.update(state, ro, **shape)
  else:
    state, ro, _ = fns.generate(state, pool)
    rewards = host(ro)
    shape = train.update_shape(ro, cfg, jax.device_count(), scored=False)
    t1 = time.perf_counter()
    state, m = fns.score_update(state, ro, rewards, **shape)
  m = jax.device_get(m)
  return state, ro, rewards, m, t1 - t0, time.perf_counter() - t1
