r"""rlx's side of experiments/benchmarks/bench_peers.py as a config file, so bench_step.py can
break the peers' workload (4 prompts x 8 samples, 128 new tokens, one update, the `even_reward`
Python reward, f32) into its phases. The argument after the colon is a bench_peers --workdir, which
holds the model directory and the prompts that bench_peers wrote:

  python experiments/benchmarks/bench_peers.py --size=100m --rlx_only --steps=1 --workdir=/tmp/p100
  python experiments/benchmarks/bench_step.py \
      --config=experiments/benchmarks/bench_peers_config.py:/tmp/p100 \
      --workdir=/tmp/p100/step --steps=3
"""

import os

import rlx


def get_config(root: str = ""):
  from rlx.experiments.benchmarks import bench_peers  # pylint: disable=g-import-not-at-top
  model_dir, data_dir = os.path.join(root, "model"), os.path.join(root, "data")
  if not root or not os.path.exists(os.path.join(model_dir, "config.json")):
    raise ValueError(f"bench_peers_config.py:{root!r}: expected a bench_peers --workdir holding "
                     f"model/ and data/ (python experiments/benchmarks/bench_peers.py --rlx_only "
                     f"--steps=1 "
                     f"--workdir=DIR writes them).")
  tok = rlx.load_tokenizer(model_dir)
  prompt_len = max(len(tok.encode(q, add_special_tokens=True)) for q in bench_peers.PROMPTS)
  return bench_peers.rlx_config(bench_peers.Workload(), model_dir, data_dir, prompt_len,
                                total_steps=6, sampler="paged")
