r"""LoRA vs full fine-tuning on the default arithmetic experiment (issue 14).

The default experiment (experiments/arith.py) with adapters of rank 1, 8 or 32 on every
projection (alpha 32, so the update is scaled by 32 / rank: with this scaling the best
learning rate barely moves with the rank, as "LoRA Without Regret" reports), against full
fine-tuning, each at its own learning rate, over seeds, all from one warm-start base, for
100 RL steps:

  python -m rlx.main --config=experiments/arith.py --workdir=/tmp/lora_base \
      --config.total_steps=1                       # the shared warm-start base, once
  python -m rlx.sweep --config=experiments/lora.py:pilot --workdir_root=/tmp/lora_pilot \
      --config.warm_start.dir=/tmp/lora_base/base  # learning rates, seed 0
  python -m rlx.sweep --config=experiments/lora.py --workdir_root=/tmp/lora_sweep \
      --config.warm_start.dir=/tmp/lora_base/base  # each method at its best rate x 3 seeds
  python experiments/lora.py /tmp/lora_pilot /tmp/lora_sweep   # the tables (pilot, seeds)

`python -m rlx.main --config=experiments/lora.py --workdir=DIR` is one LoRA run (rank 8).
"""

from __future__ import annotations

import ml_collections as mlc

from rlx.experiments import arith

# Learning rates per method, fixed from the pilot (`:pilot`, seed 0; see the README).
BEST_LR = {"full": 3e-4, "lora": 1e-3}
RANKS = (1, 8, 32)
SEEDS = (0, 1, 2)
PILOT_LRS = {"full": (3e-4, 1e-3), "lora": (1e-3, 3e-3, 1e-2)}


def get_config(arg: str = "") -> mlc.ConfigDict:
  base_arg = "runlocal" if arg == "runlocal" else ""
  if arg not in ("", "runlocal", "pilot"):
    raise ValueError(f"Unknown config variant {arg!r}; expected '', 'pilot' or 'runlocal'.")
  c = arith.get_config(base_arg)
  c.lora.rank = 8
  c.lora.alpha = 32.0
  c.optim.lr = BEST_LR["lora"]
  if not base_arg:
    # Half the default experiment's 200 steps (most of its gain comes in the first 100), to
    # afford 3 seeds x 4 methods + the learning-rate pilot on 2 CPU cores; before/after only.
    c.total_steps = 100
    c.eval_every = 100
  return c


def get_sweep(arg: str = "") -> list[dict]:
  get_config(arg)
  if arg == "runlocal":
    tiny = {"total_steps": 2, "eval_every": 2, "sft.steps": 2}
    return [{**tiny, "lora.rank": 0, "optim.lr": 3e-4, "_name": "full"},
            {**tiny, "lora.rank": 4, "_name": "lora4"}]
  if arg == "pilot":
    return ([{"lora.rank": 0, "optim.lr": lr, "seed": 0, "_name": f"full_lr{lr:g}"}
             for lr in PILOT_LRS["full"]] +
            [{"lora.rank": 8, "optim.lr": lr, "seed": 0, "_name": f"r8_lr{lr:g}"}
             for lr in PILOT_LRS["lora"]])
  # Seed 0 of full fine-tuning and of rank 8 at their best rates are the pilot's runs.
  runs = []
  for s in SEEDS:
    if s:
      runs.append({"lora.rank": 0, "optim.lr": BEST_LR["full"], "seed": s,
                   "_name": f"full_s{s}"})
    for r in RANKS:
      if s or r != 8:
        runs.append({"lora.rank": r, "optim.lr": BEST_LR["lora"], "seed": s,
                     "_name": f"r{r}_s{s}"})
  return runs


if __name__ == "__main__":
  import csv
  import os
  import re
  import sys

  import numpy as np

  pilot_root, main_root = sys.argv[1:3]
  tables = {}
  for root in (pilot_root, main_root):
    tables[root] = list(csv.DictReader(open(os.path.join(root, "sweep_results.csv"))))
  best = {f"full_lr{BEST_LR['full']:g}": "full", f"r8_lr{BEST_LR['lora']:g}": "r8"}
  tables["seeds (pilot's seed 0 at the chosen rate + the main sweep)"] = [
      {**r, "run": f"{best[r['run']]}_s0"} for r in tables[pilot_root] if r["run"] in best
  ] + tables[main_root]
  del tables[main_root]
  for root, rows in tables.items():
    by = {}
    for r in rows:
      method = re.sub(r"_s\d+$", "", r["run"])
      by.setdefault(method, []).append(r)
    print(f"\n{root}")
    print("| run | seeds | band before | band after | gain (mean ± sd, points) |")
    print("|---|---|---|---|---|")
    for method, rs in by.items():
      before = [float(r["band_acc_before"]) for r in rs]
      after = [float(r["band_acc_after"]) for r in rs]
      gain = 100 * (np.array(after) - np.array(before))
      print(f"| {method} | {len(rs)} | {100 * np.mean(before):.1f}% | "
            f"{100 * np.mean(after):.1f}% | {gain.mean():+.1f} ± {gain.std():.1f} |")
