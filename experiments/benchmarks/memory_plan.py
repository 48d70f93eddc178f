r"""Per-device memory plans of the default experiment, a Qwen2.5-1.5B run and 7B-class runs
(full-parameter vs LoRA), without devices.

  python experiments/benchmarks/memory_plan.py            # (a), (b) and (c)
  python experiments/benchmarks/memory_plan.py 7b         # (c) only, as markdown tables

(a) experiments/arith.py on one device (this machine's capacity).
(b) experiments/hf_rl.py with the Qwen2.5-1.5B shapes (experiments/shapes/qwen2.5-1.5b holds
    only its config.json: nothing is loaded), bf16 compute, f32 master weights, 32 prompts x
    G=8, 256 new tokens, paged sampler, on 16-device meshes, against an 80 GiB (H100-class),
    a 141 GiB (H200-class) and a 16 GiB (TPU v5e-class) device.
(c) experiments/hf_rl.py with Qwen2.5-7B and Llama-3.1-8B shapes (experiments/shapes/), the
    same run (RUN_7B) on a TPU v5e-8 (8 chips x 16 GiB), a TPU v5p-8 (4 chips x 95 GiB: the
    8 counts TensorCores, 2 per chip) and one H200 (139 GiB usable of 141 GB), FSDP over the
    chips: full-parameter (f32 master weights; and bf16 ones) vs LoRA (rank 16 on all seven
    projections, bf16 frozen base, adapters merged for sampling). experiments/results/
    memory_7b.md holds the tables and their assumptions.
"""

from __future__ import annotations

import os

import ml_collections as mlc
from absl import app

from rlx import configs
from rlx import memory
from rlx.model import hf
from rlx.model.config import ModelConfig

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the configs
QWEN = os.path.join(EXPERIMENTS, "shapes", "qwen2.5-1.5b")
GiB = 2**30
DEVICES = (("H100-class 80 GiB", 80 * GiB), ("H200-class 141 GiB", 141 * GiB),
           ("TPU v5e-class 16 GiB", 16 * GiB))

# (c) 7B-class plans.
SHAPES_7B = (("Qwen2.5-7B", os.path.join(EXPERIMENTS, "shapes", "qwen2.5-7b")),
             ("Llama-3.1-8B", os.path.join(EXPERIMENTS, "shapes", "llama-3.1-8b")))
# (name, chips, bytes per chip). v5p-8 is 4 chips (the 8 counts TensorCores); an H200 has
# 141 GB, of which JAX can use ~139 GiB with XLA_PYTHON_CLIENT_MEM_FRACTION=.99 (the default
# preallocation, 75%, leaves ~105 GiB).
HARDWARE_7B = (("TPU v5e-8", 8, 16 * GiB), ("TPU v5p-8", 4, 95 * GiB), ("1x H200", 1, 139 * GiB))
# The run: 16 prompts x G=8 = 128 rollouts per step, P=256 prompt + T=1024 completion tokens,
# 16 minibatches (one optimizer step each: 8 rows per minibatch, 1 row per v5e chip), f32
# log-probs over 128 completion positions at a time, per-layer remat, KL to the reference
# (GRPO's 0.04), bf16 compute, the dense sampler (the paged one reads the weights replicated:
# 15 GiB in bf16, more than a v5e chip can spare), eval over 64 prompts.
RUN_7B = {"rl.prompts_per_step": 16, "rl.group_size": 8, "rl.num_minibatches": 16,
          "sampler.max_prompt_len": 256, "sampler.max_new_tokens": 1024,
          "rl.logprob_chunk": 128, "rl.remat": True, "rl.kl_coef": 0.04,
          "sampler.impl": "dense", "sampler.eval_batch_size": 64, "model.dtype": "bfloat16"}
METHODS_7B = (
    ("full, f32 params", {"model.param_dtype": "float32"}),
    ("full, bf16 params", {"model.param_dtype": "bfloat16"}),
    ("LoRA r=16, bf16 base", {"lora.rank": 16, "lora.alpha": 32.0,
                              "lora.base_dtype": "bfloat16", "lora.merge_for_sampling": True}),
)


def _load(name: str, arg: str = "") -> mlc.ConfigDict:
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(name, os.path.join(EXPERIMENTS, f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


def _with_device(config: mlc.ConfigDict, device_bytes: int) -> mlc.ConfigDict:
  # (Set in place: replacing config.memory dropped keys added later, such as memory.check.)
  return _set(config, {"memory.device_bytes": device_bytes, "memory.activation_margin": 1.2})


def arith_plan() -> memory.MemoryPlan:
  config = _load("arith")
  model_cfg = configs.model_config(config, config.tokenizer.vocab_size)
  return memory.plan(config, model_cfg, {"data": 1})


def qwen_config() -> tuple[mlc.ConfigDict, ModelConfig]:
  config = _load("hf_rl")
  config.model.path = QWEN
  config.rl.prompts_per_step, config.rl.group_size = 32, 8
  config.sampler.impl, config.sampler.max_new_tokens = "paged", 256
  model_cfg = hf.config_from_hf(hf.read_config(QWEN), dtype=config.model.dtype,
                                param_dtype=config.model.param_dtype)
  return config, model_cfg


def _set(config: mlc.ConfigDict, overrides: dict) -> mlc.ConfigDict:
  return configs.with_overrides(config, overrides)


def plan_7b(shape: str, chips: int, chip_bytes: int, method: dict,
            run: dict | None = None) -> tuple[memory.MemoryPlan, ModelConfig]:
  """The plan of RUN_7B (+ `run`) with `method` for the model at `shape`, FSDP over `chips`
  chips of `chip_bytes` each. remat_realised: TPU / GPU (XLA:CPU is the exception)."""
  config = _set(_load("hf_rl"), {**RUN_7B, **method, **(run or {}), "model.path": shape,
                                 "memory.device_bytes": chip_bytes,
                                 "memory.activation_margin": 1.2})
  model_cfg = hf.config_from_hf(hf.read_config(shape), dtype=config.model.dtype,
                                param_dtype=config.model.param_dtype)
  return memory.plan(config, model_cfg, {"data": 1, "fsdp": chips},
                     remat_realised=True), model_cfg


def _dominant(p: memory.MemoryPlan) -> str:
  live = [it for it in p.items if p.peak_phase in memory._LIVE_IN[it.phase]]  # pylint: disable=protected-access
  top = max(live, key=lambda it: it.bytes)
  return f"{top.name} {memory.human(top.bytes)} ({100 * top.bytes / p.total_bytes:.0f}%)"


def _state(p: memory.MemoryPlan) -> int:
  return sum(it.bytes for it in p.items if it.phase == "state")


def tables_7b(run: dict | None = None) -> str:
  """Markdown: one table per model shape, a row per (hardware, method)."""
  out = []
  for name, shape in SHAPES_7B:
    rows = []
    for hw, chips, chip_bytes in HARDWARE_7B:
      for label, method in METHODS_7B:
        p, model_cfg = plan_7b(shape, chips, chip_bytes, method, run)
        totals = p.phase_bytes()
        rows.append(
            f"| {hw} ({chips} x {memory.human(chip_bytes)}) | {label} | "
            f"{memory.human(_state(p))} | {memory.human(totals['rollout'])} | "
            f"{memory.human(max(totals['grad'], totals['logp']))} | "
            f"**{memory.human(p.total_bytes)}** ({p.peak_phase}) | {_dominant(p)} | "
            f"{memory.human(p.headroom_bytes)} | {'yes' if p.fits else '**no**'} |")
    out.append(f"{name} ({model_cfg.num_params() / 1e9:.2f}B params, {model_cfg.num_layers} "
               f"layers, d {model_cfg.d_model}, F {model_cfg.mlp_dim}, {model_cfg.num_heads}"
               f"/{model_cfg.num_kv_heads} heads, vocab {model_cfg.vocab_size}), per chip:\n")
    out.append("| hardware | method | state | rollout | update | peak (phase) | "
               "largest line at the peak | headroom | fits |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    out += rows
    out.append("")
  return "\n".join(out)


def sweep_v5e() -> str:
  """Markdown: LoRA r=16 on a v5e-8, Qwen2.5-7B and Llama-3.1-8B, over completion length and
  rows per chip per minibatch (num_minibatches = 128 rollouts / (8 chips x rows))."""
  out = ["| model | T (completion) | rows / chip / minibatch (minibatches) | rollout | update | "
         "peak (phase) | largest line at the peak | headroom | fits |",
         "|---|---|---|---|---|---|---|---|---|"]
  for name, shape in SHAPES_7B:
    for t in (1024, 2048):
      for rows in (1, 2, 4):
        mb = 128 // (8 * rows)
        p, _ = plan_7b(shape, 8, 16 * GiB, METHODS_7B[2][1],
                       {"sampler.max_new_tokens": t, "rl.num_minibatches": mb})
        totals = p.phase_bytes()
        out.append(f"| {name} | {t} | {rows} ({mb}) | {memory.human(totals['rollout'])} | "
                   f"{memory.human(max(totals['grad'], totals['logp']))} | "
                   f"**{memory.human(p.total_bytes)}** ({p.peak_phase}) | {_dominant(p)} | "
                   f"{memory.human(p.headroom_bytes)} | {'yes' if p.fits else '**no**'} |")
  return "\n".join(out)


def main(argv) -> None:
  if argv[1:] == ["7b"]:
    print(tables_7b())
    print("LoRA r=16 on a TPU v5e-8 (16 GiB per chip), the rest of RUN_7B unchanged:\n")
    print(sweep_v5e())
    return
  print("(a) experiments/arith.py, 1 device\n")
  print(memory.format_plan(arith_plan()))
  config, model_cfg = qwen_config()
  print(f"\n(b) experiments/hf_rl.py, Qwen2.5-1.5B ({model_cfg.num_params() / 1e9:.3f}B params, "
        f"compute {model_cfg.dtype}, params {model_cfg.param_dtype}), prompts_per_step "
        f"{config.rl.prompts_per_step} x G={config.rl.group_size}, "
        f"P={config.sampler.max_prompt_len} + T={config.sampler.max_new_tokens}, "
        f"{config.rl.num_minibatches} minibatches, {config.sampler.impl} sampler")
  for mesh in ({"data": 2, "fsdp": 8}, {"data": 1, "fsdp": 16}):
    plans = [(label, memory.plan(_with_device(config, cap), model_cfg, mesh))
             for label, cap in DEVICES]
    print()
    print(memory.format_plan(plans[0][1]))
    for label, p in plans:
      print(f"  {label:<22} peak {memory.human(p.total_bytes):>10}  headroom "
            f"{memory.human(p.headroom_bytes):>11}  {'FITS' if p.fits else 'DOES NOT FIT'}")
  print("\n(c) 7B-class models, full-parameter vs LoRA (experiments/results/memory_7b.md)\n")
  p, _ = plan_7b(SHAPES_7B[0][1], 8, 16 * GiB, METHODS_7B[2][1])
  print("Qwen2.5-7B, LoRA r=16, TPU v5e-8:")
  print(memory.format_plan(p))
  print()
  print(tables_7b())


if __name__ == "__main__":
  app.run(main)
