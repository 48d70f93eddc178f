r"""GRPO from a local Hugging Face checkpoint (Llama 3.x, Qwen2/2.5/3, Gemma 2/3).

The weights come from `model.path` (config.json + *.safetensors, see README "Start from a
Hugging Face model"); the tokenizer, stop ids and chat template from the same directory.
Prompts are rendered with the model's own chat template, so instruct models see their
training format. No supervised warm start: the checkpoint is the starting policy.

  python -m rlx.main --config=experiments/hf_rl.py --workdir=/tmp/rlx_qwen \
      --config.model.path=/ckpt/Qwen2.5-0.5B-Instruct
  python -m rlx.main --config=experiments/hf_rl.py:runlocal --workdir=/tmp/rlx_qwen_local \
      --config.model.path=/ckpt/Qwen2.5-0.5B-Instruct          # a few steps, f32, CPU-sized
  python -m rlx.main --config=experiments/hf_rl.py --workdir=/tmp/x \
      --config.model.path=/ckpt/Llama-3.2-1B-Instruct --config.rl.group_size=16
"""

import ml_collections as mlc


def get_config(arg: str = "") -> mlc.ConfigDict:
  runlocal = arg == "runlocal"
  if arg not in ("", "runlocal"):
    raise ValueError(f"Unknown config variant {arg!r}; expected '' or 'runlocal'.")
  c = mlc.ConfigDict()
  c.seed = 0
  c.total_steps = 4 if runlocal else 300
  c.eval_every = 2 if runlocal else 50
  c.checkpoint_every = 2 if runlocal else 50
  c.keep_checkpoints = 2
  c.log_every = 1
  c.fused_step = False

  c.task = mlc.ConfigDict()
  c.task.name = "arithmetic"
  c.task.ops = ("add", "mul")
  c.task.levels = (3, 4) if runlocal else (3, 4, 5, 6)
  c.task.num_train_per_level = 100 if runlocal else 5000
  c.task.num_eval_per_level = 8 if runlocal else 200
  c.task.rl_levels = (4,) if runlocal else (4, 5)
  c.task.band = (4,) if runlocal else (4, 5)
  # Instruct models answer in prose: the prompt asks for a final line, and the reward reads
  # the last number of the decoded completion instead of an exact token match.
  c.task.instruction = "Solve: {prompt}\nEnd with a line 'Answer: <number>'."
  c.task.reward = "final_number"

  c.tokenizer = mlc.ConfigDict()
  c.tokenizer.path = ""  # empty: model.path (tokenizer.json or tokenizer.model there)
  c.tokenizer.chat_template = True  # render prompts with the model's chat template
  c.tokenizer.system_prompt = ""  # empty: none (the template's default, if it has one)

  c.model = mlc.ConfigDict()
  c.model.path = ""  # required: a Hugging Face model directory
  c.model.dtype = "float32" if runlocal else "bfloat16"  # activations; bf16 is slow on CPU
  c.model.param_dtype = "float32"  # master weights for the optimizer

  c.sft = mlc.ConfigDict()
  c.sft.steps = 0  # the checkpoint is the starting policy

  c.rl = mlc.ConfigDict()
  c.rl.prompts_per_step = 2 if runlocal else 32
  c.rl.group_size = 4 if runlocal else 8
  c.rl.advantage = "grpo"
  c.rl.num_updates = 1
  c.rl.num_minibatches = 1 if runlocal else 4
  c.rl.eps_low = 0.2
  c.rl.eps_high = 0.28
  c.rl.aggregation = "token_mean"
  c.rl.kl_coef = 0.0
  c.rl.kl_estimator = "k3"
  c.rl.is_cap = 2.0
  c.rl.is_mode = "truncate"
  c.rl.ratio_level = "token"

  c.sampler = mlc.ConfigDict()
  c.sampler.impl = "dense" if runlocal else "paged"
  c.sampler.max_prompt_len = 128  # chat templates add a system header
  c.sampler.max_new_tokens = 16 if runlocal else 256
  c.sampler.temperature = 1.0
  c.sampler.top_k = 0
  c.sampler.top_p = 1.0
  c.sampler.eval_batch_size = 16 if runlocal else 128

  c.optim = mlc.ConfigDict()
  c.optim.lr = 1e-6
  c.optim.schedule = "constant"
  c.optim.warmup_steps = 0 if runlocal else 10
  c.optim.weight_decay = 0.0
  c.optim.grad_clip = 1.0
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999

  c.mesh = mlc.ConfigDict()
  c.mesh.data = 1
  c.mesh.fsdp = -1  # a 0.5B-8B model is sharded over all devices
  c.mesh.tensor = 1

  c.export = mlc.ConfigDict()
  c.export.dir = ""  # non-empty: save_hf the final policy there (tokenizer files copied)
  c.export.dtype = "bfloat16"
  return c
