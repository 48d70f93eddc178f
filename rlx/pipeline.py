"""Generation and training overlapped on two sub-meshes, bounded staleness (config.pipeline).

In "sync" mode (the default) one mesh takes turns: the sampler decodes while the update's
work waits, then the other way round. In "overlap" mode the devices split into a generator
sub-mesh and a learner sub-mesh and the two roles run at once, the generator k =
`max_staleness` steps ahead (one-step-off-policy for k = 1, as in verl's one-step-off mode,
AReaL's bounded staleness and PipelineRL):

  step t:  generator  batch t+k = generate(theta_t)             (dispatched first)
           learner    theta_{t+1} = update(theta_t, batch t)    (runs at the same time)
           then theta_{t+1} is resharded onto the generator's sub-mesh, device to device.

Each role is a pure jitted function over its own sub-mesh and the host loop only dispatches
them: JAX's asynchronous dispatch keeps both programs in flight; the host blocks only for the
update's static shape (a few scalars of the batch it is about to train on) and for logging.

Roles and what they own:
  learner    TrainState: params, optimizer, replay ring, selector (rlx.train)
  generator  its copy of the policy params (merged for LoRA), the selector's snapshot of the
             same step, its RNG stream (`gen_rng`), and the batches in flight (`InFlight`,
             already moved to the learner's sub-mesh as soon as they are dispatched).

The generator's RNG stream is the sync step's: batch t uses the key the sync step would use
for step t, and the learner trains batch t with the RNG state that followed it, so k = 0
reproduces the sync step exactly and k >= 1 is a sequential one-step-off run with the same
keys. Every row records the policy version that generated it (Batch.policy_version); the
update's decoupled correction (rl.is_mode / rl.anchor) handles the staleness as it does for
replayed rows, and the ledger reports its histogram.

A checkpoint in overlap mode holds the learner's state, the generator's RNG and the batches
in flight (`OverlapState`): a resumed run trains exactly the batches the interrupted one had
generated and continues bitwise as if never stopped.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from rlx import configs
from rlx import sharding as shd
from rlx import train


@struct.dataclass
class InFlight:
  """One generated batch waiting to be trained on (on the learner's sub-mesh)."""

  batch: train.Batch
  stats: jax.Array  # f32[S] the rollout's ledger scalars, in `Overlap.stat_keys` order
  rewards: jax.Array  # f32[B] the task's jnp verifier rewards
  rng: jax.Array  # u32[2] the generator's RNG after this batch: the learner's RNG for it


@struct.dataclass
class OverlapState:
  """What an overlap-mode checkpoint holds."""

  learner: train.TrainState
  gen_rng: jax.Array  # u32[2] the generator's RNG for its next batch
  in_flight: tuple  # InFlight per batch generated and not yet trained on, oldest first


def num_in_flight(done: int, total_steps: int, max_staleness: int) -> int:
  """Batches in flight after `done` steps: the generator stops at the last step's batch."""
  return max(0, min(max_staleness, total_steps - done))


def make_meshes(spec: configs.RunSpec, devices=None) -> tuple[Mesh, Mesh]:
  """(generator sub-mesh, learner sub-mesh) over disjoint devices.

  The generator takes the first `pipeline.generator_devices` devices (0: half), data-parallel
  with `generator_tensor`-way tensor parallelism; the learner the rest, shaped by
  config.mesh (data -1: what is left).
  """
  if jax.process_count() > 1:
    raise configs.ConfigError(
        f"config.pipeline.mode='overlap' with {jax.process_count()} processes: overlap mode "
        f"runs in one process for now (each sub-mesh's program would have to be dispatched "
        f"by every process that owns one of its devices); use pipeline.mode='sync'.")
  devices = list(devices if devices is not None else jax.devices())
  n, p = len(devices), spec.pipeline
  g = p.generator_devices or n // 2
  if not 1 <= g < n:
    raise configs.ConfigError(
        f"config.pipeline.generator_devices={p.generator_devices} with {n} devices: overlap "
        f"needs at least one generator and one learner device (expected 1..{n - 1}, or 0 for "
        f"half).")
  try:
    gen_mesh = shd.make_mesh(-1, 1, p.generator_tensor, devices=devices[:g])
  except ValueError as e:
    raise configs.ConfigError(f"config.pipeline.generator_tensor={p.generator_tensor} on the "
                              f"{g} generator devices: {e}") from None
  m = spec.mesh
  try:
    learn_mesh = shd.make_mesh(m.data, m.fsdp, m.tensor, devices=devices[g:])
  except ValueError as e:
    raise configs.ConfigError(f"config.mesh on the {n - g} learner devices (config.pipeline."
                              f"generator_devices={g} of {n}): {e}") from None
  nb = shd.batch_size_of(gen_mesh)
  rows = spec.rl.prompts_per_step * spec.rl.group_size * spec.selection.groups_sampled_factor
  if rows % nb:
    raise configs.ConfigError(
        f"the {rows} rollouts sampled per step cannot be split over the {nb} generator "
        f"devices (config.pipeline.generator_devices={g}); use a multiple of {nb}.")
  if spec.sampler.eval_batch_size % nb:
    raise configs.ConfigError(
        f"config.sampler.eval_batch_size={spec.sampler.eval_batch_size} must be a multiple of "
        f"the {nb} generator devices (evaluation decodes on the generator's sub-mesh).")
  return gen_mesh, learn_mesh


class _Watcher:
  """Records when device arrays become ready, on a thread (the host loop never waits)."""

  def __init__(self, clock: Callable[[], float]):
    self._clock = clock
    self._times: dict[Any, float] = {}
    self._cv = threading.Condition()
    self._jobs: collections.deque = collections.deque()
    self._thread = threading.Thread(target=self._loop, daemon=True)
    self._thread.start()

  def watch(self, key, array) -> None:
    with self._cv:
      self._jobs.append((key, array))
      self._cv.notify()

  def ready_time(self, key) -> float:
    """Blocks until `key`'s array is ready; when it became ready."""
    with self._cv:
      while key not in self._times:
        self._cv.wait()
      return self._times.pop(key)

  def _loop(self):
    while True:
      with self._cv:
        while not self._jobs:
          self._cv.wait()
        key, array = self._jobs.popleft()
      try:
        jax.block_until_ready(array)
      except Exception:  # pylint: disable=broad-except
        pass  # the host loop sees the error when it reads the array
      t = self._clock()
      with self._cv:
        self._times[key] = t
        self._cv.notify_all()


@dataclasses.dataclass
class _Pending:
  step: int  # the step that trains on it
  inflight: InFlight  # on the learner's sub-mesh
  dispatch: float  # host time the generation was dispatched (nan: restored from a checkpoint)


class Overlap:
  """The overlap-mode host loop's state: the generator's copy of the policy, its RNG, the
  batches in flight, and the timeline.

    ov = Overlap(...); state = ov.start(state, start_step)           # or start(..., restored)
    for step in ...: state, metrics = ov.step(state, step)
    ov.checkpoint(state)  -> the OverlapState to save after a step

  `fns` are the learner's StepFns (rlx.train.make_step_fns on the learner sub-mesh).
  """

  def __init__(self, graphdef, cfg: train.StepConfig, fns: train.StepFns, *,
               gen_mesh: Mesh, learn_mesh: Mesh, pool, abstract_state: train.TrainState,
               max_staleness: int, total_steps: int, rules=shd.DEFAULT_RULES,
               clock: Callable[[], float] = time.perf_counter):
    self.cfg, self.fns, self.k, self.total = cfg, fns, max_staleness, total_steps
    self.gen_mesh, self.learn_mesh = gen_mesh, learn_mesh
    self._clock = clock
    self.t_origin = clock()
    gen_cfg = dataclasses.replace(cfg, lora=None)  # the generator decodes merged weights
    self._gen_rep = shd.replicated(gen_mesh)
    self.pool = shd.put(pool, self._gen_rep)
    abstract_policy = jax.eval_shape(
        lambda s: train.policy_params(s, cfg), abstract_state)
    self.gen_param_sharding = shd.param_shardings(abstract_policy, gen_mesh, rules)
    self._policy = functools.partial(train.policy_params, cfg=cfg)
    self.stat_keys: tuple[str, ...] = ()

    def generate(params, selector, rng, step, version, pool):
      state = train.TrainState(params=params, opt_state=None, rng=rng, step=step,
                               policy_version=version, selector=selector)
      state, ro, rewards = train.generate(state, pool, graphdef=graphdef, cfg=gen_cfg,
                                          mesh=gen_mesh)
      self.stat_keys = tuple(sorted(ro.stats))  # static: set while tracing
      stats = jnp.stack([ro.stats[k] for k in self.stat_keys]) if ro.stats else (
          jnp.zeros((0,), jnp.float32))
      return InFlight(batch=ro.batch, stats=stats, rewards=rewards, rng=state.rng)

    sel = None if abstract_state.selector is None else jax.tree.map(
        lambda _: self._gen_rep, abstract_state.selector)
    self._generate = jax.jit(generate, in_shardings=(
        self.gen_param_sharding, sel, self._gen_rep, self._gen_rep, self._gen_rep,
        self._gen_rep))
    abstract_gen = jax.eval_shape(generate, abstract_policy, abstract_state.selector,
                                  abstract_state.rng, abstract_state.step,
                                  abstract_state.step, pool)
    self.inflight_sharding = self._inflight_sharding(abstract_gen)
    self._abstract_inflight = jax.tree.map(
        lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        self.inflight_sharding, abstract_gen)

    def score(state, inf: InFlight):
      state = state.replace(rng=inf.rng)
      ro = train.Rollouts(inf.batch, {k: inf.stats[i] for i, k in enumerate(self.stat_keys)})
      return train.score(state, ro, inf.rewards, cfg=cfg, mesh=learn_mesh)
    self._score = jax.jit(score, donate_argnums=0,
                          in_shardings=(fns.state_sharding, self.inflight_sharding),
                          out_shardings=(fns.state_sharding, None))
    self._queue: collections.deque[_Pending] = collections.deque()
    self._watcher = _Watcher(clock)
    self._learn_intervals: collections.deque = collections.deque(maxlen=max_staleness + 2)
    self._last_gen_ready = None
    self._last_learn_ready = None
    self._run = 0
    self.gen_params = self.gen_selector = self.gen_version = self.gen_rng = None

  def _inflight_sharding(self, abstract: InFlight) -> InFlight:
    rep = shd.replicated(self.learn_mesh)
    return InFlight(
        batch=jax.tree.map(lambda x: shd.batch_sharding(self.learn_mesh, x.ndim),
                           abstract.batch),
        stats=rep, rewards=shd.batch_sharding(self.learn_mesh, 1), rng=rep)

  def abstract_checkpoint(self, abstract_state: train.TrainState, done: int):
    """(abstract OverlapState, its shardings) of a checkpoint written after `done` steps."""
    n = num_in_flight(done, self.total, self.k)
    abstract = OverlapState(learner=abstract_state, gen_rng=abstract_state.rng,
                            in_flight=(self._abstract_inflight,) * n)
    shardings = OverlapState(learner=self.fns.state_sharding,
                             gen_rng=shd.replicated(self.learn_mesh),
                             in_flight=(self.inflight_sharding,) * n)
    return abstract, shardings

  # -------------------------------------------------------------- generator side

  def _sync_generator(self, state: train.TrainState) -> None:
    """The learner's latest policy, selector and version onto the generator's sub-mesh
    (device to device: jax.device_put between shardings of the two sub-meshes)."""
    self.gen_params = jax.device_put(self._policy(state), self.gen_param_sharding)
    self.gen_selector = (None if state.selector is None else
                         jax.device_put(state.selector, self._gen_rep))
    self.gen_version = jax.device_put(state.policy_version, self._gen_rep)

  def _dispatch(self, step: int) -> None:
    """Generates the batch that step `step` trains on (with the policy the generator holds);
    the selector's clock reads `step`, as it would in the sync step."""
    t = self._clock()
    inf = self._generate(self.gen_params, self.gen_selector, self.gen_rng,
                         np.int32(step), self.gen_version, self.pool)
    self.gen_rng = inf.rng
    self._watcher.watch((self._run, step), inf.rewards)
    self._queue.append(_Pending(step, jax.device_put(inf, self.inflight_sharding), t))

  def start(self, state: train.TrainState, start: int,
            restored: OverlapState | None = None) -> train.TrainState:
    """Fills the pipeline: the first k batches generated with the start's policy, or (resume)
    the batches in flight from the checkpoint. Starting again (another run with the same
    compiled programs) drops whatever was in flight."""
    self._run += 1  # ready times of an earlier run's batches never match this run's
    self._queue.clear()
    self._learn_intervals.clear()
    self._last_gen_ready = self._last_learn_ready = None
    if restored is not None:
      state = restored.learner
      self._sync_generator(state)
      self.gen_rng = jax.device_put(restored.gen_rng, self._gen_rep)
      for i, inf in enumerate(restored.in_flight):
        self._queue.append(_Pending(start + i, inf, float("nan")))
    else:
      self._sync_generator(state)
      self.gen_rng = jax.device_put(state.rng, self._gen_rep)
      for i in range(num_in_flight(start, self.total, self.k)):
        self._dispatch(start + i)
    return state

  # -------------------------------------------------------------- one step

  def step(self, state: train.TrainState, step: int, *,
           after_rollout: Callable[[], None] | None = None) -> tuple[train.TrainState, dict]:
    """Trains batch `step` while the generator makes batch step + k; returns the learner's
    new state and the step's metrics (host floats, with the timeline). after_rollout: called
    once the batch is scored, before the update (the trainer's fault-injection point)."""
    t0 = self._clock()
    if step + self.k < self.total:  # the generator first: it must not wait for the learner
      self._dispatch(step + self.k)
    cur = self._queue.popleft()
    if cur.step != step:
      raise RuntimeError(f"overlap pipeline out of order: batch for step {cur.step + 1} at "
                         f"step {step + 1}.")
    t_learn = self._clock()
    state, ro = self._score(state, cur.inflight)
    shape = train.update_shape(ro, self.cfg, shd.batch_size_of(self.learn_mesh))  # waits
    if after_rollout is not None:
      after_rollout()
    state, m = self.fns.update(state, ro, **shape)
    self._sync_generator(state)  # theta_{t+1} -> generator, queued behind the update
    m = jax.device_get(m)
    learn_ready = self._clock()
    restored = math.isnan(cur.dispatch)  # generated before this process started
    gen_ready = t_learn if restored else self._watcher.ready_time((self._run, step))
    m = {k: float(v) for k, v in m.items()}
    m.update(self._timeline(cur, gen_ready, t0, t_learn, learn_ready))
    return state, m

  def _timeline(self, cur: _Pending, gen_ready, t0, t_learn, learn_ready) -> dict:
    """Per-step busy / idle times of both sub-meshes (from dispatch and ready times).

    gen_*: the generation of the batch trained this step (it ran during an earlier step when
    k >= 1); learn_*: this step's score + update. A program starts when it is dispatched
    and its sub-mesh has finished the previous one (its inputs are ready by then: the
    generator's policy was the learner's output before the dispatch).
    """
    o = self.t_origin
    gen_start = gen_ready if math.isnan(cur.dispatch) else cur.dispatch
    if self._last_gen_ready is not None:
      gen_start = max(gen_start, self._last_gen_ready)
    gen_start = min(gen_start, gen_ready)
    learn_start = max(t_learn, gen_ready)
    gen_idle = gen_start - self._last_gen_ready if self._last_gen_ready is not None else 0.0
    learn_idle = (learn_start - self._last_learn_ready if self._last_learn_ready is not None
                  else 0.0)
    overlap = sum(max(0.0, min(gen_ready, b) - max(gen_start, a))
                  for a, b in self._learn_intervals)
    self._learn_intervals.append((learn_start, learn_ready))
    self._last_gen_ready, self._last_learn_ready = gen_ready, learn_ready
    gen_busy, learn_busy = gen_ready - gen_start, learn_ready - learn_start
    return {
        "time/generate_s": gen_busy, "time/update_s": learn_busy,
        "time/step_s": learn_ready - t0,
        "pipeline/gen_idle_s": max(gen_idle, 0.0), "pipeline/learn_idle_s": max(learn_idle, 0.0),
        "pipeline/overlap_s": overlap,
        "pipeline/overlap_frac": overlap / max(gen_busy, 1e-9),
        "pipeline/gen_start": gen_start - o, "pipeline/gen_ready": gen_ready - o,
        "pipeline/learn_start": learn_start - o, "pipeline/learn_ready": learn_ready - o,
    }

  def checkpoint(self, state: train.TrainState) -> OverlapState:
    """The learner's state with the generator's RNG and the batches in flight (waits for
    them: they are part of the checkpoint)."""
    return OverlapState(learner=state, gen_rng=jax.device_put(
        self.gen_rng, shd.replicated(self.learn_mesh)),
                        in_flight=tuple(p.inflight for p in self._queue))
