"""The ways of running one RL step, each behind the same small interface, so that the host
loop (rlx.trainer) never asks which one it runs:

  restore(ckpt, step, abstract, record, log) -> state   the checkpoint's state (its layout)
  start(state, start) -> state      ready to train from step `start` (overlap: fill the pipe)
  step(state, step) -> (state, m)   one step; m: host floats with time/generate_s,
                                    time/update_s and time/step_s
  eval_params(state)                the params that evaluation decodes with
  to_save(state)                    what a checkpoint holds
  close()                           ends what the mode started (the host reward's worker)
  eval_mesh, eval_reward            where evaluation decodes, its host reward (or None)

`make` picks a run's mode: HostRewardStep (a Python reward, scored in a worker process),
OverlapStep (config.pipeline.mode='overlap'), FusedStep (config.fused_step) or SyncStep.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import jax
import numpy as np

from rlx import distributed, experiment, pipeline, resume, reward_worker, train
from rlx import sharding as shd

if TYPE_CHECKING:
  from rlx.trainer import Setup


class SyncStep:
  """Sync mode with the task's jnp verifier: the rollout half, then the update half (timed
  apart; the host waits between them only for the update's static shape)."""

  eval_reward = None

  def __init__(self, setup: Setup):
    self.setup, self.fns = setup, setup.fns
    self.eval_mesh = setup.mesh
    self.pool = None

  def restore(self, ckpt, step, abstract, record, log):
    return resume.restore(ckpt, step, abstract, self.fns.state_sharding, self.setup.exp.model_cfg,
                    record, log)

  def start(self, state, start):
    del start
    self.pool = shd.put(self.setup.exp.train_pool, self.fns.pool_sharding)
    return state

  def _update_shape(self, batch, **kw) -> dict:
    return train.update_shape(batch, self.setup.step_cfg, shd.batch_size_of(self.setup.mesh),
                              **kw)

  def step(self, state, step):
    t0 = time.perf_counter()
    state, batch = self.fns.rollout(state, self.pool)
    shape = self._update_shape(batch)  # waits for the rollout
    resume.fault("kill_after_rollout", step + 1)
    t1 = time.perf_counter()
    state, m = self.fns.update(state, batch, **shape)
    return state, timed(jax.device_get(m), t1 - t0, time.perf_counter() - t1)

  def eval_params(self, state):
    return train.policy_params(state, self.setup.step_cfg)

  def to_save(self, state):
    return state

  def close(self):
    pass


class FusedStep(SyncStep):
  """config.fused_step: rollout and update as one jitted program (no time split)."""

  def step(self, state, step):
    t0 = time.perf_counter()
    state, m = self.fns.train_step(state, self.pool)
    m = jax.device_get(m)
    return state, timed(m, time.perf_counter() - t0, 0.0)


class HostRewardStep(SyncStep):
  """Sync mode with a Python reward (config.task.reward): generate on the devices, decode and
  score on the host in a worker process (forked on first use) that a timeout or a signal can
  always end, even while the reward holds the GIL in C code, then score + update."""

  def __init__(self, setup: Setup, host_reward, stop: resume.SignalFlag,
               preempt: Callable[[int, Any], None]):
    super().__init__(setup)
    self.stop, self.preempt = stop, preempt
    self.timeout_s = setup.spec.task.reward_timeout_s
    self.worker = reward_worker.RewardWorker(host_reward, name=repr(setup.spec.task.reward))

  def eval_reward(self, *args, **kwargs):  # a signal while it runs abandons the evaluation
    values = self.worker.call(args, kwargs, timeout_s=self.timeout_s, stop=self.stop)
    if values is None:
      raise resume.Stop(self.stop.signum)
    return values

  def step(self, state, step):
    t0 = time.perf_counter()
    rng_host = np.asarray(jax.device_get(state.rng))  # `generate` changes only the RNG
    state, batch, _ = self.fns.generate(state, self.pool)
    args, kwargs = reward_args(batch.batch, self.setup.exp)
    values = self.worker.call(args, kwargs, timeout_s=self.timeout_s, stop=self.stop)
    if values is None:  # SIGTERM while the reward ran: undo the step, save the last finished
      state = state.replace(rng=shd.put(rng_host, self.fns.state_sharding.rng))
      self.preempt(step, state)
    rewards = shd.put(np.asarray(values, np.float32), shd.batch_sharding(self.setup.mesh, 1))
    resume.fault("kill_after_rollout", step + 1)
    t1 = time.perf_counter()
    state, m = self.fns.score_update(state, batch, rewards,
                                     **self._update_shape(batch, scored=False))
    return state, timed(jax.device_get(m), t1 - t0, time.perf_counter() - t1)

  def close(self):
    self.worker.close()


class OverlapStep:
  """config.pipeline.mode='overlap': `pipeline.Overlap` runs the steps (generation on its own
  sub-mesh, k steps ahead); evaluation decodes there with the generator's copy of the policy,
  and a checkpoint holds the batches in flight."""

  eval_reward = None

  def __init__(self, setup: Setup, abstract):
    self.overlap = pipeline.Overlap(
        setup.exp.graphdef, setup.step_cfg, setup.fns, gen_mesh=setup.gen_mesh,
        learn_mesh=setup.mesh, pool=setup.exp.train_pool, abstract_state=abstract,
        max_staleness=setup.spec.pipeline.max_staleness, total_steps=setup.spec.total_steps)
    self.model_cfg = setup.exp.model_cfg
    self.eval_mesh = setup.gen_mesh
    self.restored = None

  def restore(self, ckpt, step, abstract, record, log):
    layout = self.overlap.abstract_checkpoint(abstract, int(step))
    self.restored = resume.restore(ckpt, step, *layout, self.model_cfg, record, log)
    return self.restored.learner

  def start(self, state, start):
    return self.overlap.start(state, start, self.restored)

  def step(self, state, step):
    return self.overlap.step(state, step,
                             after_rollout=lambda: resume.fault("kill_after_rollout", step + 1))

  def eval_params(self, state):
    del state
    return self.overlap.gen_params

  def to_save(self, state):
    return self.overlap.checkpoint(state)

  def close(self):
    pass


def timed(m: dict, t_gen: float, t_upd: float) -> dict[str, float]:
  """A sync step's metrics as host floats with its timings (overlap times its own)."""
  m = {k: float(v) for k, v in m.items()}
  m.update({"time/generate_s": t_gen, "time/update_s": t_upd, "time/step_s": t_gen + t_upd})
  return m


def make(setup: Setup, host_reward, stop: resume.SignalFlag, preempt, abstract):
  """The step mode of this run (see the module docstring)."""
  if host_reward is not None:
    return HostRewardStep(setup, host_reward, stop, preempt)
  if setup.spec.pipeline.mode == "overlap":
    return OverlapStep(setup, abstract)
  return FusedStep(setup) if setup.spec.fused_step else SyncStep(setup)


def reward_args(batch, exp: experiment.Experiment) -> tuple[tuple, dict]:
  """The Python reward's arguments for a rollout batch: (prompts, completions decoded on the
  host), {answer, difficulty}."""
  tokens = distributed.to_host(batch.completions)
  lengths = distributed.to_host(batch.lengths)
  ids = distributed.to_host(batch.prompt_ids)
  texts = [exp.tokenizer.decode(t[:l]) for t, l in zip(tokens, lengths)]
  h = exp.train_host
  return (([h.prompts[i] for i in ids], texts),
          {"answer": [h.answers[i] for i in ids],
           "difficulty": [int(h.difficulty[i]) for i in ids]})


def host_rewards(batch, exp: experiment.Experiment, host_reward, mesh):
  """Decodes the rollouts on the host and scores them with the Python reward in this process
  (the benchmarks' path; the trainer calls it through its RewardWorker)."""
  args, kwargs = reward_args(batch, exp)
  return shd.put(np.asarray(host_reward(*args, **kwargs), np.float32),
                 shd.batch_sharding(mesh, 1))
