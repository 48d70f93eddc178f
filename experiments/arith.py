r"""GRPO on synthetic addition with a tiny Llama-style model: the default experiment.

A supervised warm start (cached in WORKDIR/base) teaches a 0.8M-parameter model addition
from an imperfect teacher: on 3- and 4-digit problems the teacher drops the lowest carry 60%
of the time (the eval split and the RL reward always use the true answer). The base model
thus knows the carry procedure but, greedily, follows the teacher's habit: it is uncertain
exactly on the 3-4 digit band. GRPO with the exact-match verifier then has to discover that
carries matter; held-out greedy accuracy on the band is printed before and after RL.

  python -m rlx.main --config=experiments/arith.py --workdir=/tmp/rlx_arith
  python -m rlx.main --config=experiments/arith.py:runlocal --workdir=/tmp/rlx_local
  python -m rlx.main --config=experiments/arith.py --workdir=/tmp/x --config.rl.group_size=16
"""

import ml_collections as mlc


def get_config(arg: str = "") -> mlc.ConfigDict:
  runlocal = arg == "runlocal"
  if arg not in ("", "runlocal"):
    raise ValueError(f"Unknown config variant {arg!r}; expected '' or 'runlocal'.")
  c = mlc.ConfigDict()
  c.seed = 0
  c.total_steps = 8 if runlocal else 200
  c.eval_every = 4 if runlocal else 25
  c.checkpoint_every = 4 if runlocal else 50
  c.keep_checkpoints = 2
  c.log_every = 1
  c.fused_step = False  # True: one jitted step (no generation/update time split)

  c.task = mlc.ConfigDict()
  c.task.name = "arithmetic"
  c.task.ops = ("add",)  # ("add", "mul") for both; multiplication learns ~3x slower
  c.task.levels = (2, 3, 4) if runlocal else (2, 3, 4, 5)  # number of digits
  c.task.num_train_per_level = 300 if runlocal else 5000
  c.task.num_eval_per_level = 32 if runlocal else 200
  c.task.reverse_answer = False  # True: answers lowest digit first
  c.task.teacher_error_levels = (3, 4)
  c.task.teacher_error_rate = 0.6
  c.task.rl_levels = (2, 3, 4)  # prompts RL trains on
  c.task.band = (3, 4)  # where accuracy before/after RL is reported
  c.task.eval_levels = ()  # levels of the held-out set to evaluate (empty: all)
  c.task.data_dir = ""  # where TFDS prepares the data (empty: WORKDIR/data)

  c.tokenizer = mlc.ConfigDict()
  c.tokenizer.vocab_size = 64
  c.tokenizer.path = ""  # empty: train a sentencepiece model on the task text

  c.model = mlc.ConfigDict()
  c.model.path = ""  # a Hugging Face checkpoint directory (empty: the tiny model below)
  c.model.num_layers = 2 if runlocal else 4
  c.model.d_model = 32 if runlocal else 128
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 8 if runlocal else 32
  c.model.mlp_dim = 64 if runlocal else 384
  c.model.rope_theta = 10_000.0
  c.model.tie_embeddings = True
  c.model.dtype = "float32"

  c.warm_start = mlc.ConfigDict()
  # A base model directory written by an earlier run (WORKDIR/base); empty: look in this
  # workdir, else run the warm start below.
  c.warm_start.dir = ""

  c.sft = mlc.ConfigDict()
  c.sft.steps = 20 if runlocal else 1000
  c.sft.batch_size = 32 if runlocal else 128
  c.sft.lr = 2e-3
  c.sft.warmup_steps = 5 if runlocal else 100
  c.sft.max_len = 20
  # Sampling weight of each difficulty level in the warm-start data (level 5 is never seen).
  c.sft.level_weights = {"2": 1.0, "3": 1.0, "4": 1.0}

  c.rl = mlc.ConfigDict()
  c.rl.prompts_per_step = 4 if runlocal else 16
  c.rl.group_size = 4 if runlocal else 8
  c.rl.advantage = "grpo"
  c.rl.num_updates = 1
  c.rl.num_minibatches = 1
  c.rl.eps_low = 0.2
  c.rl.eps_high = 0.28
  c.rl.aggregation = "token_mean"
  c.rl.kl_coef = 0.0
  c.rl.kl_estimator = "k3"
  c.rl.is_cap = 2.0
  c.rl.is_mode = "truncate"
  c.rl.ratio_level = "token"

  # Sample efficiency (rlx.rl.selection / replay / length); off = plain GRPO.
  c.selection = mlc.ConfigDict()
  c.selection.mode = "uniform"  # uniform | band | history | skip
  c.selection.ema = 0.5
  c.selection.floor = 0.05
  c.selection.history_cooldown = 50
  c.selection.skip_keep_base = 0.25
  c.selection.dynamic_filter = False  # DAPO dynamic sampling
  c.selection.oversample = 2

  c.replay = mlc.ConfigDict()
  c.replay.enabled = False
  c.replay.capacity = 1024
  c.replay.num_samples = 64
  c.replay.max_staleness = 4
  c.replay.max_reuse = 2
  c.replay.priority = "abs_adv"  # abs_adv | recency | uniform

  c.length = mlc.ConfigDict()
  c.length.overlong_shaping = False
  c.length.overlong_buffer = 2
  c.length.overlong_penalty = 1.0
  c.length.overlong_filter = False

  c.sampler = mlc.ConfigDict()
  c.sampler.impl = "dense"
  c.sampler.max_prompt_len = 16
  c.sampler.max_new_tokens = 8
  c.sampler.temperature = 1.0
  c.sampler.top_k = 0
  c.sampler.top_p = 1.0
  c.sampler.eval_batch_size = 256

  c.optim = mlc.ConfigDict()
  c.optim.lr = 3e-4
  c.optim.schedule = "cosine"
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.0
  c.optim.grad_clip = 1.0
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999

  c.guard = mlc.ConfigDict()
  c.guard.max_consecutive_skips = 3  # steps with non-finite loss/grads before stopping
  c.guard.reward_range = (-10.0, 10.0)  # a reward outside stops the run, naming the example

  c.memory = mlc.ConfigDict()
  c.memory.device_bytes = 0  # per-device memory for the plan (0: ask the device / host RAM)
  c.memory.activation_margin = 1.2
  c.memory.check = True  # refuse to start a run whose plan does not fit

  c.mesh = mlc.ConfigDict()
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  return c


def get_sweep(arg: str = "") -> list[dict]:
  """Override sets for `python -m rlx.sweep --config=experiments/arith.py --workdir_root=DIR`.

  Full: group size 4 vs 8 crossed with GRPO vs Dr.GRPO advantages (4 runs from one warm start).
  runlocal: the same tiny config with two seeds (2 RL steps each), which shows run-to-run
  variance and runs in seconds (the second run reuses the first one's compiled programs).
  """
  if arg == "runlocal":
    tiny = {"total_steps": 2, "eval_every": 2, "sft.steps": 2}
    return [{**tiny, "seed": 0}, {**tiny, "seed": 1}]
  get_config(arg)  # rejects an unknown arg
  return [{"rl.group_size": g, "rl.advantage": a} for g in (4, 8) for a in ("grpo", "dr_grpo")]
