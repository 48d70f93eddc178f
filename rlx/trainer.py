"""The host loop: set up, restore, run the jitted step halves, evaluate, log, checkpoint.

All the math lives in `rlx.train` (pure, jitted); this file only moves control: one
`rollout` and one `update` call per step (timed separately, so the ledger can say where the
time went), periodic greedy evaluation on the held-out set, metrics to WORKDIR/metrics.jsonl
and orbax checkpoints. A rerun with the same workdir resumes from the last checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
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
from rlx import tensorboard, train
from rlx import sharding as shd


def _check_workdir(workdir: str) -> None:
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f".rlx_write_probe{jax.process_index()}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise configs.ConfigError(f"--workdir={workdir!r} is not writable ({e.strerror}); "
                              f"choose a directory you can write to.") from None


def step_config(config: mlc.ConfigDict, tokenizer) -> train.StepConfig:
  stop_ids = tuple(getattr(tokenizer, "stop_ids", ()) or ())
  return train.StepConfig(
      prompts_per_step=config.rl.prompts_per_step, group_size=config.rl.group_size,
      advantage=config.rl.advantage, num_updates=config.rl.num_updates,
      num_minibatches=config.rl.num_minibatches, loss=configs.loss_config(config),
      sampling=configs.sampling_params(config, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                                       stop_ids=stop_ids),
      sampler_impl=config.sampler.impl,
      paged=configs.paged_config(config) if config.sampler.impl == "paged" else None,
      selection=configs.selection_config(config),
      replay=configs.replay_config(config), length=configs.length_config(config),
      reward_range=tuple(float(x) for x in config.get("guard", {}).get(
          "reward_range", (-10.0, 10.0))))


def band_accuracy(m: dict[str, float], band) -> float:
  """Mean accuracy over the band's levels (empty band: overall accuracy)."""
  if not band:
    return float(m["eval/accuracy"])
  vals = [m[f"eval/accuracy_d{int(l)}"] for l in band if f"eval/accuracy_d{int(l)}" in m]
  return float(np.mean(vals)) if vals else float("nan")


def host_reward_fn(config: mlc.ConfigDict):
  """The checked Python reward named by config.task.reward, or None for the jnp verifier.

  "exact_match": the task's token-level jnp verifier inside the jitted step (default).
  A registered name ("math", "exact", see rlx.rewards) or "package.module:function": host
  Python between the rollout and update halves.
  """
  name = config.task.get("reward", "exact_match") or "exact_match"
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
  lo, hi = config.get("guard", {}).get("reward_range", (-10.0, 10.0))
  return rewards.wrap_reward(fn, task_name=config.task.name, low=lo, high=hi)


@dataclasses.dataclass
class Setup:
  """Everything a run needs before its first step (shared by `run` and the benchmarks)."""

  config: mlc.ConfigDict
  exp: experiment.Experiment
  mesh: Any
  step_cfg: train.StepConfig
  tx: Any
  state: train.TrainState
  fns: train.StepFns


def build(config: mlc.ConfigDict, workdir: str, *, log: Callable[[str], None] = print,
          devices=None) -> Setup:
  """Validates the config, prepares data / tokenizer / base model, compiles nothing yet.

  devices: the devices of the mesh (default: all devices of all processes).
  """
  mesh = shd.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor, devices=devices)
  configs.validate(config, shd.batch_size_of(mesh))
  _check_workdir(workdir)
  if jax.process_index() == 0:
    ckpt_lib.save_json(os.path.join(workdir, "config.json"), configs.to_plain(config))
  has_checkpoints = os.path.isdir(os.path.join(workdir, "checkpoints")) and any(
      name.isdigit() for name in os.listdir(os.path.join(workdir, "checkpoints")))
  exp = experiment.setup(config, workdir, log=log, resuming=has_checkpoints)
  log(f"[rlx] model: {exp.model_cfg.num_params() / 1e6:.2f}M params "
      f"({exp.model_cfg.num_layers} layers, d_model {exp.model_cfg.d_model}); base: "
      f"{exp.base_source}")
  log(f"[rlx] mesh {dict(mesh.shape)}; RL pool {exp.train_pool.size} prompts (levels "
      f"{tuple(config.task.rl_levels)}), eval {exp.eval_pool.size} prompts")
  mem = memory.plan(config, exp.model_cfg, dict(mesh.shape), num_prompts=exp.train_pool.size,
                    prompt_width=exp.train_pool.max_prompt_len)
  log(f"[rlx] memory plan: peak {memory.human(mem.total_bytes)} per device of "
      f"{memory.human(mem.capacity_bytes)} ({mem.peak_phase}); --dry_run prints the whole plan")
  if config.get("memory", {}).get("check", True):
    memory.check_fits(mem)
  cfg = step_config(config, exp.tokenizer)
  tx = train.make_optimizer(config.optim.lr, config.total_steps,
                            warmup_steps=config.optim.warmup_steps,
                            schedule=config.optim.schedule,
                            weight_decay=config.optim.weight_decay,
                            grad_clip=config.optim.grad_clip, b1=config.optim.b1,
                            b2=config.optim.b2,
                            updates_per_step=cfg.num_updates * cfg.num_minibatches)
  state = train.init_state(exp.base_params, tx, config.seed, mesh,
                           with_ref=cfg.loss.kl_coef > 0, num_prompts=exp.train_pool.size,
                           prompt_groups=np.unique(np.asarray(exp.train_pool.difficulty),
                                                   return_inverse=True)[1],
                           replay=cfg.replay, prompt_width=exp.train_pool.max_prompt_len,
                           max_new_tokens=cfg.sampling.max_new_tokens)
  fns = train.make_step_fns(exp.graphdef, cfg, tx, mesh, jax.eval_shape(lambda: state))
  return Setup(config=config, exp=exp, mesh=mesh, step_cfg=cfg, tx=tx, state=state, fns=fns)


def dry_run(config: mlc.ConfigDict, workdir: str, *, devices=None) -> tuple[Any, str]:
  """The memory plan of a run, without data, weights or compilation: (plan, text).

  The model shape comes from config.model.path's config.json (weights are not read) or from
  config.model (vocabulary: the workdir's tokenizer if present, else
  config.tokenizer.vocab_size, an upper bound).
  """
  from rlx.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  from rlx.model import hf  # pylint: disable=g-import-not-at-top
  mesh = shd.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor, devices=devices)
  configs.validate(config, shd.batch_size_of(mesh))
  if config.model.get("path", ""):
    model_cfg = hf.config_from_hf(hf.read_config(config.model.path),
                                  dtype=config.model.get("dtype", "float32"),
                                  param_dtype=config.model.get("param_dtype", None))
  else:
    tok_path = os.path.join(workdir, "tokenizer.model")
    vocab = (Tokenizer.load(tok_path).vocab_size if os.path.exists(tok_path)
             else config.tokenizer.vocab_size)
    model_cfg = configs.model_config(config, vocab)
  plan = memory.plan(config, model_cfg, dict(mesh.shape))
  text = (f"model: {model_cfg.num_params() / 1e6:.1f}M params, {model_cfg.num_layers} layers, "
          f"d_model {model_cfg.d_model}, vocab {model_cfg.vocab_size}\n" +
          memory.format_plan(plan))
  return plan, text


class Preempted(Exception):
  """Raised after a SIGTERM / SIGINT once the current step's checkpoint is saved."""


class NumericError(RuntimeError):
  """Training produced non-finite values K steps in a row, or invalid rewards."""


def _fault(point: str, step: int) -> None:
  """Test hook: RLX_FAULT="kill_after_rollout:5,kill_in_save:4" SIGKILLs this process there."""
  for item in filter(None, os.environ.get("RLX_FAULT", "").split(",")):
    name, _, at = item.partition(":")
    if name == point and int(at) == step:
      os.kill(os.getpid(), signal.SIGKILL)


class _SignalFlag:
  """Remembers SIGTERM / SIGINT so the loop can checkpoint and stop at a step boundary."""

  def __init__(self):
    self.signum = None
    self._old = {}

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


def run(config: mlc.ConfigDict, workdir: str, *, log: Callable[[str], None] = print,
        show_progress: bool = True, devices=None) -> dict[str, Any]:
  """Trains per `config` in `workdir`; returns a summary (accuracy before/after, timings).

  Rerunning with the same workdir resumes from the last checkpoint; SIGTERM / SIGINT save
  a checkpoint at the end of the current step and raise `Preempted`.
  """
  main_process = jax.process_index() == 0
  if not main_process:
    log, show_progress = (lambda s: None), False
  setup = build(config, workdir, log=log, devices=devices)
  exp, mesh, fns, state = setup.exp, setup.mesh, setup.fns, setup.state
  tok = exp.tokenizer
  abstract = jax.eval_shape(lambda: state)

  ckpt = ckpt_lib.Checkpointer(workdir, keep=config.keep_checkpoints)
  meta = {"model": exp.model_cfg.to_dict(), "config": configs.to_plain(config)}
  start = 0
  latest = ckpt.latest_step()
  if latest is not None:
    state, _ = ckpt.restore(latest, abstract, fns.state_sharding, exp.model_cfg)
    start = int(latest)
    log(f"[rlx] resumed from {ckpt.directory}/{latest}")

  greedy = configs.sampling_params(config, eos_id=tok.eos_id, pad_id=tok.pad_id,
                                   stop_ids=tuple(getattr(tok, "stop_ids", ()) or ()),
                                   greedy=True)
  host_reward = host_reward_fn(config)
  evaluator = evaluate.Evaluator(exp.graphdef, exp.eval_pool, greedy,
                                 config.sampler.eval_batch_size, mesh, host_reward=host_reward,
                                 host=exp.eval_host, tokenizer=tok)
  band = tuple(config.task.band)
  base_eval_path = os.path.join(workdir, "eval_base.json")
  writer = metrics_lib.JsonlWriter(os.path.join(workdir, "metrics.jsonl"),
                                   resume_step=start if latest is not None else None,
                                   enabled=main_process)
  tb = tensorboard.SummaryWriter(os.path.join(workdir, "tb"), purge_step=start or None) if (
      main_process) else None
  if latest is None or not os.path.exists(base_eval_path):
    base_eval = evaluator(state.params)
    base_eval["eval/band_accuracy"] = band_accuracy(base_eval, band)
    if main_process:
      ckpt_lib.save_json(base_eval_path, base_eval)
    if latest is None:
      writer.write(0, base_eval)
      if tb:
        tb.scalars(0, base_eval)
  else:
    with open(base_eval_path) as f:
      base_eval = json.load(f)
  log("[rlx] before RL: " + _fmt_eval(base_eval, band))

  pool = shd.put(exp.train_pool, fns.pool_sharding)
  max_skips = int(config.get("guard", {}).get("max_consecutive_skips", 3))
  updates_per_step = setup.step_cfg.num_updates * setup.step_cfg.num_minibatches
  bar = metrics_lib.progress(config.total_steps, initial=start, disable=not show_progress)
  last_eval = base_eval if start == 0 else {}
  gen_times, upd_times, tok_rates = [], [], []
  skipped_in_a_row = 0
  done = start
  try:
    with _SignalFlag() as stop:
      for step in range(start, config.total_steps):
        t0 = time.perf_counter()
        if host_reward is not None:
          state, batch = fns.generate(state, pool)
          rewards = _host_rewards(batch, exp, host_reward, mesh)
          _fault("kill_after_rollout", step + 1)
          t1 = time.perf_counter()
          state, m = fns.score_update(state, batch, rewards)
          m = jax.device_get(m)
          t_gen, t_upd = t1 - t0, time.perf_counter() - t1
        elif config.fused_step:
          state, m = fns.train_step(state, pool)
          m = jax.device_get(m)
          t_gen, t_upd = time.perf_counter() - t0, 0.0
        else:
          state, batch = fns.rollout(state, pool)
          jax.block_until_ready(batch)
          _fault("kill_after_rollout", step + 1)
          t1 = time.perf_counter()
          state, m = fns.update(state, batch)
          m = jax.device_get(m)
          t_gen, t_upd = t1 - t0, time.perf_counter() - t1
        m = {k: float(v) for k, v in m.items()}
        _check_rewards(m, exp, config)
        m["time/generate_s"] = t_gen
        m["time/update_s"] = t_upd
        m["time/step_s"] = t_gen + t_upd
        m["ledger/generated_tokens_per_s"] = m["ledger/tokens_generated"] / max(t_gen, 1e-9)
        if step > start:  # the first step of a process includes compilation
          gen_times.append(t_gen)
          upd_times.append(t_upd)
          tok_rates.append(m["ledger/generated_tokens_per_s"])
        done = step + 1
        skipped_in_a_row = (skipped_in_a_row + 1
                            if m["guard/skipped_updates"] >= updates_per_step else 0)
        if done % config.eval_every == 0 or done == config.total_steps:
          last_eval = evaluator(state.params)
          last_eval["eval/band_accuracy"] = band_accuracy(last_eval, band)
          m.update(last_eval)
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
          ckpt.save(done, state, meta, force=True)
          ckpt.wait()
          raise Preempted(
              f"stopped by {signal.Signals(stop.signum).name} after step {done}; checkpoint "
              f"saved to {ckpt.directory}/{done}. Rerun the same command to resume.")
        if done % config.checkpoint_every == 0 or done == config.total_steps:
          ckpt.save(done, state, meta)
          _fault("kill_in_save", done)
  finally:
    bar.close()
    writer.close()
    if tb:
      tb.close()
    ckpt.close()

  final = last_eval if last_eval else evaluator(state.params)
  if "eval/band_accuracy" not in final:
    final["eval/band_accuracy"] = band_accuracy(final, band)
  log("[rlx] after RL:  " + _fmt_eval(final, band))
  gain = 100 * (final["eval/band_accuracy"] - base_eval["eval/band_accuracy"])
  log(f"[rlx] held-out greedy accuracy on the band (levels {band}): "
      f"{100 * base_eval['eval/band_accuracy']:.1f}% -> {100 * final['eval/band_accuracy']:.1f}%"
      f" ({gain:+.1f} points) after {config.total_steps} RL steps")
  if gen_times:
    log(f"[rlx] median step: generation {np.median(gen_times):.3f}s, update "
        f"{np.median(upd_times):.3f}s, {np.median(tok_rates):.0f} generated tokens/s")
  return {"before": base_eval, "after": final, "gain_points": gain,
          "median_generate_s": float(np.median(gen_times)) if gen_times else None,
          "median_update_s": float(np.median(upd_times)) if upd_times else None,
          "state": state}


def _host_rewards(batch, exp: experiment.Experiment, host_reward, mesh):
  """Decodes the rollouts on the host and scores them with the Python reward (time spent
  here counts as generation)."""
  tokens = distributed.to_host(batch.completions)
  lengths = distributed.to_host(batch.lengths)
  ids = distributed.to_host(batch.prompt_ids)
  texts = [exp.tokenizer.decode(t[:l]) for t, l in zip(tokens, lengths)]
  h = exp.train_host
  values = host_reward([h.prompts[i] for i in ids], texts, answer=[h.answers[i] for i in ids],
                       difficulty=[int(h.difficulty[i]) for i in ids])
  return shd.put(np.asarray(values, np.float32), shd.batch_sharding(mesh, 1))


def _check_rewards(m: dict[str, float], exp: experiment.Experiment, config) -> None:
  if m.get("reward/invalid_count", 0) > 0:
    pid = int(m["reward/first_invalid_prompt"])
    lo, hi = config.get("guard", {}).get("reward_range", (-10.0, 10.0))
    raise NumericError(
        f"task {config.task.name!r}: reward {m['reward/first_invalid_value']} for train "
        f"example {pid} (prompt {exp.train_host.prompts[pid]!r}) is non-finite or outside "
        f"[{lo}, {hi}] ({int(m['reward/invalid_count'])} such rollouts in this step).")


def _fmt_eval(m: dict[str, float], band) -> str:
  levels = sorted(int(k.rsplit("_d", 1)[1]) for k in m if k.startswith("eval/accuracy_d"))
  parts = [f"d{l} {100 * m[f'eval/accuracy_d{l}']:.1f}%" + ("*" if l in band else "")
           for l in levels]
  return "held-out accuracy " + ", ".join(parts) + "  (* = band)"
