r"""GRPO from a local Hugging Face checkpoint (Llama 3.x, Qwen2/2.5/3, Gemma 2/3).

The weights come from `model.path` (config.json + *.safetensors; README "Start from a
Hugging Face model" says how to get such a directory); the tokenizer, stop ids and chat
template from the same directory. Prompts are rendered with the model's own chat template,
so instruct models see their training format, and the reward reads the final number of the
decoded completion (Python reward "math", run between the rollout and update halves). No
supervised warm start: the checkpoint is the starting policy.

  python -m rlx.main --config=experiments/hf_rl.py --workdir=/tmp/rlx_qwen \
      --config.model.path=/ckpt/Qwen2.5-0.5B-Instruct
  python -m rlx.main --config=experiments/hf_rl.py:gsm8k --workdir=/tmp/rlx_qwen_gsm8k \
      --config.model.path=/ckpt/Qwen2.5-0.5B-Instruct --config.task.manual_dir=~/data/gsm8k
  python -m rlx.main --config=experiments/hf_rl.py:runlocal --workdir=/tmp/rlx_qwen_local \
      --config.model.path=/ckpt/Qwen2.5-0.5B-Instruct          # a few steps, f32, CPU-sized
  python -m rlx.main --config=experiments/hf_rl.py --workdir=/tmp/x --dry_run \
      --config.model.path=experiments/shapes/qwen2.5-1.5b     # memory plan only

Variants (after the colon): "" (arithmetic 3-6 digits), "gsm8k", "math", "runlocal".
"""

import ml_collections as mlc

from rlx import configs

VARIANTS = ("", "gsm8k", "math", "runlocal")


def get_config(arg: str = "") -> mlc.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f"Unknown config variant {arg!r}; expected one of {VARIANTS}.")
  runlocal = arg == "runlocal"
  c = configs.defaults()
  c.total_steps = 4 if runlocal else 300
  c.eval_every = 2 if runlocal else 50
  c.checkpoint_every = 2 if runlocal else 50

  if arg in ("gsm8k", "math"):
    c.task.name = arg
    c.task.manual_dir = ""  # required: the directory holding train.jsonl / test.jsonl
    c.task.num_eval = 500
    c.task.instruction = ("{prompt}\nPlease reason step by step, and put your final answer "
                          "within \\boxed{{}}.")
  else:
    c.task.name = "arithmetic"
    c.task.ops = ("add", "mul")
    c.task.levels = (3, 4) if runlocal else (3, 4, 5, 6)
    c.task.num_train_per_level = 100 if runlocal else 5000
    c.task.num_eval_per_level = 8 if runlocal else 200
    c.task.rl_levels = (4,) if runlocal else (4, 5)
    c.task.band = (4,) if runlocal else (4, 5)
    c.task.instruction = "Compute {prompt}\nEnd your reply with the final number."
  # Instruct models answer in prose: score the final answer of the decoded text.
  c.task.reward = "math"

  c.tokenizer.path = ""  # empty: model.path (tokenizer.json or tokenizer.model there)
  c.tokenizer.chat_template = True
  c.tokenizer.system_prompt = ""

  c.model.path = ""  # required: a Hugging Face model directory
  c.model.dtype = "float32" if runlocal else "bfloat16"  # activations; bf16 is slow on CPU
  c.model.param_dtype = "float32"  # master weights for the optimizer

  c.rl.prompts_per_step = 2 if runlocal else 32
  c.rl.group_size = 4 if runlocal else 8
  c.rl.num_minibatches = 1 if runlocal else 4
  c.optim.lr = 1e-6
  c.optim.schedule = "constant"
  c.optim.warmup_steps = 0 if runlocal else 10

  c.sampler.impl = "dense"
  c.sampler.max_prompt_len = 128 if arg in ("", "runlocal") else 512  # chat headers add tokens
  c.sampler.max_new_tokens = 16 if runlocal else (512 if arg in ("gsm8k", "math") else 256)
  c.sampler.eval_batch_size = 16 if runlocal else 128
  return c
