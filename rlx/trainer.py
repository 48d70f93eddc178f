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
import time
from typing import Any, Callable

import jax
import ml_collections as mlc
import numpy as np

from rlx import checkpoint as ckpt_lib
from rlx import configs, evaluate, experiment, metrics as metrics_lib, train
from rlx import sharding as shd


def _check_workdir(workdir: str) -> None:
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, ".rlx_write_probe")
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
      sampler_impl=config.sampler.impl, selection=configs.selection_config(config),
      replay=configs.replay_config(config), length=configs.length_config(config))


def band_accuracy(m: dict[str, float], band) -> float:
  vals = [m[f"eval/accuracy_d{int(l)}"] for l in band if f"eval/accuracy_d{int(l)}" in m]
  return float(np.mean(vals)) if vals else float("nan")


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


def build(config: mlc.ConfigDict, workdir: str, *, log: Callable[[str], None] = print
          ) -> Setup:
  """Validates the config, prepares data / tokenizer / base model, compiles nothing yet."""
  mesh = shd.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  configs.validate(config, shd.batch_size_of(mesh))
  _check_workdir(workdir)
  ckpt_lib.save_json(os.path.join(workdir, "config.json"), configs.to_plain(config))
  has_checkpoints = os.path.isdir(os.path.join(workdir, "checkpoints")) and any(
      name.isdigit() for name in os.listdir(os.path.join(workdir, "checkpoints")))
  exp = experiment.setup(config, workdir, log=log, resuming=has_checkpoints)
  log(f"[rlx] model: {exp.model_cfg.num_params() / 1e6:.2f}M params "
      f"({exp.model_cfg.num_layers} layers, d_model {exp.model_cfg.d_model}); base: "
      f"{exp.base_source}")
  log(f"[rlx] mesh {dict(mesh.shape)}; RL pool {exp.train_pool.size} prompts (levels "
      f"{tuple(config.task.rl_levels)}), eval {exp.eval_pool.size} prompts")
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
                           replay=cfg.replay, prompt_width=exp.train_pool.max_prompt_len,
                           max_new_tokens=cfg.sampling.max_new_tokens)
  fns = train.make_step_fns(exp.graphdef, cfg, tx, mesh, jax.eval_shape(lambda: state))
  return Setup(config=config, exp=exp, mesh=mesh, step_cfg=cfg, tx=tx, state=state, fns=fns)


def run(config: mlc.ConfigDict, workdir: str, *, log: Callable[[str], None] = print,
        show_progress: bool = True) -> dict[str, Any]:
  """Trains per `config` in `workdir`; returns a summary (accuracy before/after, timings)."""
  setup = build(config, workdir, log=log)
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
  evaluator = evaluate.Evaluator(exp.graphdef, exp.eval_pool, greedy,
                                 config.sampler.eval_batch_size, mesh)
  band = tuple(config.task.band)
  base_eval_path = os.path.join(workdir, "eval_base.json")
  writer = metrics_lib.JsonlWriter(os.path.join(workdir, "metrics.jsonl"),
                                   resume_step=start if latest is not None else None)
  if latest is None or not os.path.exists(base_eval_path):
    base_eval = evaluator(state.params)
    base_eval["eval/band_accuracy"] = band_accuracy(base_eval, band)
    ckpt_lib.save_json(base_eval_path, base_eval)
    if latest is None:
      writer.write(0, base_eval)
  with open(base_eval_path) as f:
    base_eval = json.load(f)
  log("[rlx] before RL: " + _fmt_eval(base_eval, band))

  pool = jax.device_put(exp.train_pool, fns.pool_sharding)
  bar = metrics_lib.progress(config.total_steps, initial=start, disable=not show_progress)
  last_eval = base_eval if start == 0 else {}
  gen_times, upd_times, tok_rates = [], [], []
  try:
    for step in range(start, config.total_steps):
      t0 = time.perf_counter()
      if config.fused_step:
        state, m = fns.train_step(state, pool)
        m = jax.device_get(m)
        t_gen, t_upd = time.perf_counter() - t0, 0.0
      else:
        state, batch = fns.rollout(state, pool)
        jax.block_until_ready(batch)
        t1 = time.perf_counter()
        state, m = fns.update(state, batch)
        m = jax.device_get(m)
        t_gen, t_upd = t1 - t0, time.perf_counter() - t1
      m = {k: float(v) for k, v in m.items()}
      m["time/generate_s"] = t_gen
      m["time/update_s"] = t_upd
      m["time/step_s"] = t_gen + t_upd
      m["ledger/generated_tokens_per_s"] = m["ledger/tokens_generated"] / max(t_gen, 1e-9)
      if step > start:  # the first step of a process includes compilation
        gen_times.append(t_gen)
        upd_times.append(t_upd)
        tok_rates.append(m["ledger/generated_tokens_per_s"])
      done = step + 1
      if done % config.eval_every == 0 or done == config.total_steps:
        last_eval = evaluator(state.params)
        last_eval["eval/band_accuracy"] = band_accuracy(last_eval, band)
        m.update(last_eval)
      writer.write(done, m)
      bar.update(1)
      bar.set_postfix({**metrics_lib.postfix(m), **(
          {"eval": f"{last_eval['eval/band_accuracy']:.3f}"} if last_eval else {})})
      if done % config.checkpoint_every == 0 or done == config.total_steps:
        ckpt.save(done, state, meta)
  finally:
    bar.close()
    writer.close()
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


def _fmt_eval(m: dict[str, float], band) -> str:
  levels = sorted(int(k.rsplit("_d", 1)[1]) for k in m if k.startswith("eval/accuracy_d"))
  parts = [f"d{l} {100 * m[f'eval/accuracy_d{l}']:.1f}%" + ("*" if l in band else "")
           for l in levels]
  return "held-out accuracy " + ", ".join(parts) + "  (* = band)"
