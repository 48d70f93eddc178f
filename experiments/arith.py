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

Every key and its default: rlx/configs.py `defaults()`.
"""

import ml_collections as mlc

from rlx import configs


def get_config(arg: str = "") -> mlc.ConfigDict:
  runlocal = arg == "runlocal"
  if arg not in ("", "runlocal"):
    raise ValueError(f"Unknown config variant {arg!r}; expected '' or 'runlocal'.")
  c = configs.defaults()
  if runlocal:  # seconds on a CPU: a tiny model, a few steps
    c.total_steps, c.eval_every, c.checkpoint_every = 8, 4, 4

  c.task.name = "arithmetic"
  c.task.ops = ("add",)  # ("add", "mul") for both; multiplication learns ~3x slower
  c.task.levels = (2, 3, 4) if runlocal else (2, 3, 4, 5)  # number of digits
  c.task.num_train_per_level = 300 if runlocal else 5000
  c.task.num_eval_per_level = 32 if runlocal else 200
  c.task.teacher_error_levels = (3, 4)
  c.task.teacher_error_rate = 0.6
  c.task.rl_levels = (2, 3, 4)  # prompts RL trains on
  c.task.band = (3, 4)  # where accuracy before/after RL is reported

  c.model.num_layers = 2 if runlocal else 4
  c.model.d_model = 32 if runlocal else 128
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 8 if runlocal else 32
  c.model.mlp_dim = 64 if runlocal else 384

  c.sft.steps = 20 if runlocal else 1000
  c.sft.batch_size = 32 if runlocal else 128
  c.sft.warmup_steps = 5 if runlocal else 100
  # Sampling weight of each level in the warm-start data (level 5 is never seen).
  c.sft.level_weights = {"2": 1.0, "3": 1.0, "4": 1.0}

  c.rl.prompts_per_step = 4 if runlocal else 16
  c.rl.group_size = 4 if runlocal else 8
  c.optim.lr = 3e-4
  c.optim.schedule = "cosine"
  c.sampler.max_prompt_len = 16
  c.sampler.max_new_tokens = 8
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
