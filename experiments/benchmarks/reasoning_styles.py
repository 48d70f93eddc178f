r"""Sampled accuracy by answer style (verbose / concise) and level on column addition.

The reasoning experiment's warm start writes two styles (rlx.data.column_add: a verbose
teacher numbers its columns, "col1:..."); which style a level answers in, and how accurately,
decides what a length reward does to it (experiments/results/reasoning_levels.md). This
samples the held-out problems of every level at the config's temperature, several times
each, from the workdir's base model, and prints each level's share and accuracy per style.

  python experiments/benchmarks/reasoning_styles.py --workdir=/tmp/rlx_reasoning \
      --config.task.num_eval_per_level=64 --samples=8
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from rlx import configs, evaluate, experiment
from rlx.data import column_add

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/reasoning.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/rlx_reasoning", "Workdir (its base is made if "
                               "missing).")
_SAMPLES = flags.DEFINE_integer("samples", 8, "Samples per held-out problem.")
_BATCH = flags.DEFINE_integer("batch", 128, "Sequences decoded at once.")


def style(text: str) -> str:
  return "verbose" if "col1:" in text else "concise"


def main(argv):
  del argv
  spec = configs.resolve(_CONFIG.value)
  if spec.task.name != "column_add":
    raise app.UsageError(f"config.task.name={spec.task.name!r}; this reads column_add answers.")
  ex = experiment.setup(spec, _WORKDIR.value, log=lambda s: None, show_progress=False)
  tok = ex.tokenizer
  sp = spec.sampler.sampling(eos_id=tok.eos_id, pad_id=tok.pad_id)
  pool = ex.eval_pool
  diff = np.asarray(pool.difficulty)
  gen = jax.jit(lambda p, pr, pl, k: evaluate.decode(ex.graphdef, p, pr, pl, k, sp))
  stats = collections.defaultdict(lambda: [0, 0])
  idx = np.repeat(np.arange(pool.size), _SAMPLES.value)
  b = _BATCH.value
  for s in range(0, len(idx), b):
    ii = idx[s:s + b]
    n = len(ii)
    ii = np.concatenate([ii, np.zeros(b - n, int)])  # one compiled shape
    keys = jax.random.split(jax.random.key(s), b)
    ro = gen(ex.base_params, jnp.asarray(pool.prompts[ii]), jnp.asarray(pool.prompt_lens[ii]),
             keys)
    toks = np.asarray(ro.tokens)
    for j in range(n):
      i = ii[j]
      text = tok.decode(toks[j])
      answer = tok.decode(np.asarray(pool.answers[i])[:int(pool.answer_lens[i])]).strip()
      got = column_add.parse_final_answer(text)
      st = stats[(int(diff[i]), style(text))]
      st[0] += got is not None and got.strip() == answer
      st[1] += 1
    print(f"[styles] {min(s + b, len(idx))}/{len(idx)} sequences", flush=True)
  print("| level | style | samples | share | accuracy |\n|---|---|---|---|---|")
  for level in sorted({l for l, _ in stats}):
    total = sum(stats[(level, st)][1] for st in ("concise", "verbose"))
    for st in ("concise", "verbose"):
      ok, n = stats[(level, st)]
      if n:
        print(f"| d{level} | {st} | {n} | {n / total:.0%} | {ok / n:.1%} |")


if __name__ == "__main__":
  app.run(main)
