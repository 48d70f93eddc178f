"""The memory plan of an overlap-mode run (rlx.pipeline): the generator's and the learner's
sub-meshes hold different things, so each gets its own plan (rlx.memory), per device.

    gen, learn = plan_overlap(config, model_cfg, {"data": 2}, {"fsdp": 2})
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import ml_collections as mlc

from rlx import configs
from rlx import memory
from rlx.memory_model import cdiv, check_mesh
from rlx.model.config import ModelConfig


def plan_overlap(config: configs.RunSpec | mlc.ConfigDict, model_cfg: ModelConfig,
                 gen_shape: Mapping[str, int], learn_shape: Mapping[str, int],
                 **kw) -> tuple[memory.MemoryPlan, memory.MemoryPlan]:
  """(generator plan, learner plan) of an overlap-mode run (rlx.pipeline), per device of each
  sub-mesh.

  generator  its copy of the policy (the params, or LoRA's merged weights, split on its
             sub-mesh by the same rules; matrices in the compute dtype where the params are
             wider: the sampling copy), the selector snapshot, the prompt pool, the
             rollout's and evaluation's sampler, and the batch it just generated;
  learner    the training state (`plan` on the learner's sub-mesh without the sampler
             phases and the prompt pool) plus the max_staleness batches in flight, which
             live on the learner from their dispatch until they are trained on.
  """
  spec = configs.resolve(config)
  k = spec.pipeline.max_staleness
  gen_full, gen_w = memory.plan_with_weights(spec, model_cfg, gen_shape, **kw)
  learn_full = memory.plan(spec, model_cfg, learn_shape, **kw)
  pw = int(kw.get("prompt_width") or spec.sampler.max_prompt_len)
  t_new = int(spec.sampler.max_new_tokens)
  rows = (spec.selection.groups_sampled_factor * spec.rl.prompts_per_step *
          spec.rl.group_size)
  # InFlight: prompts, completions, behaviour log-probs and 8 per-row scalars (4B each).
  per_row = (pw + 2 * t_new + 8) * 4
  gen_nb = check_mesh(gen_shape)
  learn_nb = check_mesh(learn_shape)
  gen_rows = cdiv(rows, gen_nb["data"] * gen_nb["fsdp"])
  learn_rows = cdiv(rows, learn_nb["data"] * learn_nb["fsdp"])
  inflight = lambda r: f"{r} rows x (P={pw} + 2T={2 * t_new} + 8) x 4B"

  sampling = ("rollout", "eval")
  # The generator holds what the learner's policy_params made: the sampling copy (where the
  # params are wider than the compute dtype) instead of the params and of its own copy.
  copied = [it for it in gen_full.items if it.name.startswith("sampling weights")]
  merged = [it for it in gen_full.items if it.name.startswith("merged adapted weights")]
  gen_items = []
  for it in gen_full.items:
    if it.name in ("selector", "prompt pool") or (
        it.phase in sampling and it not in merged + copied):
      gen_items.append(it)
    elif it.name == "params" or it.name.startswith("frozen base"):
      lora = it.name != "params"  # LoRA: the generator holds the merged policy
      extra = merged[0].bytes if merged and not copied else 0
      what = ", matrices as the sampling copy" if copied else (
          " + merged adapted weights" if extra else "")
      gen_items.append(dataclasses.replace(
          it, name=f"policy copy ({'LoRA merged' if lora else 'params'})",
          bytes=it.bytes + extra - gen_w.copy_from_dev + gen_w.copy_dev,
          formula=f"{it.formula}{what}"))
  gen_items.append(memory.MemoryItem("generated batch (before its transfer)",
                              gen_rows * per_row, inflight(gen_rows), "rollout"))
  learn_items = [it for it in learn_full.items
                 if it.phase not in sampling and it.name != "prompt pool"]
  learn_items.append(memory.MemoryItem(f"batches in flight (max_staleness={k})",
                                k * learn_rows * per_row, f"{k} x {inflight(learn_rows)}",
                                "state", "a smaller config.pipeline.max_staleness"))
  note = ("Overlap mode (config.pipeline): the generator and learner sub-meshes hold different "
          "things; each is planned on its own devices.",)
  return (dataclasses.replace(gen_full, items=tuple(gen_items), notes=note + gen_full.notes),
          dataclasses.replace(learn_full, items=tuple(learn_items),
                              notes=note + learn_full.notes))
