r"""GRPO on worked column addition: long, variable-length completions, a length reward.

The task (rlx.data.column_add): "4821+3907=" is answered with a worked solution, one line per
column, then the final answer after "=>", which is all the reward reads:

  1+7=8|482+390|8;2+0=2|48+39|28;8+9=17|4+3|728;4+3+c1=8||8728;=>8728

A supervised warm start (cached in WORKDIR/base) teaches a 0.8M-parameter model from an
imperfect teacher that is verbose where it is unreliable: on 3- and 4-digit problems (the band)
it forgets the first carry 60% of the time and writes 65% of its solutions verbosely
(restating the problem, numbering columns, spelling out every digit written and carry: ~1.8x
the tokens); 1-, 2- and 5-digit problems it solves correctly and concisely. The base model is
thus uncertain and wordy on the band, sure and short elsewhere. GRPO with the final-answer
verifier and Kimi k1.5's group length reward (added after the normalisation, so its push is
bounded by its weight) has to discover that carries matter and that the short solution is as
good as the long one on the band, and a KL to the base (0.1) holds the levels the base solved:
learning the band's carries otherwise moves the addition the 5-digit answers share with it
(experiments/results/reasoning_levels.md, route 17). Held-out greedy accuracy per level and
the mean length of correct band completions are printed before and after RL.

  python -m rlx.main --config=experiments/reasoning.py --workdir=/tmp/rlx_reasoning
  python -m rlx.main --config=experiments/reasoning.py:runlocal --workdir=/tmp/rlx_reasoning_local

Every key and its default: rlx/configs.py `defaults()`.
"""

import ml_collections as mlc

from rlx import configs


def get_config(arg: str = "") -> mlc.ConfigDict:
  runlocal = arg == "runlocal"
  if arg not in ("", "runlocal"):
    raise ValueError(f"Unknown config variant {arg!r}; expected '' or 'runlocal'.")
  c = configs.defaults()
  c.total_steps, c.eval_every, c.checkpoint_every = (4, 2, 2) if runlocal else (100, 25, 25)

  c.task.name = "column_add"
  c.task.levels = (1, 2, 3) if runlocal else (1, 2, 3, 4, 5)  # number of digits
  c.task.num_train_per_level = 200 if runlocal else 4000
  c.task.num_eval_per_level = 8 if runlocal else 128  # 3 points = 4 problems (issue 37)
  c.task.band = (3,) if runlocal else (3, 4)  # where accuracy before/after RL is reported
  c.task.teacher_error_levels = c.task.band
  c.task.teacher_error_rate = 0.6
  c.task.teacher_verbose_levels = c.task.band  # wordy only where it is unreliable
  c.task.teacher_verbose_rate = 0.65
  # The RL prompt mix: mostly short problems, a tail of long 5-digit ones.
  c.task.rl_level_weights = ({"1": 1.0, "2": 1.0, "3": 1.0} if runlocal else
                             {"1": 0.15, "2": 0.25, "3": 0.2, "4": 0.15, "5": 0.25})

  c.model.num_layers = 2 if runlocal else 4
  c.model.d_model = 32 if runlocal else 128
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 8 if runlocal else 32
  c.model.mlp_dim = 64 if runlocal else 384

  # 1200, not 700: at 700 a seed could end with 5-digit sums at 65-69% (greedy) and RL then
  # broke them or never shortened the band; at 1200 every base measured has them >= 98%
  # (reasoning_levels.md, "A longer warm start").
  c.sft.steps = 10 if runlocal else 1200
  c.sft.batch_size = 16 if runlocal else 32
  c.sft.lr = 2e-3
  c.sft.warmup_steps = 5 if runlocal else 50
  c.sft.max_len = 240
  c.sft.level_weights = {str(l): 0.5 if l == 1 else 1.0 for l in c.task.levels}
  c.sft.batch_by_level = True

  c.rl.prompts_per_step = 2 if runlocal else 8
  c.rl.group_size = 4 if runlocal else 8
  c.optim.lr = 5e-5
  c.rl.kl_coef = 0.1  # to the base (k3): keeps the solved levels (reasoning_levels.md)
  c.optim.schedule = "cosine"
  c.length.length_reward = 0.5
  c.sampler.max_prompt_len = 16
  c.sampler.max_new_tokens = 64 if runlocal else 224
  c.sampler.eval_batch_size = 64 if runlocal else 256
  return c


def get_sweep(arg: str = "") -> list[dict]:
  """Override sets for `python -m rlx.sweep --config=experiments/reasoning.py --workdir_root=DIR`.

  Full: the length reward off / on, crossed with DAPO overlong shaping off / on (4 runs from
  one warm start). runlocal: the tiny config with two seeds.
  """
  if arg == "runlocal":
    tiny = {"total_steps": 2, "eval_every": 2, "sft.steps": 2}
    return [{**tiny, "seed": 0}, {**tiny, "seed": 1}]
  get_config(arg)  # rejects an unknown arg
  return [{"length.length_reward": r, "length.overlong_shaping": s}
          for r in (0.0, 0.5) for s in (False, True)]
