r"""Page faults of the update: what one jitted value-and-grad costs in fresh host memory.

  python experiments/bench_faults.py --rows=32            # the 100M model of bench_peers
  GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736 \
      python experiments/bench_faults.py --rows=32        # freed memory kept in the process

Times the value-and-grad of a policy-gradient loss on the log-probs of `--rows` random rows of
7 prompt + 128 completion tokens (bench_peers' workload) at bench_peers' model shape, and
prints per call: wall time, minor page faults, system and user CPU time (getrusage), then the
process's peak RSS and an f32 2048^3 GEMM probe. XLA:CPU maps its temporary buffer fresh for
every call and unmaps it after, so each call faults that memory in again; see README
("Training step vs TRL") for what that costs on a VM.
"""

import argparse
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rlx import train
from rlx.model import transformer


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rows", type=int, default=32)
  p.add_argument("--size", default="100m", choices=("tiny", "3m", "100m"))
  p.add_argument("--calls", type=int, default=3)
  args = p.parse_args()
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from bench_peers import MODELS  # pylint: disable=g-import-not-at-top
  from bench_step import gemm_peak  # pylint: disable=g-import-not-at-top
  cfg = MODELS[args.size]
  graphdef, params = transformer.init_params(cfg, 0)
  rng = np.random.default_rng(0)
  b, plen, t = args.rows, 7, 128
  prompts = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, plen)), jnp.int32)
  comps = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, t)), jnp.int32)
  plens, lens = jnp.full((b,), plen, jnp.int32), jnp.full((b,), t, jnp.int32)
  adv = jnp.asarray(rng.normal(size=(b,)), jnp.float32)

  def loss(p):
    lp, mask = train.completion_logprobs(graphdef, p, prompts, plens, comps, lens, 1.0)
    ratio = jnp.exp(lp - jax.lax.stop_gradient(lp))
    return jnp.sum(ratio * adv[:, None] * mask) / mask.sum()

  grad = jax.jit(jax.value_and_grad(loss))
  jax.block_until_ready(grad(params))  # compile
  print(f"{args.size}, {b} rows x ({plen} + {t}) tokens: value-and-grad per call")
  for _ in range(args.calls):
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    jax.block_until_ready(grad(params))
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    faults = r1.ru_minflt - r0.ru_minflt
    sys_s = r1.ru_stime - r0.ru_stime
    print(f"  {wall:6.2f} s wall  {faults:9d} minor faults  {sys_s:6.2f} s system  "
          f"{r1.ru_utime - r0.ru_utime:6.2f} s user"
          + (f"  ({sys_s / faults * 1e6:.1f} us system per fault)" if faults else ""))
  print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GB; "
        f"f32 GEMM probe (bench_step.gemm_peak) {gemm_peak() / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
  main()
