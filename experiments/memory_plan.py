r"""Per-device memory plans of the default experiment and a Qwen2.5-1.5B run, without devices.

  python experiments/memory_plan.py            # (a) arith on 1 device, (b) Qwen2.5-1.5B x 16

(a) experiments/arith.py on one device (this machine's capacity).
(b) experiments/hf_rl.py with the Qwen2.5-1.5B shapes (experiments/shapes/qwen2.5-1.5b holds
    only its config.json: nothing is loaded), bf16 compute, f32 master weights, 32 prompts x
    G=8, 256 new tokens, paged sampler, on 16-device meshes, against an 80 GiB (H100-class),
    a 141 GiB (H200-class) and a 16 GiB (TPU v5e-class) device.
"""

from __future__ import annotations

import os

import ml_collections as mlc

from rlx import configs
from rlx import memory
from rlx.model import hf
from rlx.model.config import ModelConfig

HERE = os.path.dirname(os.path.abspath(__file__))
QWEN = os.path.join(HERE, "shapes", "qwen2.5-1.5b")
GiB = 2**30
DEVICES = (("H100-class 80 GiB", 80 * GiB), ("H200-class 141 GiB", 141 * GiB),
           ("TPU v5e-class 16 GiB", 16 * GiB))


def _load(name: str, arg: str = "") -> mlc.ConfigDict:
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


def _with_device(config: mlc.ConfigDict, device_bytes: int) -> mlc.ConfigDict:
  config = mlc.ConfigDict(config.to_dict())
  config.memory = mlc.ConfigDict({"device_bytes": device_bytes, "activation_margin": 1.2})
  return config


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


def main() -> None:
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


if __name__ == "__main__":
  main()
