"""The host loop: set up, restore, run the jitted step halves, evaluate, log, checkpoint.

All the math lives in `rlx.train` (pure, jitted); this file only moves control: one
`rollout` and one `update` call per step (timed separately, so the ledger can say where the
time went), periodic greedy evaluation on the held-out set, metrics to WORKDIR/metrics.jsonl
and orbax checkpoints. A rerun with the same workdir resumes from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
from typing import Any, Callable

import jax
import ml_collections as mlc
import numpy as np

from rlx import checkpoint as ckpt_lib
from rlx import configs, evaluate, experiment, memory, memory_overlap, metrics as metrics_lib
from rlx import pipeline, resume, reward_worker, step_modes, tensorboard, train
from rlx import sharding as shd
from rlx.data import registry
from rlx.model import lora as lora_lib
# The benchmarks score rollouts with the trainer's reward helpers under these names.
from rlx.step_modes import host_rewards as _host_rewards  # noqa: F401
from rlx.step_modes import reward_args as _reward_args  # noqa: F401
from rlx.workdir import WorkdirLock


def _check_writable(directory: str, flag: str) -> None:
  try:
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, f".rlx_write_probe{jax.process_index()}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    what = f"{flag}={directory!r}" if flag.startswith("--") else f"{flag} {directory!r}"
    raise configs.ConfigError(f"{what} is not writable ({e.strerror}); choose a directory "
                              f"you can write to.") from None


def step_config(spec: configs.RunSpec, tokenizer) -> train.StepConfig:
  stop_ids = tuple(getattr(tokenizer, "stop_ids", ()) or ())
  sampling = spec.sampler.sampling(eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                                   stop_ids=stop_ids)
  return train.StepConfig.from_spec(
      spec, sampling=sampling, verifier=registry.verifier_for(spec.task, tokenizer),
      probe_references=registry.get_task(spec.task.name).probe_references is not None)


def dtype_note(spec: configs.RunSpec) -> str:
  """' (model.dtype='auto' on gpu)' where the compute dtype was chosen for the backend."""
  return f" (model.dtype='auto' on {jax.default_backend()})" if spec.model.auto_dtype else ""


def band_accuracy(m: dict[str, float], band) -> float:
  """Mean accuracy over the band's levels (empty band: overall accuracy)."""
  if not band:
    return float(m["eval/accuracy"])
  vals = [m[f"eval/accuracy_d{int(l)}"] for l in band if f"eval/accuracy_d{int(l)}" in m]
  return float(np.mean(vals)) if vals else float("nan")


def host_reward_fn(spec: configs.RunSpec):
  """The checked Python reward named by config.task.reward, or None for the jnp verifier.

  "exact_match": the task's token-level jnp verifier inside the jitted step (default).
  A registered name ("math", "exact", see rlx.rewards) or "package.module:function": host
  Python between the rollout and update halves.
  """
  name = spec.task.reward
  if name == "exact_match":
    return None
  from rlx import rewards  # pylint: disable=g-import-not-at-top
  if ":" in name:
    import importlib  # pylint: disable=g-import-not-at-top
    module, _, attr = name.partition(":")
    try:
      fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
      raise configs.ConfigError(f"config.task.reward={name!r} cannot be imported ({e}).") from None
  else:
    try:
      fn = rewards.get_reward(name)
    except (KeyError, ValueError) as e:
      raise configs.ConfigError(f"config.task.reward={name!r}: {e}") from None
  if not callable(fn):
    raise configs.ConfigError(f"config.task.reward={name!r} names {type(fn).__name__} "
                              f"{fn!r:.80}, not a function.")
  lo, hi = spec.guard.reward_range
  return rewards.wrap_reward(fn, task_name=spec.task.name, low=lo, high=hi)


@dataclasses.dataclass
class Setup:
  """Everything a run needs before its first step (shared by `run` and the benchmarks)."""

  spec: configs.RunSpec
  exp: experiment.Experiment
  mesh: Any
  step_cfg: train.StepConfig
  tx: Any
  state: train.TrainState
  fns: train.StepFns
  gen_mesh: Any = None  # overlap mode: the generator's sub-mesh (`mesh` is the learner's)

  @property
  def held_out(self):
    """The held-out examples (prompts, answers, difficulty) that evaluation scores."""
    return self.exp.eval_host


def resolve(config: mlc.ConfigDict | configs.RunSpec, devices=None):
  """(RunSpec, mesh): the config checked against the mesh it will run on (overlap mode: the
  learner's sub-mesh; `pipeline.make_meshes` gives both)."""
  spec = configs.resolve(config)
  m = spec.mesh
  if spec.pipeline.mode == "overlap":
    mesh = pipeline.make_meshes(spec, devices)[1]
  else:
    mesh = shd.make_mesh(m.data, m.fsdp, m.tensor, devices=devices)
  if not isinstance(config, configs.RunSpec):
    spec = configs.resolve(config, shd.batch_size_of(mesh))
  return spec, mesh


def build(config: mlc.ConfigDict | configs.RunSpec, workdir: str, *,
          log: Callable[[str], None] = print, devices=None,
          show_progress: bool = False, check_stop: Callable[[], None] | None = None) -> Setup:
  """Validates the config, prepares data / tokenizer / base model, compiles nothing yet.

  devices: the devices of the mesh (default: all devices of all processes). Writes only
  caches (WORKDIR/data, tokenizer, base); the run's record (config.json) is `run`'s.
  """
  spec, mesh = resolve(config, devices)
  _check_writable(workdir, "--workdir")
  has_checkpoints = os.path.isdir(os.path.join(workdir, "checkpoints")) and any(
      name.isdigit() for name in os.listdir(os.path.join(workdir, "checkpoints")))
  exp = experiment.setup(spec, workdir, log=log, resuming=has_checkpoints,
                         show_progress=show_progress, check_stop=check_stop, mesh=mesh)
  log(f"[rlx] model: {exp.model_cfg.num_params() / 1e6:.2f}M params "
      f"({exp.model_cfg.num_layers} layers, d_model {exp.model_cfg.d_model}), computing in "
      f"{spec.model.dtype}{dtype_note(spec)} with {spec.model.param_dtype} master params; "
      f"base: {exp.base_source}")
  log(f"[rlx] mesh {dict(mesh.shape)}; RL pool {exp.train_pool.size} prompts (levels "
      f"{spec.task.rl_levels or spec.task.levels}), eval {exp.eval_pool.size} prompts")
  gen_mesh = pipeline.make_meshes(spec, devices)[0] if spec.pipeline.mode == "overlap" else None
  for role, mem in _plans(spec, exp.model_cfg, mesh, gen_mesh, num_prompts=exp.train_pool.size,
                          prompt_width=exp.train_pool.max_prompt_len):
    log(f"[rlx] memory plan{role}: peak {memory.human(mem.total_bytes)} per device of "
        f"{memory.human(mem.capacity_bytes)} ({mem.peak_phase}); --dry_run prints the whole "
        f"plan")
    if spec.memory.check:
      memory.check_fits(mem)
  rows = spec.rl.prompts_per_step * spec.rl.group_size + (
      spec.replay.num_samples if spec.replay is not None else 0)
  shape = spec.record.get("update_shape", {})  # the config as given (`config` may be a RunSpec)
  if 0 < spec.rl.update_micro_rows < rows and not shape.get("micro_rows", 0):
    log(f"[rlx] update: micro-batches of <= {spec.rl.update_micro_rows} rows on CPU "
        f"(config.update_shape.cpu_micro_tokens={shape.get('cpu_micro_tokens')}; 0 turns it "
        f"off)")
  cfg = step_config(spec, exp.tokenizer)
  o = spec.optim
  tx = train.make_optimizer(o.lr, spec.total_steps, warmup_steps=o.warmup_steps,
                            schedule=o.schedule, weight_decay=o.weight_decay,
                            grad_clip=o.grad_clip, b1=o.b1, b2=o.b2,
                            updates_per_step=cfg.num_updates * cfg.num_minibatches)
  state = train.init_state(exp.base_params, tx, spec.seed, mesh,
                           with_ref=cfg.loss.kl_coef > 0, num_prompts=exp.train_pool.size,
                           prompt_groups=np.unique(np.asarray(exp.train_pool.difficulty),
                                                   return_inverse=True)[1],
                           replay=cfg.replay, prompt_width=exp.train_pool.max_prompt_len,
                           max_new_tokens=cfg.sampling.max_new_tokens, lora=cfg.lora,
                           selector_spread=cfg.selection.bucket_score == "spread",
                           length_levels=np.unique(np.asarray(exp.train_pool.difficulty))
                           if cfg.length.length_reward > 0 and cfg.length.guard_margin > 0
                           else None)
  if cfg.lora is not None:
    n = lora_lib.num_params(state.params)
    log(f"[rlx] LoRA rank {cfg.lora.rank} (alpha {cfg.lora.alpha:g}) on "
        f"{len(lora_lib.adapter_paths(state.params))} matrices: {n / 1e6:.3f}M trainable "
        f"params ({100 * n / exp.model_cfg.num_params():.2f}% of the model), base frozen in "
        f"{jax.tree.leaves(state.base)[0].dtype}")
  fns = train.make_step_fns(exp.graphdef, cfg, tx, mesh, jax.eval_shape(lambda: state))
  if gen_mesh is not None:
    log(f"[rlx] pipeline overlap: generator sub-mesh {dict(gen_mesh.shape)}, learner "
        f"sub-mesh {dict(mesh.shape)}, generator up to {spec.pipeline.max_staleness} "
        f"step(s) ahead")
  return Setup(spec=spec, exp=exp, mesh=mesh, step_cfg=cfg, tx=tx, state=state, fns=fns,
               gen_mesh=gen_mesh)


def _plans(spec: configs.RunSpec, model_cfg, mesh, gen_mesh, **kw):
  """[(label, MemoryPlan)]: the run's mesh, or (overlap) each sub-mesh."""
  if gen_mesh is None:
    return [("", memory.plan(spec, model_cfg, dict(mesh.shape), **kw))]
  gen, learn = memory_overlap.plan_overlap(spec, model_cfg, dict(gen_mesh.shape),
                                           dict(mesh.shape), **kw)
  return [(f" (generator sub-mesh {dict(gen_mesh.shape)})", gen),
          (f" (learner sub-mesh {dict(mesh.shape)})", learn)]


def dry_run(config: mlc.ConfigDict | configs.RunSpec, workdir: str, *,
            devices=None) -> tuple[Any, str]:
  """The memory plan of a run, without data, weights or compilation: (plan, text).

  The model shape comes from config.model.path's config.json (weights are not read) or from
  config.model (vocabulary: the workdir's tokenizer if present, else
  config.tokenizer.vocab_size, an upper bound).
  """
  from rlx.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  from rlx.model import hf  # pylint: disable=g-import-not-at-top
  spec, mesh = resolve(config, devices)
  if spec.model.path:
    model_cfg = spec.model.run_as(hf.config_from_hf(
        hf.read_config(spec.model.path), dtype=spec.model.dtype,
        param_dtype=spec.model.param_dtype))
  else:
    tok_path = os.path.join(workdir, "tokenizer.model")
    vocab = (Tokenizer.load(tok_path).vocab_size if os.path.exists(tok_path)
             else spec.tokenizer.vocab_size)
    model_cfg = spec.model.tiny(vocab)
  gen_mesh = pipeline.make_meshes(spec, devices)[0] if spec.pipeline.mode == "overlap" else None
  plans = _plans(spec, model_cfg, mesh, gen_mesh)
  text = (f"model: {model_cfg.num_params() / 1e6:.1f}M params, {model_cfg.num_layers} layers, "
          f"d_model {model_cfg.d_model}, vocab {model_cfg.vocab_size}\n" + "\n".join(
              (f"== {label.strip(' ()')}\n" if label else "") + memory.format_plan(p)
              for label, p in plans))
  # The plan that decides: the one closest to its capacity (overlap: either sub-mesh).
  plan = min((p for _, p in plans), key=lambda p: p.headroom_bytes)
  return plan, text


class Preempted(Exception):
  """Raised after a SIGTERM / SIGINT once the current step's checkpoint is saved."""


class NumericError(RuntimeError):
  """Training produced non-finite values K steps in a row, or invalid rewards."""


RewardError = reward_worker.RewardError  # a host reward hung, exited or killed its process


def run(config: mlc.ConfigDict | configs.RunSpec, workdir: str, *,
        log: Callable[[str], None] = print, show_progress: bool = True,
        devices=None) -> dict[str, Any]:
  """Trains per `config` in `workdir`; returns a summary (accuracy before/after, timings).

  Rerunning with the same workdir resumes from the last checkpoint; SIGTERM / SIGINT save
  a checkpoint at the end of the current step (or, before the first step, stop at once) and
  raise `Preempted`. One run at a time holds a workdir (WorkdirBusy otherwise).
  """
  main_process = jax.process_index() == 0
  if not main_process:
    log, show_progress = (lambda s: None), False
  spec, _ = resolve(config, devices)  # before touching the workdir: a bad config changes nothing
  _check_writable(workdir, "--workdir")
  lock = WorkdirLock(workdir) if main_process else contextlib.nullcontext()
  with lock, resume.SignalFlag() as stop:
    _check_writable(os.path.join(workdir, "checkpoints"), "the checkpoint directory")
    try:
      return _run(spec, workdir, log=log, show_progress=show_progress, devices=devices,
                  stop=stop, main_process=main_process)
    except resume.Stop as e:
      raise Preempted(
          f"stopped by {signal.Signals(e.signum).name} before the first RL step of this "
          f"process: there was no new step to checkpoint (the data, tokenizer and warm-start "
          f"caches already written are kept). Rerun the same command to resume.") from None


def _checked_host_reward(spec: configs.RunSpec):
  """`host_reward_fn(spec)`, refused with the step modes that need the jnp verifier."""
  host_reward = host_reward_fn(spec)
  if host_reward is not None and spec.adaptive is not None:
    raise configs.ConfigError(
        f"config.adaptive.first={spec.adaptive.first} with the host Python reward "
        f"config.task.reward={spec.task.reward!r}: the second round is chosen from the first "
        f"round's rewards inside the jitted rollout, which needs the task's jnp verifier.")
  if host_reward is not None and spec.pipeline.mode == "overlap":
    raise configs.ConfigError(
        f"config.pipeline.mode='overlap' with the host Python reward config.task.reward="
        f"{spec.task.reward!r}: overlap mode scores rollouts with the task's jnp verifier on "
        f"the devices; use pipeline.mode='sync' for host rewards.")
  return host_reward


# ------------------------------------------------------------------------------ the host loop


def _run(spec: configs.RunSpec, workdir: str, *, log, show_progress: bool, devices,
         stop: resume.SignalFlag, main_process: bool) -> dict[str, Any]:
  host_reward = _checked_host_reward(spec)  # an unknown reward fails before any work
  setup = build(spec, workdir, log=log, devices=devices, show_progress=show_progress,
                check_stop=stop.check)
  stop.check()
  loop = _Loop(setup, workdir, host_reward, log=log, show_progress=show_progress, stop=stop,
               main_process=main_process)  # restores the last checkpoint, starts the mode
  try:
    loop.open_logs()
    loop.evaluate_base()
    loop.save_record()
    loop.begin_steps()  # from here a signal stops the loop at the next step boundary
    for step in range(loop.start, spec.total_steps):
      m = loop.step(step)  # the step mode's halves, the guards, the timings
      loop.evaluate_if_due(m)
      loop.log_step(m)
      loop.check_skips(m)
      loop.checkpoint_if_due()
    stop.deferred = False
    loop.saver.close()
  except BaseException:
    stop.deferred = False
    loop.close_quietly()
    raise
  loop.close_logs()
  return loop.closing_lines()


class _Loop:
  """One run's host side between `build` and its closing lines: the step mode, checkpoints,
  evaluation, the metric writers, the progress bar and the running tallies; one method per
  phase of `_run`."""

  def __init__(self, setup: Setup, workdir: str, host_reward, *, log, show_progress: bool,
               stop: resume.SignalFlag, main_process: bool):
    spec, exp = setup.spec, setup.exp
    self.spec, self.setup, self.workdir, self.log = spec, setup, workdir, log
    self.show_progress, self.stop, self.main_process = show_progress, stop, main_process
    self.band = spec.task.band
    abstract = jax.eval_shape(lambda: setup.state)
    self.ckpt = ckpt_lib.Checkpointer(workdir, keep=spec.checkpoint.keep)
    self.saver = resume.Saver(self.ckpt)
    self.meta = {"model": exp.model_cfg.to_dict(), "config": spec.record}
    self.mode = step_modes.make(setup, host_reward, stop, self.preempt, abstract)
    self.state, self.start, self.resumed = self._restore(abstract)
    # Overlap: the first batches go to the generator before anything else.
    self.state = self.mode.start(self.state, self.start)
    self.evaluator = self._evaluator()
    self.writer = metrics_lib.JsonlWriter(os.path.join(workdir, "metrics.jsonl"),
                                          resume_step=self.start if self.resumed else None,
                                          enabled=main_process)
    self.tb = self.bar = None
    self.base_eval: dict[str, float] = {}
    self.last_eval: dict[str, float] = {}
    self.gen_times, self.upd_times, self.tok_rates = [], [], []
    self.skipped_in_a_row = 0
    self.done = self.start
    self.updates_per_step = setup.step_cfg.num_updates * setup.step_cfg.num_minibatches

  # ---------------------------------------------------------------- setup

  def _restore(self, abstract):
    """(state, first step, resumed): the last checkpoint's state, or the built one."""
    latest = self.ckpt.latest_step()
    if latest is None:
      return self.setup.state, 0, False
    state = self.mode.restore(self.ckpt, latest, abstract, self.spec.record, self.log)
    self.log(f"[rlx] resumed from {self.ckpt.directory}/{latest}")
    if latest >= self.spec.total_steps:
      self.log(f"[rlx] the checkpoint already holds step {latest} >= config.total_steps="
               f"{self.spec.total_steps}: nothing is trained; its policy is evaluated")
    return state, int(latest), True

  def _evaluator(self) -> evaluate.Evaluator:
    exp, cfg, tok = self.setup.exp, self.setup.step_cfg, self.setup.exp.tokenizer
    greedy = self.spec.sampler.sampling(eos_id=tok.eos_id, pad_id=tok.pad_id,
                                        stop_ids=tuple(getattr(tok, "stop_ids", ()) or ()),
                                        greedy=True)
    return evaluate.Evaluator(exp.graphdef, exp.eval_pool, greedy,
                              self.spec.sampler.eval_batch_size, self.mode.eval_mesh,
                              verifier=cfg.verifier, band=self.band,
                              host_reward=self.mode.eval_reward, host=exp.eval_host,
                              tokenizer=tok, show_progress=self.show_progress,
                              check_stop=self.stop.check, sampler_impl=cfg.sampler_impl,
                              paged=cfg.paged)

  def open_logs(self) -> None:
    if self.main_process:
      self.tb = tensorboard.SummaryWriter(os.path.join(self.workdir, "tb"),
                                          purge_step=self.start or None)

  def evaluate_base(self) -> None:
    """The base policy's evaluation: run once (and kept in eval_base.json), read on resume."""
    path = os.path.join(self.workdir, "eval_base.json")
    if not self.resumed or not os.path.exists(path):
      self.base_eval = self._evaluate()
      if self.main_process:
        ckpt_lib.save_json(path, self.base_eval)
      if not self.resumed:
        self.writer.write(0, self.base_eval)
        if self.tb:
          self.tb.scalars(0, self.base_eval)
    else:
      self.base_eval = ckpt_lib.read_json(path)
    self.log("[rlx] before RL: " + _fmt_eval(self.base_eval, self.band))
    self.last_eval = self.base_eval if self.start == 0 else {}

  def save_record(self) -> None:
    """The run's record, written once the workdir is known to accept this config."""
    if self.main_process:
      ckpt_lib.save_json(os.path.join(self.workdir, "config.json"), self.spec.record)

  def begin_steps(self) -> None:
    """The progress bar; then a signal no longer stops at once (`resume.SignalFlag.deferred`)."""
    self.bar = metrics_lib.progress(self.spec.total_steps, initial=self.start,
                                    disable=not self.show_progress)
    self.stop.check()
    self.stop.deferred = True

  # ---------------------------------------------------------------- one step

  def step(self, step: int) -> dict[str, float]:
    """Runs the step; its metrics, checked, with the generation rate and the tallies."""
    self.state, m = self.mode.step(self.state, step)
    if m.get("guard/signal_rows_left_out", 0) > 0:  # a bug, never a data problem
      raise RuntimeError(f"step {step + 1}: the update left out "
                         f"{int(m['guard/signal_rows_left_out'])} rows with a learning signal.")
    if m.get("guard/rows_over_width", 0) > 0:  # a bug, never a data problem
      raise RuntimeError(f"step {step + 1}: the update cut {int(m['guard/rows_over_width'])} "
                         f"rows shorter than their length.")
    _check_rewards(m, self.setup.exp, self.spec)
    t_gen = m["time/generate_s"]
    m["ledger/generated_tokens_per_s"] = m["ledger/tokens_generated"] / max(t_gen, 1e-9)
    if step > self.start:  # the first step of a process includes compilation
      self.gen_times.append(t_gen)
      self.upd_times.append(m["time/update_s"])
      self.tok_rates.append(m["ledger/generated_tokens_per_s"])
    self.done = step + 1
    return m

  def _evaluate(self) -> dict[str, float]:
    m = self.evaluator(self.mode.eval_params(self.state))
    m["eval/band_accuracy"] = band_accuracy(m, self.band)
    return m

  def evaluate_if_due(self, m: dict[str, float]) -> None:
    if self.done % self.spec.eval_every == 0 or self.done == self.spec.total_steps:
      try:
        self.last_eval = self._evaluate()
        m.update(self.last_eval)
      except resume.Stop:  # a signal while the host reward scored it: save the step without it
        pass

  def log_step(self, m: dict[str, float]) -> None:
    self.writer.write(self.done, m)
    if self.tb:
      self.tb.scalars(self.done, m)
    self.bar.update(1)
    self.bar.set_postfix({**metrics_lib.postfix(m), **(
        {"eval": f"{self.last_eval['eval/band_accuracy']:.3f}"} if self.last_eval else {})})

  def check_skips(self, m: dict[str, float]) -> None:
    """Stops a run whose every update has been skipped (non-finite) K steps in a row."""
    self.skipped_in_a_row = (self.skipped_in_a_row + 1
                             if m["guard/skipped_updates"] >= self.updates_per_step else 0)
    max_skips = self.spec.guard.max_consecutive_skips
    if self.skipped_in_a_row >= max_skips:
      raise NumericError(
          f"{self.skipped_in_a_row} consecutive steps (up to step {self.done}) had a non-finite "
          f"loss or gradient in every update and were skipped (config.guard."
          f"max_consecutive_skips={max_skips}). Lower config.optim.lr, check the rewards, "
          f"or resume from the last checkpoint in {self.ckpt.directory}.")

  def preempt(self, done: int, state) -> None:
    _preempt(self.saver, done, state, self.meta, self.stop)

  def checkpoint_if_due(self) -> None:
    """Saves the step when due; after a signal, saves it and raises Preempted."""
    if self.stop.signum is not None:
      self.preempt(self.done, self.mode.to_save(self.state))
    if self.done % self.spec.checkpoint.every == 0 or self.done == self.spec.total_steps:
      self.saver.save(self.done, self.mode.to_save(self.state), self.meta)
      resume.fault("kill_in_save", self.done)

  # ---------------------------------------------------------------- the end

  def close_quietly(self) -> None:
    """After an error: the error being raised is the one to report (a full disk also fails
    the metric writers, whose errors would otherwise replace it)."""
    for closer in (self.mode.close, getattr(self.bar, "close", None), self.writer.close,
                   getattr(self.tb, "close", None), self.ckpt.close):
      if closer is not None:
        with contextlib.suppress(Exception):
          closer()

  def close_logs(self) -> None:
    for closer in (self.bar.close, self.writer.close, getattr(self.tb, "close", None)):
      if closer is not None:
        closer()

  def closing_lines(self) -> dict[str, Any]:
    """The final evaluation (the last step's, when it had one), the closing lines, and the
    run's summary."""
    try:
      final = self.last_eval if self.last_eval else self._evaluate()
    finally:
      self.mode.close()
    base_eval, band = self.base_eval, self.band
    if "eval/band_accuracy" not in final:
      final["eval/band_accuracy"] = band_accuracy(final, band)
    self.log("[rlx] after RL:  " + _fmt_eval(final, band))
    gain = 100 * (final["eval/band_accuracy"] - base_eval["eval/band_accuracy"])
    self.log(f"[rlx] held-out greedy accuracy on the band (levels {band}): "
             f"{100 * base_eval['eval/band_accuracy']:.1f}% -> "
             f"{100 * final['eval/band_accuracy']:.1f}% ({gain:+.1f} points) after "
             f"{self.done} RL steps")  # a resume past total_steps trains none: its step
    for line in _level_changes(base_eval, final, band):
      self.log(line)
    gen, upd = self.gen_times, self.upd_times
    if gen:
      self.log(f"[rlx] median step: generation {np.median(gen):.3f}s, update "
               f"{np.median(upd):.3f}s, {np.median(self.tok_rates):.0f} generated tokens/s")
    return {"before": base_eval, "after": final, "gain_points": gain,
            "median_generate_s": float(np.median(gen)) if gen else None,
            "median_update_s": float(np.median(upd)) if upd else None,
            "state": self.state}


def _preempt(saver: resume.Saver, done: int, state, meta, stop: resume.SignalFlag):
  """Saves step `done` unless it is already saved (waiting until it is complete on disk),
  then raises Preempted."""
  existed = saver.ensure(done, state, meta)
  raise Preempted(
      f"stopped by {signal.Signals(stop.signum).name} after step {done}; checkpoint "
      f"saved to {saver.ckpt.directory}/{done}"
      f"{' (already saved before the signal)' if existed else ''}. Rerun the same command "
      f"to resume.")


def _check_rewards(m: dict[str, float], exp: experiment.Experiment,
                   spec: configs.RunSpec) -> None:
  if m.get("reward/invalid_count", 0) > 0:
    pid = int(m["reward/first_invalid_prompt"])
    lo, hi = spec.guard.reward_range
    raise NumericError(
        f"task {spec.task.name!r}: reward {m['reward/first_invalid_value']} for train "
        f"example {pid} (prompt {exp.train_host.prompts[pid]!r:.120}) is non-finite or "
        f"outside [{lo}, {hi}] ({int(m['reward/invalid_count'])} such rollouts in this step).")


def _level_changes(before: dict[str, float], after: dict[str, float], band) -> list[str]:
  """The run's closing lines: every level's accuracy change (RL must not break what the base
  already solved) and the band's mean correct-completion length before and after."""
  levels = sorted(int(k.rsplit("_d", 1)[1]) for k in after if k.startswith("eval/accuracy_d"))
  parts = []
  for l in levels:
    b, a = (100 * m.get(f"eval/accuracy_d{l}", math.nan) for m in (before, after))
    parts.append(f"d{l} {b:.1f} -> {a:.1f}% ({a - b:+.1f})")
  lines = ["[rlx] per level: " + ", ".join(parts)] if parts else []
  b, a = (m.get("eval/band_correct_len_mean", math.nan) for m in (before, after))
  if math.isfinite(b) and math.isfinite(a) and b > 0:
    lines.append(f"[rlx] correct band completions: {b:.1f} -> {a:.1f} tokens "
                 f"({100 * (a / b - 1):+.1f}%)")
  return lines


def _fmt_eval(m: dict[str, float], band) -> str:
  levels = sorted(int(k.rsplit("_d", 1)[1]) for k in m if k.startswith("eval/accuracy_d"))
  parts = [f"d{l} {100 * m[f'eval/accuracy_d{l}']:.1f}%" + ("*" if l in band else "")
           for l in levels]
  return "held-out accuracy " + ", ".join(parts) + "  (* = band)"
