r"""GRPO on op-chains: many small skills whose uncertain band moves (rlx.data.op_chains).

The efficiency benchmark's task (experiments/benchmarks/efficiency.py --task=chains). 48 operators
are fixed permutations of the digits; a prompt is an input digit and a chain of 1-4 operators,
the completion names each operator and writes the digit it gives ("7kQf=" -> "k3Q5f1"), and
the reward is exact match on the whole chain. The warm-start teacher is wrong on a sixth of
the operators 60% of the time, on another sixth 85% and on another 97% (half are never wrong),
so the base model solves chains of reliable operators, is uncertain where a 0.6 operator
appears and hopeless where a 0.97 one does: most groups are zero-variance, and the band is
meant to move from one operator class to the next as RL fixes them (measured: before the
target it stays on the 0.6 class in 6 of 8 seeds; it moves later). Held-out greedy accuracy
on chains with an unreliable operator (levels 2-4) is the headline.

  python -m rlx.main --config=experiments/chains.py --workdir=/tmp/rlx_chains
  python -m rlx.main --config=experiments/chains.py:runlocal --workdir=/tmp/rlx_chains_local

Every key and its default: rlx/configs.py `defaults()`.
"""

import ml_collections as mlc

from rlx import configs


def get_config(arg: str = "") -> mlc.ConfigDict:
  runlocal = arg == "runlocal"
  if arg not in ("", "runlocal"):
    raise ValueError(f"Unknown config variant {arg!r}; expected '' or 'runlocal'.")
  c = configs.defaults()
  c.total_steps, c.eval_every, c.checkpoint_every = (8, 4, 4) if runlocal else (400, 10, 100)

  c.task.name = "op_chains"
  c.task.levels = (1, 2, 3, 4)  # 1 + the class of the chain's least reliable operator
  # A pool of 2,000 chains (500 drawn per level, mixed below): the tuned GRPO baseline sees
  # it ~1 time before its target (135 steps x 16) and ~4 times in 500 steps, so selection that
  # learns from a prompt's own past visits (SRPO history, GRESO skip) has history to use.
  # (The first pilot's 4,000-chain pool was visited ~0.6 times before the target; the 1,000
  # one of the lever grid, with half filler, left the oracle only 2.5x of room:
  # experiments/results/efficiency_chains.md.)
  c.task.num_train_per_level = 100 if runlocal else 500
  c.task.num_eval_per_level = 16 if runlocal else 128
  c.task.rl_levels = (1, 2, 3, 4)  # level 0: the warm start's own chains, not in the pool
  # The RL pool: three quarters filler chains of reliable operators, as a real data set is
  # mostly problems the model already solves; ~90% of groups carry no signal, and an oracle
  # selector needs 3.5x fewer tokens than GRPO at its tuned rate (8 seeds, 90% CI 2.7-4.9;
  # 3.0x against GRPO's better batch shape, 8 prompts per step, 3 seeds).
  c.task.rl_level_weights = {"1": 0.75, "2": 1 / 12, "3": 1 / 12, "4": 1 / 12}
  c.task.band = (2, 3, 4)
  c.tokenizer.vocab_size = 80

  c.model.num_layers = 2 if runlocal else 4
  c.model.d_model = 32 if runlocal else 128
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 8 if runlocal else 32
  c.model.mlp_dim = 64 if runlocal else 384

  c.sft.steps = 20 if runlocal else 1500
  c.sft.batch_size = 32 if runlocal else 128
  c.sft.lr = 2e-3
  c.sft.warmup_steps = 5 if runlocal else 100
  c.sft.max_len = 24
  c.sft.level_weights = {"0": 1.0}  # the warm-start chains only

  c.rl.prompts_per_step = 4 if runlocal else 16
  c.rl.group_size = 4 if runlocal else 8
  c.optim.lr = 3e-4
  c.optim.schedule = "constant"
  c.optim.warmup_steps = 10
  c.sampler.max_prompt_len = 8
  c.sampler.max_new_tokens = 9
  return c
