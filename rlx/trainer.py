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
import threading
import time
from typing import Any, Callable

import jax
import ml_collections as mlc
import numpy as np

from rlx import checkpoint as ckpt_lib
from rlx import configs, distributed, evaluate, experiment, memory, metrics as metrics_lib
from rlx import pipeline, reward_worker, tensorboard, train
from rlx import sharding as shd
from rlx.data import registry
from rlx.model import lora as lora_lib
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
  rl = spec.rl
  return train.StepConfig(
      prompts_per_step=rl.prompts_per_step, group_size=rl.group_size,
      advantage=rl.advantage, num_updates=rl.num_updates,
      num_minibatches=rl.num_minibatches, loss=rl.loss,
      sampling=spec.sampler.sampling(eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                                     stop_ids=stop_ids),
      sampler_impl=spec.sampler.impl,
      paged=spec.sampler.paged if spec.sampler.impl == "paged" else None,
      selection=spec.selection, replay=spec.replay, length=spec.length,
      reward_range=spec.guard.reward_range, logprob_chunk=rl.logprob_chunk, remat=rl.remat,
      fuse_pi_old=rl.fuse_pi_old, update_buckets=rl.update_buckets,
      drop_zero_adv_rows=rl.drop_zero_adv_rows, update_parts=rl.update_parts,
      update_micro_rows=rl.update_micro_rows,
      verifier=registry.verifier_for(spec.task, tokenizer), lora=spec.lora,
      staleness_hist=spec.pipeline.mode == "overlap", adaptive=spec.adaptive,
      ledger_levels=tuple(sorted(set(spec.task.rl_levels or spec.task.levels))))


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
      f"({exp.model_cfg.num_layers} layers, d_model {exp.model_cfg.d_model}); base: "
      f"{exp.base_source}")
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
  rl_record = spec.record.get("rl", {})  # the config as given (`config` may be a RunSpec)
  if 0 < spec.rl.update_micro_rows < rows and not rl_record.get("update_micro_rows", 0):
    log(f"[rlx] update: micro-batches of <= {spec.rl.update_micro_rows} rows on CPU "
        f"(config.rl.cpu_micro_tokens={rl_record.get('cpu_micro_tokens')}; 0 turns it off)")
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
                           selector_spread=cfg.selection.bucket_score == "spread")
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
  gen, learn = memory.plan_overlap(spec, model_cfg, dict(gen_mesh.shape), dict(mesh.shape), **kw)
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
    model_cfg = hf.config_from_hf(hf.read_config(spec.model.path), dtype=spec.model.dtype,
                                  param_dtype=spec.model.param_dtype)
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


def _fault(point: str, step: int) -> None:
  """Test hook: RLX_FAULT="kill_after_rollout:5,kill_in_save:4" SIGKILLs this process there."""
  for item in filter(None, os.environ.get("RLX_FAULT", "").split(",")):
    name, _, at = item.partition(":")
    if name == point and int(at) == step:
      os.kill(os.getpid(), signal.SIGKILL)


class _Stop(BaseException):
  """SIGTERM / SIGINT outside the RL loop's step boundary (raised from the handler)."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


class _SignalFlag:
  """SIGTERM / SIGINT handling for a whole run: the handler only remembers the signal.

  Inside the RL loop the loop checkpoints and stops at the next step boundary. Before it
  (set-up, warm start, base evaluation) `check()` is polled at safe points (each warm-start
  step, each evaluation batch) and raises `_Stop`, since there is no step to finish. Raising
  from the handler itself is not safe: it can land in a garbage-collector callback, where
  Python prints and drops it.
  """

  def __init__(self):
    self.signum = None
    self.deferred = False
    self._old = {}

  def check(self) -> None:
    if self.signum is not None and not self.deferred:
      raise _Stop(self.signum)

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    if self.signum is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C: stop now
    self.signum = signum

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


class _Saver:
  """Checkpoint saves that fail with one line naming the path and the OS error."""

  def __init__(self, ckpt: ckpt_lib.Checkpointer):
    self.ckpt = ckpt

  def _fail(self, step: int, e: BaseException):
    err = e
    while err is not None and not isinstance(err, OSError):
      err = err.__cause__ or err.__context__
    why = (f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
           if isinstance(err, OSError) else f"{type(e).__name__}: {' '.join(str(e).split())}")
    latest = self.ckpt.latest_step()
    keep = (f"the checkpoint of step {latest} is kept" if latest is not None
            else "no earlier checkpoint exists")
    return ckpt_lib.CheckpointError(
        f"could not save the checkpoint of step {step} to {self.ckpt.directory} "
        f"({why[:300]}); {keep}. Free space or fix permissions, then rerun to resume.")

  def ensure(self, step: int, state, meta) -> bool:
    """Step `step` on disk: waits for a save in flight, saves it unless a checkpoint of it
    exists (the step a run resumed from, or one just saved with checkpoint_every=1); returns
    whether it existed."""
    try:
      self.ckpt.wait()
    except Exception as e:  # pylint: disable=broad-except
      raise self._fail(step, e) from None
    if self.ckpt.latest_step() == step:
      return True
    self.save(step, state, meta, force=True, wait=True)
    return False

  def save(self, step: int, state, meta, *, force: bool = False, wait: bool = False) -> None:
    try:
      self.ckpt.save(step, state, meta, force=force)
      if wait:
        self.ckpt.wait()
    except Exception as e:  # pylint: disable=broad-except  (orbax wraps OS errors variously)
      raise self._fail(step, e) from None
    if wait and self.ckpt.latest_step() != step:
      raise self._fail(step, RuntimeError("the checkpoint is not on disk after the save"))

  def close(self) -> None:
    try:
      self.ckpt.close()
    except Exception as e:  # pylint: disable=broad-except
      raise self._fail(self.ckpt.latest_step() or 0, e) from None


def _config_diff(saved: dict | None, ours: dict, prefix: str = "") -> list[str]:
  """'key: checkpoint X, now Y' for every config value that differs (dotted keys)."""
  if saved is None:
    return []
  out = []
  for k in sorted(set(saved) | set(ours)):
    a, b = saved.get(k, "<absent>"), ours.get(k, "<absent>")
    if isinstance(a, dict) and isinstance(b, dict):
      out += _config_diff(a, b, f"{prefix}{k}.")
    elif a != b:
      out.append(f"{prefix}{k}: checkpoint {a!r}, now {b!r}")
  return out


# Settings that change the saved state's tree or shapes (optimizer chain, replay ring, selector,
# reference params, prompt pool): a checkpoint made with other values cannot be restored.
_LAYOUT_KEYS = ("optim.", "replay.", "selection.", "rl.kl_coef", "task.", "sampler.max_",
                "model.", "tokenizer.", "lora.")


def _lora_rank(record: dict | None) -> int:
  return int(((record or {}).get("lora") or {}).get("rank", 0) or 0)


def _restore(ckpt: ckpt_lib.Checkpointer, step: int, abstract, shardings, model_cfg,
             record: dict, log) -> Any:
  """Restores `step`; a failure names the config settings that differ from the checkpoint's
  (a changed optimizer or replay setting changes the saved state's layout) instead of
  calling a healthy checkpoint corrupt."""
  import json  # pylint: disable=g-import-not-at-top
  saved = ckpt.read_meta(step).get("config")
  ours = json.loads(json.dumps(record, default=str))
  theirs_lora, ours_lora = _lora_rank(saved), _lora_rank(ours)
  if (theirs_lora > 0) != (ours_lora > 0):
    what = lambda r: f"LoRA adapters (lora.rank={r})" if r else "all parameters (lora.rank=0)"
    raise ckpt_lib.CheckpointError(
        f"the checkpoint at {ckpt.directory}/{step} trains {what(theirs_lora)} and this config "
        f"trains {what(ours_lora)}: a run cannot switch between LoRA and full-parameter "
        f"training. Rerun with --config.lora.rank={theirs_lora} to resume, or pass a new "
        f"--workdir to start a new run.")
  if theirs_lora and ours_lora:
    keys = ("rank", "alpha", "targets", "base_dtype")
    changed = [f"lora.{k}: checkpoint {saved['lora'].get(k)!r}, now {ours['lora'].get(k)!r}"
               for k in keys if saved["lora"].get(k) != ours["lora"].get(k)]
    if changed:  # a changed alpha or base dtype would restore, and silently change the policy
      raise ckpt_lib.CheckpointError(
          f"the checkpoint at {ckpt.directory}/{step} was made with other LoRA settings "
          f"({'; '.join(changed)}): its adapters only mean the same policy with those. Rerun "
          f"with the checkpoint's settings to resume, or pass a new --workdir.")
  pipe = lambda r: (((r or {}).get("pipeline") or {}).get("mode", "sync"),
                    ((r or {}).get("pipeline") or {}).get("max_staleness", 1))
  (theirs_mode, theirs_k), (ours_mode, ours_k) = pipe(saved), pipe(ours)
  if theirs_mode != ours_mode or (ours_mode == "overlap" and theirs_k != ours_k):
    held = (f"pipeline.mode={theirs_mode!r}" + (f", pipeline.max_staleness={theirs_k}"
                                                  if theirs_mode == "overlap" else ""))
    raise ckpt_lib.CheckpointError(
        f"the checkpoint at {ckpt.directory}/{step} was written with {held} (an overlap "
        f"checkpoint holds the batches in flight, one per step of staleness) and this config "
        f"has pipeline.mode={ours_mode!r}"
        f"{f', max_staleness={ours_k}' if ours_mode == 'overlap' else ''}. Rerun with the "
        f"checkpoint's pipeline settings to resume, or pass a new --workdir.")
  diff = _config_diff(saved, ours)
  try:
    state, _ = ckpt.restore(step, abstract, shardings, model_cfg)
  except ckpt_lib.CheckpointError as e:
    layout = [d for d in diff if d.startswith(_LAYOUT_KEYS)]
    if not layout or "different model" in str(e):
      raise
    shown = "; ".join(layout[:6]) + (f"; and {len(layout) - 6} more" if len(layout) > 6 else "")
    raise ckpt_lib.CheckpointError(
        f"the checkpoint at {ckpt.directory}/{step} was made with other settings ({shown}), "
        f"and its saved state does not fit this config. Rerun with the checkpoint's settings "
        f"(its config is in the workdir's config.json) to resume, or pass a new --workdir to "
        f"start a new run.") from None
  if diff:
    log(f"[rlx] resuming with settings changed since the checkpoint: {'; '.join(diff[:6])}"
        + (f"; and {len(diff) - 6} more" if len(diff) > 6 else ""))
  return state


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
  with lock, _SignalFlag() as stop:
    _check_writable(os.path.join(workdir, "checkpoints"), "the checkpoint directory")
    try:
      return _run(spec, workdir, log=log, show_progress=show_progress, devices=devices,
                  stop=stop, main_process=main_process)
    except _Stop as e:
      raise Preempted(
          f"stopped by {signal.Signals(e.signum).name} before the first RL step of this "
          f"process: there was no new step to checkpoint (the data, tokenizer and warm-start "
          f"caches already written are kept). Rerun the same command to resume.") from None


def _run(spec: configs.RunSpec, workdir: str, *, log, show_progress: bool, devices,
         stop: _SignalFlag, main_process: bool) -> dict[str, Any]:
  host_reward = host_reward_fn(spec)  # an unknown reward fails before any work
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
  setup = build(spec, workdir, log=log, devices=devices, show_progress=show_progress,
                check_stop=stop.check)
  stop.check()
  exp, mesh, fns, state = setup.exp, setup.mesh, setup.fns, setup.state
  tok = exp.tokenizer
  abstract = jax.eval_shape(lambda: state)

  ckpt = ckpt_lib.Checkpointer(workdir, keep=spec.checkpoint.keep)
  saver = _Saver(ckpt)
  meta = {"model": exp.model_cfg.to_dict(), "config": spec.record}
  start = 0
  latest = ckpt.latest_step()
  overlap = None
  if spec.pipeline.mode == "overlap":
    overlap = pipeline.Overlap(
        exp.graphdef, setup.step_cfg, fns, gen_mesh=setup.gen_mesh, learn_mesh=mesh,
        pool=exp.train_pool, abstract_state=abstract,
        max_staleness=spec.pipeline.max_staleness, total_steps=spec.total_steps)
  restored = None
  if latest is not None:
    if overlap is not None:
      restored = _restore(ckpt, latest, *overlap.abstract_checkpoint(abstract, int(latest)),
                          exp.model_cfg, spec.record, log)
      state = restored.learner
    else:
      state = _restore(ckpt, latest, abstract, fns.state_sharding, exp.model_cfg,
                       spec.record, log)
    start = int(latest)
    log(f"[rlx] resumed from {ckpt.directory}/{latest}")
  if overlap is not None:  # the first batches go to the generator before anything else
    state = overlap.start(state, start, restored)
  # What evaluation decodes with (overlap: the generator's copy of the latest policy).
  eval_params = (lambda s: overlap.gen_params) if overlap is not None else (
      lambda s: train.policy_params(s, setup.step_cfg))
  to_save = (lambda s: overlap.checkpoint(s)) if overlap is not None else (lambda s: s)

  greedy = spec.sampler.sampling(eos_id=tok.eos_id, pad_id=tok.pad_id,
                                 stop_ids=tuple(getattr(tok, "stop_ids", ()) or ()),
                                 greedy=True)
  # Host rewards run in a worker process (forked on first use) that a timeout or a signal
  # can always end, even while the reward holds the GIL in C code.
  worker = eval_reward = None
  if host_reward is not None:
    worker = reward_worker.RewardWorker(host_reward, name=repr(spec.task.reward))

    def eval_reward(*args, **kwargs):  # a signal while it runs abandons the evaluation
      values = worker.call(args, kwargs, timeout_s=spec.task.reward_timeout_s, stop=stop)
      if values is None:
        raise _Stop(stop.signum)
      return values
  evaluator = evaluate.Evaluator(exp.graphdef, exp.eval_pool, greedy,
                                 spec.sampler.eval_batch_size,
                                 setup.gen_mesh if overlap is not None else mesh,
                                 verifier=setup.step_cfg.verifier, band=spec.task.band,
                                 host_reward=eval_reward,
                                 host=exp.eval_host, tokenizer=tok,
                                 show_progress=show_progress, check_stop=stop.check,
                                 sampler_impl=setup.step_cfg.sampler_impl,
                                 paged=setup.step_cfg.paged)
  band = spec.task.band
  base_eval_path = os.path.join(workdir, "eval_base.json")
  writer = metrics_lib.JsonlWriter(os.path.join(workdir, "metrics.jsonl"),
                                   resume_step=start if latest is not None else None,
                                   enabled=main_process)
  tb = None
  bar = None
  try:
    tb = tensorboard.SummaryWriter(os.path.join(workdir, "tb"), purge_step=start or None) if (
        main_process) else None
    if latest is None or not os.path.exists(base_eval_path):
      base_eval = evaluator(eval_params(state))
      base_eval["eval/band_accuracy"] = band_accuracy(base_eval, band)
      if main_process:
        ckpt_lib.save_json(base_eval_path, base_eval)
      if latest is None:
        writer.write(0, base_eval)
        if tb:
          tb.scalars(0, base_eval)
    else:
      base_eval = ckpt_lib.read_json(base_eval_path)
    log("[rlx] before RL: " + _fmt_eval(base_eval, band))
    # The run's record, written once the workdir is known to accept this config.
    if main_process:
      ckpt_lib.save_json(os.path.join(workdir, "config.json"), spec.record)

    # Overlap: the generator holds the pool on its own sub-mesh (pipeline.Overlap).
    pool = shd.put(exp.train_pool, fns.pool_sharding) if overlap is None else None
    max_skips = spec.guard.max_consecutive_skips
    updates_per_step = setup.step_cfg.num_updates * setup.step_cfg.num_minibatches
    bar = metrics_lib.progress(spec.total_steps, initial=start, disable=not show_progress)
    last_eval = base_eval if start == 0 else {}
    gen_times, upd_times, tok_rates = [], [], []
    skipped_in_a_row = 0
    done = start
    stop.check()
    stop.deferred = True
    for step in range(start, spec.total_steps):
      t0 = time.perf_counter()
      if host_reward is not None:
        rng_before = state.rng  # `generate` changes only the RNG: the step can be undone
        rng_host = np.asarray(jax.device_get(rng_before))
        state, batch, _ = fns.generate(state, pool)
        args, kwargs = _reward_args(batch.batch, exp)
        values = worker.call(args, kwargs, timeout_s=spec.task.reward_timeout_s, stop=stop)
        if values is None:  # SIGTERM while the reward ran: save the last finished step
          state = state.replace(rng=shd.put(rng_host, fns.state_sharding.rng))
          _preempt(saver, done, state, meta, stop)
        rewards = shd.put(np.asarray(values, np.float32), shd.batch_sharding(mesh, 1))
        _fault("kill_after_rollout", step + 1)
        t1 = time.perf_counter()
        state, m = fns.score_update(state, batch, rewards, **train.update_shape(
            batch, setup.step_cfg, shd.batch_size_of(mesh), scored=False))
        m = jax.device_get(m)
        t_gen, t_upd = t1 - t0, time.perf_counter() - t1
      elif overlap is not None:
        state, m = overlap.step(
            state, step, after_rollout=lambda: _fault("kill_after_rollout", step + 1))
        t_gen, t_upd = m["time/generate_s"], m["time/update_s"]
      elif spec.fused_step:
        state, m = fns.train_step(state, pool)
        m = jax.device_get(m)
        t_gen, t_upd = time.perf_counter() - t0, 0.0
      else:
        state, batch = fns.rollout(state, pool)
        shape = train.update_shape(batch, setup.step_cfg, shd.batch_size_of(mesh))  # waits
        _fault("kill_after_rollout", step + 1)
        t1 = time.perf_counter()
        state, m = fns.update(state, batch, **shape)
        m = jax.device_get(m)
        t_gen, t_upd = t1 - t0, time.perf_counter() - t1
      m = {k: float(v) for k, v in m.items()}
      if m.get("guard/signal_rows_left_out", 0) > 0:  # a bug, never a data problem
        raise RuntimeError(f"step {step + 1}: the update left out "
                           f"{int(m['guard/signal_rows_left_out'])} rows with a learning signal.")
      if m.get("guard/rows_over_width", 0) > 0:  # a bug, never a data problem
        raise RuntimeError(f"step {step + 1}: the update cut {int(m['guard/rows_over_width'])} "
                           f"rows shorter than their length.")
      _check_rewards(m, exp, spec)
      m["time/generate_s"] = t_gen
      m["time/update_s"] = t_upd
      if overlap is None:  # overlap: the step's wall time, with both halves at once
        m["time/step_s"] = t_gen + t_upd
      m["ledger/generated_tokens_per_s"] = m["ledger/tokens_generated"] / max(t_gen, 1e-9)
      if step > start:  # the first step of a process includes compilation
        gen_times.append(t_gen)
        upd_times.append(t_upd)
        tok_rates.append(m["ledger/generated_tokens_per_s"])
      done = step + 1
      skipped_in_a_row = (skipped_in_a_row + 1
                          if m["guard/skipped_updates"] >= updates_per_step else 0)
      if done % spec.eval_every == 0 or done == spec.total_steps:
        try:
          last_eval = evaluator(eval_params(state))
          last_eval["eval/band_accuracy"] = band_accuracy(last_eval, band)
          m.update(last_eval)
        except _Stop:  # a signal while the host reward scored it: save the step without it
          pass
      writer.write(done, m)
      if tb:
        tb.scalars(done, m)
      bar.update(1)
      bar.set_postfix({**metrics_lib.postfix(m), **(
          {"eval": f"{last_eval['eval/band_accuracy']:.3f}"} if last_eval else {})})
      if skipped_in_a_row >= max_skips:
        raise NumericError(
            f"{skipped_in_a_row} consecutive steps (up to step {done}) had a non-finite loss "
            f"or gradient in every update and were skipped (config.guard."
            f"max_consecutive_skips={max_skips}). Lower config.optim.lr, check the rewards, "
            f"or resume from the last checkpoint in {ckpt.directory}.")
      if stop.signum is not None:
        _preempt(saver, done, to_save(state), meta, stop)
      if done % spec.checkpoint.every == 0 or done == spec.total_steps:
        saver.save(done, to_save(state), meta)
        _fault("kill_in_save", done)
    stop.deferred = False
    saver.close()
  except BaseException:
    stop.deferred = False
    # Close quietly: the error being raised is the one to report (a full disk also fails the
    # metric writers, whose errors would otherwise replace it).
    for closer in (getattr(worker, "close", None), getattr(bar, "close", None), writer.close,
                   getattr(tb, "close", None), ckpt.close):
      if closer is not None:
        with contextlib.suppress(Exception):
          closer()
    raise
  for closer in (bar.close, writer.close, getattr(tb, "close", None)):
    if closer is not None:
      closer()

  try:
    final = last_eval if last_eval else evaluator(eval_params(state))
  finally:
    if worker is not None:
      worker.close()
  if "eval/band_accuracy" not in final:
    final["eval/band_accuracy"] = band_accuracy(final, band)
  log("[rlx] after RL:  " + _fmt_eval(final, band))
  gain = 100 * (final["eval/band_accuracy"] - base_eval["eval/band_accuracy"])
  log(f"[rlx] held-out greedy accuracy on the band (levels {band}): "
      f"{100 * base_eval['eval/band_accuracy']:.1f}% -> {100 * final['eval/band_accuracy']:.1f}%"
      f" ({gain:+.1f} points) after {spec.total_steps} RL steps")
  for line in _level_changes(base_eval, final, band):
    log(line)
  if gen_times:
    log(f"[rlx] median step: generation {np.median(gen_times):.3f}s, update "
        f"{np.median(upd_times):.3f}s, {np.median(tok_rates):.0f} generated tokens/s")
  return {"before": base_eval, "after": final, "gain_points": gain,
          "median_generate_s": float(np.median(gen_times)) if gen_times else None,
          "median_update_s": float(np.median(upd_times)) if upd_times else None,
          "state": state}


def _preempt(saver: _Saver, done: int, state, meta, stop: _SignalFlag):
  """Saves step `done` unless it is already saved (waiting until it is complete on disk),
  then raises Preempted."""
  existed = saver.ensure(done, state, meta)
  raise Preempted(
      f"stopped by {signal.Signals(stop.signum).name} after step {done}; checkpoint "
      f"saved to {saver.ckpt.directory}/{done}"
      f"{' (already saved before the signal)' if existed else ''}. Rerun the same command "
      f"to resume.")


def _reward_args(batch, exp: experiment.Experiment) -> tuple[tuple, dict]:
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


def _host_rewards(batch, exp: experiment.Experiment, host_reward, mesh):
  """Decodes the rollouts on the host and scores them with the Python reward in this process
  (the benchmarks' path; the trainer calls it through its RewardWorker)."""
  args, kwargs = _reward_args(batch, exp)
  return shd.put(np.asarray(host_reward(*args, **kwargs), np.float32),
                 shd.batch_sharding(mesh, 1))


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
